"""Baseline scaling policies beside Shoal's, pure like it: Kubernetes HPA defaults, KEDA defaults, a static fleet.

They exist to be compared with `decide` in the simulator; each is `*_decide(observation, state, config, *, now)
-> (BaselineDecision, state)` with its own observation, since each sees the fleet as its real counterpart does.

HPA (autoscaling/v2, `behavior` unset, so the defaults apply), as the Kubernetes docs and controller describe it
[1][2]:
- Every `sync_period_s` (15 s, kube-controller-manager's `--horizontal-pod-autoscaler-sync-period`), for a `Pods`
  metric with an `AverageValue` target: ratio = mean over pods with a metric / target; within `tolerance` (10%)
  of 1 nothing changes; else desired = ceil(ratio x pods with a metric).
- Pods without a metric (here: replicas still starting, which no router reports on) are set aside, then counted
  as 0 when scaling up and as 100% of the target when scaling down; if that reverses the direction or lands in
  the tolerance band, nothing changes [1, "Algorithm details"]. Not-ready pods with a metric are only special for
  the CPU resource metric, so this models none (a starting replica has no metric). Failed and deleted pods: none.
- Stabilization: the recommendation is stored; scale-up takes the lowest recommendation within 0 s (none), scale
  down the highest within 300 s. Rate policies: up max(4 pods, 100%) per 15 s, down 100% per 15 s; each policy's
  base is the replica count at the start of its period (current less changes within it) [1, "Default Behavior"].
- min/max replicas clamp the result; HPA never scales to or from zero.

KEDA (ScaledObject defaults [3][4]): the operator polls the scaler every `polling_interval_s` (30 s) for activity
(metric > `activation_threshold`, 0); it scales 0 -> 1 when active and to 0 after `cooldown_period_s` (300 s)
without activity (`minReplicaCount` defaults to 0). Between 1 and max, KEDA creates an HPA with an `External`
metric and an `AverageValue` target: desired = ceil(total / target) when |total / (target x current) - 1| exceeds
the tolerance (the external per-pod branch of the HPA's replica calculator: no readiness handling, the current
count is every pod, starting ones included), then the HPA's default behaviour above.

Static: always `replicas` (peak provisioning).

Sources:
[1] https://kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale/ (algorithm, tolerance, missing and
    not-ready pods, stabilization, default behavior)
[2] kubernetes/kubernetes pkg/controller/podautoscaler/replica_calculator.go (`calcPlainMetricReplicas`,
    `GetExternalPerPodMetricReplicas`) and horizontal.go (`stabilizeRecommendationWithBehaviors`,
    `calculateScaleUpLimitWithScalingRules`, `calculateScaleDownLimitWithBehaviors`)
[3] https://keda.sh/docs/latest/reference/scaledobject-spec/ (pollingInterval 30, cooldownPeriod 300,
    minReplicaCount 0, advanced.horizontalPodAutoscalerConfig)
[4] https://keda.sh/docs/latest/concepts/scaling-deployments/ (activation phase 0 <-> 1 by the operator, scaling
    phase 1 <-> N by the HPA; metrics served to the HPA as External metrics with AverageValue targets)
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class HPAScalingPolicy(_Config):
    """One HPA rate policy (`behavior.scaleUp.policies[]` / `scaleDown.policies[]`)."""

    type: Literal["Pods", "Percent"]
    value: float = Field(gt=0)
    """Pods, or percent of the replicas at the period's start, that may change per period."""
    period_s: float = Field(gt=0)


class HPARules(_Config):
    """`behavior.scaleUp` or `behavior.scaleDown`: a stabilization window and rate policies, the most permissive
    of which applies (`selectPolicy: Max`, the default)."""

    stabilization_window_s: float = Field(ge=0)
    policies: tuple[HPAScalingPolicy, ...]


def _default_up() -> HPARules:
    return HPARules(
        stabilization_window_s=0.0,
        policies=(
            HPAScalingPolicy(type="Pods", value=4, period_s=15.0),
            HPAScalingPolicy(type="Percent", value=100, period_s=15.0),
        ),
    )


def _default_down() -> HPARules:
    return HPARules(
        stabilization_window_s=300.0, policies=(HPAScalingPolicy(type="Percent", value=100, period_s=15.0),)
    )


