"""The control loop: observe -> decide -> actuate, every `interval_s`.

Each step reads what exists from the actuator and what the routers see, removes replicas that failed (crashed, or
still starting past their deadline), registers ready local replicas with the routers, asks the pure policy for a
target, and moves towards it:

- Up: removals still draining are cancelled first (an undrain brings capacity back at once), then the actuator
  grows by the rest.
- Down: the controller picks each victim itself (fewest in-flight requests, then least cached-prefix value, then
  still-starting before serving) and removes it in a task of its own: drain it at every router, wait until its
  in-flight count is zero or the drain timeout passes, deregister it (local replicas), and only then
  `actuator.scale_down(victim, ...)`. A draining replica no longer counts as capacity, so the policy does not ask
  for the same removal twice; the loop keeps deciding while drains run.

Actuator calls that change the fleet hold one lock, so a removal committing and a scale-up never interleave.
`dry_run` observes, decides, logs and exports, and changes nothing.

Failures: a step that fails on a router or the actuator (`RouterError`, `ActuatorError`) is logged and the next
step tries again. Any other failure is one the loop did not foresee (say a router's listing it cannot read): the
loop runs under `supervise`, which counts it (task `control`), logs it and restarts the loop after a backoff from
`interval_s` to `_MAX_BACKOFF_S`. A removal that fails so ends as `error`, counted (task `removal`), its replica
undrained where possible; the next decisions take it from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from autoscaler.actuators.base import Actuator, ActuatorError, ReplicaInfo
from autoscaler.observe import ReplicaLoad, RouterClient, RouterError, RoutersReading
from autoscaler.policy import (
    Action,
    Observation,
    ScaleDecision,
    ScalerState,
    ScalingPolicyConfig,
    decide,
    is_start_overdue,
)
from autoscaler.service import AutoscalerMetrics
from router.service.supervise import supervise

log = logging.getLogger(__name__)

_MAX_BACKOFF_S = 60.0
"""Longest wait before the control loop starts again after failures it did not foresee."""


def choose_victims(
    candidates: Sequence[ReplicaInfo], loads: Mapping[str, ReplicaLoad], count: int
) -> list[ReplicaInfo]:
    """The `count` replicas whose removal costs least: fewest in-flight requests, then least cached-prefix value,
    then one still starting over one that serves, then the youngest."""

    def cost(replica: ReplicaInfo) -> tuple[int, int, int, float]:
        load = loads.get(replica.url) if replica.url else None
        return (
            load.in_flight if load else 0,
            load.cached_blocks if load else 0,
            0 if replica.phase == "starting" else 1,
            -replica.created_s,
        )

    return sorted(candidates, key=cost)[:count]


@dataclass(frozen=True, slots=True)
class RemovalRecord:
    """How one removal went, for logs, metrics and tests."""

    name: str
    url: str | None
    outcome: str
    """`drained`, `drain_timeout`, `failed` (the replica had failed), `cancelled` or `error`."""
    in_flight_at_drain: int | None
    """Requests in flight to it when the drain began (None when not drained, or unknown)."""
    duration_s: float


@dataclass
class _Removal:
    replica: ReplicaInfo
    started_at: float
    task: asyncio.Task[None] | None = None
    in_flight_at_drain: int | None = None
    is_committed: bool = False
    """Past the drain: the replica is being removed and can no longer be kept."""


@dataclass
class Controller:
    actuator: Actuator
    routers: RouterClient
    config: ScalingPolicyConfig
    metrics: AutoscalerMetrics
    interval_s: float = 2.0
    drain_timeout_s: float = 300.0
    drain_poll_s: float = 0.5
    dry_run: bool = False
    register_replicas: bool = False
    """Register ready replicas with the routers and deregister removed ones (local replicas; in Kubernetes the
    routers discover pods themselves)."""
    clock: Callable[[], float] = time.monotonic
    """The decisions' clock; must be the one `routers` stamps its readings with."""
    wall_clock: Callable[[], float] = time.time
    """The actuator's clock (`ReplicaInfo.created_s`)."""
    state: ScalerState = field(default_factory=ScalerState)
    """The policy's memory; a new controller starts fresh (the policy then seeds its windows with the fleet)."""
    last_decision: ScaleDecision | None = field(default=None, init=False)
    removals: deque[RemovalRecord] = field(default_factory=lambda: deque(maxlen=256), init=False)
    """The latest removals, oldest first."""
    _pending: dict[str, _Removal] = field(default_factory=dict, init=False)
    _registered: dict[str, str] = field(default_factory=dict, init=False)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)

    @property
    def draining(self) -> list[str]:
        """Names of the replicas being removed (draining, or being stopped)."""
        return list(self._pending)

    async def wait_for_removals(self) -> None:
        """Wait until every removal under way has finished (drained and stopped, or given up)."""
        tasks = [r.task for r in self._pending.values() if r.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)

    async def run(self) -> None:
        """Step every `interval_s` until cancelled; a failed step is logged and the next one tries again, and a
        failure not foreseen restarts the loop after a backoff (module docstring)."""
        self.metrics.is_leader.set(1)
        try:
            await supervise(
                "control",
                self._loop,
                failures=self.metrics.tasks,
                clock=self.clock,
                min_backoff_s=self.interval_s,
                max_backoff_s=max(self.interval_s, _MAX_BACKOFF_S),
            )
        finally:
            self.metrics.is_leader.set(0)
            await self.close()

    async def _loop(self) -> None:
        while True:
            started = self.clock()
            try:
                await self.step()
            except (ActuatorError, RouterError) as exc:
                log.warning("autoscaler step failed: %s", exc)
                self.metrics.errors.labels("step").inc()
            await asyncio.sleep(max(0.0, self.interval_s - (self.clock() - started)))

    async def close(self) -> None:
        """Stop pending removals: undrain those still draining, let committed ones finish."""
        for removal in list(self._pending.values()):
            if not await self._cancel(removal) and removal.task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await removal.task

    async def step(self) -> ScaleDecision:
        # A removal that ends while this step observes must not bring its victim back as live capacity.
        removing = set(self._pending)
        replicas = await self.actuator.observe()
        reading = await self.routers.observe()
        now = self.clock()
        wall_now = self.wall_clock()

        def since(replica: ReplicaInfo) -> float:
            return now - (wall_now - replica.created_s)

        present = [r for r in replicas if r.name not in removing | set(self._pending) and r.phase != "terminating"]
        failed = [
            r
            for r in present
            if r.phase == "failed" or (r.phase == "starting" and is_start_overdue(since(r), self.config, now=now))
        ]
        if not self.dry_run:
            for replica in failed:
                await self._remove_failed(replica)
            if self.register_replicas:
                await self._sync_registrations(replicas, reading)
        removed = set() if self.dry_run else {r.name for r in failed}
        live = [r for r in present if r.phase in ("ready", "starting") and r.name not in removed]
        ready = [r for r in live if r.phase == "ready"]
        starting = [r for r in live if r.phase == "starting"]
        observation = Observation(
            demand=reading.demand,
            metrics_age_s=max(0.0, now - reading.measured_at),
            num_ready=len(ready),
            starting_since=tuple(since(r) for r in starting),
        )
        decision, self.state = decide(observation, self.state, self.config, now=now)
        self.metrics.record(
            decision,
            ready=len(ready),
            starting=len(starting),
            draining=len(self._pending),
            failed=len(failed),
            metrics_age_s=observation.metrics_age_s if reading.demand is not None else None,
        )
        self._log(decision)
        self.last_decision = decision
        if not self.dry_run:
            await self._actuate(decision, [r for r in live if r.name not in {f.name for f in failed}], reading)
        return decision

    def _log(self, decision: ScaleDecision) -> None:
        previous = self.last_decision
        is_news = decision.action is not Action.HOLD or previous is None or previous.reason is not decision.reason
        log.log(
            logging.INFO if is_news else logging.DEBUG,
            "%s%s %d -> %d (%s): %s",
            "[dry-run] " if self.dry_run else "",
            decision.action,
            decision.current_replicas,
            decision.target_replicas,
            decision.reason,
            decision.detail,
        )

    async def _actuate(self, decision: ScaleDecision, live: list[ReplicaInfo], reading: RoutersReading) -> None:
        change = decision.target_replicas - decision.current_replicas
        if change > 0:
            for removal in sorted(self._pending.values(), key=lambda r: -r.started_at):
                if change > 0 and await self._cancel(removal):
                    change -= 1
            if change > 0:
                async with self._lock:
                    desired = await self.actuator.desired_replicas()
                    # `desired` may run ahead of the replicas observed (pods not created yet): never past the cap.
                    target = min(desired + change, self.config.max_replicas)
                    if target > desired:
                        await self.actuator.scale_up(target)
        elif change < 0:
            for victim in choose_victims(live, reading.replicas, -change):
                removal = _Removal(victim, started_at=self.clock())
                self._pending[victim.name] = removal
                removal.task = asyncio.create_task(self._remove(removal), name=f"remove {victim.name}")

    async def _remove(self, removal: _Removal) -> None:
        victim = removal.replica
        outcome = "drained"
        try:
            if victim.url is not None and await self.routers.drain(victim.url):
                outcome = await self._wait_drained(removal, victim.url)
            removal.is_committed = True
            async with self._lock:
                if self.register_replicas and victim.url is not None:
                    await self.routers.deregister(victim.url)
                    self._registered.pop(victim.name, None)
                desired = await self.actuator.desired_replicas()
                await self.actuator.scale_down(victim, max(0, desired - 1))
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except (ActuatorError, RouterError) as exc:
            outcome = "error"
            log.warning("removing %s failed: %s", victim.name, exc)
            self.metrics.errors.labels("scale_down").inc()
            if victim.url is not None:
                with contextlib.suppress(RouterError):
                    await self.routers.undrain(victim.url)
        except Exception as exc:  # not foreseen: counted and logged as the removal task's failure
            outcome = "error"
            self.metrics.tasks.failed("removal", exc, where=victim.name)
            if victim.url is not None and not removal.is_committed:
                with contextlib.suppress(Exception):
                    await self.routers.undrain(victim.url)
        finally:
            self._pending.pop(victim.name, None)
            self._record(victim, outcome, removal.in_flight_at_drain, removal.started_at)

    async def _wait_drained(self, removal: _Removal, url: str) -> str:
        deadline = self.clock() + self.drain_timeout_s
        while True:
            in_flight = await self.routers.in_flight(url)
            if removal.in_flight_at_drain is None:
                removal.in_flight_at_drain = in_flight
            if in_flight == 0:
                log.info("drained %s (%s in flight at the start)", removal.replica.name, removal.in_flight_at_drain)
                return "drained"
            if self.clock() >= deadline:
                log.warning(
                    "%s still has %s request(s) in flight after %.0f s of draining; removing it anyway",
                    removal.replica.name,
                    in_flight,
                    self.drain_timeout_s,
                )
                return "drain_timeout"
            await asyncio.sleep(self.drain_poll_s)

    async def _cancel(self, removal: _Removal) -> bool:
        """Keep a replica that is still draining: stop its removal and undrain it. False once committed."""
        if removal.is_committed or removal.task is None:
            return False
        removal.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await removal.task
        if removal.replica.url is not None:
            try:
                await self.routers.undrain(removal.replica.url)
            except RouterError as exc:
                log.warning("undraining %s failed: %s", removal.replica.name, exc)
        log.info("kept %s: demand came back while it drained", removal.replica.name)
        return True

    async def _remove_failed(self, replica: ReplicaInfo) -> None:
        started = self.clock()
        try:
            async with self._lock:
                if self.register_replicas and replica.url is not None:
                    await self.routers.deregister(replica.url)
                    self._registered.pop(replica.name, None)
                desired = await self.actuator.desired_replicas()
                await self.actuator.scale_down(replica, max(0, desired - 1))
        except (ActuatorError, RouterError) as exc:
            log.warning("removing failed replica %s failed: %s", replica.name, exc)
            self.metrics.errors.labels("remove_failed").inc()
            return
        log.warning("removed %s: %s", replica.name, "it failed" if replica.phase == "failed" else "start deadline")
        self._record(replica, "failed", None, started)

    async def _sync_registrations(self, replicas: Sequence[ReplicaInfo], reading: RoutersReading) -> None:
        """Ready replicas join every router (again, if a router lost or drained them); gone ones leave."""
        if not reading.listed:
            return
        for replica in replicas:
            if replica.phase != "ready" or replica.url is None or replica.name in self._pending:
                continue
            listings = [listed.get(replica.url) for listed in reading.listed.values()]
            if any(entry is None or entry.status == "draining" for entry in listings):
                try:
                    await self.routers.register(replica.url, replica.name)
                except RouterError as exc:
                    log.warning("registering %s failed: %s", replica.name, exc)
                    self.metrics.errors.labels("register").inc()
                    continue
            self._registered[replica.name] = replica.url
        names = {r.name for r in replicas}
        for name, url in list(self._registered.items()):
            if name not in names:
                with contextlib.suppress(RouterError):
                    await self.routers.deregister(url)
                del self._registered[name]

    def _record(self, replica: ReplicaInfo, outcome: str, in_flight: int | None, started_at: float) -> None:
        self.removals.append(RemovalRecord(replica.name, replica.url, outcome, in_flight, self.clock() - started_at))
        self.metrics.removals.labels(outcome).inc()
