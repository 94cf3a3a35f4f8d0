"""The simulator's router: the live router's routing steps and load view, over the real policy and prefix index.

This mirrors `router/service/routing.py` (RoutingCore) step by step, without its service dependencies:

    eligible = the ready replicas under `max_in_flight_per_replica` (`admission.with_room`); none: the request is held
    matched  = index.match(hashes[:max_blocks], now)
    decision = SESSION: the replica the request's session went to last, while it is eligible (session affinity on)
               else ONLY_REPLICA without asking the policy when one replica is eligible
               else policy.select(RouteRequest(hashes, prompt_tokens, block_size, matched, session_key), eligible,
                                  now)
    remember the session's replica (session affinity on; the most recent 100,000 sessions)
    index.record(decision.replica, hashes, now)     # approximate mode; exact mode records `predicted` guesses
                                                     # (or nothing) and applies the engines' KV events instead
    begin:       in_flight += 1, waiting += 1, waiting_prompt_tokens += uncached (as predicted), last_selected = now
    first token: waiting -> streaming; the prefill-rate estimate learns from the observed TTFT and the backlog
                 ahead at routing time; a replica's first observation re-seeds the unobserved replicas
    finish:      in_flight -= 1, streaming -= 1

Scraped gauges (num_running, num_waiting, kv_usage) are copied in by `scrape`, which the simulation calls every
scrape interval, so policies see them as stale as the live router does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from router.policy.admission import free_slots, with_room
from router.policy.kv_events import KVEvent
from router.policy.prefill_rate import PrefillRate, PrefillRateEstimator
from router.policy.prefix_index import PrefixIndex
from router.policy.session import SessionAffinityConfig, SessionTable
from router.policy.types import Branch, Decision, Policy, ReplicaState, RouteRequest

IndexMode = Literal["approximate", "exact", "exact_predicted"]
"""approximate: the router records its own decisions (the live router today). exact: only the engines' KV events
fill the index. exact_predicted: KV events, plus short-lived `predicted` records for sibling requests that arrive
before the events."""


"""Sessions the router remembers a replica for, least recently routed forgotten first (the live router's bound)."""

INDEX_BLIND_POLICIES = frozenset({"round_robin", "random", "least_load", "power_of_two", "consistent_hash"})
"""Policies that read neither the index's match nor the prefill backlog it feeds (`waiting_prompt_tokens`): their
decisions are the same whether or not the router keeps an index, so the simulator may skip it for them (their
predicted hit is then 0). consistent_hash hashes the request's first block hash itself."""


@dataclass(slots=True)
class Ticket:
    """One routed request, as the router tracks it."""

    replica: str
    decision: Decision
    uncached_tokens: int
    started_s: float
    tokens_ahead: int
    """Prefill backlog of the replica when the request joined it."""
    is_waiting: bool = True


class _RouterReplica:
    __slots__ = ("prefill_rate", "state")

    def __init__(self, state: ReplicaState, prefill_rate: PrefillRate) -> None:
        self.state = state
        self.prefill_rate = prefill_rate


class SimRouter:
    """Routes requests with a real `Policy` over a real `PrefixIndex`."""

    def __init__(
        self,
        policy: Policy,
        index: PrefixIndex,
        prefill_rate: PrefillRateEstimator,
        *,
        block_size: int,
        seed_bytes: bytes,
        mode: IndexMode = "approximate",
        max_blocks: int = 8192,
        use_index: bool = True,
        is_session_affinity: bool = False,
        session_affinity: SessionAffinityConfig | None = None,
        max_in_flight_per_replica: int = 0,
    ) -> None:
        self.policy = policy
        self.index = index
        self.prefill_rate = prefill_rate
        self.block_size = block_size
        self.seed_bytes = seed_bytes
        self.mode = mode
        self.max_blocks = max_blocks
        self.use_index = use_index
        """Match and record in the index; off only for `INDEX_BLIND_POLICIES`, whose choices do not depend on it."""
        self.is_session_affinity = is_session_affinity
        """Read requests' session keys, as the live router does when `session_header` is set: pin a session to
        its replica, and give the policy (consistent_hash's key) the session key."""
        self.sessions = SessionTable(session_affinity)
        self.max_in_flight_per_replica = max_in_flight_per_replica
        """Replicas at this many requests are not offered (`router.policy.admission`); 0: no limit."""
        self._replicas: dict[str, _RouterReplica] = {}
        self._eligible: list[ReplicaState] = []

    @property
    def eligible(self) -> Sequence[ReplicaState]:
        return self._eligible

    @property
    def free_slots(self) -> int:
        """Requests the eligible replicas can take now (`admission.free_slots`); 0: a request would be held."""
        return free_slots(self._eligible, self.max_in_flight_per_replica)

    def state(self, replica_id: str) -> ReplicaState:
        return self._replicas[replica_id].state

    def add_replica(self, replica_id: str, kv_capacity_blocks: int | None) -> None:
        """A replica joins the pool (not yet eligible: `set_eligible` once it is ready)."""
        rate = self.prefill_rate.initial(r.prefill_rate for r in self._replicas.values())
        state = ReplicaState(replica_id, prefill_tokens_per_s=rate.tokens_per_s, kv_capacity_blocks=kv_capacity_blocks)
        self._replicas[replica_id] = _RouterReplica(state, rate)
        self.index.add_replica(replica_id, kv_capacity_blocks)

    def remove_replica(self, replica_id: str) -> None:
        self.set_eligible(replica_id, False)
        del self._replicas[replica_id]
        self.index.remove_replica(replica_id)

    def set_eligible(self, replica_id: str, is_eligible: bool) -> None:
        """Whether the replica takes new requests (ready and not draining)."""
        state = self._replicas[replica_id].state
        self._eligible = [s for s in self._eligible if s is not state]
        if is_eligible:
            self._eligible.append(state)
            self._eligible.sort(key=lambda s: s.id)

    def route(self, hashes: Sequence[int], prompt_tokens: int, now: float, session: str | None = None) -> Ticket | None:
        """Choose a replica and count the request against it; None when no replica is eligible. `session` is the
        request's conversation, read only with session affinity on (as the live router reads its header). With
        `max_in_flight_per_replica`, replicas at it are not eligible, so None also means all are full."""
        eligible = with_room(self._eligible, self.max_in_flight_per_replica)
        if not eligible:
            return None
        session_key = session if self.is_session_affinity else None
        routed = hashes[: self.max_blocks] if len(hashes) > self.max_blocks else hashes
        matched = self.index.match(routed, now=now) if routed and self.use_index else {}
        request = RouteRequest(
            hashes=routed,
            prompt_tokens=prompt_tokens,
            tokens_per_block=float(self.block_size),
            matched_blocks=matched,
            session_key=session_key,
        )
        decision = self.sessions.decide(request, eligible) if session_key is not None else None
        if decision is None:
            if len(eligible) == 1:
                only = eligible[0].id
                decision = Decision(only, Branch.ONLY_REPLICA, matched.get(only, 0), request.cached_tokens(only))
            else:
                decision = self.policy.select(request, eligible, now=now)
        if session_key is not None:
            self.sessions.remember(session_key, decision.replica)
        if routed and self.use_index and self.mode != "exact":
            self.index.record(decision.replica, routed, now=now, predicted=self.mode == "exact_predicted")
        state = self._replicas[decision.replica].state
        uncached = max(0, prompt_tokens - decision.predicted_cached_tokens)
        ticket = Ticket(decision.replica, decision, uncached, now, state.waiting_prompt_tokens)
        state.in_flight += 1
        state.waiting += 1
        state.waiting_prompt_tokens += uncached
        state.last_selected = now
        return ticket

    def first_token(self, ticket: Ticket, now: float) -> None:
        """The replica streamed its first token: the request moves to streaming; the prefill rate learns."""
        if not ticket.is_waiting:
            return
        ticket.is_waiting = False
        replica = self._replicas.get(ticket.replica)
        if replica is None:
            return
        s = replica.state
        s.waiting -= 1
        s.waiting_prompt_tokens -= ticket.uncached_tokens
        s.streaming += 1
        before = replica.prefill_rate
        replica.prefill_rate = self.prefill_rate.update(
            before,
            uncached_tokens=ticket.uncached_tokens,
            ttfb_s=now - ticket.started_s,
            queue_tokens_ahead=ticket.tokens_ahead,
        )
        s.prefill_tokens_per_s = replica.prefill_rate.tokens_per_s
        if before.num_observations == 0 and replica.prefill_rate is not before:
            start = self.prefill_rate.initial(r.prefill_rate for r in self._replicas.values())
            for other in self._replicas.values():
                if other.prefill_rate.num_observations == 0:
                    other.prefill_rate = start
                    other.state.prefill_tokens_per_s = start.tokens_per_s

    def finish(self, ticket: Ticket) -> None:
        replica = self._replicas.get(ticket.replica)
        if replica is None:
            return
        s = replica.state
        s.in_flight -= 1
        if ticket.is_waiting:
            s.waiting -= 1
            s.waiting_prompt_tokens -= ticket.uncached_tokens
            ticket.is_waiting = False
        else:
            s.streaming -= 1

    def scrape(self, replica_id: str, num_running: int, num_waiting: int, kv_usage: float) -> None:
        """The gauges a scrape of the replica's /metrics returned now."""
        s = self._replicas[replica_id].state
        s.num_running = num_running
        s.num_waiting = num_waiting
        s.kv_usage = kv_usage

    def apply_kv_events(self, replica_id: str, events: Sequence[KVEvent], now: float) -> None:
        """Exact modes: the replica's KV events reached the router."""
        if replica_id not in self._replicas or not self.use_index:
            return
        for event in events:
            self.index.apply(replica_id, event, seed=self.seed_bytes, now=now)
