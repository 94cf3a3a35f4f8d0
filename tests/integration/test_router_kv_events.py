"""Exact mode: the router's prefix index follows what each replica reports it caches.

SSE: two real Shoal replicas (small KV caches, so they evict) behind a router with `kv_events.source: sse`; the
index is compared with the replicas' own block managers, which hash exactly as the router does. ZMQ: a real pyzmq
XPUB socket in the test plays vLLM, publishing msgpack `KVEventBatch`es laid out as vLLM's msgspec structs encode
them (tests/unit/test_kv_event_decoding.py has the field-level cases).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import msgpack  # type: ignore[import-untyped]
import orjson
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from router.policy.hashing import hash_tokens, namespace_seed
from router.policy.prefix_index import PrefixIndexConfig
from router.policy.routing_text import RoutingKey
from router.service.app import POOL, ROUTING
from router.service.settings import KVEventSettings
from tests.integration.conftest import MODEL, RouterHandle, StartFakes, StartRouter, eventually, metric_value
from tests.integration.replica_support import ReplicaHandle, StartReplica

pytestmark = pytest.mark.integration

SEED = namespace_seed(MODEL)
BLOCK = 16
NUM_BLOCKS = 48
"""KV blocks per test replica: four 12-block prompts fill it, so a fifth evicts."""
FAR_S = 10_000.0
"""Look-ups this far ahead see exact entries only: every guess (predicted or approximate) has expired by then."""


def kv_settings(source: str, **extra: Any) -> KVEventSettings:
    return KVEventSettings(source=source, reconnect_min_s=0.05, reconnect_max_s=0.5, **extra)


def prompt(rng: random.Random, num_blocks: int) -> list[int]:
    return [rng.randrange(1, 500) for _ in range(num_blocks * BLOCK)]


def rid(handle: ReplicaHandle) -> str:
    return handle.url.removeprefix("http://")


def exact_depth(router: RouterHandle, replica_id: str, tokens: list[int]) -> int:
    """Leading blocks of `tokens` the router's index says the replica holds, by its events alone."""
    now = asyncio.get_running_loop().time() + FAR_S
    return router.app[ROUTING].index.match(hash_tokens(tokens, SEED, BLOCK), now=now).get(replica_id, 0)


def cached_depth(replica: ReplicaHandle, tokens: list[int]) -> int:
    """Leading blocks of `tokens` the replica's own prefix cache holds (read while it is idle)."""
    cached = replica.state.engine.engine.block_manager.hash_to_block
    depth = 0
    for h in hash_tokens(tokens, SEED, BLOCK):
        if h not in cached:
            break
        depth += 1
    return depth


def is_in_step(router: RouterHandle, replica: ReplicaHandle) -> bool:
    """The router indexes exactly as many blocks for the replica as the replica caches (guesses swept first)."""
    index = router.app[ROUTING].index
    index.expire(asyncio.get_running_loop().time())
    num_cached = len(replica.state.engine.engine.block_manager.hash_to_block)
    return index.stats().blocks_per_replica.get(rid(replica), 0) == num_cached


def num_live(router: RouterHandle) -> int:
    return sum(r.has_live_kv_events for r in router.app[POOL])


