"""Several routers in front of one fleet of simulated replicas, each with its own view, sharing it or not.

Each router is a `SimRouter`: its own prefix index, in-flight counts and learned rates. A request goes to one
router, as a load balancer in front of them would send it (`RoutersConfig.spread`). Without sharing a router knows
only the requests it routed itself. With sharing, the live fleet's records (`router.policy.sharing`) travel between
routers as events, and every peer applies them with the live router's code (`PeerRouters.apply`):
  - each decision is a `Routed` record (and a `Pin`, with session affinity), applied by the peers `lag_s` later;
  - every `flush_interval_s` each router publishes its own loads, those changed since its last batch and the whole
    table every `load_heartbeat_s`, applied by the peers `round_trip_s` later.
The wire encoding is left out: nothing crosses a wire here. Every router scrapes the engines' gauges and follows
their KV events (exact modes), as each live router does. One router is the single router, call for call.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from router.policy.kv_events import KVEvent
from router.policy.prefix_index import PrefixIndex
from router.policy.routing_core import RoutingCore
from router.policy.sharing import Batch, Load, PeerRouters, Pin, Routed, own_loads
from router.policy.types import Decision, ReplicaState
from simulations.events import Simulator
from simulations.routing import SimRouter, Ticket


class RoutersConfig(BaseModel):
    """A scenario's `routers`: how many routers, how requests reach them, and whether they share their views."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    count: int = Field(default=1, ge=1)
    """Routers, each with its own view of the replicas."""
    sharing: bool = False
    """Routers share decisions and loads (`on`), as a fleet sharing through Redis does; `off`: each sees only its
    own requests."""
    spread: Literal["random", "round_robin", "session"] = "random"
    """How requests are spread over routers: `random`, per request from the scenario's seed (a plain load
    balancer); `round_robin`, by request id (workloads number requests in arrival order); `session`, by a hash of
    the request's session, as a balancer with affinity would (random for a request without one)."""
    flush_interval_s: float = Field(default=0.05, gt=0.0)
    """Seconds between a router's batches of loads: the live fleet's `flush_interval_s`."""
    round_trip_s: float = Field(default=0.001, ge=0.0)
    """Seconds from a batch's write to its peers applying it: a Redis round trip on a data-centre network."""
    lag_s: float | None = Field(default=None, ge=0.0)
    """Seconds from a router's decision to its peers applying it. None: `flush_interval_s + round_trip_s`, the
    longest the live driver takes (a decision waits for the next flush, then a round trip)."""
    load_heartbeat_s: float = Field(default=0.5, gt=0.0)
    """Seconds between batches that carry a router's whole load table: the live fleet's `heartbeat_s`."""
    load_ttl_s: float = Field(default=3.0, gt=0.0)
    """Seconds after a router's last batch at which its load stops counting at the others: the live `load_ttl_s`."""

    @property
    def decision_lag_s(self) -> float:
        return self.lag_s if self.lag_s is not None else self.flush_interval_s + self.round_trip_s


@dataclass(slots=True)
class FleetTicket:
    """A request in flight and the router that routed it."""

    router: int
    route: Ticket

    @property
    def replica_id(self) -> str:
        return self.route.replica_id

    @property
    def decision(self) -> Decision:
        return self.route.decision


