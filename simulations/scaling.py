"""The autoscaling hook: what a scaling driver sees of the fleet, and what it may answer.

Every `interval_s` the simulation hands the driver a `FleetObservation` and asks for a desired replica count
(None: no change). The simulation carries the answer out as the live actuators do: new replicas start after the
engine's `startup_s` and join the router when ready; surplus replicas are drained (no new requests, removed once
idle), replicas still starting first, then those with the fewest requests in flight and the least cached data.

Drivers here: `FixedFleet` (never scales), `ScheduledFleet` (a replica count per time, for experiments and tests),
and `PolicyFleet`, which runs one of `autoscaler.policy`'s pure policies (Shoal's `decide`, or the HPA, KEDA and
static baselines) on an observation built from the `FleetObservation`, as its live counterpart would see the fleet:
Shoal reads the routers' and engines' demand (`fleet_demand`: in flight, engine-queued and held) and each starting
replica's creation time; the HPA a per-pod metric from ready pods only (starting ones have none); KEDA a fleet-wide
query. Metrics are fresh at each tick (no scrape lag is modelled, for every policy alike).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from autoscaler.policy import Observation, ScalerState, ScalingPolicyConfig, decide, fleet_demand
from autoscaler.policy.baselines import (
    HPAConfig,
    HPAObservation,
    HPAState,
    KEDAConfig,
    KEDAObservation,
    KEDAState,
    StaticConfig,
    hpa_decide,
    keda_decide,
    static_decide,
)
from simulations.startup import StartupTime, startup_quantile_s


@dataclass(frozen=True, slots=True)
class FleetObservation:
    """The fleet as metrics show it at one tick (router-side counts and engine gauges, all current)."""

    now_s: float
    num_ready: int
    """Replicas taking requests."""
    num_starting: int
    """Replicas created and not ready yet."""
    num_draining: int
    in_flight: int
    """Requests routed and not finished, all replicas."""
    router_waiting: int
    """Of those, requests waiting for their first token."""
    held: int
    """Requests held at the router because no replica was ready."""
    engine_running: int
    engine_waiting: int
    mean_kv_usage: float
    arrivals_per_s: float
    """Request arrivals over the last interval, per second."""
    starting_since: tuple[float, ...] = ()
    """Creation time of each replica still starting (`num_starting` of them), oldest first."""
    ttfts_s: tuple[float, ...] = ()
    """TTFT of each request whose first token came since the previous tick (the routers' histogram over one
    round); requests still waiting are not in it."""
    request_times_s: tuple[float, ...] = ()
    """Time of each request that finished since the previous tick, arrival to last byte (the routers'
    `shoal_router_request_seconds` over one round)."""


class ScalingDriver(Protocol):
    interval_s: float

    def desired_replicas(self, observation: FleetObservation) -> int | None:
        """Replicas wanted now (ready plus starting), or None for no change."""
        ...


class FixedFleet:
    """Never scales: the fleet keeps its initial size."""

    interval_s = float("inf")

    def desired_replicas(self, observation: FleetObservation) -> int | None:
        return None


class _Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class FixedScalingConfig(_Config):
    kind: Literal["fixed"] = "fixed"


class ScheduledScalingConfig(_Config):
    """A replica count per point in time: [[t_s, replicas], ...], each holding from t_s until the next."""

    kind: Literal["schedule"] = "schedule"
    steps: list[tuple[float, int]] = Field(min_length=1)
    interval_s: float = Field(default=10.0, gt=0.0)
    """Seconds between ticks: a step takes effect at the first tick at or after its time."""


class ScheduledFleet:
    def __init__(self, config: ScheduledScalingConfig) -> None:
        self.interval_s = config.interval_s
        self._times = [t for t, _ in sorted(config.steps)]
        self._counts = [n for _, n in sorted(config.steps)]

    def desired_replicas(self, observation: FleetObservation) -> int | None:
        i = bisect.bisect_right(self._times, observation.now_s) - 1
        return self._counts[i] if i >= 0 else None


AutoscalePolicyConfig = ScalingPolicyConfig | HPAConfig | KEDAConfig | StaticConfig


class AutoscaleConfig(_Config):
    """A scenario's `autoscale:` section: one of the four policies over the simulated fleet.

    The shared fields set every policy's bounds and per-replica target, so the policies differ only in their
    algorithms; the per-policy mappings override anything else of that policy's config (validated here)."""

    policy: Literal["shoal", "hpa", "keda", "static"] = "shoal"
    min_replicas: int = Field(default=1, ge=0)
    """Floor of shoal and hpa. KEDA keeps its own default (`minReplicaCount` 0) unless `keda` sets it."""
    max_replicas: int = Field(default=16, ge=1)
    startup_s: StartupTime = 120.0
    """Seconds from a replica's creation to ready, or a distribution of them (`simulations.startup`: lognormal
    p50/p90, or measured samples); replaces the engine preset's `startup_s`. Shoal's `expected_start_s` is its
    p90 unless `shoal` sets it."""
    interval_s: float = Field(default=5.0, gt=0.0)
    """Seconds between observations (the Shoal controller's scrape interval). HPA and KEDA act only on their
    own sync and polling periods (15 s, 30 s), which their state tracks."""
    target_requests_per_replica: float = Field(default=8.0, gt=0.0)
    """Requests (waiting plus running) per replica: Shoal's target, HPA's AverageValue, KEDA's trigger target."""
    metric_lag_s: float = Field(default=0.0, ge=0.0)
    """Seconds between the fleet's load and the policy seeing it: the demand figures (requests in flight, held,
    waiting) each tick are those of this long ago; replica counts stay current (the actuator's own view). 0: the
    policy reads the routers directly each interval, as `shoal autoscaler` does. A Prometheus pipeline with a 15 s
    scrape, a rate window and an adapter's cache adds some 30-60 s; users report 60-85 s from a burst to the
    first new replica with HPA on custom metrics."""
    static_replicas: int | None = Field(default=None, ge=1)
    """Fleet size of `static`; None: `max_replicas`."""
    initial_replicas: int | None = Field(default=None, ge=0)
    """Replicas ready at time 0; None: `static_replicas` for static, otherwise the fleet's `num_replicas`."""
    shoal: dict[str, Any] = Field(default_factory=dict)
    """Overrides of `ScalingPolicyConfig` (say `panic: {enabled: false}`)."""
    hpa: dict[str, Any] = Field(default_factory=dict)
    """Overrides of `HPAConfig`."""
    keda: dict[str, Any] = Field(default_factory=dict)
    """Overrides of `KEDAConfig`."""

    @model_validator(mode="after")
    def _check(self) -> AutoscaleConfig:
        for policy in ("shoal", "hpa", "keda", "static"):
            self.policy_config(policy)
        return self

    def policy_config(self, policy: str | None = None) -> AutoscalePolicyConfig:
        """The chosen policy's config (or `policy`'s), shared fields first, then its overrides."""
        policy = policy or self.policy
        bounds = {"max_replicas": self.max_replicas}
        target = self.target_requests_per_replica
        if policy == "shoal":
            return ScalingPolicyConfig.model_validate(
                {
                    **bounds,
                    "min_replicas": max(1, self.min_replicas),
                    "target_requests_per_replica": target,
                    "expected_start_s": startup_quantile_s(self.startup_s) or 1.0,
                    **self.shoal,
                }
            )
        if policy == "hpa":
            return HPAConfig.model_validate(
                {**bounds, "min_replicas": max(1, self.min_replicas), "target_average_value": target, **self.hpa}
            )
        if policy == "keda":
            return KEDAConfig.model_validate({**bounds, "target_value": target, **self.keda})
        return StaticConfig(replicas=self.static_replicas or self.max_replicas)

    def replicas_at_start(self, fleet_replicas: int) -> int:
        if self.initial_replicas is not None:
            return self.initial_replicas
        if self.policy == "static":
            return self.static_replicas or self.max_replicas
        return fleet_replicas


