"""Exact mode: each replica's KV events, applied to the shared prefix index (DESIGN.md contract 2).

One `KVEventSubscriber` per replica, for as long as the replica is in the pool: `KVEventSubscribers` is a pool
listener, so the static list, the admin API and discovery all start and stop streams the same way. The health
checker steers them: a replica taken out of rotation has its entries dropped (`RoutingCore.drop_cache`) and its
stream restarted, and one back in rotation is reconnected at once rather than after its backoff.

Sources (`kv_events.source`).
  - `sse`: Shoal's replica, `GET /v1/kv_events`. Each connection opens with a snapshot (`cleared`, then every
    cached block, parents first), so a (re)connection rebuilds the replica's entries from the truth. `seq` grows
    by one per message; a gap means missed events, and the cure is another connection, hence another snapshot.
  - `zmq`: vLLM's ZMQ publishers, found through the replica's `GET /kv_event_sources` (else the configured
    port), multipart [topic, seq (8 bytes, big endian), msgpack `KVEventBatch`]. There is no snapshot: on
    connecting and on a gap in `seq` the publisher's replay endpoint supplies the batches it still buffers
    (`ZmqSubscriber`); where that cannot close the gap, the replica's exact entries are demoted to approximate
    ones (`PrefixIndex.demote`), since whatever removals went missing would otherwise keep blocks indexed that
    the engine has dropped. vLLM's 128-token CPU blocks are indexed as the router's smaller blocks.

Each subscriber runs under `router.service.supervise`: a failure it did not foresee is counted (task
`kv_events`) and logged, and the subscriber starts over after a backoff from `reconnect_min_s` to
`reconnect_max_s`, its stream not live meanwhile.

A stream is live once it is in sync: an SSE snapshot applied, a ZMQ replay or batch applied. While it is, the
router records its routing decisions for token-id prompts as short-lived predictions (routing.py), which the
engine's `stored` events confirm.

The events name no model, or only a LoRA adapter (vLLM's `lora_name`), while the router's hashes are namespaced
by the request's model: a replica's base model is the one card of its `/v1/models` without a parent, known after
its first good probe. Until then its stream waits.

Pacing: applying a block costs some 8 us (its router hash and a few dict updates), and the index lives on the
event loop. Events are applied at most `max_blocks_per_s` per stream, yielding to the loop every
`_YIELD_EVERY_BLOCKS`, so a large snapshot costs the proxy a few ms of latency at a time, not a stall. A stream
that outruns the pace is read late and ends in the source's own overflow handling (the replica drops a slow SSE
reader, ZMQ drops past its high-water mark), then a resync.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

from router.policy.hashing import namespace_seed
from router.policy.kv_events import AllCleared, BlockRemoved, BlockStored, KVEvent, KVEventError
from router.policy.prefix_index import PrefixIndex
from router.service.kv_event_wire import MalformedBatch, decode_vllm_batch, parse_sse_message
from router.service.metrics import RouterMetrics
from router.service.pool import Replica, ReplicaPool
from router.service.settings import KVEventSettings, RouterSettings
from router.service.supervise import supervise

if TYPE_CHECKING:
    import zmq.asyncio

log = logging.getLogger("shoal.router.kv_events")

_YIELD_EVERY_BLOCKS = 512
"""Blocks applied between yields to the event loop: some 4 ms of work."""
_BURST_S = 0.05
"""Seconds of `max_blocks_per_s` a stream may apply at once after an idle spell."""
_KIND: dict[type, str] = {BlockStored: "stored", BlockRemoved: "removed", AllCleared: "cleared"}


class Pacer:
    """A token bucket over blocks: how long to wait, at `now`, before applying `num_blocks` more."""

    def __init__(self, blocks_per_s: float, burst_s: float = _BURST_S) -> None:
        self._blocks_per_s = blocks_per_s
        self._burst_s = burst_s
        self._free_at = -float("inf")
        """When the blocks let through so far would have been applied at exactly `blocks_per_s`."""

    def delay_s(self, num_blocks: int, now: float) -> float:
        self._free_at = max(self._free_at, now - self._burst_s) + num_blocks / self._blocks_per_s
        return max(0.0, self._free_at - now)


def backoff_s(num_failures: int, settings: KVEventSettings, jitter: float) -> float:
    """Wait before the next attempt after `num_failures` consecutive ones: doubling from `reconnect_min_s` up to
    `reconnect_max_s`, scaled by `jitter` in [0.5, 1] so that routers restarted together do not reconnect in step."""
    exponent = min(max(num_failures - 1, 0), 30)
    return min(settings.reconnect_max_s, settings.reconnect_min_s * 2.0**exponent) * jitter


# --- subscribers --------------------------------------------------------------------------------------------------


class _StreamEnded(Exception):
    """The stream ended, or must be restarted, for `reason` (a metric label)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(detail or reason)
        self.reason = reason


