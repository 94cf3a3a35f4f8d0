"""Shoal's scaling policy: `decide(observation, state, config, *, now) -> (ScaleDecision, state)`.

Per call:
1. Starting replicas past their deadline (`start_deadline_s` after creation) count as failed; the others are
   capacity on its way: current = ready + starting on time. Counting them is what stops a burst with slow cold
   starts from cascading, and the deadline is what stops a stuck start from blocking the fleet forever.
2. Missing or stale figures hold the current size, never lower it; after `hold_after_failures` such
   observations the decision says so and applies the fallback, if any.
3. Demand is absolute: per signal, desired = ceil(total / per-replica target), averaged over the stable window
   and over the short panic window; the largest signal wins. The requests signal may keep a square-root
   headroom for Poisson noise (`requests_headroom_sd`): ceil((requests + beta x sqrt(requests)) / target). With
   `capacity` (off by default, `capacity.py`) the requests are what the arrivals keep in flight at the nominal
   pace plus the waiting ones (`from_arrivals`), and the target is learnt from TTFT (`learn_target`).
4. Panic (Knative) when the short window needs at least `threshold` x the ready replicas (before rounding up) and,
   on the requests signal, exceeds their capacity by more than Poisson noise (`noise_margin_sd`): size on the
   short window, never below the current size, until a stable window passes without the condition.
5. Otherwise size on the stable window, unless within the tolerance band of the current size.
5b. Predictive scale-up (`forecast`, off by default): the demand forecast at now + the expected start time
   (`forecast.py`: the stable mean carried along the recent trend) may raise the recommendation of steps 4-5
   (window `forecast`): above the current size once past the tolerance band, else up to the current size, so a
   rising trend also holds off a scale-down. It never lowers it.
5c. TTFT breach (with `target_ttft_s`): when the latest observation's TTFT quantile exceeds the target, the
   recommendation is at least one more than the ready replicas (window `latest`, reason `ttft_breach`), and panic
   mode is armed so nothing is removed for a stable window. Replicas still starting count towards it, so a breach
   that lasts through a cold start adds one replica per cold start, not one per tick.
6. Up at once, capped by the rate policy over its period; down to the highest recommendation over the
   stabilization window, by at most the down step per period. To zero only after the idle window with nothing
   starting (the idle window is its own stabilization); from zero, any waiting request wakes the fleet.

Rate caps follow HPA: changes already made within the period count against it, and the period's starting size
is the base of the percent step. Unlike HPA, replicas still starting are not part of that base
(`scale_up.is_step_from_ready`): a step waits for the previous one to serve, so a queue that builds during a cold
start cannot stack steps on it. Everything is a function of the arguments; `now` is the caller's clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from autoscaler.policy.capacity import learn, nominal_request_s, sized_demand
from autoscaler.policy.config import ScaleDownConfig, ScaleUpConfig, ScalingPolicyConfig
from autoscaler.policy.demand import ceil_replicas, describe, is_burst, largest, mean_demand, raw_desired
from autoscaler.policy.forecast import forecast_demand
from autoscaler.policy.types import (
    Action,
    Cap,
    Demand,
    Observation,
    Reason,
    Sample,
    ScaleDecision,
    ScalerState,
    Signal,
    Window,
)


def is_start_overdue(created_at: float, config: ScalingPolicyConfig, *, now: float) -> bool:
    """True when a replica created at `created_at` and still starting counts as failed."""
    return now - created_at >= config.start_deadline_s


@dataclass(frozen=True, slots=True)
class _Verdict:
    """What one branch of the policy settled on; `_finish` turns it into the decision."""

    target: int
    reason: Reason
    window: Window
    recommended: int
    cap: Cap | None = None
    detail: str = ""


def decide(
    observation: Observation, state: ScalerState, config: ScalingPolicyConfig, *, now: float
) -> tuple[ScaleDecision, ScalerState]:
    on_time = [t for t in observation.starting_since if not is_start_overdue(t, config, now=now)]
    num_starting = len(on_time)
    num_overdue = len(observation.starting_since) - num_starting
    current = observation.num_ready + num_starting
    demand = observation.demand
    if demand is None or observation.metrics_age_s > config.metrics.stale_after_s:
        verdict, state = _without_metrics(observation, state, config, now=now, current=current)
        is_panicking = state.panic_until is not None and now < state.panic_until
        return _finish(
            verdict,
            replace(state, previous_fleet=None),
            config,
            now=now,
            current=current,
            num_overdue=num_overdue,
            is_panicking=is_panicking,
        )

    horizon = max(
        config.stable_window_s,
        config.panic.window_s if config.panic.enabled else 0.0,
        config.forecast.window_s if config.forecast.enabled else 0.0,
    )
    elapsed_s = now - state.samples[-1].at if state.samples else 0.0
    nominal_s = nominal_request_s(state.nominal_request_s, demand, config, elapsed_s=elapsed_s)
    sized = sized_demand(demand, nominal_s, config)
    lesson = learn(
        state, sized, config, num_ready=observation.num_ready, num_starting=num_starting, elapsed_s=elapsed_s, now=now
    )
    target = lesson.target
    samples = (*(s for s in state.samples if s.at > now - horizon), Sample(now, sized))
    last_busy_at = now if demand.is_busy else (state.last_busy_at if state.last_busy_at is not None else now)
    stable_mean = mean_demand(samples, now - config.stable_window_s)
    stable = raw_desired(stable_mean, observation.num_ready, config, target)
    stable_signal, stable_raw = largest(stable)
    stable_n = ceil_replicas(stable_raw)

    panic_until = state.panic_until if state.panic_until is not None and now < state.panic_until else None
    short, short_signal, short_n = stable, stable_signal, stable_n
    if config.panic.enabled:
        short_mean = mean_demand(samples, now - config.panic.window_s)
        short = raw_desired(short_mean, observation.num_ready, config, target)
        short_signal, short_raw = largest(short)
        short_n = ceil_replicas(short_raw)
        if is_burst(short_mean, short_signal, short_raw, observation.num_ready, config, target):
            panic_until = now + config.stable_window_s
    is_panicking = panic_until is not None

    if is_panicking:
        window, signal, by_signal, window_s = Window.PANIC, short_signal, short, config.panic.window_s
        wanted = max(short_n, stable_n)
        recommended = max(wanted, current)  # never down while panicking
        is_within_tolerance = False
    else:
        window, signal, by_signal, window_s = Window.STABLE, stable_signal, stable, config.stable_window_s
        wanted = stable_n
        is_within_tolerance = current > 0 and abs(stable_raw / current - 1.0) <= config.tolerance
        recommended = current if is_within_tolerance else stable_n
    figures = (
        f"{describe(mean_demand(samples, now - window_s), signal)} over the {window} window ({window_s:.0f} s) "
        f"needs {wanted} (ready {observation.num_ready}, starting {num_starting})"
    )
    if lesson.note:
        figures = f"{figures}; {lesson.note}"
    ahead = None
    if config.forecast.enabled:
        ahead = _ahead(samples, stable_mean, observation.num_ready, config, target, now=now, current=current)
    if ahead is not None and ahead.recommended > recommended:
        window, signal, by_signal = Window.FORECAST, ahead.signal, ahead.by_signal
        wanted, recommended = ahead.wanted, ahead.recommended
        figures = f"{ahead.figures}; {figures}"
        is_within_tolerance = False
    is_breach = _is_ttft_breach(demand, observation.num_ready, config)
    if is_breach:
        panic_until = now + config.stable_window_s
        is_panicking = True
        breach_n = observation.num_ready + 1
        figures = (
            f"TTFT {demand.ttft_s:.2f} s over the latest interval breaches the {config.target_ttft_s:g} s target: "
            f"needs more than the {observation.num_ready} ready; {figures}"
        )
        if breach_n >= recommended and breach_n > current:
            window, signal, wanted, recommended = Window.LATEST, Signal.TTFT, breach_n, breach_n
            is_within_tolerance = False
        else:
            recommended = max(recommended, current)  # panic mode: never down right after a breach
    is_resuming = state.failed_observations > 0
    state = ScalerState(
        samples=samples,
        recommendations=state.recommendations,
        scale_steps=state.scale_steps,
        panic_until=panic_until,
        last_busy_at=last_busy_at,
        failed_observations=0,
        nominal_request_s=nominal_s,
        learnt_target=target if config.capacity.learn_target else None,
        target_changed_at=lesson.changed_at,
    )

    idle_s = now - last_busy_at
    if config.scale_to_zero.enabled and not demand.is_busy and (current == 0 or idle_s >= config.scale_to_zero.idle_s):
        if current == 0:
            verdict = _Verdict(
                0, Reason.IDLE_AT_ZERO, Window.IDLE, 0, detail=f"no replica and no request for {idle_s:.0f} s"
            )
        elif num_starting == 0:
            verdict = _Verdict(0, Reason.SCALE_TO_ZERO, Window.IDLE, 0, detail=f"no request for {idle_s:.0f} s")
        else:
            verdict = _Verdict(
                current,
                Reason.AT_TARGET,
                Window.IDLE,
                current,
                detail=f"idle for {idle_s:.0f} s, but {num_starting} replica(s) still starting",
            )
    else:
        verdict, state = _size(
            state,
            config,
            now=now,
            current=current,
            num_starting=num_starting,
            recommended=recommended,
            wanted=wanted,
            window=window,
            is_panicking=is_panicking,
            is_within_tolerance=is_within_tolerance,
            is_wake=current == 0 and demand.is_busy,
            is_breach=is_breach and window is Window.LATEST,
            is_resuming=is_resuming,
            figures=figures,
        )
    decision, state = _finish(
        verdict,
        state,
        config,
        now=now,
        current=current,
        num_overdue=num_overdue,
        is_panicking=is_panicking,
        signal=signal,
        desired_by_signal={s: ceil_replicas(v) for s, v in by_signal.items()},
        target_requests=target,
    )
    return decision, replace(state, previous_fleet=(decision.target_replicas, num_starting))


def _size(
    state: ScalerState,
    config: ScalingPolicyConfig,
    *,
    now: float,
    current: int,
    num_starting: int,
    recommended: int,
    wanted: int,
    window: Window,
    is_panicking: bool,
    is_within_tolerance: bool,
    is_wake: bool,
    is_breach: bool,
    is_resuming: bool,
    figures: str,
) -> tuple[_Verdict, ScalerState]:
    """Clamp the recommendation, record it, and move towards it: up at once within the rate cap, down to the
    stabilized recommendation within the down step."""
    cap: Cap | None = None
    if recommended < config.min_replicas:
        recommended, cap = config.min_replicas, Cap.MIN_REPLICAS
    if recommended > config.max_replicas:
        recommended, cap = config.max_replicas, Cap.MAX_REPLICAS
    since = now - config.scale_down.stabilization_window_s
    # A fresh start, or fresh figures after a gap of missing ones longer than the window, starts the window at the
    # current size, as HPA seeds its own: an absence of recommendations is not a window of low ones.
    earlier = tuple((t, r) for t, r in state.recommendations if t > since)
    if not earlier and (not state.recommendations or is_resuming):
        earlier = ((now, current),)
    recommendations = (*earlier, (now, recommended))
    # While replicas start, the figures measure a fleet short of what it asked for: the window does not keep them.
    kept = recommendations if num_starting == 0 or config.scale_down.is_kept_while_starting else earlier
    state = replace(state, recommendations=kept)

    if recommended > current:
        target = min(recommended, _up_limit(current, num_starting, state.scale_steps, config.scale_up, now=now))
        if target < recommended:
            cap = Cap.SCALE_UP_RATE
        reason = Reason.WAKE_FROM_ZERO if is_wake else Reason.TTFT_BREACH if is_breach else Reason.SCALE_UP
        return _Verdict(target, reason, window, recommended, cap, figures), state
    if recommended < current:
        stabilized = min(max(r for _, r in recommendations), config.max_replicas)
        window_s = config.scale_down.stabilization_window_s
        if stabilized >= current:
            detail = f"{figures}; {stabilized} recommended within the last {window_s:.0f} s"
            return _Verdict(current, Reason.STABILIZING, Window.STABILIZATION, recommended, detail=detail), state
        target = max(stabilized, _down_limit(current, state.scale_steps, config.scale_down, now=now))
        if target > stabilized:
            cap = Cap.SCALE_DOWN_RATE
        elif target != recommended:
            cap = None  # the window, not the floor, set this target
        detail = f"{figures}; at most {stabilized} recommended within the last {window_s:.0f} s"
        return _Verdict(target, Reason.SCALE_DOWN, Window.STABILIZATION, recommended, cap, detail), state
    if is_panicking and wanted < current:
        reason = Reason.PANIC_HOLD
    elif is_within_tolerance and wanted != current:
        reason = Reason.WITHIN_TOLERANCE
    else:
        reason = Reason.AT_TARGET
    return _Verdict(current, reason, window, recommended, cap if recommended != wanted else None, figures), state


def _is_ttft_breach(demand: Demand, num_ready: int, config: ScalingPolicyConfig) -> bool:
    """True when the latest TTFT quantile exceeds `target_ttft_s` on a fleet that serves (at zero, the waiting
    requests wake it instead)."""
    target = config.target_ttft_s
    return target is not None and demand.ttft_s is not None and num_ready > 0 and demand.ttft_s > target


def _without_metrics(
    observation: Observation, state: ScalerState, config: ScalingPolicyConfig, *, now: float, current: int
) -> tuple[_Verdict, ScalerState]:
    """Hold the current size (never lower it); after `hold_after_failures` observations say so and apply the
    fallback. The floor still applies, unless the fleet is at zero by choice."""
    failures = state.failed_observations + 1
    if observation.demand is None:
        what = "no figures from the routers"
    else:
        what = f"figures {observation.metrics_age_s:.0f} s old (limit {config.metrics.stale_after_s:.0f} s)"
    target, cap = current, None
    is_at_zero_by_choice = current == 0 and config.scale_to_zero.enabled
    if target < config.min_replicas and not is_at_zero_by_choice:
        target, cap = config.min_replicas, Cap.MIN_REPLICAS
    reason = Reason.METRICS_STALE
    if failures >= config.metrics.hold_after_failures:
        reason = Reason.METRICS_UNAVAILABLE
        fallback = config.metrics.fallback_replicas
        if fallback is not None and min(fallback, config.max_replicas) > target:
            target, cap = min(fallback, config.max_replicas), Cap.FALLBACK
    recommended = target
    if target > current:
        limit = _up_limit(current, current - observation.num_ready, state.scale_steps, config.scale_up, now=now)
        if limit < target:
            target, cap = limit, Cap.SCALE_UP_RATE
    held = "applying the fallback" if cap is Cap.FALLBACK else "holding the current size"
    detail = f"{what} for {failures} observation(s); {held}"
    return _Verdict(target, reason, Window.NONE, recommended, cap, detail), replace(state, failed_observations=failures)


def _finish(
    verdict: _Verdict,
    state: ScalerState,
    config: ScalingPolicyConfig,
    *,
    now: float,
    current: int,
    num_overdue: int,
    is_panicking: bool,
    signal: Signal | None = None,
    desired_by_signal: Mapping[Signal, int] | None = None,
    target_requests: float | None = None,
) -> tuple[ScaleDecision, ScalerState]:
    """The decision, and the state with this step recorded for the rate caps."""
    period_s = max(config.scale_up.period_s, config.scale_down.period_s)
    steps = tuple((t, d) for t, d in state.scale_steps if t > now - period_s)
    target = verdict.target
    if target != current:
        steps += ((now, target - current),)
    action = Action.UP if target > current else Action.DOWN if target < current else Action.HOLD
    detail = verdict.detail
    if verdict.cap is not None:
        detail += f"; capped by {verdict.cap}"
    if num_overdue:
        detail += f"; {num_overdue} replica(s) past their start deadline count as failed"
    decision = ScaleDecision(
        target_replicas=target,
        current_replicas=current,
        action=action,
        reason=verdict.reason,
        window=verdict.window,
        signal=signal,
        cap=verdict.cap,
        recommended_replicas=verdict.recommended,
        desired_by_signal=dict(desired_by_signal or {}),
        is_panicking=is_panicking,
        num_overdue=num_overdue,
        detail=detail,
        target_requests_per_replica=target_requests,
    )
    return decision, replace(state, scale_steps=steps)


def _up_limit(
    current: int, num_starting: int, steps: tuple[tuple[float, int], ...], rule: ScaleUpConfig, *, now: float
) -> int:
    """Most replicas allowed now: the period's starting size plus the larger of the two steps; with
    `is_step_from_ready`, the starting size counts only ready replicas."""
    added = sum(d for t, d in steps if d > 0 and t > now - rule.period_s)
    start = max(0, current - added)
    if rule.is_step_from_ready:
        start = min(start, current - num_starting)
    return start + max(rule.max_replicas, math.ceil(start * rule.max_percent / 100.0))


def _down_limit(current: int, steps: tuple[tuple[float, int], ...], rule: ScaleDownConfig, *, now: float) -> int:
    """Fewest replicas allowed now: the period's starting size less the larger of the two steps."""
    removed = sum(-d for t, d in steps if d < 0 and t > now - rule.period_s)
    start = current + removed
    return max(0, start - max(rule.max_replicas, math.ceil(start * rule.max_percent / 100.0)))