_Counts = tuple[int, int, int, int, tuple[float, ...], float, tuple[float, ...]]


def quantile(values: tuple[float, ...], q: float) -> float | None:
    """The `q` quantile of `values` (nearest rank); None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class PolicyFleet:
    """Runs one of `autoscaler.policy`'s pure policies each tick; counts its reasons (`reasons`)."""

    def __init__(self, config: AutoscaleConfig) -> None:
        self.interval_s = config.interval_s
        self.config = config.policy_config()
        self.metric_lag_s = config.metric_lag_s
        self.reasons: Counter[str] = Counter()
        self._history: deque[tuple[float, _Counts]] = deque()
        """(time, `_lagged`'s counts) of past ticks, for `metric_lag_s`."""
        self._shoal = ScalerState()
        self._hpa = HPAState()
        self._keda = KEDAState()

    def desired_replicas(self, observation: FleetObservation) -> int | None:
        obs, now = observation, observation.now_s
        current = obs.num_ready + obs.num_starting
        in_flight, held, waiting, engine_waiting, ttfts_s, arrivals_per_s, request_times_s = self._lagged(obs)
        config = self.config
        if isinstance(config, ScalingPolicyConfig):
            demand = fleet_demand(
                in_flight=in_flight,
                waiting=waiting,
                held=held,
                engine_waiting=engine_waiting,
                ttft_s=quantile(ttfts_s, config.ttft_quantile),
                arrivals_per_s=arrivals_per_s,
                request_s=sum(request_times_s) / len(request_times_s) if request_times_s else None,
            )
            seen = Observation(demand=demand, num_ready=obs.num_ready, starting_since=obs.starting_since)
            decision, self._shoal = decide(seen, self._shoal, config, now=now)
            self.reasons[decision.reason.value] += 1
            return decision.target_replicas
        if isinstance(config, HPAConfig):
            pods = HPAObservation(current, metric_total=in_flight, num_with_metric=obs.num_ready)
            hpa, self._hpa = hpa_decide(pods, self._hpa, config, now=now)
            self.reasons[hpa.reason.value] += 1
            return hpa.target_replicas
        if isinstance(config, KEDAConfig):
            external = KEDAObservation(current, metric_total=in_flight + held)
            keda, self._keda = keda_decide(external, self._keda, config, now=now)
            self.reasons[keda.reason.value] += 1
            return keda.target_replicas
        static = static_decide(current, config)
        self.reasons[static.reason.value] += 1
        return static.target_replicas

    def _lagged(self, obs: FleetObservation) -> _Counts:
        """(in flight, held, waiting at the routers, waiting in engines, TTFTs, arrivals per second, request
        times) as of `metric_lag_s` ago: the newest tick at least that old (the oldest one while the run is younger
        than the lag)."""
        current = (
            obs.in_flight,
            obs.held,
            obs.router_waiting,
            obs.engine_waiting,
            obs.ttfts_s,
            obs.arrivals_per_s,
            obs.request_times_s,
        )
        if self.metric_lag_s <= 0.0:
            return current
        history = self._history
        history.append((obs.now_s, current))
        cutoff = obs.now_s - self.metric_lag_s
        while len(history) > 1 and history[1][0] <= cutoff:
            history.popleft()
        return history[0][1]


ScalingConfig = FixedScalingConfig | ScheduledScalingConfig


def build_scaling(config: ScalingConfig | AutoscaleConfig) -> ScalingDriver:
    if isinstance(config, AutoscaleConfig):
        return PolicyFleet(config)
    if isinstance(config, ScheduledScalingConfig):
        return ScheduledFleet(config)
    return FixedFleet()
