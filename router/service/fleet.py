"""Several routers share one view through Redis (DESIGN.md, Router fleet): publish this router's routing records,
apply the others'.

One Redis Stream, `{<namespace>}:fleet:records`, carries every router's batches (`router.policy.sharing`: decisions,
load, session pins, drains), one entry per batch with fields `r` (the publisher's id, new per process) and `d` (the
encoded batch), capped with XADD MAXLEN ~. Drains also live in the hash `{<namespace>}:fleet:drains`, since a drain
must outlive the stream's trimming. The braces are a hash tag: on a Redis Cluster both keys live in one slot, so a
publish (XADD and HSET in one pipeline) goes to one node. The URL may name a standalone Redis, Sentinel or Cluster
(`router.service.redis_url`); every command here is a single-key one that all three serve.

- Publishing is off the request path: `routed`/`pinned` (called by `PoolRouting.commit`) append to a bounded queue,
  dropping and counting past `max_queued_records`; a task turns the queue, the router's own load changes and its
  drain changes into one batch every `flush_interval_s` (sooner past `max_batch_records`), with the whole load table
  every `heartbeat_s`.
- Consuming: a task XREADs after its own last entry id, skips its own entries and applies the others' to the core
  (`sharing.PeerRouters`); a peer's load expires `load_ttl_s` after its last batch.
- Start: before the app serves, the newest `max_replay_entries` of the stream are applied and the drains read,
  within `load_timeout_s`; what is not loaded by then is read by the consumer afterwards.
- Outages: every Redis command runs in these tasks, under `command_timeout_s`, so no request waits on Redis. Down,
  slow (a timeout) or flushed, the router serves on its own view; the first failure of an outage is logged, and
  when Redis answers again the router logs it, re-reads the drains (writing its own back if Redis lost them) and
  carries on from its position in the stream. A gap in a peer's batches (the stream was trimmed or flushed past
  them) triggers the same re-read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.exceptions import RedisClusterException, RedisError, ResponseError

from router.policy.sharing import (
    Batch,
    Drain,
    Load,
    PeerRouters,
    Pin,
    SharingError,
    decode_batch,
    encode_batch,
    merge_routed,
)
from router.policy.sharing import own_loads as read_own_loads
from router.service.pool import Replica, ReplicaPool
from router.service.redis_url import redis_client
from router.service.routing import PoolRouting
from router.service.settings import FleetSettings
from router.service.supervise import TaskFailures, supervise

log = logging.getLogger("shoal.router.fleet")

_ERRORS = (RedisError, RedisClusterException, OSError, TimeoutError)
"""What a Redis that is down or slow raises; RedisClusterException is no RedisError (a cluster not reachable)."""


_REPLAY_PAGE = 1000
"""Stream entries fetched per XREVRANGE at start."""
_READ_COUNT = 512
"""Stream entries one XREAD returns at most."""
_APPLY_YIELD_EVERY = 200
"""Entries applied between yields to the event loop at start, so the load deadline can interrupt a long replay."""


def _stream_id(entry_id: str) -> tuple[int, int]:
    """A stream entry's ID, "milliseconds-sequence", in the order Redis gives IDs."""
    milliseconds, _, sequence = entry_id.partition("-")
    return int(milliseconds), int(sequence or 0)


