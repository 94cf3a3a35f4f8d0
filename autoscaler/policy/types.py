"""The vocabulary of scaling decisions, shared by the controller, the simulator and the tests.

A driver (the controller, or the simulator) builds an `Observation` (the fleet's demand as the routers report it,
how old that is, and which replicas are ready or starting) and calls `decide(observation, state, config, now=now)`.
The `ScaleDecision` says how many replicas to hold and why: the reason, the signal that drove it, the window it
was measured on and the cap that limited it. `ScalerState` is the policy's memory between calls (demand samples,
past recommendations, recent scale steps, panic and idle clocks); it is immutable, and `decide` returns the next.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field


class Signal(enum.StrEnum):
    """A demand signal; each gives desired replicas on its own and the largest wins. Values are metric labels."""

    REQUESTS = "requests"
    """Requests waiting or running (router in-flight plus held) / `target_requests_per_replica`."""
    PREFILL_BACKLOG = "prefill_backlog"
    """Uncached prompt tokens waiting for their first token / `target_prefill_backlog_tokens_per_replica`."""
    KV_USAGE = "kv_usage"
    """Sum of the replicas' KV cache fractions / `target_kv_usage_per_replica`."""
    TTFT = "ttft"
    """Ready replicas x observed TTFT quantile / `target_ttft_s`."""


class Action(enum.StrEnum):
    UP = "up"
    DOWN = "down"
    HOLD = "hold"


class Reason(enum.StrEnum):
    """Why the target is what it is. Values are stable: they are metric labels and log fields."""

    SCALE_UP = "scale_up"
    """Demand needs more replicas than are ready or starting."""
    TTFT_BREACH = "ttft_breach"
    """The routers observed TTFT above `target_ttft_s` over the latest interval: one replica more than are ready,
    at once, however the averaged signals read (a queue can grow while the per-replica figures look fine)."""
    SCALE_DOWN = "scale_down"
    """Demand has needed fewer replicas for the whole stabilization window."""
    AT_TARGET = "at_target"
    """Demand needs the replicas there are."""
    WITHIN_TOLERANCE = "within_tolerance"
    """Demand differs from the current size by less than the tolerance band."""
    STABILIZING = "stabilizing"
    """Demand needs fewer replicas now, but not for the whole stabilization window yet."""
    PANIC_HOLD = "panic_hold"
    """Demand needs fewer replicas, but a burst is on (panic mode): nothing is removed."""
    SCALE_TO_ZERO = "scale_to_zero"
    """No request for the idle window: every replica goes."""
    IDLE_AT_ZERO = "idle_at_zero"
    """No replica and no request: stay at zero."""
    WAKE_FROM_ZERO = "wake_from_zero"
    """No replica, and a request is waiting: start replicas."""
    METRICS_STALE = "metrics_stale"
    """The routers' figures are missing or too old: hold the current size (never scale down on them)."""
    METRICS_UNAVAILABLE = "metrics_unavailable"
    """Figures have been missing for `hold_after_failures` observations: hold, or apply the fallback."""


class Window(enum.StrEnum):
    """Which window the target was measured on."""

    STABLE = "stable"
    PANIC = "panic"
    FORECAST = "forecast"
    """The demand forecast at now + the expected start time (predictive scale-up)."""
    LATEST = "latest"
    """The latest observation alone: a TTFT breach is acted on without averaging."""
    STABILIZATION = "stabilization"
    """The highest recommendation over the scale-down stabilization window."""
    IDLE = "idle"
    NONE = "none"
    """No demand was measured (metrics missing)."""


class Cap(enum.StrEnum):
    """What limited the target below (or above) the recommendation."""

    MAX_REPLICAS = "max_replicas"
    MIN_REPLICAS = "min_replicas"
    SCALE_UP_RATE = "scale_up_rate"
    SCALE_DOWN_RATE = "scale_down_rate"
    FALLBACK = "fallback"
    """`metrics.fallback_replicas` raised the target while metrics were unavailable."""