class HPAConfig(_Config):
    """Kubernetes HPA with a `Pods` metric and an `AverageValue` target; every default is Kubernetes' own."""

    kind: Literal["hpa"] = "hpa"
    min_replicas: int = Field(1, ge=1)
    """`minReplicas` (default 1; HPA cannot go to zero)."""
    max_replicas: int = Field(10, ge=1)
    target_average_value: float = Field(8.0, gt=0)
    """Metric per pod (here requests waiting or running) the HPA holds: Shoal's `target_requests_per_replica` for
    a like-for-like comparison."""
    tolerance: float = Field(0.1, ge=0, lt=1)
    """`--horizontal-pod-autoscaler-tolerance`, default 0.1."""
    sync_period_s: float = Field(15.0, gt=0)
    """`--horizontal-pod-autoscaler-sync-period`, default 15 s."""
    scale_up: HPARules = Field(default_factory=_default_up)
    """Default: no stabilization; max(4 pods, 100%) per 15 s."""
    scale_down: HPARules = Field(default_factory=_default_down)
    """Default: 300 s stabilization; 100% per 15 s."""

    @model_validator(mode="after")
    def _check(self) -> HPAConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        return self


class KEDAConfig(_Config):
    """A KEDA ScaledObject with its defaults, over the HPA it creates."""

    kind: Literal["keda"] = "keda"
    min_replicas: int = Field(0, ge=0)
    """`minReplicaCount`, default 0: KEDA scales to zero after the cooldown."""
    max_replicas: int = Field(100, ge=1)
    """`maxReplicaCount`, default 100."""
    target_value: float = Field(8.0, gt=0)
    """The trigger's target, served to the HPA as an `AverageValue` per pod."""
    activation_threshold: float = Field(0.0, ge=0)
    """`activationThreshold` (default 0): active while the metric exceeds it."""
    polling_interval_s: float = Field(30.0, gt=0)
    """`pollingInterval`, default 30 s: how often the operator checks activity (0 <-> 1)."""
    cooldown_period_s: float = Field(300.0, ge=0)
    """`cooldownPeriod`, default 300 s: inactivity before scaling to zero."""
    hpa_tolerance: float = Field(0.1, ge=0, lt=1)
    hpa_sync_period_s: float = Field(15.0, gt=0)
    scale_up: HPARules = Field(default_factory=_default_up)
    scale_down: HPARules = Field(default_factory=_default_down)

    @model_validator(mode="after")
    def _check(self) -> KEDAConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        return self


class StaticConfig(_Config):
    """A fixed fleet (peak provisioning)."""

    kind: Literal["static"] = "static"
    replicas: int = Field(1, ge=0)


class BaselineReason(enum.StrEnum):
    """Why a baseline holds what it holds. Values are stable metric labels."""

    NOT_SYNCED = "not_synced"
    """Between two syncs (HPA) or polls (KEDA): no change."""
    NO_METRICS = "no_metrics"
    """No pod has a metric: the HPA cannot compute and changes nothing."""
    WITHIN_TOLERANCE = "within_tolerance"
    SCALE_UP = "scale_up"
    SCALE_DOWN = "scale_down"
    AT_TARGET = "at_target"
    STABILIZING = "stabilizing"
    """The recommendation is lower, but not for the whole scale-down stabilization window."""
    ACTIVATE = "activate"
    """KEDA: from zero to one replica, the scaler is active."""
    TO_ZERO = "to_zero"
    """KEDA: inactive for the cooldown period."""
    STATIC = "static"


@dataclass(frozen=True, slots=True)
class BaselineDecision:
    target_replicas: int
    current_replicas: int
    reason: BaselineReason
    recommended_replicas: int | None = None
    """The metric's wish before stabilization, rate policies and min/max."""
    is_rate_limited: bool = False
    detail: str = ""


@dataclass(frozen=True, slots=True)
class HPAObservation:
    """What an HPA's replica calculator sees for a `Pods` metric."""

    current_replicas: int
    """The scale subresource's replicas: every pod, starting ones included."""
    metric_total: float
    """Sum of the metric over the pods that report one."""
    num_with_metric: int
    """Pods that report the metric (ready replicas)."""

    @property
    def num_missing(self) -> int:
        return max(0, self.current_replicas - self.num_with_metric)


@dataclass(frozen=True, slots=True)
class HPAState:
    last_sync_at: float | None = None
    recommendations: tuple[tuple[float, int], ...] = ()
    """(time, recommendation before stabilization) within the longer stabilization window."""
    scale_events: tuple[tuple[float, int], ...] = ()
    """(time, change in replicas) within the longest policy period."""


