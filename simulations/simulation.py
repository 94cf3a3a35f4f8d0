"""One simulated run: a workload through a router with one policy, over a fleet of simulated replicas.
With a scenario's `routers.count` above one, several routers (`simulations.routers`), each request through one.

Events: each request's arrival (pulled lazily from the workload, one pending at a time), each replica's step
ends, scrapes of the engines' gauges, index sweeps, KV-event deliveries (exact modes), time-series samples and
scaling ticks. Periodic events stop rescheduling themselves once every request has arrived and finished, so the
run ends when the last request does.

A request that arrives while no replica is ready (a fleet scaled to nothing, or still starting) is held at the
router and routed when one becomes ready, as the live router holds requests; so is one that finds every replica at
`router.max_in_flight_per_replica` (when set), routed when a request finishes and frees a slot. Held requests go
in arrival order, and no new one overtakes them. One held longer than `hold_max_wait_s` ends unserved (the live
router's 503), so a fleet that never comes back cannot stall the run.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from router.policy.config import build_policy
from router.policy.kv_events import KVEvent
from router.policy.prefix_index import PrefixIndex
from router.policy.types import Decision
from simulations.events import Simulator
from simulations.metrics import FleetSample, Recorder
from simulations.replica import Seq, SimReplica
from simulations.routers import FleetTicket, RouterFleet
from simulations.routing import INDEX_BLIND_POLICIES, SimRouter
from simulations.scaling import FleetObservation, ScalingDriver, build_scaling
from simulations.scenario import PolicyEntry, Scenario
from simulations.startup import StartupSampler
from simulations.workload import PrefillOnlyWorkload, Request, Workload


@dataclass(slots=True)
class Member:
    """A replica of the fleet and its life cycle."""

    replica: SimReplica
    created_s: float
    ready_s: float
    is_ready: bool = False
    is_draining: bool = False
    removed_s: float | None = None


@dataclass(slots=True)
class RunResult:
    label: str
    summary: dict[str, Any]
    recorder: Recorder
    num_events: int


class Simulation:
    """A run of `workload` under `scenario`'s fleet and router with one policy."""

    def __init__(
        self,
        scenario: Scenario,
        policy: PolicyEntry,
        workload: Workload,
        *,
        on_finished: Callable[[int], None] | None = None,
        on_routed: Callable[[Request, Decision], None] | None = None,
    ) -> None:
        """`on_finished(n)`: n more requests ended; `on_routed(request, decision)`: the router sent a request."""
        self.scenario = scenario
        self.label = policy.label
        if scenario.fleet.prefill_only and not isinstance(workload, PrefillOnlyWorkload):
            workload = PrefillOnlyWorkload(workload)
        self.workload = workload
        self.engine, self.step_model, self.speculation = scenario.fleet.resolve()
        if self.engine.block_size != workload.block_size:
            raise ValueError(
                f"the engine's block size ({self.engine.block_size}) must equal the workload's ({workload.block_size})"
            )
        router_cfg = scenario.router
        self.sim = Simulator()
        routers = [
            SimRouter(
                build_policy(policy.config, seed=scenario.seed + i),
                PrefixIndex(router_cfg.index),
                router_cfg.prefill_rate,
                block_size=self.engine.block_size,
                seed_bytes=workload.seed_bytes,
                mode=router_cfg.index_mode,
                max_blocks=router_cfg.max_blocks,
                use_index=router_cfg.index_for_index_blind or policy.config.kind not in INDEX_BLIND_POLICIES,
                is_session_affinity=router_cfg.session_affinity,
                session_affinity=router_cfg.session,
                max_in_flight_per_replica=router_cfg.max_in_flight_per_replica,
                service_time=router_cfg.service_time,
                infer_max_num_seqs=router_cfg.infer_max_num_seqs,
            )
            for i in range(scenario.routers.count)
        ]
        self.router = RouterFleet(routers, scenario.routers, self.sim, seed=scenario.seed)
        self.recorder = Recorder()
        self.scaling: ScalingDriver = build_scaling(scenario.autoscale or scenario.scaling)
        autoscale = scenario.autoscale
        startup = self.engine.startup_s if autoscale is None else autoscale.startup_s
        self._startup = StartupSampler(startup, seed=scenario.seed)
        num_replicas = scenario.fleet.num_replicas
        self._initial_replicas = num_replicas if autoscale is None else autoscale.replicas_at_start(num_replicas)
        self._members: dict[str, Member] = {}
        self._next_replica = 0
        self._held: deque[Request] = deque()
        self._arrivals: Iterator[Request] = iter(())
        self._is_arriving = True
        self._in_flight = 0
        self._num_arrived = 0
        self._arrived_at_last_tick = 0
        self._is_scaling = self.scaling.interval_s != float("inf")
        """A driver ticks and reads the latencies since its last tick (a fixed fleet never does: none are kept)."""
        self._ttfts_since_tick: list[float] = []
        """TTFT of each first token since the last scaling tick (the routers' histogram over one round)."""
        self._request_times_since_tick: list[float] = []
        """Whole time of each request finished since the last scaling tick, arrival to last byte."""
        self._window_hit = 0
        self._window_prompt = 0
        self._end_s = 0.0
        self._on_finished = on_finished
        self._on_routed = on_routed
        self._scrape_interval_s = scenario.router.scrape_interval_s or 0.0

    # Fleet ----------------------------------------------------------------------------------------------------

    @property
    def members(self) -> list[Member]:
        """Every replica the run created, removed ones included, in creation order."""
        return list(self._members.values())

    def _add_replica(self, *, startup_s: float) -> None:
        replica_id = f"r{self._next_replica:03d}"
        factors = self.scenario.fleet.step_time_factors
        step_model = self.step_model
        if self._next_replica < len(factors):
            step_model = step_model.scaled(factors[self._next_replica])
        self._next_replica += 1
        is_exact = self.scenario.router.index_mode != "approximate" and self.router.use_index
        replica = SimReplica(
            replica_id,
            self.engine,
            step_model,
            self.sim,
            on_first_token=self._first_token,
            on_finish=self._finish,
            on_reject=self._reject,
            on_kv_events=self._kv_events if is_exact else None,
            max_decode_steps_per_event=self.scenario.decode_steps_per_event,
            speculation=self.speculation,
            seed=self.scenario.seed,
            busy_peers=lambda: sum(m.replica.is_busy for m in self._members.values()) - replica.is_busy,
        )
        now = self.sim.now
        member = Member(replica, created_s=now, ready_s=now + startup_s)
        self._members[replica_id] = member
        capacity = self.engine.num_kv_blocks if self.scenario.router.is_capacity_known else None
        self.router.add_replica(replica_id, capacity)
        if startup_s > 0:
            self.sim.at(member.ready_s, self._ready, replica_id)
        else:
            self._ready(replica_id)

    def _ready(self, replica_id: str) -> None:
        member = self._members.get(replica_id)
        if member is None or member.removed_s is not None or member.is_draining:
            return
        member.is_ready = True
        self.router.set_eligible(replica_id, True)
        self._release_held()

    def _drain(self, member: Member) -> None:
        member.is_draining = True
        self.router.set_eligible(member.replica.id, False)
        if member.replica.is_idle:
            self._remove(member)

    def _remove(self, member: Member) -> None:
        member.removed_s = self.sim.now
        self.router.remove_replica(member.replica.id)

    def _live_members(self) -> list[Member]:
        return [m for m in self._members.values() if m.removed_s is None]

    def _scale_to(self, desired: int) -> None:
        active = [m for m in self._live_members() if not m.is_draining]
        if desired > len(active):
            for _ in range(desired - len(active)):
                self._add_replica(startup_s=self._startup())
        elif desired < len(active):
            # Starting replicas first, then the fewest requests in flight, then the least cached data.
            def cost(m: Member) -> tuple[bool, int, int, str]:
                in_flight = self.router.in_flight(m.replica.id)
                return (m.is_ready, in_flight, len(m.replica.cache.refs), m.replica.id)

            for member in sorted(active, key=cost)[: len(active) - desired]:
                self._drain(member)

    # Requests -------------------------------------------------------------------------------------------------

    def _arrive(self, request: Request) -> None:
        self._num_arrived += 1
        self._in_flight += 1
        self._route(request)
        nxt = next(self._arrivals, None)
        if nxt is None:
            self._is_arriving = False
        else:
            self.sim.at(max(nxt.arrival_s, self.sim.now), self._arrive, nxt)

    def _release_held(self) -> None:
        """Route held requests, oldest first, while the fleet has room for them."""
        while self._held and self.router.free_slots:
            if not self._dispatch(self._held[0]):
                break
            self._held.popleft()

    def _route(self, request: Request) -> None:
        # Arrival order: nobody overtakes a held request.
        if self._held or not self._dispatch(request):
            self._held.append(request)
            self.sim.at(self.sim.now + self.scenario.router.hold_max_wait_s, self._hold_expired, request)

    def _dispatch(self, request: Request) -> bool:
        """Route the request to a replica; False when none can take it (none ready, or all full)."""
        ticket = self.router.route(request.id, request.hashes, request.prompt_tokens, self.sim.now, request.session)
        if ticket is None:
            return False
        self.recorder.branches[ticket.decision.branch.value] += 1
        if self._on_routed is not None:
            self._on_routed(request, ticket.decision)
        self._members[ticket.replica_id].replica.submit(Seq(request, ticket))
        return True

    def _hold_expired(self, request: Request) -> None:
        """A held request waited `hold_max_wait_s` for a replica with room: the router answers 503, it ends unserved."""
        position = next((i for i, held in enumerate(self._held) if held is request), None)
        if position is None:
            return  # routed meanwhile
        del self._held[position]
        self.recorder.num_rejected += 1
        self._in_flight -= 1
        self._end_s = max(self._end_s, self.sim.now)
        if self._on_finished is not None:
            self._on_finished(1)

    def _first_token(self, seq: Seq) -> None:
        ticket: FleetTicket = seq.ticket
        if seq.request.is_stream:
            self.router.first_byte(ticket, self.sim.now, is_stream=True)
        self._window_hit += seq.hit_tokens or 0
        self._window_prompt += seq.request.prompt_tokens
        if self._is_scaling:
            self._ttfts_since_tick.append(self.sim.now + self.scenario.router.overhead_s - seq.request.arrival_s)

    def _finish(self, seq: Seq) -> None:
        ticket: FleetTicket = seq.ticket
        if not seq.request.is_stream:  # the router's first byte of a whole answer is its end
            self.router.first_byte(ticket, self.sim.now, is_stream=False)
        self.router.finish(ticket, self.sim.now)
        now = self.sim.now
        request = seq.request
        assert seq.first_token_s is not None and seq.hit_tokens is not None
        path = self.scenario.router
        path_s = path.overhead_s + path.overhead_s_per_prompt_token * request.prompt_tokens
        self.recorder.finished(
            arrival_s=request.arrival_s,
            first_token_s=seq.first_token_s + path_s,
            finish_s=now + path_s,
            prompt_tokens=request.prompt_tokens,
            hit_tokens=seq.hit_tokens,
            predicted_tokens=ticket.decision.predicted_cached_tokens,
            output_tokens=request.output_tokens,
        )
        if self._is_scaling:
            self._request_times_since_tick.append(now + path_s - request.arrival_s)
        self._in_flight -= 1
        self._end_s = now
        if self._on_finished is not None:
            self._on_finished(1)
        self._release_held()
        member = self._members[ticket.replica_id]
        if member.is_draining:
            # The finishing sequence leaves the replica's running list when this step has been applied: look again
            # then.
            self.sim.at(now, self._remove_if_idle, member)

    def _reject(self, seq: Seq) -> None:
        """The engine refused the request (longer than its KV cache): it ends now, unserved."""
        ticket: FleetTicket = seq.ticket
        self.router.finish(ticket, self.sim.now)
        self.recorder.num_rejected += 1
        self._in_flight -= 1
        self._end_s = max(self._end_s, self.sim.now)
        if self._on_finished is not None:
            self._on_finished(1)

    def _remove_if_idle(self, member: Member) -> None:
        if member.removed_s is None and member.replica.is_idle:
            self._remove(member)

    def _kv_events(self, replica_id: str, events: list[KVEvent]) -> None:
        delay = self.scenario.router.kv_event_delay_s
        self.sim.at(self.sim.now + delay, self._deliver_kv_events, (replica_id, events))

    def _deliver_kv_events(self, arg: tuple[str, list[KVEvent]]) -> None:
        self.router.apply_kv_events(arg[0], arg[1], self.sim.now)

    # Periodic -------------------------------------------------------------------------------------------------

    def _is_done(self) -> bool:
        return not self._is_arriving and self._in_flight == 0

    def _scrape(self, _: Any) -> None:
        for member in self._live_members():
            r = member.replica
            limit = r.engine.max_num_seqs if r.engine.exports_max_num_seqs else None
            self.router.scrape(r.id, r.num_running, r.num_waiting, r.cache.usage, max_num_seqs=limit)
        if not self._is_done():
            self.sim.at(self.sim.now + self._scrape_interval_s, self._scrape)

    def _sweep(self, _: Any) -> None:
        self.router.sweep(self.sim.now)
        if not self._is_done():
            self.sim.at(self.sim.now + self.scenario.router.sweep_interval_s, self._sweep)

    def _sample(self, _: Any) -> None:
        live = self._live_members()
        self.recorder.samples.append(
            FleetSample(
                time_s=self.sim.now,
                engine_waiting=sum(m.replica.num_waiting for m in live),
                engine_running=sum(m.replica.num_running for m in live),
                in_flight=self._in_flight,
                num_replicas=len(live),
                window_hit_ratio=self._window_hit / self._window_prompt if self._window_prompt else None,
                mean_kv_usage=sum(m.replica.cache.usage for m in live) / len(live) if live else 0.0,
            )
        )
        self._window_hit = self._window_prompt = 0
        if not self._is_done():
            self.sim.at(self.sim.now + self.scenario.sample_interval_s, self._sample)

    def _scale_tick(self, _: Any) -> None:
        live = self._live_members()
        interval = self.scaling.interval_s
        observation = FleetObservation(
            now_s=self.sim.now,
            num_ready=sum(1 for m in live if m.is_ready and not m.is_draining),
            num_starting=sum(1 for m in live if not m.is_ready and not m.is_draining),
            num_draining=sum(1 for m in live if m.is_draining),
            in_flight=self._in_flight - len(self._held),
            router_waiting=sum(self.router.waiting(m.replica.id) for m in live),
            held=len(self._held),
            engine_running=sum(m.replica.num_running for m in live),
            engine_waiting=sum(m.replica.num_waiting for m in live),
            mean_kv_usage=sum(m.replica.cache.usage for m in live) / len(live) if live else 0.0,
            arrivals_per_s=(self._num_arrived - self._arrived_at_last_tick) / interval,
            starting_since=tuple(sorted(m.created_s for m in live if not m.is_ready and not m.is_draining)),
            ttfts_s=tuple(self._ttfts_since_tick),
            request_times_s=tuple(self._request_times_since_tick),
        )
        self._arrived_at_last_tick = self._num_arrived
        self._ttfts_since_tick = []
        self._request_times_since_tick = []
        desired = self.scaling.desired_replicas(observation)
        if desired is not None:
            self._scale_to(max(0, desired))
        if not self._is_done():
            self.sim.at(self.sim.now + interval, self._scale_tick)

    # Run ------------------------------------------------------------------------------------------------------

    def run(self) -> RunResult:
        for _ in range(self._initial_replicas):
            self._add_replica(startup_s=0.0)
        self._arrivals = self.workload.requests()
        first = next(self._arrivals, None)
        if first is None:
            self._is_arriving = False
        else:
            self.sim.at(first.arrival_s, self._arrive, first)
        interval = self.scenario.router.scrape_interval_s
        if interval is not None:
            self.sim.at(0.0, self._scrape)
        self.sim.at(self.scenario.router.sweep_interval_s, self._sweep)
        self.sim.at(0.0, self._sample)
        self.router.start(self._is_done)
        if self._is_scaling:
            self.sim.at(0.0, self._scale_tick)
        self.sim.run()
        end_s = self._end_s
        self._sample(None)
        replica_seconds = sum(
            (m.removed_s if m.removed_s is not None else end_s) - m.created_s for m in self._members.values()
        )
        self.recorder.num_preemptions = sum(m.replica.num_preemptions for m in self._members.values())
        summary = self.recorder.summary(self.scenario.slo, replica_seconds=replica_seconds, duration_s=end_s)
        summary["events"] = self.sim.num_events
        summary["index"] = _index_stats(self.router.index)
        if self.speculation is not None and self.speculation.is_enabled:
            summary["speculation"] = _speculation_stats([m.replica for m in self._members.values()])
        return RunResult(self.label, summary, self.recorder, self.sim.num_events)


def _speculation_stats(replicas: list[SimReplica]) -> dict[str, Any]:
    """The fleet's speculative steps: `spec_steps` that speculated, `plain_decode_steps` that did not, by reason,
    and `spec_tokens_per_step`, tokens a decoding sequence emitted per speculative step (tau, less the outputs'
    ends that cut some short)."""
    branches: Counter[str] = Counter()
    for replica in replicas:
        branches.update(replica.spec_branches)
    seq_steps = sum(r.num_spec_seq_steps for r in replicas)
    spec_steps = branches.pop("speculated", 0)
    return {
        "spec_steps": spec_steps,
        "plain_decode_steps": dict(sorted(branches.items())),
        "spec_tokens_per_step": sum(r.num_spec_tokens for r in replicas) / seq_steps if seq_steps else math.nan,
    }


def _index_stats(index: PrefixIndex) -> dict[str, int]:
    stats = index.stats()
    return {
        "blocks": stats.num_blocks,
        "entries": stats.num_entries,
        "events_applied": stats.events_applied,
        "events_skipped": stats.events_skipped,
        "evictions": stats.evictions,
    }
