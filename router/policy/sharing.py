"""Routing records that routers share (DESIGN.md, Router fleet): their encoding, and applying peers' records.

Each router publishes batches of what the others need to know, and applies the others' batches to its own
`RoutingCore`, so that a prefix one router routed is a hit at every router and each replica's load, as any router
sees it, is the sum over routers:
  - `Routed`: a replica and the block hashes of the prompts routed there since the last batch, merged
    (`merge_routed`). A peer records them as the router that decided would (`RoutingCore.record_peer`):
    approximate, or a short-lived prediction where the peer follows that replica's KV events itself.
  - `Loads`: the publishing router's own requests in flight per replica, as absolute counts, not begin/finish
    deltas: a lost or dropped batch is healed by the next one, where a lost delta would skew the sum for good.
    `is_complete` batches (the heartbeat) list every replica with load, so a replica left out has none from that
    router. A peer's counts expire `load_ttl_s` after its last batch: a router that dies stops counting.
  - `Pin`: a session's pin (session affinity), so a session's next turn keeps its replica at any router.
  - `Drain`: a replica drained or undrained through one router's admin API, which the others follow.

Gaps. Batches carry the publisher's `seq`, one more per batch, from a publisher id that is new per process. A batch
whose seq is not the next one (the capped stream was trimmed past it, Redis was flushed) is applied, and reported
as a gap: loads heal by themselves, approximate records are guesses either way, and the driver re-reads the state
that does not heal (drains) instead of guessing it.

Wire form: JSON (orjson), block hashes packed as little-endian uint64 in base64 (11 bytes a hash, against 20 as
decimal text). Pure: no I/O, `now` comes from the caller.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import orjson

from router.policy.routing_core import RoutingCore

WIRE_VERSION = 1


class SharingError(ValueError):
    """A malformed batch; the consumer counts and skips it."""


@dataclass(frozen=True, slots=True)
class Routed:
    replica: str
    hashes: tuple[int, ...]
    """Block hashes in the order `PrefixIndex.record` takes them: one prompt's from block 0, or several prompts'
    merged by `merge_routed`."""
    is_tokens: bool
    """Hashed over token ids: KV events of the replica name the same blocks."""


def merge_routed(decisions: Iterable[tuple[str, Sequence[int], bool]]) -> tuple[Routed, ...]:
    """Decisions (replica, a prompt's block hashes from block 0, hashed over token ids), oldest first, as one
    `Routed` per replica and kind: recording it leaves an index as recording each decision in turn at one `now`.

    `PrefixIndex.record` touches a prompt's blocks leaf first, so after the decisions in turn each block sits
    where it was last touched; those positions, newest first, are the first occurrences in the newest decision's
    hashes followed by the next older one's, and so on. Prompts that share a system prompt or an agent's history
    send those blocks once a batch instead of once a decision. A block's ancestors are in every prompt that holds
    it, so they stay more recent than it, as eviction needs.
    """
    groups: dict[tuple[str, bool], list[Sequence[int]]] = {}
    for replica, hashes, is_tokens in decisions:
        if hashes:
            groups.setdefault((replica, is_tokens), []).append(hashes)
    return tuple(
        Routed(replica, tuple(dict.fromkeys(chain.from_iterable(reversed(prompts)))), is_tokens)
        for (replica, is_tokens), prompts in groups.items()
    )


@dataclass(frozen=True, slots=True)
class Load:
    """One router's own requests on one replica."""

    in_flight: int = 0
    waiting: int = 0
    """Of `in_flight`, those waiting for their first byte."""
    waiting_prompt_tokens: int = 0
    """Uncached prompt tokens of the `waiting` ones."""


@dataclass(frozen=True, slots=True)
class Pin:
    session_key: str
    replica: str


@dataclass(frozen=True, slots=True)
class Drain:
    replica: str
    is_draining: bool


@dataclass(frozen=True, slots=True)
class Batch:
    router: str
    """The publisher's id, new per process."""
    seq: int
    """One more than the publisher's previous batch; 1 for its first."""
    routed: tuple[Routed, ...] = ()
    loads: dict[str, Load] = field(default_factory=dict)
    """Replica id -> the publisher's load there, for the replicas whose load changed (or all, `is_complete`)."""
    is_complete: bool = False
    """`loads` lists every replica the publisher has load on: any other has none."""
    pins: tuple[Pin, ...] = ()
    drains: tuple[Drain, ...] = ()


def _pack(hashes: Sequence[int]) -> str:
    return base64.b64encode(struct.pack(f"<{len(hashes)}Q", *hashes)).decode()


def _unpack(text: Any) -> tuple[int, ...]:
    if not isinstance(text, str):
        raise SharingError("hashes must be a base64 string")
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError as exc:
        raise SharingError(f"hashes are not base64: {exc}") from exc
    if len(raw) % 8:
        raise SharingError("packed hashes must be a multiple of 8 bytes")
    return struct.unpack(f"<{len(raw) // 8}Q", raw)


def encode_batch(batch: Batch) -> bytes:
    body = {
        "v": WIRE_VERSION,
        "router": batch.router,
        "seq": batch.seq,
        "routed": [[r.replica, _pack(r.hashes), r.is_tokens] for r in batch.routed],
        "loads": {rid: [x.in_flight, x.waiting, x.waiting_prompt_tokens] for rid, x in batch.loads.items()},
        "complete": batch.is_complete,
        "pins": [[p.session_key, p.replica] for p in batch.pins],
        "drains": [[d.replica, d.is_draining] for d in batch.drains],
    }
    return orjson.dumps(body)


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise SharingError(f"{what} must be a string")
    return value


def _count(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise SharingError(f"{what} must be a non-negative integer")
    return value


def decode_batch(data: bytes) -> Batch:
    """The batch `encode_batch` wrote; raises SharingError for anything else (another wire version included)."""
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise SharingError(f"batch is not JSON: {exc}") from exc
    if not isinstance(body, dict) or body.get("v") != WIRE_VERSION:
        raise SharingError(f"batch must be an object of wire version {WIRE_VERSION}")
    try:
        routed = tuple(Routed(_str(r, "replica"), _unpack(h), t is True) for r, h, t in body.get("routed", []))
        loads = {
            _str(rid, "replica"): Load(_count(a, "in_flight"), _count(b, "waiting"), _count(c, "tokens"))
            for rid, (a, b, c) in body.get("loads", {}).items()
        }
        pins = tuple(Pin(_str(k, "session key"), _str(r, "replica")) for k, r in body.get("pins", []))
        drains = tuple(Drain(_str(r, "replica"), d is True) for r, d in body.get("drains", []))
    except (TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, SharingError):
            raise
        raise SharingError(f"malformed records: {exc}") from exc
    return Batch(
        _str(body.get("router"), "router"),
        _count(body.get("seq"), "seq"),
        routed,
        loads,
        body.get("complete") is True,
        pins,
        drains,
    )


@dataclass(frozen=True, slots=True)
class Applied:
    """What applying a batch left to the driver."""

    drains: tuple[Drain, ...] = ()
    """Drains and undrains to set on the driver's replicas (eligibility is the driver's)."""
    is_gap: bool = False
    """Batches of this publisher went missing before this one (module docstring)."""
    num_unknown: int = 0
    """Records naming a replica this router does not know (yet), left out."""


@dataclass(slots=True)
class _Peer:
    next_seq: int
    loads: dict[str, Load]
    expires_at: float


class PeerRouters:
    """The other routers as this one sees them: each one's load per replica, summed into the core's load views,
    and its position in its own sequence of batches."""

    def __init__(self, core: RoutingCore, *, load_ttl_s: float) -> None:
        if not load_ttl_s > 0:
            raise ValueError(f"load_ttl_s must be positive, got {load_ttl_s}")
        self.core = core
        self.load_ttl_s = load_ttl_s
        self._peers: dict[str, _Peer] = {}

    @property
    def peers(self) -> tuple[str, ...]:
        """Ids of the routers whose load counts now."""
        return tuple(self._peers)

    @property
    def num_entries(self) -> int:
        """Per-router load entries held (peers x replicas with load): the view's size."""
        return sum(len(p.loads) for p in self._peers.values())

    def load_of(self, router: str) -> dict[str, Load]:
        peer = self._peers.get(router)
        return dict(peer.loads) if peer is not None else {}

    def apply(
        self, batch: Batch, now: float, *, age_s: float = 0.0, has_live_kv_events: Callable[[str], bool] = bool
    ) -> Applied:
        """Apply a peer's batch, published `age_s` seconds ago (a replay at start), at `now`.
        `has_live_kv_events(replica)`: this router follows that replica's KV events, so a token-id prompt routed
        there is recorded as a prediction its events will confirm (as `RoutingCore.commit` does)."""
        core = self.core
        num_unknown = 0
        for routed in batch.routed:
            is_predicted = routed.is_tokens and has_live_kv_events(routed.replica)
            if not core.record_peer(routed.replica, routed.hashes, now, predicted=is_predicted):
                num_unknown += 1
        for pin in batch.pins:
            core.pin(pin.session_key, pin.replica)
        peer = self._peers.get(batch.router)
        is_gap = peer is not None and batch.seq != peer.next_seq
        expires_at = now + self.load_ttl_s - max(0.0, age_s)
        if expires_at > now:
            if peer is None:
                peer = self._peers[batch.router] = _Peer(batch.seq + 1, {}, expires_at)
            peer.next_seq = batch.seq + 1
            peer.expires_at = max(peer.expires_at, expires_at)
            changed = set(batch.loads)
            if batch.is_complete:
                changed.update(peer.loads)
                peer.loads = {}
            peer.loads.update(batch.loads)
            for rid in [rid for rid, x in peer.loads.items() if not (x.in_flight or x.waiting)]:
                del peer.loads[rid]
            self._resum(changed)
        elif peer is not None:
            peer.next_seq = batch.seq + 1
        return Applied(batch.drains, is_gap, num_unknown)

    def expire(self, now: float) -> list[str]:
        """Forget the routers whose last batch is older than `load_ttl_s`; returns their ids."""
        gone = [rid for rid, p in self._peers.items() if p.expires_at <= now]
        changed: set[str] = set()
        for rid in gone:
            changed.update(self._peers.pop(rid).loads)
        self._resum(changed)
        return gone

    def _resum(self, replicas: Iterable[str]) -> None:
        for rid in replicas:
            in_flight = waiting = tokens = 0
            for peer in self._peers.values():
                x = peer.loads.get(rid)
                if x is not None:
                    in_flight += x.in_flight
                    waiting += x.waiting
                    tokens += x.waiting_prompt_tokens
            self.core.set_peer_load(rid, in_flight, waiting, tokens)


def own_loads(core: RoutingCore, replicas: Iterable[str]) -> dict[str, Load]:
    """This router's own load on each of `replicas` (what it publishes), leaving out the peers' share."""
    return {rid: Load(*core.own_load(rid)) for rid in replicas if core.has_replica(rid)}