class KVEventSubscriber(abc.ABC):
    """One replica's KV-event stream: connect, apply, reconnect with backoff, until cancelled. Subclasses say how
    to follow one connection (`_follow`)."""

    def __init__(
        self,
        replica: Replica,
        index: PrefixIndex,
        settings: KVEventSettings,
        *,
        token_block_size: int,
        metrics: RouterMetrics,
        clock: Callable[[], float],
        rng: random.Random,
    ) -> None:
        self.replica = replica
        self.index = index
        self.settings = settings
        self.metrics = metrics
        self._token_block_size = token_block_size
        self._clock = clock
        self._rng = rng
        self._pacer = Pacer(settings.max_blocks_per_s)
        self._adapter_seeds: dict[str, bytes] = {}
        self._wake = asyncio.Event()
        self._num_failures = 0
        self._task: asyncio.Task[None] | None = None
        self._stream: asyncio.Task[str] | None = None
        self._resync_reason: str | None = None
        self._is_block_size_reported = False

    def start(self) -> None:
        """Follow the stream in a task of its own, restarted with backoff after a failure it did not foresee
        (router/service/supervise.py)."""
        run = supervise(
            "kv_events",
            self._run,
            failures=self.metrics.tasks,
            clock=self._clock,
            where=self.replica.id,
            min_backoff_s=self.settings.reconnect_min_s,
            max_backoff_s=self.settings.reconnect_max_s,
        )
        self._task = asyncio.get_running_loop().create_task(run, name=f"kv-events {self.replica.id}")

    def cancel(self) -> asyncio.Task[None] | None:
        """Stop for good (the replica left the pool); returns the task to await."""
        if self._task is not None:
            self._task.cancel()
        return self._task

    def resync(self, reason: str) -> None:
        """Drop the current connection and start over (the replica's entries were dropped meanwhile)."""
        if self._stream is not None and not self._stream.done():
            self._resync_reason = reason
            self._stream.cancel()

    def wake(self) -> None:
        """Retry now instead of after the backoff (the replica is back in rotation)."""
        self._num_failures = 0
        self._wake.set()

    async def _run(self) -> None:
        try:
            while True:
                seed = self._base_seed()
                if seed is not None:
                    reason = await self._follow_once(seed)
                    self.metrics.kv_events_reconnects.inc((reason,))
                    self._num_failures += 1
                    delay = backoff_s(self._num_failures, self.settings, self._rng.uniform(0.5, 1.0))
                else:
                    delay = self.settings.reconnect_max_s  # or sooner, when the first good probe wakes us
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
        finally:
            self._set_live(False)

    async def _follow_once(self, seed: bytes) -> str:
        """Follow one connection until it ends; returns why it did."""
        self._stream = asyncio.get_running_loop().create_task(self._follow(seed))
        try:
            return await self._stream
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # stopped
            return self._resync_reason or "resync"
        except _StreamEnded as exc:
            log.info("KV events of %s: stream ended (%s)", self.replica.id, exc)
            return exc.reason
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.info("KV events of %s: %s: %s", self.replica.id, type(exc).__name__, exc)
            return "error"
        finally:  # any other failure ends the task, which its supervisor restarts (start)
            self._stream = None
            self._resync_reason = None
            self._set_live(False)

    @abc.abstractmethod
    async def _follow(self, seed: bytes) -> str:
        """Follow one connection, applying its events hashed under `seed` (the base model's); returns why it
        ended, or raises."""

    def _base_seed(self) -> bytes | None:
        """Namespace seed of the replica's base model; None while unknown (its models are not known yet, or it
        lists several without a parent)."""
        bases = [m for m, card in self.replica.model_cards.items() if not card.get("parent")]
        return namespace_seed(bases[0]) if len(bases) == 1 else None

    def _adapter_seed(self, adapter: str) -> bytes:
        """Namespace seed of a LoRA adapter: requests name it as their model, and the router hashes them so."""
        seed = self._adapter_seeds.get(adapter)
        if seed is None:
            seed = self._adapter_seeds[adapter] = namespace_seed(adapter)
        return seed

    def _set_live(self, is_live: bool) -> None:
        if is_live and not self.replica.has_live_kv_events:
            log.info("KV events of %s: in sync", self.replica.id)
        self.replica.has_live_kv_events = is_live
        if is_live:
            self._num_failures = 0

    def _clear(self) -> None:
        """Forget every entry of the replica: what the index holds may no longer be what the engine holds."""
        self.index.apply(self.replica.id, AllCleared(), seed=b"", now=self._clock())

    async def _apply(self, events: Iterable[tuple[KVEvent, bytes]]) -> None:
        rid = self.replica.id
        index = self.index
        applied = self.metrics.kv_events_applied
        num_since_yield = 0
        for event, seed in events:
            num_blocks = 1 if isinstance(event, AllCleared) else len(event.block_hashes)
            delay_s = self._pacer.delay_s(num_blocks, self._clock())
            num_since_yield += num_blocks
            if delay_s > 0 or num_since_yield >= _YIELD_EVERY_BLOCKS:
                await asyncio.sleep(delay_s)
                num_since_yield = 0
            if isinstance(event, BlockStored) and event.block_size % self._token_block_size:
                self._report_block_size(event.block_size)
            if index.apply(rid, event, seed=seed, now=self._clock(), block_size=self._token_block_size):
                applied.inc((_KIND[type(event)],))
            else:
                self.metrics.kv_events_skipped.inc(("unknown_parent",))

    def _report_block_size(self, block_size: int) -> None:
        if not self._is_block_size_reported:
            self._is_block_size_reported = True
            log.warning(
                "KV events of %s name %d-token blocks, not a multiple of the router's %d-token blocks "
                "(hashing.token_block_size): no request will match them",
                self.replica.id,
                block_size,
                self._token_block_size,
            )