def hpa_replicas_for_pods_metric(
    observation: HPAObservation, target: float, tolerance: float
) -> tuple[int, bool] | None:
    """`calcPlainMetricReplicas`: (desired replicas, whether the tolerance band or the pods without a metric held
    the current count) for a per-pod metric, or None without any metric."""
    current = observation.current_replicas
    ready = observation.num_with_metric
    if ready == 0:
        return None
    ratio = observation.metric_total / ready / target
    missing = observation.num_missing
    if missing == 0:
        return (current, True) if abs(ratio - 1.0) <= tolerance else (math.ceil(ratio * ready), False)
    # Missing pods: 0 when scaling up, the target when scaling down.
    filled = observation.metric_total + (0.0 if ratio >= 1.0 else missing * target)
    new_ratio = filled / (ready + missing) / target
    if abs(new_ratio - 1.0) <= tolerance or (ratio > 1.0) != (new_ratio > 1.0):
        return current, True
    desired = math.ceil(new_ratio * (ready + missing))
    if (new_ratio < 1.0 and desired > current) or (new_ratio > 1.0 and desired < current):
        return current, True
    return desired, False


def hpa_replicas_for_external_metric(total: float, current: int, target: float, tolerance: float) -> tuple[int, bool]:
    """`GetExternalPerPodMetricReplicas`: ceil(total / target) unless within the tolerance of `current` pods (then
    (current, True))."""
    if current > 0 and abs(total / (target * current) - 1.0) <= tolerance:
        return current, True
    return math.ceil(total / target), False


def hpa_normalize(
    recommended: int,
    current: int,
    state: HPAState,
    *,
    min_replicas: int,
    max_replicas: int,
    scale_up: HPARules,
    scale_down: HPARules,
    now: float,
) -> tuple[int, bool, HPAState]:
    """`normalizeDesiredReplicasWithBehaviors`: stabilize, then apply the rate policies and min/max. Returns
    (replicas, whether a rate policy or min/max cut it, state with the recommendation and scale event stored)."""
    up_cutoff = now - scale_up.stabilization_window_s
    down_cutoff = now - scale_down.stabilization_window_s
    up, down = recommended, recommended
    for at, value in state.recommendations:
        if at > up_cutoff:
            up = min(up, value)
        if at > down_cutoff:
            down = max(down, value)
    stabilized = min(max(current, up), down)
    keep_s = max(scale_up.stabilization_window_s, scale_down.stabilization_window_s)
    recommendations = (*((t, r) for t, r in state.recommendations if t > now - keep_s), (now, recommended))

    limited = stabilized
    if stabilized > current:
        limited = min(stabilized, _scale_up_limit(current, state.scale_events, scale_up, now=now))
    elif stabilized < current:
        limited = max(stabilized, _scale_down_limit(current, state.scale_events, scale_down, now=now))
    final = min(max(limited, min_replicas), max_replicas)
    period_s = max(p.period_s for p in (*scale_up.policies, *scale_down.policies))
    events = tuple((t, d) for t, d in state.scale_events if t > now - period_s)
    if final != current:
        events += ((now, final - current),)
    state = replace(state, recommendations=recommendations, scale_events=events)
    return final, final != stabilized, state


def _period_start(current: int, events: tuple[tuple[float, int], ...], period_s: float, *, now: float) -> int:
    """Replicas at the start of a policy's period: current less additions plus removals within it."""
    return current - sum(d for t, d in events if t > now - period_s)


def _scale_up_limit(current: int, events: tuple[tuple[float, int], ...], rules: HPARules, *, now: float) -> int:
    limits = []
    for policy in rules.policies:
        start = _period_start(current, events, policy.period_s, now=now)
        if policy.type == "Pods":
            limits.append(start + int(policy.value))
        else:  # rounded up, so that a percent step always adds a pod
            limits.append(math.ceil(start * (1.0 + policy.value / 100.0)))
    return max(limits, default=current)


def _scale_down_limit(current: int, events: tuple[tuple[float, int], ...], rules: HPARules, *, now: float) -> int:
    limits = []
    for policy in rules.policies:
        start = _period_start(current, events, policy.period_s, now=now)
        if policy.type == "Pods":
            limits.append(start - int(policy.value))
        else:  # truncated, as the controller's int32 conversion does
            limits.append(int(start * (1.0 - policy.value / 100.0)))
    return max(0, min(limits, default=current))