async def complete_directly(http: aiohttp.ClientSession, replica: ReplicaHandle, tokens: list[int]) -> None:
    body = {"model": MODEL, "prompt": tokens, "max_tokens": 1}
    async with http.post(replica.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()


async def counter(router: RouterHandle, name: str, labels: dict[str, str] | None = None) -> float:
    return metric_value(await router.metrics(), name, labels) or 0.0


# --- SSE, real replicas ----------------------------------------------------------------------------------------


async def test_the_index_follows_what_the_replicas_report(
    start_replica: StartReplica, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    replicas = {rid(h): h for h in [await start_replica(num_blocks=NUM_BLOCKS) for _ in range(2)]}
    router = await start_router(
        list(replicas.values()),
        kv_events=kv_settings("sse"),
        index=PrefixIndexConfig(predicted_ttl_s=0.2),
    )
    await eventually(lambda: num_live(router) == 2, timeout_s=10, what="both KV-event streams in sync")
    assert await counter(router, "shoal_router_kv_events_live_streams") == 2
    rng = random.Random(7)

    # A request lands on some replica A: the router's index holds A's blocks, as A reports them.
    first = prompt(rng, 12)
    reply = await router.complete(first, max_tokens=1)
    assert reply.status == 200, reply.body
    a = replicas[reply.replica or ""]
    await eventually(lambda: exact_depth(router, rid(a), first) == 12, what="A's stored events applied")
    await eventually(lambda: is_in_step(router, a), what="the index holding what A caches")

    # A prompt sharing that prefix goes to A, because A holds it.
    follow_up = first + prompt(rng, 4)
    reply = await router.complete(follow_up, max_tokens=1)
    assert (reply.replica, reply.branch) == (rid(a), "cache_hit")

    # With the stream live, the router's own record of a token prompt is a short prediction, not a lasting guess;
    # a text prompt, which no engine event names, is still recorded as an approximate entry.
    routing = router.app[ROUTING]
    now = asyncio.get_running_loop().time()
    unsent = prompt(rng, 3)
    prepared = routing.prepare(RoutingKey(token_ids=unsent), MODEL, None, None)
    decision = routing.choose(prepared, [], now)
    assert decision is not None
    routing.commit(prepared, decision, now)
    assert routing.index.match(hash_tokens(unsent, SEED, BLOCK), now=now + 0.1) == {decision.replica: 3}
    assert routing.index.match(hash_tokens(unsent, SEED, BLOCK), now=now + 1.0) == {}
    text = routing.prepare(RoutingKey(text=b"x" * 640), MODEL, None, None)
    decision = routing.choose(text, [], now)
    assert decision is not None
    routing.commit(text, decision, now)
    assert routing.index.match(text.hashes, now=now + 60) == {decision.replica: 10}

    # A evicts the first prompt's blocks (traffic the router never saw): the index drops them too.
    removed_before = await counter(router, "shoal_router_kv_events_applied_total", {"kind": "removed"})
    for _ in range(4):
        await complete_directly(http, a, prompt(rng, 12))
    assert cached_depth(a, follow_up) < 12  # A evicted, leaves first
    await eventually(
        lambda: exact_depth(router, rid(a), follow_up) == cached_depth(a, follow_up), what="evictions applied"
    )
    await eventually(lambda: is_in_step(router, a), what="the index holding what A caches after evictions")
    assert await counter(router, "shoal_router_kv_events_applied_total", {"kind": "removed"}) > removed_before

    # The connection drops: the router reconnects and resyncs from a fresh snapshot (a `cleared`, then every block).
    cleared_before = await counter(router, "shoal_router_kv_events_applied_total", {"kind": "cleared"})
    await a.state.events.close()  # the replica ends every subscriber's stream

    async def resynced() -> bool:
        return await counter(router, "shoal_router_kv_events_applied_total", {"kind": "cleared"}) > cleared_before

    await eventually(resynced, what="a fresh snapshot from A")
    await eventually(lambda: num_live(router) == 2, what="A's stream live again")
    assert await counter(router, "shoal_router_kv_events_reconnects_total", {"reason": "closed"}) >= 1
    assert is_in_step(router, a)


async def test_a_restarted_replica_resyncs_to_its_empty_cache(
    start_replica: StartReplica, start_router: StartRouter, http: aiohttp.ClientSession, tiny_checkpoint: Path
) -> None:
    a = await start_replica(num_blocks=NUM_BLOCKS)
    router = await start_router([a], kv_events=kv_settings("sse"))
    await eventually(lambda: num_live(router) == 1, timeout_s=10, what="the KV-event stream in sync")
    rng = random.Random(11)
    tokens = prompt(rng, 8)
    assert (await router.complete(tokens, max_tokens=1)).status == 200
    await eventually(lambda: exact_depth(router, rid(a), tokens) == 8, what="A's blocks indexed")

    port = int(a.url.rsplit(":", 1)[1])
    await a.runner.cleanup()  # the replica goes away with its KV cache
    await eventually(lambda: num_live(router) == 0, what="the stream lost")
    async with replica_on_port(tiny_checkpoint, port) as restarted:
        await eventually(lambda: num_live(router) == 1, timeout_s=10, what="the restarted replica's stream")
        assert exact_depth(router, rid(restarted), tokens) == 0
        await complete_directly(http, restarted, tokens)
        await eventually(lambda: exact_depth(router, rid(restarted), tokens) == 8, what="new blocks indexed")


@contextlib.asynccontextmanager
async def replica_on_port(checkpoint: Path, port: int) -> AsyncIterator[ReplicaHandle]:
    """A Shoal replica on a given port (the fixture's take any free one): a restart, as the router sees it."""
    from replica.loading import load_for_serving
    from replica.server.app import create_app
    from replica.settings import ReplicaSettings

    settings = ReplicaSettings(model=str(checkpoint), served_model_name=MODEL, port=port, num_blocks=NUM_BLOCKS)
    model, tokenizer = load_for_serving(settings)
    runner = web.AppRunner(create_app(settings, model, tokenizer), shutdown_timeout=5.0)  # type: ignore[arg-type]
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
        yield ReplicaHandle(runner.app, runner, f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


class _ScriptedStream:
    """An SSE peer whose connections send the given messages in turn, then stay open; with /health and
    /v1/models, so the router takes it for a replica."""

    def __init__(self, connections: list[list[dict[str, Any]]]) -> None:
        self.connections = connections
        self.num_connections = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/kv_events", self.stream)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        messages = self.connections[min(self.num_connections, len(self.connections) - 1)]
        self.num_connections += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for message in messages:
            await response.write(b"data: " + orjson.dumps(message) + b"\n\n")
        await asyncio.Event().wait()  # open until the client goes
        return response


def stored(tokens: list[int], parent: int | None = None) -> dict[str, Any]:
    hashes = hash_tokens(tokens, SEED, BLOCK, parent_hash=parent)
    return {"type": "stored", "block_hashes": hashes, "parent_hash": parent, "token_ids": tokens, "block_size": BLOCK}


async def test_a_sequence_gap_reconnects_for_a_fresh_snapshot(start_router: StartRouter) -> None:
    rng = random.Random(3)
    old, new, late = prompt(rng, 2), prompt(rng, 3), prompt(rng, 1)
    peer = _ScriptedStream(
        [
            [
                {"seq": 5, "replica": "p", "snapshot": True, "events": [{"type": "cleared"}, stored(old)]},
                {"seq": 7, "replica": "p", "events": [stored(late)]},  # seq 6 went missing
            ],
            [{"seq": 9, "replica": "p", "snapshot": True, "events": [{"type": "cleared"}, stored(new)]}],
        ]
    )
    runner = web.AppRunner(peer.app(), shutdown_timeout=0.5)  # its streams never end by themselves
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        host, port = runner.addresses[0][:2]
        url = f"http://{host}:{port}"
        router = await start_router([SimpleNamespace(url=url)], kv_events=kv_settings("sse"))
        replica_id = f"{host}:{port}"
        await eventually(lambda: exact_depth(router, replica_id, new) == 3, what="the second snapshot applied")
        assert exact_depth(router, replica_id, old) == 0  # the snapshot's `cleared` dropped what it no longer holds
        assert exact_depth(router, replica_id, late) == 0  # the message after the gap was never applied
        assert peer.num_connections == 2
        assert await counter(router, "shoal_router_kv_events_gaps_total") == 1
        assert await counter(router, "shoal_router_kv_events_reconnects_total", {"reason": "gap"}) == 1
    finally:
        await runner.cleanup()


# --- ZMQ, vLLM's wire format ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmPublisher:
    """vLLM's ZmqEventPublisher, as seen on the wire: multipart [topic, seq (8 bytes, big endian), msgpack batch]."""

    def __init__(self, xpub: zmq.asyncio.Socket, topic: bytes) -> None:
        self.xpub = xpub
        self.topic = topic

    async def send(self, seq: int, *events: Any) -> None:
        batch = msgpack.packb([1_700_000_000.0, list(events), 0])
        await self.xpub.send_multipart([self.topic, seq.to_bytes(8, "big"), batch])


@pytest.fixture
async def vllm_publisher() -> AsyncIterator[tuple[VllmPublisher, int]]:
    """An XPUB socket (a PUB that also hears subscriptions, so the test knows when the router listens)."""
    context = zmq.asyncio.Context()
    xpub = context.socket(zmq.XPUB)
    xpub.setsockopt(zmq.LINGER, 0)
    port = free_port()
    xpub.bind(f"tcp://127.0.0.1:{port}")
    try:
        yield VllmPublisher(xpub, b"kv-events"), port
    finally:
        xpub.close(linger=0)
        context.term()


async def test_zmq_vllm_events_are_applied_and_a_gap_demotes(
    start_fakes: StartFakes, start_router: StartRouter, vllm_publisher: tuple[VllmPublisher, int]
) -> None:
    publisher, port = vllm_publisher
    fakes = await start_fakes(1)
    router = await start_router(fakes, kv_events=kv_settings("zmq", zmq_port=port, zmq_topic="kv-events"))
    replica_id = f"{fakes[0].host}:{fakes[0].port}"
    subscription = await asyncio.wait_for(publisher.xpub.recv(), timeout=10)
    assert subscription == b"\x01kv-events"

    rng = random.Random(5)
    tokens = prompt(rng, 3)
    # vLLM's engine hashes are its own (ints, or bytes): the router re-hashes the tokens and keeps these for removals.
    e1, e2, e3 = 9001, 9002, b"\x07" * 32
    # Array encoding (vLLM with msgspec array_like): [tag, block_hashes, parent, token_ids, block_size, lora_id, medium]
    await publisher.send(0, ["BlockStored", [e1, e2], None, tokens[: 2 * BLOCK], BLOCK, None, "GPU"])
    await eventually(lambda: exact_depth(router, replica_id, tokens) == 2, what="the first stored batch")
    await eventually(lambda: num_live(router) == 1, what="the ZMQ stream in sync")
    # Map encoding (vLLM after PR #42892), extending the chain from an engine parent hash.
    stored_map = {
        "type": "BlockStored",
        "block_hashes": [e3],
        "parent_block_hash": e2,
        "token_ids": tokens[2 * BLOCK :],
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    await publisher.send(1, stored_map)
    await eventually(lambda: exact_depth(router, replica_id, tokens) == 3, what="the map-encoded stored event")
    await publisher.send(2, ["BlockRemoved", [e3], "GPU"])
    await eventually(lambda: exact_depth(router, replica_id, tokens) == 2, what="the removal")
    await publisher.send(3, ["AllBlocksCleared"])
    await eventually(lambda: exact_depth(router, replica_id, tokens) == 0, what="the clear")

    # Stored again, then a gap (seq 5 never arrives) and no replay endpoint: the router no longer knows what was
    # removed meanwhile, so the replica's entries become approximate ones (they expire after the index's TTL)
    # before the batch after the gap is applied; a child of a block stored before the gap is still indexed.
    other = prompt(rng, 1)
    await publisher.send(4, ["BlockStored", [e1, e2], None, tokens[: 2 * BLOCK], BLOCK, None, "GPU"])
    await eventually(lambda: exact_depth(router, replica_id, tokens) == 2, what="stored again")
    await publisher.send(6, ["BlockStored", [7001], None, other, BLOCK, None, "GPU"])
    await eventually(lambda: exact_depth(router, replica_id, other) == 1, what="the batch after the gap")
    assert exact_depth(router, replica_id, tokens) == 0
    index = router.app[ROUTING].index
    now = asyncio.get_running_loop().time()
    ttl_s = index.config.ttl_s
    assert index.match(hash_tokens(tokens, SEED, BLOCK), now=now + ttl_s - 5.0) == {replica_id: 2}
    await publisher.send(7, ["BlockStored", [e3], e2, tokens[2 * BLOCK :], BLOCK, None, "GPU"])
    await eventually(
        lambda: index.match(hash_tokens(tokens, SEED, BLOCK), now=now + 1.0).get(replica_id) == 3,
        what="a child of a demoted block",
    )
    await publisher.send(8, ["BlockRemoved", [e3], "GPU"])
    await eventually(
        lambda: (
            exact_depth(router, replica_id, tokens) == 0
            and index.match(hash_tokens(tokens, SEED, BLOCK), now=now + 1.0).get(replica_id) == 2
        ),
        what="the child removed",
    )
    assert await counter(router, "shoal_router_kv_events_gaps_total") == 1
    applied = {
        k: await counter(router, "shoal_router_kv_events_applied_total", {"kind": k})
        for k in ("stored", "removed", "cleared")
    }
    assert applied == {"stored": 5, "removed": 2, "cleared": 1}  # events; the gap's demotion is not one

    # While the stream is live, a token prompt routed there is recorded as a short prediction only.
    sent = prompt(rng, 2)
    now = asyncio.get_running_loop().time()
    assert (await router.complete(sent, max_tokens=1)).status == 200
    assert index.match(hash_tokens(sent, SEED, BLOCK), now=now + 1.0) == {replica_id: 2}
    assert index.match(hash_tokens(sent, SEED, BLOCK), now=now + 5.0) == {}  # an approximate entry would last 600 s

    # The stream follows the replica's membership of the pool: removed, it unsubscribes; added again, it resubscribes.
    assert (await router.admin("DELETE", f"/replicas/{replica_id}")).status == 200
    assert await asyncio.wait_for(publisher.xpub.recv(), timeout=10) == b"\x00kv-events"
    assert (await router.admin("POST", "/replicas", {"url": fakes[0].url})).status == 201
    assert await asyncio.wait_for(publisher.xpub.recv(), timeout=10) == b"\x01kv-events"


class ReplayingPublisher(VllmPublisher):
    """vLLM's publisher with its replay socket, as seen on the wire: a ROUTER that answers [b"", first seq] with
    [b"", topic, seq, batch] for each buffered batch from there, then [b"", b"", seq -1, b""]."""

    def __init__(self, xpub: zmq.asyncio.Socket, replay: zmq.asyncio.Socket, topic: bytes) -> None:
        super().__init__(xpub, topic)
        self.replay = replay
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_requests: list[int] = []

    async def send(self, seq: int, *events: Any, is_dropped: bool = False) -> None:
        batch = msgpack.packb([1_700_000_000.0, list(events), 0])
        self.buffer.append((seq, batch))
        if not is_dropped:  # a batch the subscriber's socket never receives: only the replay has it
            await self.xpub.send_multipart([self.topic, seq.to_bytes(8, "big"), batch])

    async def serve_replays(self) -> None:
        while True:
            client, _, first = await self.replay.recv_multipart()
            start = int.from_bytes(first, "big")
            self.replay_requests.append(start)
            for seq, batch in self.buffer:
                if seq >= start:
                    await self.replay.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), batch])
            await self.replay.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])