class SseSubscriber(KVEventSubscriber):
    """Shoal's replica: `GET <replica>/v1/kv_events`, a snapshot then every step's events."""

    def __init__(self, *args: Any, session: aiohttp.ClientSession, connect_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=None)

    async def _follow(self, seed: bytes) -> str:
        url = self.replica.url + self.settings.sse_path
        async with self._session.get(url, timeout=self._timeout) as resp:
            if resp.status != 200:
                raise _StreamEnded("error", f"{url} answered HTTP {resp.status}")
            next_seq: int | None = None
            async for data in sse_data(resp.content, self.settings.max_message_bytes):
                try:
                    message = parse_sse_message(data)
                except KVEventError as exc:
                    raise _StreamEnded("malformed", str(exc)) from exc
                if next_seq is None and not message.is_snapshot:
                    raise _StreamEnded("malformed", "the stream did not open with a snapshot")
                if next_seq is not None and message.seq != next_seq:
                    self.metrics.kv_events_gaps.inc()
                    raise _StreamEnded("gap", f"seq {message.seq} after {next_seq - 1}")
                next_seq = message.seq + 1
                await self._apply((event, seed) for event in message.events)
                if message.is_snapshot:
                    self._set_live(True)
        return "closed"


async def sse_data(content: aiohttp.StreamReader, max_bytes: int) -> AsyncIterator[bytes]:
    """The data of each server-sent event (its `data:` lines joined by newlines); other fields and comments are
    ignored. Raises _StreamEnded past `max_bytes` of one message."""
    buffer = bytearray()
    scanned = 0  # bytes of `buffer` known to hold no newline
    lines: list[bytes] = []
    size = 0
    async for chunk in content.iter_any():
        buffer += chunk
        start = 0
        while (end := buffer.find(b"\n", max(start, scanned))) >= 0:
            line = bytes(buffer[start:end]).removesuffix(b"\r")
            start = end + 1
            if not line:
                if lines:
                    yield b"\n".join(lines)
                lines, size = [], 0
            elif line.startswith(b"data:"):
                value = line[5:].removeprefix(b" ")
                lines.append(value)
                size += len(value)
        del buffer[:start]
        scanned = len(buffer)
        if size + len(buffer) > max_bytes:
            raise _StreamEnded("malformed", f"a message exceeds {max_bytes} bytes")