class RouterFleet:
    """`count` routers over the same replicas; the interface of one `SimRouter`, with a request to route."""

    def __init__(self, routers: Sequence[SimRouter], config: RoutersConfig, sim: Simulator, *, seed: int = 0) -> None:
        if len(routers) != config.count:
            raise ValueError(f"{config.count} routers configured, {len(routers)} given")
        self.routers = list(routers)
        self.config = config
        self.sim = sim
        self.seed = seed
        self.is_sharing = config.sharing and len(routers) > 1
        self.views = [PeerRouters(r.core, load_ttl_s=config.load_ttl_s) for r in self.routers]
        self.num_batches_applied = 0
        """Batches peers applied (each counted once per peer)."""
        self._names = [f"router{i}" for i in range(len(routers))]
        self._seq = [0] * len(routers)
        self._published: list[dict[str, Load]] = [{} for _ in routers]
        self._last_heartbeat = [-float("inf")] * len(routers)
        self._replica_ids: list[str] = []
        self._is_done: Callable[[], bool] = lambda: True

    # The first router's: the only one with one router.

    @property
    def core(self) -> RoutingCore:
        return self.routers[0].core

    @property
    def index(self) -> PrefixIndex:
        return self.routers[0].index

    @property
    def use_index(self) -> bool:
        return self.routers[0].use_index

    def state(self, replica_id: str) -> ReplicaState:
        return self.routers[0].state(replica_id)

    # Replicas: every router's pool is the same.

    def in_flight(self, replica_id: str) -> int:
        """Requests on the replica, summed over routers' own."""
        return sum(r.core.own_load(replica_id)[0] for r in self.routers)

    def waiting(self, replica_id: str) -> int:
        """Requests waiting for the replica's first byte, summed over routers' own."""
        return sum(r.core.own_load(replica_id)[1] for r in self.routers)

    @property
    def free_slots(self) -> int:
        """Requests some router could send now (0: a request would be held, whichever router it reaches)."""
        return max(r.free_slots for r in self.routers)

    def add_replica(self, replica_id: str, kv_capacity_blocks: int | None) -> None:
        self._replica_ids.append(replica_id)
        for router in self.routers:
            router.add_replica(replica_id, kv_capacity_blocks)

    def remove_replica(self, replica_id: str) -> None:
        self._replica_ids.remove(replica_id)
        for router in self.routers:
            router.remove_replica(replica_id)

    def set_eligible(self, replica_id: str, is_eligible: bool) -> None:
        for router in self.routers:
            router.set_eligible(replica_id, is_eligible)

    def scrape(
        self, replica_id: str, num_running: int, num_waiting: int, kv_usage: float, max_num_seqs: int | None = None
    ) -> None:
        for router in self.routers:
            router.scrape(replica_id, num_running, num_waiting, kv_usage, max_num_seqs)

    def apply_kv_events(self, replica_id: str, events: Sequence[KVEvent], now: float) -> None:
        for router in self.routers:
            router.apply_kv_events(replica_id, events, now)

    def sweep(self, now: float) -> None:
        """Expired index entries go, at every router."""
        for router in self.routers:
            router.index.expire(now)

    # Requests.

    def router_for(self, request_id: int, session: str | None) -> int:
        """The router a request reaches (`RoutersConfig.spread`): a function of the request, so a held request's
        retries reach the same router."""
        count = len(self.routers)
        if count == 1:
            return 0
        spread = self.config.spread
        if spread == "round_robin":
            return request_id % count
        if spread == "session" and session is not None:
            return zlib.crc32(session.encode()) % count
        return random.Random(self.seed * 1_000_003 + request_id).randrange(count)

    def route(
        self,
        request_id: int,
        hashes: Sequence[int],
        prompt_tokens: int,
        now: float,
        session: str | None = None,
    ) -> FleetTicket | None:
        """Route the request at its router (`SimRouter.route`); with sharing, its decision goes to the peers."""
        i = self.router_for(request_id, session)
        router = self.routers[i]
        ticket = router.route(hashes, prompt_tokens, now, session)
        if ticket is None:
            return None
        if self.is_sharing:
            replica = ticket.replica_id
            routed = hashes[: router.core.config.max_blocks] if router.use_index else ()
            pinned = session is not None and router.is_session_affinity
            if routed or pinned:
                batch = Batch(
                    self._names[i],
                    self._next_seq(i),
                    routed=(Routed(replica, tuple(routed), True),) if routed else (),
                    pins=(Pin(session, replica),) if session is not None and pinned else (),
                )
                self.sim.at(now + self.config.decision_lag_s, self._deliver, (i, batch))
        return FleetTicket(i, ticket)

    def first_byte(self, ticket: FleetTicket, now: float, *, is_stream: bool) -> None:
        self.routers[ticket.router].first_byte(ticket.route, now, is_stream=is_stream)

    def finish(self, ticket: FleetTicket, now: float) -> None:
        self.routers[ticket.router].finish(ticket.route, now)

    # Sharing.

    def start(self, is_done: Callable[[], bool]) -> None:
        """Start each router's load batches, spread over the flush interval, until `is_done()`."""
        if not self.is_sharing:
            return
        self._is_done = is_done
        count = len(self.routers)
        for i in range(count):
            self.sim.at(self.sim.now + i * self.config.flush_interval_s / count, self._flush, i)

    def _next_seq(self, i: int) -> int:
        self._seq[i] += 1
        return self._seq[i]

    def _flush(self, i: int) -> None:
        """Router `i`'s load batch, as the live driver builds it: loads changed since its last batch, or all of
        them at a heartbeat."""
        now = self.sim.now
        self.views[i].expire(now)
        loads = own_loads(self.routers[i].core, self._replica_ids)
        published = self._published[i]
        is_heartbeat = now - self._last_heartbeat[i] >= self.config.load_heartbeat_s
        if is_heartbeat:
            changed = {rid: x for rid, x in loads.items() if x.in_flight or x.waiting}
            self._last_heartbeat[i] = now
        else:
            changed = {rid: x for rid, x in loads.items() if x != published.get(rid, Load())}
            changed.update((rid, Load()) for rid in published if rid not in loads)
        if is_heartbeat or changed:
            self._published[i] = {rid: x for rid, x in loads.items() if x.in_flight or x.waiting}
            batch = Batch(self._names[i], self._next_seq(i), loads=changed, is_complete=is_heartbeat)
            self.sim.at(now + self.config.round_trip_s, self._deliver, (i, batch))
        if not self._is_done():
            self.sim.at(now + self.config.flush_interval_s, self._flush, i)

    def _deliver(self, arg: tuple[int, Batch]) -> None:
        sender, batch = arg
        now = self.sim.now
        for j, view in enumerate(self.views):
            if j != sender:
                view.apply(batch, now, has_live_kv_events=self._has_live_kv_events)
                self.num_batches_applied += 1

    def _has_live_kv_events(self, replica_id: str) -> bool:
        """In exact modes every router follows every replica's KV events."""
        return self.routers[0].mode != "approximate"
