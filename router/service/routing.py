"""`PoolRouting`: the routing core over the live replica pool; settings to `RoutingConfig`, the pool's replicas to
their load views.

`router.policy.routing_core.RoutingCore` makes every decision and keeps the load bookkeeping; the simulator drives
the same object. `PoolRouting` adds what only the live router has: the pool's
eligibility (health, circuit, draining, models), the `Replica` each attempt is on (`ReplicaTicket`: its address,
its circuit breaker), whether a replica's KV-event stream is live, which `commit` reads, and the `publisher` that
tells a fleet's other routers of each commit. The proxy runs `commit` as soon as the request is written and
before the event loop runs anything else, so the next decision sees the record just as if it had been made
before the request left.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from router.policy import routing_core
from router.policy.prefill_rate import PrefillRateEstimator
from router.policy.prefix_index import PrefixIndex
from router.policy.routing_core import Prepared, RoutingConfig
from router.policy.routing_text import RoutingKey
from router.policy.types import Decision, Policy
from router.service.pool import Replica, ReplicaPool
from router.service.settings import RouterSettings

__all__ = ["PoolRouting", "Prepared", "RecordSink", "ReplicaTicket", "routing_config"]


def routing_config(settings: RouterSettings) -> RoutingConfig:
    """The core's config from the router's settings."""
    h = settings.hashing
    return RoutingConfig(
        text_block_size=h.text_block_size,
        token_block_size=h.token_block_size,
        bytes_per_token=h.bytes_per_token,
        memo_entries=h.memo_entries,
        max_blocks=h.max_blocks,
        max_in_flight_per_replica=settings.hold.max_in_flight_per_replica,
        session=settings.session_affinity,
        prefill_rate=settings.prefill_rate,
        service_time=settings.service_time,
        infer_max_num_seqs=settings.scrape.infer_max_num_seqs,
    )


class RecordSink(Protocol):
    """Where committed decisions go for the other routers of a fleet (`router.service.fleet.FleetSharing`).
    Called on the request path: it must only queue. `hashes` is the prompt's own list, kept as it is until the next
    batch is published; neither side changes it after the call."""

    def routed(self, replica_id: str, hashes: list[int], is_tokens: bool) -> None: ...

    def pinned(self, session_key: str, replica_id: str) -> None: ...


@dataclass(slots=True)
class ReplicaTicket:
    """One attempt in flight on one replica: the core's `Ticket` and the pool's `Replica` it was sent to."""

    replica: Replica
    route: routing_core.Ticket

    @property
    def decision(self) -> Decision:
        return self.route.decision

    @property
    def started(self) -> float:
        return self.route.started

    @property
    def ttfb_s(self) -> float | None:
        """Time to the replica's first byte (its whole answer when not streamed), once it came."""
        return self.route.ttfb_s


class PoolRouting:
    """The routing core over the replica pool (module docstring)."""

    def __init__(
        self,
        settings: RouterSettings,
        pool: ReplicaPool,
        index: PrefixIndex,
        policy: Policy,
        prefill_rate: PrefillRateEstimator | None = None,
    ) -> None:
        """`prefill_rate`: the estimator's parameters, when not the settings' own."""
        self.settings = settings
        self.pool = pool
        config = routing_config(settings)
        if prefill_rate is not None:
            config = dataclasses.replace(config, prefill_rate=prefill_rate)
        self.core = routing_core.RoutingCore(config, index, policy)
        self.publisher: RecordSink | None = None
        """Set when the router shares its view with a fleet (`redis_url`): every commit is published."""

    @property
    def index(self) -> PrefixIndex:
        return self.core.index

    @property
    def policy(self) -> Policy:
        return self.core.policy

    def prepare(
        self, key: RoutingKey, model: str | None, session_key: str | None, max_output_tokens: int | None
    ) -> Prepared:
        return self.core.prepare(key, model, session_key, max_output_tokens)

    def choose(
        self, prepared: Prepared, exclude: Sequence[str], now: float, *, within_limit: bool = True
    ) -> Decision | None:
        """Pick a replica among the eligible ones except `exclude`, or None when there is none; `within_limit`:
        only among those under `hold.max_in_flight_per_replica`."""
        states = self.pool.eligible_states(prepared.model, exclude)
        return self.core.choose(prepared, states, now, within_limit=within_limit)

    def free_slots(self, model: str | None) -> int:
        """Requests the replicas serving `model` can take now without passing the in-flight limit; 0 means a first
        attempt would be held."""
        return self.core.free_slots(self.pool.eligible_states(model))

    def commit(self, prepared: Prepared, decision: Decision, now: float) -> None:
        """Record the prompt on the replica `decision` sent it to. Once per attempt, `now` as given to `choose`."""
        chosen = self.pool.get(decision.replica)
        block_size = None if chosen is None else chosen.kv_block_size
        live = chosen is not None and chosen.has_live_kv_events
        self.core.commit(prepared, decision, now, has_live_kv_events=live, engine_block_size=block_size)
        publisher = self.publisher
        if publisher is not None:
            if self.core.config.use_index:
                publisher.routed(decision.replica, self.core.cacheable(prepared, block_size), prepared.is_tokens)
            if prepared.session_key is not None:
                publisher.pinned(prepared.session_key, decision.replica)

    def begin(self, replica: Replica, decision: Decision, prepared: Prepared, now: float) -> ReplicaTicket:
        return ReplicaTicket(replica, self.core.begin(decision, prepared, now))

    def first_byte(self, ticket: ReplicaTicket, now: float, *, is_stream: bool) -> float:
        """The replica answered; returns the time to first byte. Streams teach the prefill-rate estimate."""
        return self.core.first_byte(ticket.route, now, is_stream=is_stream)

    def finish(self, ticket: ReplicaTicket, now: float | None = None) -> None:
        """The attempt is over; with `now`, an answered attempt teaches the replica's service time."""
        self.core.finish(ticket.route, now)

    def add_replica(self, replica: Replica) -> None:
        self.core.add_replica(replica.state)

    def remove_replica(self, replica_id: str) -> None:
        """The replica left the pool: its index entries go."""
        self.core.remove_replica(replica_id)

    def drop_cache(self, replica_id: str) -> None:
        """The replica went away unexpectedly: forget what it held (`routing_core.RoutingCore.drop_cache`)."""
        self.core.drop_cache(replica_id)