@dataclass(frozen=True, slots=True)
class ZmqSource:
    """One engine's publisher (vLLM runs one per data-parallel rank)."""

    endpoint: str
    replay_endpoint: str | None
    topic: str


async def discover_zmq_sources(
    session: aiohttp.ClientSession, replica: Replica, settings: KVEventSettings, timeout_s: float
) -> list[ZmqSource]:
    """The replica's publishers from its `GET /kv_event_sources` (vLLM >= 0.11), `*` and wildcard hosts replaced by
    the replica's host; where it answers none (an older vLLM, another engine), the configured port and topic."""
    host = f"[{replica.host}]" if ":" in replica.host else replica.host
    try:
        url = replica.url + settings.zmq_sources_path
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            ranks = await resp.json(content_type=None) if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        log.debug("KV events of %s: no /kv_event_sources (%s)", replica.id, exc)
        ranks = None
    sources = []
    if isinstance(ranks, dict):
        for rank in sorted(ranks, key=str):
            config = ranks[rank]
            if not isinstance(config, dict) or config.get("publisher") != "zmq":
                continue
            endpoint = _on_host(config.get("endpoint"), host)
            if endpoint is None:
                continue
            topic = config.get("topic")
            sources.append(
                ZmqSource(
                    endpoint,
                    _on_host(config.get("replay_endpoint"), host),
                    topic if isinstance(topic, str) else settings.zmq_topic,
                )
            )
    if sources:
        return sources
    replay = None if settings.zmq_replay_port is None else f"tcp://{host}:{settings.zmq_replay_port}"
    return [ZmqSource(f"tcp://{host}:{settings.zmq_port}", replay, settings.zmq_topic)]


def _on_host(endpoint: Any, host: str) -> str | None:
    """A TCP endpoint as the engine configured it, with a wildcard host (`*`, `0.0.0.0`, `::`) replaced by `host`;
    None for anything else (ipc and inproc endpoints are not reachable from another host)."""
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        return None
    address, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if not sep or not port.isdigit():
        return None
    if address in ("*", "0.0.0.0", "::", "[::]", "[*]", ""):
        address = host
    return f"tcp://{address}:{port}"


_END_OF_REPLAY = -1