@dataclass(frozen=True, slots=True)
class _Ahead:
    """What the demand forecast asks for."""

    recommended: int
    """The forecast's recommendation: `wanted` once past the tolerance band, else at most the current size."""
    wanted: int
    signal: Signal
    by_signal: dict[Signal, float]
    figures: str


def _ahead(
    samples: tuple[Sample, ...],
    stable_mean: Demand,
    num_ready: int,
    config: ScalingPolicyConfig,
    target: float,
    *,
    now: float,
    current: int,
) -> _Ahead | None:
    """Replicas for the demand forecast at now + the horizon; None without a trend yet."""
    forecast = forecast_demand(
        samples,
        stable_mean,
        config.forecast,
        horizon_s=config.forecast_horizon_s,
        stable_since=now - config.stable_window_s,
        now=now,
    )
    if forecast is None:
        return None
    by_signal = raw_desired(forecast.demand, num_ready, config, target)
    signal, raw = largest(by_signal)
    wanted = ceil_replicas(raw)
    # Above the current size only past the tolerance band, as any rise; below it a rising trend can still hold
    # off a scale-down. The caller takes it only when it raises the measured recommendation.
    recommended = wanted if raw > current * (1.0 + config.tolerance) else min(wanted, current)
    figures = (
        f"{describe(forecast.demand, signal)} forecast in {config.forecast_horizon_s:.0f} s "
        f"(trend {60.0 * forecast.requests_per_s:+.2f} requests/min over {config.forecast.window_s:.0f} s) "
        f"needs {wanted}"
    )
    return _Ahead(recommended, wanted, signal, by_signal, figures)