async def test_zmq_replay_fills_a_gap_and_rebuilds_a_restarted_router(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    context = zmq.asyncio.Context()
    xpub, replay = context.socket(zmq.XPUB), context.socket(zmq.ROUTER)
    port, replay_port = free_port(), free_port()
    for sock, p in ((xpub, port), (replay, replay_port)):
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"tcp://127.0.0.1:{p}")
    publisher = ReplayingPublisher(xpub, replay, b"")
    server = asyncio.ensure_future(publisher.serve_replays())
    try:
        rng = random.Random(11)
        tokens, later = prompt(rng, 3), prompt(rng, 2)
        # Stored before any router listens: only the replay has it.
        await publisher.send(0, ["BlockStored", [1, 2], None, tokens[: 2 * BLOCK], BLOCK, None, "GPU"])
        fakes = await start_fakes(1)
        settings = kv_settings("zmq", zmq_port=port, zmq_replay_port=replay_port, zmq_topic="")
        router = await start_router(fakes, kv_events=settings)
        replica_id = f"{fakes[0].host}:{fakes[0].port}"
        await eventually(lambda: exact_depth(router, replica_id, tokens) == 2, what="the replay on connecting")
        assert publisher.replay_requests == [0]
        assert await asyncio.wait_for(xpub.recv(), timeout=10) == b"\x01"  # subscribed to every topic

        # seq 1 never reaches the router's socket: seq 2 shows the gap, and the replay from 1 fills it.
        await publisher.send(1, ["BlockStored", [3], 2, tokens[2 * BLOCK :], BLOCK, None, "GPU"], is_dropped=True)
        await publisher.send(2, ["BlockStored", [4, 5], None, later, BLOCK, None, "GPU"])
        await eventually(lambda: exact_depth(router, replica_id, later) == 2, what="the batch after the gap")
        assert exact_depth(router, replica_id, tokens) == 3  # the missed batch, replayed; nothing demoted
        assert publisher.replay_requests == [0, 1]
        assert await counter(router, "shoal_router_kv_events_gaps_total") == 1
        applied = await counter(router, "shoal_router_kv_events_applied_total", {"kind": "stored"})
        assert applied == 3  # each batch once: the live seq 2 after its replay is a duplicate
    finally:
        server.cancel()
        xpub.close(linger=0)
        replay.close(linger=0)
        context.term()


