"""Several routers share one view through a real redis-server (router/service/fleet.py), over HTTP.

Routers run as `shoal router` does (conftest `start_router`), in front of fake replicas, each with `redis_url` set
to a redis-server of the test's own (`redis_process`), which tests stop, pause (SIGSTOP) and restart. State is
awaited by polling with deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import pytest
import redis.asyncio as redis

from router.policy.routing_text import RoutingKey
from router.service.app import FLEET, METRICS, POOL, ROUTING
from router.service.settings import FleetSettings
from tests.fakes import FakeReplica
from tests.integration.conftest import (
    LONG_PREFIX_BYTES,
    MODEL,
    RouterHandle,
    StartFakes,
    StartRouter,
    eventually,
    replica_id,
    unique_text,
)
from tests.integration.redis_server import RedisProcess

pytestmark = pytest.mark.integration

FAST = FleetSettings(command_timeout_s=0.3, read_block_s=0.2, retry_s=0.1, load_ttl_s=1.5, heartbeat_s=0.2)


async def fleet_router(start_router: StartRouter, fakes: Sequence[FakeReplica], url: str, **extra: Any) -> RouterHandle:
    return await start_router(fakes, redis_url=url, fleet=extra.pop("fleet", FAST), **extra)


def fleet_task_failures(router: RouterHandle) -> int:
    """Failures of the fleet's publish and consume tasks that they did not handle themselves."""
    counts = router.app[METRICS].tasks.counts
    return counts["fleet_publish"] + counts["fleet_consume"]


def holder(router: RouterHandle, text: str) -> dict[str, int]:
    """The replicas `router`'s index says hold the prompt's prefix, and how many blocks of it."""
    core = router.app[ROUTING].core
    prepared = core.prepare(RoutingKey(text=text.encode()), MODEL)
    return core.index.match(prepared.complete(), now=asyncio.get_running_loop().time())


def peer_in_flight(router: RouterHandle) -> dict[str, int]:
    return {r.id: r.state.peer_in_flight for r in router.app[POOL]}


async def assert_shared_prefixes(
    a: RouterHandle, b: RouterHandle, label: str, num_prompts: int, *, timeout_s: float = 2.0
) -> None:
    """Each prompt routed by `a` is, once `b` has applied `a`'s batch, a cache hit on the same replica at `b`."""
    for i in range(num_prompts):
        text = unique_text(LONG_PREFIX_BYTES, f"{label}{i}")
        first = await a.complete(text + " first question", max_tokens=1)
        assert first.status == 200, first.body
        chosen, prefix = first.replica, text
        await eventually(lambda: chosen in holder(b, prefix), timeout_s=timeout_s, what="B indexed A's decision")  # noqa: B023
        second = await b.complete(text + " a follow-up", max_tokens=1)
        assert second.status == 200, second.body
        assert (second.replica, second.branch) == (first.replica, "cache_hit")


async def test_a_prefix_routed_by_one_router_is_a_hit_at_another(
    start_fakes: StartFakes, start_router: StartRouter, redis_process: RedisProcess
) -> None:
    fakes = await start_fakes(3)
    a = await fleet_router(start_router, fakes, redis_process.url)
    b = await fleet_router(start_router, fakes, redis_process.url)
    await assert_shared_prefixes(a, b, "doc", 6)
    assert b.app[FLEET].counts["batches_applied"] > 0
    assert a.app[FLEET].counts["records_dropped"] == 0


