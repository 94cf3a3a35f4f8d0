"""The simulator's router: the live router's routing core (`router.policy.routing_core.RoutingCore`), driven on
simulated time.

Every routing step (admission, session pins, the policy, the index's records, the load bookkeeping and the
prefill-rate estimate) is the core's, as in the live router. What only a simulation has lives here: which replicas
are eligible (the simulation says when one is ready or draining), the index mode's mapping onto the core's
config (in exact modes every replica's KV events are live), and the scrape that copies the engines' gauges into
the load views every scrape interval, so policies see them as stale as the live router does.

A request's first byte is what the live router observes: the first token of a streamed request, the end of the
whole answer of one that is not (`first_byte` at its finish), and only a stream teaches the prefill rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from router.policy.kv_events import KVEvent
from router.policy.prefill_rate import PrefillRateEstimator
from router.policy.prefix_index import PrefixIndex
from router.policy.routing_core import RoutingConfig, RoutingCore, Ticket
from router.policy.service_time import ServiceTimeEstimator
from router.policy.session import SessionAffinityConfig
from router.policy.types import Policy, ReplicaState

IndexMode = Literal["approximate", "exact", "exact_predicted"]
"""approximate: the router records its own decisions (the live router without KV events). exact: only the engines'
KV events fill the index. exact_predicted: KV events, plus short-lived `predicted` records for sibling requests
that arrive before the events (the live router with KV events)."""

INDEX_BLIND_POLICIES = frozenset({"round_robin", "random", "least_load", "power_of_two", "consistent_hash"})
"""Policies that read neither the index's match nor the prefill backlog it feeds (`waiting_prompt_tokens`): their
decisions are the same whether or not the router keeps an index, so the simulator may skip it for them (their
predicted hit is then 0). consistent_hash hashes the request's first block hash itself."""

__all__ = ["INDEX_BLIND_POLICIES", "IndexMode", "SimRouter", "Ticket"]


class SimRouter:
    """The routing core over simulated replicas, with their eligibility and scraped gauges."""

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
        service_time: ServiceTimeEstimator | None = None,
        infer_max_num_seqs: bool = True,
    ) -> None:
        config = RoutingConfig(
            token_block_size=block_size,
            max_blocks=max_blocks,
            max_in_flight_per_replica=max_in_flight_per_replica,
            session=session_affinity or SessionAffinityConfig(),
            prefill_rate=prefill_rate,
            service_time=service_time or ServiceTimeEstimator(),
            infer_max_num_seqs=infer_max_num_seqs,
            use_index=use_index,
            records_predictions=mode != "exact",
        )
        self.core = RoutingCore(config, index, policy)
        self.seed_bytes = seed_bytes
        self.mode = mode
        self.is_session_affinity = is_session_affinity
        """Read requests' session keys, as the live router does when `session_header` is set."""
        self._eligible: list[ReplicaState] = []

    @property
    def index(self) -> PrefixIndex:
        return self.core.index

    @property
    def use_index(self) -> bool:
        return self.core.config.use_index

    @property
    def eligible(self) -> Sequence[ReplicaState]:
        return self._eligible

    @property
    def free_slots(self) -> int:
        """Requests the eligible replicas can take now (`admission.free_slots`); 0: a request would be held."""
        return self.core.free_slots(self._eligible)

    def state(self, replica_id: str) -> ReplicaState:
        return self.core.state(replica_id)

    def add_replica(self, replica_id: str, kv_capacity_blocks: int | None) -> None:
        """A replica joins the pool (not yet eligible: `set_eligible` once it is ready)."""
        self.core.add_replica(ReplicaState(replica_id, kv_capacity_blocks=kv_capacity_blocks))

    def remove_replica(self, replica_id: str) -> None:
        self.set_eligible(replica_id, False)
        self.core.remove_replica(replica_id)

    def set_eligible(self, replica_id: str, is_eligible: bool) -> None:
        """Whether the replica takes new requests (ready and not draining). Kept in id order, which is the order
        replicas join: the live pool's order."""
        state = self.core.state(replica_id)
        self._eligible = [s for s in self._eligible if s is not state]
        if is_eligible:
            self._eligible.append(state)
            self._eligible.sort(key=lambda s: s.id)

    def route(self, hashes: Sequence[int], prompt_tokens: int, now: float, session: str | None = None) -> Ticket | None:
        """Choose a replica and count the request against it; None when no eligible replica has room. `session`
        is the request's conversation, read only with session affinity on (as the live router reads its
        header)."""
        session_key = session if self.is_session_affinity else None
        prepared = self.core.prepare_hashes(hashes, prompt_tokens, session_key)
        decision = self.core.choose(prepared, self._eligible, now)
        if decision is None:
            return None
        ticket = self.core.begin(decision, prepared, now)
        self.core.commit(prepared, decision, now, has_live_kv_events=self.mode != "approximate")
        return ticket

    def first_byte(self, ticket: Ticket, now: float, *, is_stream: bool) -> None:
        """The router saw the replica's first byte: its first token when streamed, else its whole answer."""
        self.core.first_byte(ticket, now, is_stream=is_stream)

    def finish(self, ticket: Ticket, now: float) -> None:
        """The request ended; as at the live router, its duration teaches the replica's service-time terms."""
        self.core.finish(ticket, now)

    def scrape(
        self, replica_id: str, num_running: int, num_waiting: int, kv_usage: float, max_num_seqs: int | None = None
    ) -> None:
        """The gauges a scrape of the replica's /metrics returned now; `max_num_seqs` when the engine exports its
        batch limit."""
        self.core.set_gauges(replica_id, num_running, num_waiting, kv_usage, max_num_seqs)

    def apply_kv_events(self, replica_id: str, events: Sequence[KVEvent], now: float) -> None:
        """Exact modes: the replica's KV events reached the router."""
        self.core.apply_kv_events(replica_id, events, self.seed_bytes, now)