async def test_a_replay_socket_that_never_answers_costs_one_wait_not_the_stream(
    start_fakes: StartFakes, start_router: StartRouter, vllm_publisher: tuple[VllmPublisher, int]
) -> None:
    publisher, port = vllm_publisher
    fakes = await start_fakes(1)
    silent = free_port()  # nothing listens there: the replay request waits for its timeout
    settings = kv_settings("zmq", zmq_port=port, zmq_replay_port=silent, zmq_topic="kv-events", replay_timeout_s=0.2)
    router = await start_router(fakes, kv_events=settings)
    replica_id = f"{fakes[0].host}:{fakes[0].port}"
    await asyncio.wait_for(publisher.xpub.recv(), timeout=10)  # subscribed
    tokens = prompt(random.Random(3), 2)
    await eventually(lambda: num_live(router) == 1, what="the stream live after the silent replay")
    await publisher.send(0, ["BlockStored", [1, 2], None, tokens, BLOCK, None, "GPU"])
    await eventually(lambda: exact_depth(router, replica_id, tokens) == 2, what="live batches applied")
    await publisher.send(2, ["BlockRemoved", [2], "GPU"])  # a gap: not asked of the silent socket again
    await eventually(lambda: exact_depth(router, replica_id, tokens) == 0, what="the gap's demotion, then the removal")
    assert await counter(router, "shoal_router_kv_events_gaps_total") == 1