@dataclass(frozen=True, slots=True)
class Demand:
    """The fleet's load as all routers together report it at one moment."""

    requests: float
    """Requests waiting or running: in flight to replicas plus held by routers for want of a replica."""
    waiting: float = 0.0
    """Of `requests`, those without a first token yet (queued at a replica, or held by a router). Any waiting
    request wakes a fleet at zero."""
    prefill_backlog_tokens: float = 0.0
    """Uncached prompt tokens of the waiting requests."""
    kv_usage: float | None = None
    """Sum over ready replicas of their KV cache fraction (0..1 each); None when not every replica reports it."""
    ttft_s: float | None = None
    """TTFT quantile (`ttft_quantile`) over the requests since the last observation; None with none."""
    arrivals_per_s: float | None = None
    """Requests that reached the routers per second since the last observation; None when not measured."""
    request_s: float | None = None
    """Mean time of the requests that finished since the last observation, arrival to last byte; None with none."""

    @property
    def is_busy(self) -> bool:
        """Requests waiting, running or held, or arrived since the last observation."""
        return self.requests > 0 or self.waiting > 0 or (self.arrivals_per_s or 0.0) > 0


@dataclass(frozen=True, slots=True)
class Observation:
    """What the policy sees at one decision."""

    demand: Demand | None
    """None when the routers could not be read (every router must answer: a partial sum would understate)."""
    metrics_age_s: float = 0.0
    """Seconds between when `demand` was measured and `now`."""
    num_ready: int = 0
    """Replicas that serve (ready, not being removed)."""
    starting_since: tuple[float, ...] = ()
    """Creation time (on `now`'s clock) of each replica that is starting: capacity on its way, never serving."""


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    """A target replica count, and why."""

    target_replicas: int
    """Replicas to hold: ready plus starting, failed ones not included."""
    current_replicas: int
    """Ready plus starting replicas that are still within their start deadline."""
    action: Action
    reason: Reason
    window: Window = Window.NONE
    signal: Signal | None = None
    """The signal with the highest desired replicas, when demand was measured."""
    cap: Cap | None = None
    recommended_replicas: int | None = None
    """The policy's wish before the rate caps and the stabilization window (after min/max)."""
    desired_by_signal: Mapping[Signal, int] = field(default_factory=dict)
    """Desired replicas per signal on the window the decision used."""
    is_panicking: bool = False
    num_overdue: int = 0
    """Starting replicas past their start deadline: counted as failed, not as capacity."""
    detail: str = ""
    """One line for logs: the figures behind the reason."""
    target_requests_per_replica: float | None = None
    """The requests per replica the decision sized on (learnt with `capacity.learn_target`); None without
    figures."""


@dataclass(frozen=True, slots=True)
class Sample:
    at: float
    demand: Demand


@dataclass(frozen=True, slots=True)
class ScalerState:
    """The policy's memory between decisions. Start from `ScalerState()`."""

    samples: tuple[Sample, ...] = ()
    """Fresh demand samples within the longest averaging window, oldest first."""
    recommendations: tuple[tuple[float, int], ...] = ()
    """(now, recommended replicas) within the scale-down stabilization window, oldest first."""
    scale_steps: tuple[tuple[float, int], ...] = ()
    """(now, change in replicas) of recent targets, within the longer rate period, for the rate caps."""
    panic_until: float | None = None
    """Panic mode lasts while `now` is below this; re-armed each time the panic condition holds."""
    last_busy_at: float | None = None
    """Last `now` at which any request was waiting or running (for scale to zero)."""
    failed_observations: int = 0
    """Consecutive observations with missing or stale figures."""
    nominal_request_s: float | None = None
    """Request time on healthy intervals, exponentially averaged (`capacity.from_arrivals`); None until one."""
    learnt_target: float | None = None
    """Requests per replica learnt from TTFT (`capacity.learn_target`); None: the configured target."""
    target_changed_at: float | None = None
    """When `learnt_target` was last cut: one cut per cold start."""
    previous_fleet: tuple[int, int] | None = None
    """(target, replicas starting) of the previous decision with figures: the fleet this interval's TTFT was
    measured on, when nothing was starting and the target was reached."""
