"""The autoscaling hook: what a scaling driver sees of the fleet, and what it may answer.

Every `interval_s` the simulation hands the driver a `FleetObservation` and asks for a desired replica count
(None: no change). The simulation carries the answer out as the live actuators do: new replicas start after the
engine's `startup_s` and join the router when ready; surplus replicas are drained (no new requests, removed once
idle), replicas still starting first, then those with the fewest requests in flight and the least cached data.

Drivers here: `FixedFleet` (never scales) and `ScheduledFleet` (a replica count per time, for experiments and
tests). A driver around `autoscaler.policy` plugs in through the same protocol, adapting its observation and
state; nothing here depends on it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field


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


ScalingConfig = FixedScalingConfig | ScheduledScalingConfig


def build_scaling(config: ScalingConfig) -> ScalingDriver:
    if isinstance(config, ScheduledScalingConfig):
        return ScheduledFleet(config)
    return FixedFleet()
