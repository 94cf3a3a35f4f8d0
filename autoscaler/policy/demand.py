"""Demand in replicas: the figures `decide` reads from the samples, and the replicas each signal asks for.

Queue time is demand. `fleet_demand` is where a driver's counts become a `Demand`: requests held at a router (no
replica can take them: a cold start, a fleet at zero, every replica at its in-flight limit) and requests queued
inside engines (in the routers' in-flight and waiting counts, and, beyond those, the engines' scraped
`num_requests_waiting` when other clients reach the engines) all count as requests and as waiting ones. So a queue
that grows while each running batch looks fine still raises the requests signal: the per-replica figure is requests
waiting *or* running.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from autoscaler.policy.config import ScalingPolicyConfig
from autoscaler.policy.types import Demand, Sample, Signal

CEIL_SLACK = 1e-9
"""Float demand that lands a hair above an integer number of replicas (8.000000001 / 8) must not add one."""


def fleet_demand(
    *,
    in_flight: float,
    waiting: float,
    held: float,
    engine_waiting: float | None = None,
    prefill_backlog_tokens: float = 0.0,
    kv_usage: float | None = None,
    ttft_s: float | None = None,
    arrivals_per_s: float | None = None,
    request_s: float | None = None,
) -> Demand:
    """The fleet's demand from the routers' and engines' counts.

    `in_flight`: requests the routers sent to replicas and not finished; `waiting`: of those, the ones without a
    first byte (queued in an engine or in prefill); `held`: requests the routers hold for want of a replica;
    `engine_waiting`: the engines' own queue gauges summed (None when not scraped). Engine-queued requests beyond
    the routers' waiting ones (clients that reach the engines directly) are added to both figures. Engines'
    running counts are not read: they lag the routers' own counts by a scrape, and a finished batch would then
    read as load for that long. `arrivals_per_s` and `request_s` (the mean time of the requests finished since the
    last reading) feed `capacity.from_arrivals`.
    """
    for name, value in (("in_flight", in_flight), ("waiting", waiting), ("held", held)):
        if value < 0 or math.isnan(value):
            raise ValueError(f"{name} must be a count >= 0, got {value}")
    for name, rate in (("arrivals_per_s", arrivals_per_s), ("request_s", request_s)):
        if rate is not None and not rate >= 0:
            raise ValueError(f"{name} must be >= 0, got {rate}")
    unseen = max(0.0, (engine_waiting or 0.0) - waiting)
    return Demand(
        requests=in_flight + unseen + held,
        waiting=waiting + unseen + held,
        prefill_backlog_tokens=prefill_backlog_tokens,
        kv_usage=kv_usage,
        ttft_s=ttft_s,
        arrivals_per_s=arrivals_per_s,
        request_s=request_s,
    )


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def mean_demand(samples: tuple[Sample, ...], since: float) -> Demand:
    """The mean of each figure over the samples after `since` (the last sample is always included)."""
    window = [s.demand for s in samples if s.at > since] or [samples[-1].demand]
    n = len(window)
    return Demand(
        requests=sum(d.requests for d in window) / n,
        waiting=sum(d.waiting for d in window) / n,
        prefill_backlog_tokens=sum(d.prefill_backlog_tokens for d in window) / n,
        kv_usage=_mean([d.kv_usage for d in window]),
        ttft_s=_mean([d.ttft_s for d in window]),
        arrivals_per_s=_mean([d.arrivals_per_s for d in window]),
        request_s=_mean([d.request_s for d in window]),
    )


def is_burst(
    short: Demand, signal: Signal, desired: float, num_ready: int, config: ScalingPolicyConfig, target: float
) -> bool:
    """Panic's condition: the short window needs `threshold` x the ready replicas (unrounded), and, on the
    requests signal, its requests exceed the ready capacity by more than the noise margin."""
    ready = max(1, num_ready)
    if desired <= 0 or desired < config.panic.threshold * ready - CEIL_SLACK:
        return False
    if signal is not Signal.REQUESTS:
        return True
    capacity = ready * target
    return short.requests - capacity > config.panic.noise_margin_sd * math.sqrt(capacity)


def raw_desired(demand: Demand, num_ready: int, config: ScalingPolicyConfig, target: float) -> dict[Signal, float]:
    """Desired replicas per configured signal, before rounding up; `target` is the requests per replica (the
    configured one, or the learnt one)."""
    requests = demand.requests + config.requests_headroom_sd * math.sqrt(max(0.0, demand.requests))
    desired = {Signal.REQUESTS: requests / target}
    if config.target_prefill_backlog_tokens_per_replica is not None:
        desired[Signal.PREFILL_BACKLOG] = (
            demand.prefill_backlog_tokens / config.target_prefill_backlog_tokens_per_replica
        )
    if config.target_kv_usage_per_replica is not None and demand.kv_usage is not None:
        desired[Signal.KV_USAGE] = demand.kv_usage / config.target_kv_usage_per_replica
    if config.target_ttft_s is not None and demand.ttft_s is not None:
        desired[Signal.TTFT] = num_ready * demand.ttft_s / config.target_ttft_s
    return desired


def describe(mean: Demand, signal: Signal) -> str:
    """The figure of `signal` in `mean`, for a decision's reason."""
    if signal is Signal.REQUESTS:
        return f"{mean.requests:.1f} requests"
    if signal is Signal.PREFILL_BACKLOG:
        return f"{mean.prefill_backlog_tokens:.0f} prefill backlog tokens"
    if signal is Signal.KV_USAGE:
        return f"{mean.kv_usage or 0.0:.2f} summed KV usage"
    return f"{mean.ttft_s or 0.0:.2f} s TTFT"


def largest(desired: Mapping[Signal, float]) -> tuple[Signal, float]:
    """The signal that needs the most replicas; ties go to the earlier signal (requests first)."""
    best = Signal.REQUESTS
    for signal, value in desired.items():
        if value > desired[best]:
            best = signal
    return best, desired[best]


def ceil_replicas(replicas: float) -> int:
    return max(0, math.ceil(replicas - CEIL_SLACK))
