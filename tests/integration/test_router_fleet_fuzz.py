"""Hostile Redis (hypothesis): whatever lands in the fleet's keys, the router serves and its fleet tasks run on.

A router in fleet mode serves in front of two fake replicas while each example writes into a real redis-server
what no Shoal router would: stream entries of random fields, batches with random routing records, loads, pins and
undrains, random bytes and mutated batches, extreme stream IDs, random drains-hash fields, and the fleet's keys
replaced by values of the wrong type or deleted. Held after each example's writes: /health answers 200, a
completion is proxied (200), and the fleet's publish and consume tasks are alive. Then the keys are deleted, as an
operator would, and held: the router is back in touch with Redis, no fleet task is down (a failure a task did
not foresee is counted and recovered), it publishes again, and it applies a new peer's batch.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.policy.sharing import Batch, Drain, Load, Pin, Routed, encode_batch
from router.service.app import FLEET, METRICS
from tests.integration.conftest import RouterHandle, StartFakes, StartRouter, eventually, replica_id, unique_text
from tests.integration.redis_server import RedisProcess
from tests.integration.test_router_fleet import FAST

pytestmark = pytest.mark.integration

MAX_EXAMPLES = 100
"""Examples per run: some 0.15 s each on a shared 2-core machine (400 took 33 s), well under 60 s."""
STEP_TIMEOUT_S = 10.0
T = TypeVar("T")

REPLICAS = ["r0", "r1"]
"""Stand-ins for the router's replica ids, replaced by the real ones when an example is written."""
u64 = st.integers(0, 2**64 - 1)
counts = st.one_of(st.integers(0, 5), st.integers(0, 2**63))
names = st.one_of(st.sampled_from(REPLICAS), st.text(max_size=12))
batches = st.builds(
    Batch,
    router=st.one_of(st.just("peer"), st.text(max_size=12)),
    seq=st.one_of(st.integers(1, 5), st.integers(0, 2**63)),
    routed=st.lists(st.builds(Routed, names, st.lists(u64, max_size=4).map(tuple), st.booleans()), max_size=3).map(
        tuple
    ),
    loads=st.dictionaries(names, st.builds(Load, counts, counts, counts), max_size=3),
    is_complete=st.booleans(),
    pins=st.lists(st.builds(Pin, st.text(max_size=20), names), max_size=3).map(tuple),
    # Drains of its own replicas would rightly stop the router proxying to them: undrains only, and drains of others.
    drains=st.lists(
        st.one_of(st.builds(Drain, st.sampled_from(REPLICAS), st.just(False)), st.builds(Drain, st.text(max_size=8))),
        max_size=2,
    ).map(tuple),
).map(encode_batch)
json_texts = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=10,
).map(lambda value: repr(value).encode())


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = draw(batches)
    at = draw(st.integers(0, len(data) - 1))
    return data[:at] + draw(st.binary(min_size=0, max_size=3)) + data[at + 1 :]


payloads = st.one_of(batches, batches, mutated(), st.binary(max_size=40), json_texts)
entry_fields = st.one_of(
    st.fixed_dictionaries({b"r": st.one_of(st.just(b"peer"), st.binary(max_size=8)), b"d": payloads}),
    st.dictionaries(st.binary(min_size=1, max_size=4), st.binary(max_size=16), min_size=1, max_size=3),
)
stream_ids = st.one_of(
    st.just("*"),
    st.just("*"),
    st.sampled_from(
        ["0-1", "1-0", "9999999999999-0", "18446744073709551615-0", "18446744073709551615-18446744073709551615"]
    ),
    st.builds(lambda ms, seq: f"{ms}-{seq}", u64, u64),
)
operations = st.one_of(
    st.tuples(st.just("xadd"), entry_fields, stream_ids),
    st.tuples(st.just("xadd"), entry_fields, stream_ids),
    st.tuples(st.just("hset"), st.binary(min_size=1, max_size=8), st.binary(max_size=8)),
    st.tuples(
        st.just("wrong_type"),
        st.sampled_from(["stream", "drains"]),
        st.sampled_from(["string", "list", "set", "zset", "hash"]),
    ),
    st.tuples(st.just("delete"), st.sampled_from(["stream", "drains"]), st.none()),
)


