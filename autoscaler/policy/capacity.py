"""What a replica carries, from the fleet's own figures (`ScalingPolicyConfig.capacity`).

Two parts, each off by default:
- `from_arrivals`: the requests signal counts arrivals x the nominal request time (Little's law at a healthy
  pace) plus the waiting requests (queued in engines or held at routers: the queue is demand), in place of the
  requests in flight. The nominal request time is an exponential
  average, over `nominal_window_s`, of the mean request time of healthy intervals (TTFT quantile within
  `target_ttft_s`): an overload's slow requests do not enter it, so an overload does not inflate the demand.
- `learn_target`: the per-replica target moves with the TTFT the routers observe, on intervals measured on a
  settled fleet (the size the previous decision asked for, nothing starting: a fleet still short of what it
  asked for says nothing about the target). A TTFT quantile below `raise_below` x `target_ttft_s` raises the
  target by `raise_percent_per_min` per minute, up to the interval's load per replica over `near_target`: the
  target never asks a replica for more than 1 / `near_target` times a load it was seen to carry well, so each
  shrink of the fleet is a bounded step beyond what it showed. A TTFT quantile above `target_ttft_s` at a load of
  at least `near_target` x the target cuts it to `cut_factor` x itself, once per `expected_start_s` (the
  replicas the cut asks for must serve before the next is judged). It stays within [`min_factor`, `max_factor`]
  x `target_requests_per_replica`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from autoscaler.policy.config import ScalingPolicyConfig
from autoscaler.policy.types import Demand, ScalerState


def is_healthy(demand: Demand, config: ScalingPolicyConfig) -> bool:
    """An interval whose TTFT meets the target (every interval without a target, or without a TTFT reading)."""
    target = config.target_ttft_s
    return target is None or demand.ttft_s is None or demand.ttft_s <= target


def nominal_request_s(
    previous: float | None, demand: Demand, config: ScalingPolicyConfig, *, elapsed_s: float
) -> float | None:
    """The nominal request time after this interval: the previous one moved towards the interval's mean request
    time by 1 - exp(-elapsed / window) when the interval is healthy; the first reading as it is."""
    if demand.request_s is None or not is_healthy(demand, config):
        return previous
    if previous is None:
        return demand.request_s
    weight = 1.0 - math.exp(-max(0.0, elapsed_s) / config.capacity.nominal_window_s)
    return previous + weight * (demand.request_s - previous)


def sized_demand(demand: Demand, nominal_s: float | None, config: ScalingPolicyConfig) -> Demand:
    """`demand` with its requests as the arrivals keep them in flight at the nominal pace, plus the waiting ones
    (queued or held: the queue is demand), when `from_arrivals` is on and both figures are known; else as it
    is."""
    if not config.capacity.from_arrivals or nominal_s is None or demand.arrivals_per_s is None:
        return demand
    return replace(demand, requests=demand.arrivals_per_s * nominal_s + demand.waiting)


@dataclass(frozen=True, slots=True)
class Lesson:
    """What one interval taught the target."""

    target: float
    changed_at: float | None
    """When the target was last cut."""
    note: str = ""
    """What changed it, for the decision's detail; empty when nothing did."""


def current_target(state: ScalerState, config: ScalingPolicyConfig) -> float:
    return state.learnt_target if state.learnt_target is not None else config.target_requests_per_replica


def learn(
    state: ScalerState,
    sized: Demand,
    config: ScalingPolicyConfig,
    *,
    num_ready: int,
    num_starting: int,
    elapsed_s: float,
    now: float,
) -> Lesson:
    """The target after this interval (see the module's docstring)."""
    cfg = config.capacity
    target = current_target(state, config)
    unchanged = Lesson(target, state.target_changed_at)
    if not cfg.learn_target or config.target_ttft_s is None or sized.ttft_s is None:
        return unchanged
    # The interval's TTFT was measured on the fleet the previous decision settled on, with nothing starting.
    if num_ready == 0 or num_starting > 0 or state.previous_fleet != (num_ready, 0):
        return unchanged
    base = config.target_requests_per_replica
    load = sized.requests / num_ready
    if sized.ttft_s > config.target_ttft_s:
        is_recent = state.target_changed_at is not None and now - state.target_changed_at < config.expected_start_s
        if load < cfg.near_target * target or is_recent:
            return unchanged  # a lightly loaded fleet's breach is not the target's doing
        cut = max(base * cfg.min_factor, target * cfg.cut_factor)
        note = (
            f"target {target:.1f} -> {cut:.1f} requests per replica: TTFT {sized.ttft_s:.2f} s above "
            f"{config.target_ttft_s:g} s at {load:.1f} per ready replica"
        )
        return Lesson(cut, now, note)
    if sized.ttft_s < cfg.raise_below * config.target_ttft_s:
        ceiling = min(base * cfg.max_factor, load / cfg.near_target)
        grown = target * (1.0 + cfg.raise_percent_per_min / 100.0 * elapsed_s / 60.0)
        return Lesson(max(target, min(grown, ceiling)), state.target_changed_at)
    return unchanged