class ZmqSubscriber(KVEventSubscriber):
    """vLLM: a SUB socket on each of the replica's publishers, msgpack `KVEventBatch`es; missed batches asked of
    the publisher's replay socket.

    Per publisher, batches are applied in `seq` order. On connecting and on a gap, the replay endpoint (a ROUTER
    socket: send [b"", first seq], receive [b"", topic, seq, payload] per buffered batch, then seq -1) supplies
    what was missed, so a restarted router rebuilds the engine's cache from its buffer. Where no replay is
    configured, or the buffer no longer reaches back to the gap, the replica's exact entries are demoted to
    approximate ones (`PrefixIndex.demote`) rather than forgotten. A batch numbered below the last applied one
    that is not a replayed duplicate means the engine restarted: its cache is new, so the entries are cleared.
    """

    def __init__(
        self,
        *args: Any,
        context: zmq.asyncio.Context,
        session: aiohttp.ClientSession,
        connect_timeout_s: float,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._context = context
        self._session = session
        self._connect_timeout_s = connect_timeout_s
        self._last_seq: dict[str, int] = {}
        """Endpoint -> seq of the last batch applied from it; kept across connections (a gap spanning a
        reconnection is a gap too) and dropped when the replica's entries were (`resync`)."""
        self._duplicates_from: dict[str, int] = {}
        """Endpoint -> first seq of its latest replay: live batches from there up to the last applied are the
        replayed ones again."""
        self._is_replay_silent: set[str] = set()
        """Endpoints whose replay socket did not answer on this connection: their gaps are not asked again."""
        self._malformed_kinds: set[str] = set()
        """Kinds of malformed message logged already (`_malformed`)."""

    def resync(self, reason: str) -> None:
        self._last_seq.clear()
        self._duplicates_from.clear()
        super().resync(reason)

    async def _follow(self, seed: bytes) -> str:
        sources = await discover_zmq_sources(self._session, self.replica, self.settings, self._connect_timeout_s)
        if len(sources) == 1:
            await self._follow_source(sources[0], seed)
            return "closed"
        tasks = [asyncio.ensure_future(self._follow_source(source, seed)) for source in sources]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # raises the first failure
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return "closed"

    async def _follow_source(self, source: ZmqSource, seed: bytes) -> None:
        import zmq

        socket = self._context.socket(zmq.SUB)
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.RECONNECT_IVL, int(self.settings.reconnect_min_s * 1000))
            socket.setsockopt(zmq.RECONNECT_IVL_MAX, int(self.settings.reconnect_max_s * 1000))
            socket.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
            socket.connect(source.endpoint)
            self._is_replay_silent.discard(source.endpoint)
            if source.replay_endpoint is not None:
                last = self._last_seq.get(source.endpoint)
                await self._catch_up(source, 0 if last is None else last + 1, seed)
                self._set_live(True)
            while True:  # ZMQ reconnects by itself; this ends by cancellation or a socket error
                frames = await socket.recv_multipart()
                await self._on_batch(source, frames, seed)
        except zmq.ZMQError as exc:
            raise _StreamEnded("error", f"{source.endpoint}: {exc}") from exc
        finally:
            socket.close(linger=0)

    async def _on_batch(self, source: ZmqSource, frames: Sequence[bytes], seed: bytes) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            sizes = [len(f) for f in frames[:4]]
            self._malformed(source, "frames", f"{len(frames)} of {sizes} bytes, not [topic, 8-byte seq, batch]")
            return
        seq = int.from_bytes(frames[1], "big")
        last = self._last_seq.get(source.endpoint)
        if last is not None and seq <= last:
            if seq >= self._duplicates_from.get(source.endpoint, last + 1):
                return  # replayed already
            log.info("KV events of %s: seq %d after %d, the engine restarted", self.replica.id, seq, last)
            self._clear()
            del self._last_seq[source.endpoint]
        elif last is not None and seq != last + 1:
            self.metrics.kv_events_gaps.inc()
            if source.replay_endpoint is None or source.endpoint in self._is_replay_silent:
                self._lost(source, f"seq {seq} after {last}, and no replay")
            else:
                await self._catch_up(source, last + 1, seed)
                if seq <= self._last_seq.get(source.endpoint, -1):
                    return  # the replay brought this batch too
        if await self._apply_batch(source, seq, frames[2], seed):
            self._set_live(True)

    async def _apply_batch(self, source: ZmqSource, seq: int, payload: bytes, seed: bytes) -> bool:
        """Apply one batch; False when it could not be read (its events are lost)."""
        self._last_seq[source.endpoint] = seq
        try:
            batch = decode_vllm_batch(payload)
        except MalformedBatch as exc:
            self._malformed(source, exc.kind, exc.detail)
            return False
        if batch.num_unsupported:
            self.metrics.kv_events_skipped.inc(("unsupported",), batch.num_unsupported)
        await self._apply(
            [(e, seed if adapter is None else self._adapter_seed(adapter)) for e, adapter in batch.events]
        )
        return True

    async def _catch_up(self, source: ZmqSource, first_seq: int, seed: bytes) -> None:
        """Apply the batches from `first_seq` on that the publisher still buffers; demote the replica's entries
        if the buffer starts past `first_seq` after batches were applied (some are lost for good)."""
        import zmq

        assert source.replay_endpoint is not None
        dealer = self._context.socket(zmq.DEALER)
        timeout_s = self.settings.replay_timeout_s
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(source.replay_endpoint)
            await dealer.send_multipart([b"", first_seq.to_bytes(8, "big")])
            expected = first_seq
            while True:
                try:
                    frames = await asyncio.wait_for(dealer.recv_multipart(), timeout_s)
                except TimeoutError:
                    # A replay socket that does not answer (an engine without one on that port) costs this wait
                    # once per connection; what it would have filled is treated as lost.
                    self._is_replay_silent.add(source.endpoint)
                    self._lost(source, f"{source.replay_endpoint} sent no replay within {timeout_s} s")
                    return
                if len(frames) != 4 or len(frames[2]) != 8:
                    self.metrics.kv_events_skipped.inc(("malformed",))
                    raise _StreamEnded("malformed", f"a replay message of {len(frames)} frames")
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == _END_OF_REPLAY:
                    break
                if seq < expected:
                    continue
                if seq > expected and source.endpoint in self._last_seq:
                    self._lost(source, f"the replay starts at seq {seq}, {seq - expected} batches late")
                if expected == first_seq:
                    self._duplicates_from[source.endpoint] = seq
                await self._apply_batch(source, seq, frames[3], seed)
                expected = seq + 1
        finally:
            dealer.close(linger=0)

    def _malformed(self, source: ZmqSource, kind: str, detail: str) -> None:
        """A message Shoal cannot read: skipped and counted, its events lost (`_lost`); logged in one line the
        first time the replica sends one of this `kind`, and only counted after."""
        self.metrics.kv_events_skipped.inc(("malformed",))
        is_new = kind not in self._malformed_kinds
        if is_new:
            self._malformed_kinds.add(kind)
            log.warning(
                "KV events of %s: skipping a malformed message from %s (%s: %s); its entries are kept as "
                "approximate until the next good batch (further messages of this kind are only counted)",
                self.replica.id,
                source.endpoint,
                kind,
                detail[:300],
            )
        self._lost(source, detail, is_logged=False)

    def _lost(self, source: ZmqSource, detail: str, *, is_logged: bool = True) -> None:
        """Events went missing for good: what the index holds of the replica becomes approximate, and the router
        records its own decisions again until the next good batch."""
        num_demoted = self.index.demote(self.replica.id, now=self._clock())
        if is_logged:
            log.info(
                "KV events of %s: events lost from %s (%s): %d entries kept as approximate",
                self.replica.id,
                source.endpoint,
                detail,
                num_demoted,
            )
        self._set_live(False)