def hpa_decide(
    observation: HPAObservation, state: HPAState, config: HPAConfig, *, now: float
) -> tuple[BaselineDecision, HPAState]:
    current = observation.current_replicas
    if state.last_sync_at is not None and now < state.last_sync_at + config.sync_period_s:
        return BaselineDecision(current, current, BaselineReason.NOT_SYNCED), state
    state = replace(state, last_sync_at=now)
    calculated = hpa_replicas_for_pods_metric(observation, config.target_average_value, config.tolerance)
    if calculated is None:
        return BaselineDecision(current, current, BaselineReason.NO_METRICS, detail="no pod reports the metric"), state
    recommended, is_held = calculated
    target, is_limited, state = hpa_normalize(
        recommended,
        current,
        state,
        min_replicas=config.min_replicas,
        max_replicas=config.max_replicas,
        scale_up=config.scale_up,
        scale_down=config.scale_down,
        now=now,
    )
    detail = (
        f"{observation.metric_total:.1f} over {observation.num_with_metric} pod(s) with a metric, "
        f"{observation.num_missing} without; recommends {recommended}"
    )
    reason = _reason(target, current, recommended, is_held=is_held)
    return BaselineDecision(target, current, reason, recommended, is_limited, detail), state


def _reason(target: int, current: int, recommended: int, *, is_held: bool) -> BaselineReason:
    if target > current:
        return BaselineReason.SCALE_UP
    if target < current:
        return BaselineReason.SCALE_DOWN
    if recommended < current:
        return BaselineReason.STABILIZING
    return BaselineReason.WITHIN_TOLERANCE if is_held else BaselineReason.AT_TARGET


@dataclass(frozen=True, slots=True)
class KEDAObservation:
    current_replicas: int
    """Every pod, starting ones included."""
    metric_total: float
    """The trigger's metric (a fleet-wide query: requests waiting or running, held ones included)."""


@dataclass(frozen=True, slots=True)
class KEDAState:
    last_poll_at: float | None = None
    last_active_at: float | None = None
    hpa: HPAState = HPAState()


def keda_decide(
    observation: KEDAObservation, state: KEDAState, config: KEDAConfig, *, now: float
) -> tuple[BaselineDecision, KEDAState]:
    current = observation.current_replicas
    total = observation.metric_total
    if state.last_poll_at is None or now >= state.last_poll_at + config.polling_interval_s:
        # The operator's poll: activation 0 -> 1 and deactivation to zero.
        is_active = total > config.activation_threshold
        last_active = now if is_active or state.last_active_at is None else state.last_active_at
        state = replace(state, last_poll_at=now, last_active_at=last_active)
        if current == 0 and is_active:
            target = max(1, config.min_replicas)
            return BaselineDecision(target, current, BaselineReason.ACTIVATE, detail=f"metric {total:.1f}"), state
        idle_s = now - last_active
        if current > 0 and config.min_replicas == 0 and not is_active and idle_s >= config.cooldown_period_s:
            detail = f"inactive for {idle_s:.0f} s"
            return BaselineDecision(0, current, BaselineReason.TO_ZERO, detail=detail), replace(state, hpa=HPAState())
    if current == 0:
        return BaselineDecision(0, 0, BaselineReason.NOT_SYNCED, detail="at zero, waiting for activation"), state
    hpa = state.hpa
    if hpa.last_sync_at is not None and now < hpa.last_sync_at + config.hpa_sync_period_s:
        return BaselineDecision(current, current, BaselineReason.NOT_SYNCED), state
    hpa = replace(hpa, last_sync_at=now)
    recommended, is_held = hpa_replicas_for_external_metric(total, current, config.target_value, config.hpa_tolerance)
    target, is_limited, hpa = hpa_normalize(
        recommended,
        current,
        hpa,
        min_replicas=max(1, config.min_replicas),
        max_replicas=config.max_replicas,
        scale_up=config.scale_up,
        scale_down=config.scale_down,
        now=now,
    )
    detail = f"metric {total:.1f} over {current} pod(s); recommends {recommended}"
    reason = _reason(target, current, recommended, is_held=is_held)
    return BaselineDecision(target, current, reason, recommended, is_limited, detail), replace(state, hpa=hpa)


def static_decide(current_replicas: int, config: StaticConfig) -> BaselineDecision:
    return BaselineDecision(config.replicas, current_replicas, BaselineReason.STATIC, config.replicas)