async def test_each_router_sees_the_fleets_load_within_a_second(
    start_fakes: StartFakes, start_router: StartRouter, redis_process: RedisProcess
) -> None:
    fakes = await start_fakes(2, first_byte_delay_s=30.0)
    a = await fleet_router(start_router, fakes, redis_process.url)
    b = await fleet_router(start_router, fakes, redis_process.url)
    tasks = [asyncio.create_task(a.complete(unique_text(200, str(i)), timeout_s=20.0)) for i in range(4)]
    try:
        await eventually(lambda: sum(f.in_flight for f in fakes) == 4, what="4 requests at the replicas")
        own = {r.id: r.state.own_in_flight for r in a.app[POOL]}
        assert sum(own.values()) == 4
        await eventually(lambda: peer_in_flight(b) == own, timeout_s=1.0, what="B sees A's in-flight requests")
        for r in b.app[POOL]:
            assert r.state.in_flight == own[r.id] and r.state.own_in_flight == 0
        # B's own request adds to the sum A sees.
        extra = asyncio.create_task(b.complete(unique_text(200, "b"), timeout_s=20.0))
        tasks.append(extra)
        await eventually(lambda: sum(peer_in_flight(a).values()) == 1, timeout_s=1.0, what="A sees B's request")
        assert sum(r.state.in_flight for r in a.app[POOL]) == 5
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await eventually(lambda: sum(peer_in_flight(b).values()) == 0, timeout_s=1.0, what="B sees A's requests end")
    await eventually(lambda: sum(peer_in_flight(a).values()) == 0, timeout_s=1.0, what="A sees B's request end")


async def test_a_drain_through_one_router_holds_at_the_others(
    start_fakes: StartFakes, start_router: StartRouter, redis_process: RedisProcess
) -> None:
    fakes = await start_fakes(2)
    a = await fleet_router(start_router, fakes, redis_process.url)
    b = await fleet_router(start_router, fakes, redis_process.url)
    victim = replica_id(fakes[0])
    reply = await a.admin("POST", f"/replicas/{victim}/drain")
    assert reply.status == 200, reply.body
    await eventually(lambda: b.app[POOL].get(victim).is_draining, timeout_s=1.0, what="B drains it")  # type: ignore[union-attr]
    for i in range(8):
        assert (await b.complete(unique_text(200, str(i)), max_tokens=1)).replica != victim
    # A router that starts later reads the drain before it serves.
    c = await fleet_router(start_router, fakes, redis_process.url, num_ready=1)
    assert c.app[POOL].get(victim).is_draining  # type: ignore[union-attr]
    assert (await a.admin("POST", f"/replicas/{victim}/undrain")).status == 200
    await eventually(lambda: not b.app[POOL].get(victim).is_draining, timeout_s=1.0, what="B undrains it")  # type: ignore[union-attr]


async def test_the_stream_is_capped(
    start_fakes: StartFakes, start_router: StartRouter, redis_process: RedisProcess
) -> None:
    fakes = await start_fakes(2)
    settings = FAST.model_copy(update={"stream_max_len": 50, "flush_interval_s": 0.005, "max_batch_records": 1})
    a = await fleet_router(start_router, fakes, redis_process.url, fleet=settings)
    for i in range(300):
        assert (await a.complete(unique_text(400, str(i)), max_tokens=1)).status == 200
    client = redis.from_url(redis_process.url)
    try:
        key = a.app[FLEET].stream_key
        await eventually(lambda: a.app[FLEET].counts["batches_published"] >= 150, what="batches out")
        length = await client.xlen(key)
        # MAXLEN ~ trims whole radix-tree nodes (100 entries by default), so the stream may exceed the cap by one.
        assert length <= 50 + 100
        num_bytes = await client.memory_usage(key)
        assert num_bytes is not None and num_bytes < 400_000
    finally:
        with contextlib.suppress(Exception):
            await client.aclose()