class KVEventSubscribers:
    """A subscriber per replica of the pool, while it is in the pool (a `PoolListener`)."""

    def __init__(
        self,
        settings: RouterSettings,
        pool: ReplicaPool,
        index: PrefixIndex,
        metrics: RouterMetrics,
        clock: Callable[[], float],
    ) -> None:
        if settings.kv_events.source == "none":
            raise ValueError("KV-event subscribers need kv_events.source 'sse' or 'zmq'")
        self.settings = settings
        self.pool = pool
        self.index = index
        self.metrics = metrics
        self.clock = clock
        self._rng = random.Random(settings.seed)
        self._subscribers: dict[str, KVEventSubscriber] = {}
        self._stopping: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None
        self._context: zmq.asyncio.Context | None = None

    async def start(self) -> None:
        """Subscribe to every replica of the pool, and to those it gains later."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), skip_auto_headers=("User-Agent",)
        )
        if self.settings.kv_events.source == "zmq":
            import zmq.asyncio  # only routers reading vLLM's ZMQ stream load pyzmq

            self._context = zmq.asyncio.Context()
        for replica in self.pool:
            self.replica_added(replica)
        self.pool.add_listener(self)

    async def stop(self) -> None:
        with contextlib.suppress(ValueError):  # not started
            self.pool.remove_listener(self)
        for replica_id in list(self._subscribers):
            self._forget(replica_id)
        await asyncio.gather(*self._stopping, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        if self._context is not None:
            self._context.destroy(linger=0)

    def replica_added(self, replica: Replica) -> None:
        common: dict[str, Any] = {
            "token_block_size": self.settings.hashing.token_block_size,
            "metrics": self.metrics,
            "clock": self.clock,
            "rng": self._rng,
        }
        s = self.settings.kv_events
        subscriber: KVEventSubscriber
        assert self._session is not None, "start() first"
        timeout_s = self.settings.retry.connect_timeout_s
        if self._context is None:
            subscriber = SseSubscriber(
                replica, self.index, s, session=self._session, connect_timeout_s=timeout_s, **common
            )
        else:
            subscriber = ZmqSubscriber(
                replica,
                self.index,
                s,
                context=self._context,
                session=self._session,
                connect_timeout_s=timeout_s,
                **common,
            )
        self._forget(replica.id)
        self._subscribers[replica.id] = subscriber
        subscriber.start()

    def replica_removed(self, replica: Replica) -> None:
        self._forget(replica.id)

    def replica_down(self, replica: Replica) -> None:
        """Out of rotation: its entries were dropped, so its stream starts over (and a restarted engine's empty
        cache is what the next snapshot says)."""
        subscriber = self._subscribers.get(replica.id)
        if subscriber is not None:
            subscriber.resync("replica_down")

    def replica_up(self, replica: Replica) -> None:
        subscriber = self._subscribers.get(replica.id)
        if subscriber is not None:
            subscriber.wake()

    def _forget(self, replica_id: str) -> None:
        subscriber = self._subscribers.pop(replica_id, None)
        if subscriber is None:
            return
        task = subscriber.cancel()
        if task is not None:
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)