class Writer:
    """What each example writes, through a plain synchronous client from hypothesis's thread."""

    def __init__(self, url: str, router: RouterHandle) -> None:
        self.client = redis.Redis.from_url(url)
        fleet = router.app[FLEET]
        self.keys = {"stream": fleet.stream_key, "drains": fleet.drains_key}
        self.ids = [r.id for r in router.app[FLEET].pool]

    def real(self, data: bytes) -> bytes:
        for stand_in, rid in zip(REPLICAS, self.ids, strict=True):
            data = data.replace(stand_in.encode(), rid.encode())
        return data

    def apply(self, operation: tuple[str, Any, Any]) -> None:
        kind, a, b = operation
        try:
            if kind == "xadd":
                fields: dict[Any, Any] = {k: self.real(v) for k, v in a.items()}
                self.client.xadd(self.keys["stream"], fields, id=b)
            elif kind == "hset":
                self.client.hset(self.keys["drains"], a, b)
            elif kind == "delete":
                self.client.delete(self.keys[a])
            else:
                key = self.keys[a]
                self.client.delete(key)
                if b == "string":
                    self.client.set(key, b"x")
                elif b == "list":
                    self.client.rpush(key, b"x")
                elif b == "set":
                    self.client.sadd(key, b"x")
                elif b == "zset":
                    self.client.zadd(key, {b"x": 1.0})
                else:
                    self.client.hset(key, b"x", b"1")
        except redis.ResponseError:
            pass  # an ID Redis refuses (not after the top one, or 0-0): nothing was written

    def reset(self) -> None:
        self.client.delete(*self.keys.values())


async def test_the_router_serves_and_its_fleet_tasks_run_on_whatever_redis_holds(
    start_fakes: StartFakes, start_router: StartRouter, redis_process: RedisProcess
) -> None:
    fakes = await start_fakes(2)
    router = await start_router(fakes, redis_url=redis_process.url, fleet=FAST)
    fleet = router.app[FLEET]
    failures = router.app[METRICS].tasks
    writer = Writer(redis_process.url, router)
    assert sorted(writer.ids) == sorted(replica_id(f) for f in fakes)
    loop = asyncio.get_running_loop()
    peers = itertools.count()

    def on_loop(coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(STEP_TIMEOUT_S)

    async def serves(tag: str) -> None:
        assert (await router.request("GET", "/health")).status == 200
        reply = await router.complete(unique_text(100, tag), max_tokens=1)
        assert reply.status == 200 and reply.replica in writer.ids, reply.body
        assert all(not task.done() for task in fleet._tasks), [t for t in fleet._tasks if t.done()]

    async def back_in_touch() -> None:
        published = fleet.counts["batches_published"]
        await eventually(
            lambda: fleet.is_up and not any(failures.num_down.get(t) for t in ("fleet_publish", "fleet_consume")),
            what="the fleet in touch with Redis, no task down",
        )
        await eventually(lambda: fleet.counts["batches_published"] > published, what="publishing again")

    async def applied(peer: str) -> None:
        await eventually(lambda: peer in fleet.view.peers, what="a new peer's batch applied")

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,  # the same examples on every run
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(st.lists(operations, min_size=1, max_size=4))
    def check(ops: list[tuple[str, Any, Any]]) -> None:
        for operation in ops:
            writer.apply(operation)
        n = next(peers)
        on_loop(serves(f"while {n}"))
        writer.reset()
        on_loop(back_in_touch())
        # A new peer's batch, after whatever position the reader had reached: it is read and applied.
        peer = f"checker-{n}"
        writer.client.xadd(writer.keys["stream"], {b"r": peer.encode(), b"d": encode_batch(Batch(peer, 1))})
        on_loop(applied(peer))
        on_loop(serves(f"after {n}"))

    try:
        await asyncio.to_thread(check)
    finally:
        writer.client.close()
    assert fleet.counts["malformed"] > 0  # the examples did reach the reader