async def test_a_starting_router_agrees_with_the_others_on_seen_prefixes(
    start_fakes: StartFakes, start_router: StartRouter, redis_process: RedisProcess
) -> None:
    fakes = await start_fakes(3)
    a = await fleet_router(start_router, fakes, redis_process.url)
    b = await fleet_router(start_router, fakes, redis_process.url)
    home: dict[str, str] = {}
    for i in range(40):
        text = unique_text(LONG_PREFIX_BYTES, f"doc{i}")
        reply = await (a if i % 2 else b).complete(text + " q0", max_tokens=1)
        assert reply.status == 200 and reply.replica is not None
        home[text] = reply.replica
    assert len(set(home.values())) == 3  # spread over the replicas, so agreeing is not luck
    await eventually(lambda: all(r in holder(a, t) and r in holder(b, t) for t, r in home.items()), what="synced")
    loop = asyncio.get_running_loop()
    started = loop.time()
    c = await fleet_router(start_router, fakes, redis_process.url)
    ready_s = loop.time() - started
    num_known = sum(r in holder(c, t) for t, r in home.items())  # loaded before it served anything
    agreed = 0
    for text, replica in home.items():
        reply = await c.complete(text + " q1", max_tokens=1)
        assert reply.status == 200
        agreed += reply.replica == replica
    elapsed_s = loop.time() - started
    print(f"ready in {ready_s:.2f} s; {agreed}/{len(home)} agreed, last answer {elapsed_s:.2f} s after start")
    assert c.app[FLEET].is_loaded and num_known == len(home)
    assert ready_s < 2.0
    assert agreed >= 0.95 * len(home)


async def test_requests_never_wait_on_redis_stopped_paused_or_restarted(
    start_fakes: StartFakes,
    start_router: StartRouter,
    redis_process: RedisProcess,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fakes = await start_fakes(3)
    a = await fleet_router(start_router, fakes, redis_process.url)
    b = await fleet_router(start_router, fakes, redis_process.url)
    loop = asyncio.get_running_loop()
    num_requests = 0

    async def serve_some(tag: str) -> None:
        nonlocal num_requests
        for i in range(10):
            began = loop.time()
            reply = await (a, b)[i % 2].complete(unique_text(400, f"{tag}{i}"), max_tokens=1, timeout_s=5.0)
            assert reply.status == 200, reply.body
            assert loop.time() - began < FAST.command_timeout_s  # Redis's timeouts never reach a request
            num_requests += 1

    async def shared_again(tag: str) -> None:
        """A prefix routed by A becomes a hit at B: both talk to Redis again."""
        text = unique_text(LONG_PREFIX_BYTES, tag)
        first = await a.complete(text, max_tokens=1)
        await eventually(lambda: first.replica in holder(b, text), timeout_s=5.0, what=f"sharing after {tag}")

    caplog.set_level("WARNING", logger="shoal.router.fleet")
    # Stopped, then restarted empty (a flushed Redis, too).
    redis_process.stop()
    await serve_some("stopped")
    await eventually(lambda: not a.app[FLEET].is_up and not b.app[FLEET].is_up, what="both see the outage")
    await serve_some("still-stopped")
    redis_process.start()
    await eventually(lambda: a.app[FLEET].is_up and b.app[FLEET].is_up, timeout_s=5.0, what="both see Redis back")
    await shared_again("restarted")
    # Paused: connections open, no answer.
    redis_process.pause()
    try:
        await serve_some("paused")
        await eventually(lambda: not a.app[FLEET].is_up and not b.app[FLEET].is_up, what="both see the stall")
        await serve_some("still-paused")
    finally:
        redis_process.resume()
    await eventually(lambda: a.app[FLEET].is_up and b.app[FLEET].is_up, timeout_s=5.0, what="both see Redis back")
    await shared_again("resumed")
    assert num_requests == 40
    for router in (a, b):
        assert router.app[FLEET].counts["outages"] == 2
    unreachable = [r for r in caplog.records if "Redis unreachable" in r.getMessage()]
    assert len(unreachable) == 4  # once per outage and router, however many commands failed
    # Flushed under the routers' feet: they carry on sharing.
    client = redis.from_url(redis_process.url)
    try:
        await client.flushall()
    finally:
        await client.aclose()
    await shared_again("flushed")


async def raw_post(router: RouterHandle, body: bytes, extra_head: bytes) -> tuple[int, str]:
    """POST /v1/completions with header bytes no HTTP client library sends (say, non-UTF-8); (status, replica)."""
    host, port = router.server.address
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n%b\r\n%b" % (len(body), extra_head, body)
        )
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).decode("latin-1").lower()
        status = int(head.split()[1])
        replica = head.partition("x-shoal-replica: ")[2].partition("\r\n")[0]
        return status, replica
    finally:
        writer.close()