async def test_malformed_zmq_messages_are_skipped_counted_and_logged_once_per_kind(
    start_fakes: StartFakes,
    start_router: StartRouter,
    vllm_publisher: tuple[VllmPublisher, int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    publisher, port = vllm_publisher
    fakes = await start_fakes(1)
    router = await start_router(fakes, kv_events=kv_settings("zmq", zmq_port=port, zmq_topic="kv-events"))
    replica_id = f"{fakes[0].host}:{fakes[0].port}"
    await asyncio.wait_for(publisher.xpub.recv(), timeout=10)  # subscribed
    caplog.set_level(logging.INFO, logger="shoal.router")
    topic = publisher.topic

    def batch(*events: Any) -> bytes:
        return bytes(msgpack.packb([1_700_000_000.0, list(events), 0]))

    tokens = prompt(random.Random(9), 1)
    bad_frames = [
        [topic, batch(["AllBlocksCleared"])],  # no seq frame
        [topic, (0).to_bytes(4, "big"), batch(["AllBlocksCleared"])],  # a 4-byte seq
        [topic, (0).to_bytes(8, "big"), b"\xc1"],  # a byte msgpack never uses
        [topic, (1).to_bytes(8, "big"), b"\x81\x91\x01\x02"],  # a map keyed by an array
        [topic, (2).to_bytes(8, "big"), msgpack.packb(5)],  # msgpack, no batch
        [topic, (3).to_bytes(8, "big"), batch({"type": ["BlockStored"]})],  # a tag that is no string
        [topic, (4).to_bytes(8, "big"), batch(["BlockStored", [1], None, [2**40] * BLOCK, BLOCK, None, "GPU"])],
        [topic, (5).to_bytes(8, "big"), batch(["BlockShuffled", [1]])],
    ]
    for frames in bad_frames:
        await publisher.xpub.send_multipart(frames)
    await publisher.send(6, ["BlockStored", [7], None, tokens, BLOCK, None, "GPU"])
    await eventually(lambda: exact_depth(router, replica_id, tokens) == 1, what="the good batch after the bad ones")
    assert num_live(router) == 1  # the same connection reads on, in sync again

    assert await counter(router, "shoal_router_kv_events_skipped_total", {"reason": "malformed"}) == len(bad_frames)
    assert await counter(router, "shoal_router_kv_events_reconnects_total") == 0
    assert await counter(router, "shoal_router_task_failures_total", {"task": "kv_events"}) == 0
    records = [r for r in caplog.records if r.name.startswith("shoal.router")]
    skipped = [r.getMessage() for r in records if "skipping a malformed message" in r.getMessage()]
    kinds = ["(frames: ", "(not msgpack: ", "(not a batch: ", "(bad event: "]
    assert len(skipped) == len(kinds) and all(k in line for k, line in zip(kinds, skipped, strict=True)), skipped
    assert all(r.exc_info is None for r in records)  # no traceback for any of them
    assert not [r for r in records if "events lost" in r.getMessage()]  # one line per kind, not one per message
    assert len([r for r in records if r.getMessage().endswith(": in sync")]) == 1  # live again with the good batch