class FleetSharing:
    """This router's link to its fleet through Redis (module docstring)."""

    def __init__(
        self,
        url: str,
        settings: FleetSettings,
        routing: PoolRouting,
        pool: ReplicaPool,
        clock: Callable[[], float],
        *,
        failures: TaskFailures,
        on_undrained: Callable[[Replica], None] = lambda replica: None,
    ) -> None:
        self.url = url
        self.failures = failures
        self.settings = settings
        self.routing = routing
        self.pool = pool
        self.view = PeerRouters(routing.core, load_ttl_s=settings.load_ttl_s)
        self.router_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._router_id_bytes = self.router_id.encode()
        self._clock = clock
        self._on_undrained = on_undrained
        ns = settings.namespace
        self.stream_key = f"{{{ns}}}:fleet:records"
        self.drains_key = f"{{{ns}}}:fleet:drains"
        self._routed: list[tuple[str, list[int], bool]] = []
        """Decisions since the last batch, oldest first (merged into the batch by `sharing.merge_routed`)."""
        self._pins: dict[str, str] = {}
        self._num_queued = 0
        self._seq = 0
        self._pending: tuple[bytes, tuple[Drain, ...]] | None = None
        """A batch built but not yet written (Redis failed): retried as it is, so peers see no gap."""
        self._published: dict[str, Load] = {}
        self._last_heartbeat = -float("inf")
        self._drains: dict[str, bool] = {r.id: r.is_draining for r in pool}
        """Drain state last published or applied, per replica: a change from it is this router's to publish."""
        self._last_id = "0-0"
        self._clock_offset_ms = 0.0
        """Redis's clock minus this host's, measured at start: ages of stream entries come from their ids."""
        self._wake = asyncio.Event()
        self._needs_resync = False
        self.is_up = True
        self._outage_started: float | None = None
        self.is_loaded = False
        """The start-up load finished (within `load_timeout_s`)."""
        self.counts = dict.fromkeys(
            (
                "records_dropped",
                "batches_published",
                "batches_applied",
                "gaps",
                "malformed",
                "unknown_replica",
                "outages",
                "resyncs",
                "position_resets",
            ),
            0,
        )
        self._writer: Any = None
        self._reader: Any = None
        self._malformed_kinds: set[str] = set()
        self._clients = contextlib.AsyncExitStack()
        self._tasks: list[asyncio.Task[None]] = []

    # --- lifecycle ----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, load the fleet's state within `load_timeout_s`, then publish and consume in the background."""
        cfg = self.settings
        self._writer = redis_client(
            self.url, self._clients, timeout_s=cfg.command_timeout_s, connect_timeout_s=cfg.command_timeout_s
        )
        self._reader = redis_client(
            self.url,
            self._clients,
            timeout_s=cfg.command_timeout_s + cfg.read_block_s,
            connect_timeout_s=cfg.command_timeout_s,
        )
        try:
            async with asyncio.timeout(cfg.load_timeout_s):
                await self._load()
            self.is_loaded = True
        except _ERRORS as exc:
            self._down(exc)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._supervised("fleet_publish", self._publish_loop), name="fleet publish"),
            loop.create_task(self._supervised("fleet_consume", self._consume_loop), name="fleet consume"),
        ]

    async def _supervised(self, task: str, run: Callable[[], Awaitable[None]]) -> None:
        """`run` restarted after any failure it did not handle itself, which counts as an outage of sharing (the
        health gauge says so) and as a task failure; a failed publisher's batch is dropped, not retried for ever."""
        is_publisher = run == self._publish_loop

        def on_failure(exc: BaseException) -> None:
            if is_publisher:
                self._pending = None
            self._down(exc)

        await supervise(
            task,
            run,
            failures=self.failures,
            clock=self._clock,
            on_failure=on_failure,
            max_backoff_s=self.settings.retry_s * 10,
        )

    async def stop(self) -> None:
        """Cancel the tasks, then close the clients, each step within `command_timeout_s`: a shutdown does not wait
        on a Redis that is gone (a cluster client may still be retrying its nodes)."""
        timeout_s = self.settings.command_timeout_s
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=timeout_s)
            if pending:
                log.warning("fleet tasks still running %.1f s after cancel; leaving them", timeout_s)
        self._tasks = []
        try:
            async with asyncio.timeout(timeout_s):
                await self._clients.aclose()
        except _ERRORS as exc:
            log.info("closing the Redis clients: %s: %s", type(exc).__name__, exc)

    # --- what the request path calls (PoolRouting.commit) -------------------------------------------------------

    def routed(self, replica_id: str, hashes: list[int], is_tokens: bool) -> None:
        if self._num_queued >= self.settings.max_queued_records:
            self.counts["records_dropped"] += 1
            return
        self._routed.append((replica_id, hashes, is_tokens))
        self._queued()

    def pinned(self, session_key: str, replica_id: str) -> None:
        if self._pins.get(session_key) == replica_id:
            return
        if self._num_queued >= self.settings.max_queued_records:
            self.counts["records_dropped"] += 1
            return
        self._pins[session_key] = replica_id
        self._queued()

    def _queued(self) -> None:
        self._num_queued += 1
        if self._num_queued >= self.settings.max_batch_records:
            self._wake.set()

    # --- publishing ---------------------------------------------------------------------------------------------

    async def _publish_loop(self) -> None:
        cfg = self.settings
        while True:
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), cfg.flush_interval_s)
            self.view.expire(self._clock())
            if self._pending is None:
                self._pending = self._next_batch()
            if self._pending is None:
                continue
            data, drains = self._pending
            try:
                async with self._writer.pipeline(transaction=False) as pipe:
                    pipe.xadd(
                        self.stream_key,
                        {"r": self._router_id_bytes, "d": data},
                        maxlen=cfg.stream_max_len,
                        approximate=True,
                    )
                    for drain in drains:
                        if drain.is_draining:
                            pipe.hset(self.drains_key, drain.replica, "1")
                        else:
                            pipe.hdel(self.drains_key, drain.replica)
                    added, *drained = await pipe.execute(raise_on_error=False)
                if isinstance(added, ResponseError) and (
                    "exhausted the last possible ID" in str(added) or str(added).startswith("WRONGTYPE")
                ):
                    # The stream's top ID is the largest there is (a hostile entry), or its key holds another type:
                    # no XADD can succeed, for any router. Deleting the key lets every router publish again; readers
                    # find their position past its end and start over (_check_position).
                    self._malformed(f"the stream {self.stream_key!r} cannot advance ({added}): deleted")
                    await self._writer.delete(self.stream_key)
                    continue
                if isinstance(added, Exception):
                    raise added
                for result in drained:
                    if isinstance(result, ResponseError):  # the drains key holds another type: the stream goes on
                        self._malformed(f"the drains key {self.drains_key!r} is not a hash ({result})")
            except _ERRORS as exc:
                self._down(exc)
                await asyncio.sleep(cfg.retry_s)  # pacing the retries of a background task, not a wait on state
                continue
            self._pending = None
            self.counts["batches_published"] += 1
            self._up()

    def _next_batch(self) -> tuple[bytes, tuple[Drain, ...]] | None:
        """This router's news since the last batch, encoded; None when there is none."""
        now = self._clock()
        loads = read_own_loads(self.routing.core, [r.id for r in self.pool])
        is_heartbeat = now - self._last_heartbeat >= self.settings.heartbeat_s
        if is_heartbeat:
            changed = {rid: x for rid, x in loads.items() if x.in_flight or x.waiting}
            self._last_heartbeat = now
        else:
            changed = {rid: x for rid, x in loads.items() if x != self._published.get(rid, Load())}
            changed.update((rid, Load()) for rid in self._published if rid not in loads)
        drains = []
        for replica in self.pool:
            if self._drains.get(replica.id, False) != replica.is_draining:
                self._drains[replica.id] = replica.is_draining
                drains.append(Drain(replica.id, replica.is_draining))
        if not (is_heartbeat or changed or drains or self._routed or self._pins):
            return None
        self._published = {rid: x for rid, x in loads.items() if x.in_flight or x.waiting}
        self._seq += 1
        batch = Batch(
            self.router_id,
            self._seq,
            merge_routed(self._routed),
            changed,
            is_heartbeat,
            tuple(Pin(k, r) for k, r in self._pins.items()),
            tuple(drains),
        )
        self._routed = []
        self._pins = {}
        self._num_queued = 0
        return encode_batch(batch), batch.drains

    # --- consuming ----------------------------------------------------------------------------------------------

    async def _load(self) -> None:
        """The fleet's state before this router serves: the stream's newest entries, then the drains."""
        seconds, micros = await self._writer.time()
        self._clock_offset_ms = seconds * 1000 + micros / 1000 - time.time() * 1000
        entries: list[tuple[bytes, dict[bytes, bytes]]] = []
        upper: str | bytes = "+"
        while len(entries) < self.settings.max_replay_entries:
            count = min(_REPLAY_PAGE, self.settings.max_replay_entries - len(entries))
            page = await self._writer.xrevrange(self.stream_key, max=upper, min="-", count=count)
            if not page:
                break
            entries.extend(page)
            upper = b"(" + page[-1][0]
        for i, (entry_id, fields) in enumerate(reversed(entries)):
            self._apply_entry(entry_id, fields)
            if i % _APPLY_YIELD_EVERY == _APPLY_YIELD_EVERY - 1:
                await asyncio.sleep(0)
        await self._read_drains()

    async def _consume_loop(self) -> None:
        cfg = self.settings
        block_ms = int(cfg.read_block_s * 1000)
        while True:
            try:
                if self._needs_resync:
                    await self._read_drains()
                    self._needs_resync = False
                    self.counts["resyncs"] += 1
                reply = await self._reader.xread({self.stream_key: self._last_id}, count=_READ_COUNT, block=block_ms)
            except _ERRORS as exc:
                self._down(exc)
                await asyncio.sleep(cfg.retry_s)  # pacing the retries of a background task, not a wait on state
                continue
            self._up()
            if not reply:
                try:
                    await self._check_position()
                except _ERRORS as exc:
                    self._down(exc)
                continue
            for _stream, entries in reply:
                for entry_id, fields in entries:
                    self._apply_entry(entry_id, fields)

    async def _check_position(self) -> None:
        """After a read that found nothing: if the stream now ends before this reader's position (it was deleted
        and written anew, or its top entry was a hostile maximum ID), read it again from its start and resync;
        else the reader would wait past its end for ever."""
        newest = await self._reader.xrevrange(self.stream_key, count=1)
        end = _stream_id(newest[0][0].decode()) if newest else (0, 0)
        if end < _stream_id(self._last_id):
            log.warning(
                "the fleet stream ends at %s, before this router's position %s: reading it anew", end, self._last_id
            )
            self.counts["position_resets"] += 1
            self._last_id = "0-0"
            self._needs_resync = True

    def _apply_entry(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        self._last_id = entry_id.decode()
        if fields.get(b"r") == self._router_id_bytes:
            return
        try:
            batch = decode_batch(fields.get(b"d", b""))
        except SharingError as exc:
            self.counts["malformed"] += 1
            log.warning("skipping a malformed fleet record %s: %s", self._last_id, exc)
            return
        age_s = max(0.0, (time.time() * 1000 + self._clock_offset_ms - int(self._last_id.partition("-")[0])) / 1000)
        applied = self.view.apply(batch, self._clock(), age_s=age_s, has_live_kv_events=self._has_live_kv_events)
        self.counts["batches_applied"] += 1
        self.counts["unknown_replica"] += applied.num_unknown
        if applied.is_gap:
            self.counts["gaps"] += 1
            self._needs_resync = True
        for drain in applied.drains:
            self._set_drain(drain.replica, drain.is_draining)

    def _has_live_kv_events(self, replica_id: str) -> bool:
        replica = self.pool.get(replica_id)
        return replica is not None and replica.has_live_kv_events

    async def _read_drains(self) -> None:
        """Set drains as the hash says; if Redis lost the hash (flushed) while this router knows drains, write
        them back."""
        try:
            stored = await self._writer.hgetall(self.drains_key)
        except ResponseError as exc:  # WRONGTYPE: another writer's key there; Redis itself answers
            self._malformed(f"the drains key {self.drains_key!r} is not a hash ({exc})")
            return
        drained = set()
        for field in stored:
            try:
                drained.add(field.decode())
            except UnicodeDecodeError:
                self._malformed(f"a drains field that is not UTF-8: {field[:40]!r}")
        if not stored and any(self._drains.values()):
            await self._writer.hset(self.drains_key, mapping={rid: "1" for rid, d in self._drains.items() if d})
            return
        for replica in self.pool:
            self._set_drain(replica.id, replica.id in drained)

    def _malformed(self, detail: str) -> None:
        """A record Shoal cannot read: skipped and counted, logged once per kind of trouble."""
        self.counts["malformed"] += 1
        kind = detail.partition(":")[0]
        if kind not in self._malformed_kinds:
            self._malformed_kinds.add(kind)
            log.warning("skipping what the fleet's Redis holds: %s (further ones are only counted)", detail)

    def _set_drain(self, replica_id: str, is_draining: bool) -> None:
        self._drains[replica_id] = is_draining
        replica = self.pool.get(replica_id)
        if replica is None or replica.is_draining == is_draining:
            return
        log.info("%s %s, as another router said", "draining" if is_draining else "undraining", replica_id)
        replica.is_draining = is_draining
        if not is_draining:
            self._on_undrained(replica)

    # --- outages ------------------------------------------------------------------------------------------------

    def _down(self, exc: BaseException) -> None:
        if self.is_up:
            self.is_up = False
            self._outage_started = self._clock()
            self.counts["outages"] += 1
            log.warning("Redis unreachable (%s: %s): serving on this router's own view", type(exc).__name__, exc)

    def _up(self) -> None:
        if not self.is_up:
            self.is_up = True
            started = self._outage_started if self._outage_started is not None else self._clock()
            log.warning("Redis is back after %.1f s: resynchronising", self._clock() - started)
            self._needs_resync = True
            self._last_heartbeat = -float("inf")  # the whole load table goes out next

    # --- metrics ------------------------------------------------------------------------------------------------

    def collector(self) -> Collector:
        return _FleetCollector(self)


class _FleetCollector(Collector):
    def __init__(self, fleet: FleetSharing) -> None:
        self._fleet = fleet

    def collect(self) -> Iterator[Metric]:
        fleet = self._fleet
        for name, value in fleet.counts.items():
            family = CounterMetricFamily(f"shoal_router_fleet_{name}", f"Router fleet: {name.replace('_', ' ')}")
            family.add_metric([], value)
            yield family
        yield GaugeMetricFamily("shoal_router_fleet_redis_up", "1 while Redis answers", value=float(fleet.is_up))
        yield GaugeMetricFamily(
            "shoal_router_fleet_peers", "Other routers whose load counts", value=len(fleet.view.peers)
        )
        yield GaugeMetricFamily(
            "shoal_router_fleet_view_entries", "Per-router load entries held", value=fleet.view.num_entries
        )
        yield GaugeMetricFamily(
            "shoal_router_fleet_queued_records", "Records not yet published", value=fleet._num_queued
        )