async def test_a_session_key_of_any_bytes_is_shared_and_publishing_goes_on(
    start_fakes: StartFakes, start_router: StartRouter, redis_process: RedisProcess
) -> None:
    fakes = await start_fakes(3)
    a = await fleet_router(start_router, fakes, redis_process.url, session_header="X-Session")
    b = await fleet_router(start_router, fakes, redis_process.url, session_header="X-Session")
    body = b'{"model": "%b", "prompt": "hello", "max_tokens": 1}' % MODEL.encode()
    status, pinned = await raw_post(a, body, b"X-Session: \xff\xfe-not-utf8\r\n")
    assert status == 200
    # The pin reaches the other router under the same key, and a's publishing goes on (it died here once).
    for _ in range(3):
        assert await raw_post(b, body, b"X-Session: \xff\xfe-not-utf8\r\n") == (200, pinned)
    await assert_shared_prefixes(a, b, "after", 2)
    assert a.app[FLEET].is_up and fleet_task_failures(a) == 0


async def test_hostile_drain_records_are_skipped_and_counted_and_routers_start_and_share(
    start_fakes: StartFakes, start_router: StartRouter, redis_process: RedisProcess
) -> None:
    fakes = await start_fakes(3)
    a = await fleet_router(start_router, fakes, redis_process.url)
    drains_key = a.app[FLEET].drains_key
    conn = redis.from_url(redis_process.url)
    try:
        # A field that is not UTF-8 once made a starting router exit 1 (and a --workers group with it).
        await conn.hset(drains_key, b"\xff\xfe", "1")
        b = await fleet_router(start_router, fakes, redis_process.url)
        assert b.app[FLEET].is_loaded and b.app[FLEET].counts["malformed"] >= 1
        await assert_shared_prefixes(a, b, "utf8", 2)
        # A drains key of another type once read as an outage, flapping, with the stream unread meanwhile.
        await conn.delete(drains_key)
        await conn.set(drains_key, "not a hash")
        first = fakes[0]
        assert (await a.admin("POST", f"/replicas/{replica_id(first)}/drain")).status == 200
        await assert_shared_prefixes(a, b, "wrongtype", 2)
        assert a.app[FLEET].is_up and b.app[FLEET].is_up
        assert a.app[FLEET].counts["malformed"] >= 1 and fleet_task_failures(a) == 0
    finally:
        await conn.aclose()


async def test_a_stream_entry_with_the_largest_id_stops_no_router_for_long(
    start_fakes: StartFakes, start_router: StartRouter, redis_process: RedisProcess
) -> None:
    fakes = await start_fakes(3)
    a = await fleet_router(start_router, fakes, redis_process.url)
    b = await fleet_router(start_router, fakes, redis_process.url)
    await assert_shared_prefixes(a, b, "before", 1)
    conn = redis.from_url(redis_process.url)
    try:
        # No XADD can follow this entry: every router's publishing failed, and every reader sat past it for ever.
        largest = "18446744073709551615-18446744073709551615"
        await conn.xadd(a.app[FLEET].stream_key, {"r": "hostile", "d": "{}"}, id=largest)
        await assert_shared_prefixes(a, b, "after", 3, timeout_s=10.0)
        # A stream key of another type: every XADD failed (WRONGTYPE), flapping "unreachable" / "back" until someone
        # deleted the key by hand.
        outages = [r.app[FLEET].counts.get("outages", 0) for r in (a, b)]
        await conn.delete(a.app[FLEET].stream_key)
        await conn.set(a.app[FLEET].stream_key, "not a stream")
        await assert_shared_prefixes(a, b, "wrongtype", 4, timeout_s=10.0)
        assert [r.app[FLEET].counts.get("outages", 0) for r in (a, b)] == outages
    finally:
        await conn.aclose()
    counts = [r.app[FLEET].counts for r in (a, b)]
    assert sum(c["position_resets"] for c in counts) >= 1 and sum(c["malformed"] for c in counts) >= 2
    assert all(r.app[FLEET].is_up for r in (a, b)) and all(fleet_task_failures(r) == 0 for r in (a, b))
