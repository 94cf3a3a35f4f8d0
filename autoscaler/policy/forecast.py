"""Demand forecast for predictive scale-up: the stable window's mean carried forward along the recent trend.

A replica started now serves only a cold start later, so a fleet sized on the demand it measures is, on a rising
curve, one cold start behind it (Dynamo's planner forecasts load for the same reason). The forecast here is
deliberately simple and one-sided:
- trend: per additive figure (requests, waiting, prefill backlog tokens, summed KV usage), the least-squares slope
  of the samples over the last `window_s`: slope = sum((t - t_mean) (y - y_mean)) / sum((t - t_mean)^2);
- forecast = stable mean + slope x (lead), lead = `horizon_s` + the stable mean's age (now minus its samples' mean
  time, about half the stable window): the stable mean is the demand of that long ago, and a replica started now
  serves `horizon_s` from now;
- only a rising trend moves a figure (a falling one leaves the stable mean as it is), and the forecast is at most
  `max_ratio` x the stable mean: steeper rises are bursts, which panic mode sizes on its own window.
TTFT is not additive and depends on the ready replicas, so it is not forecast. Too short a history (samples
spanning less than half `window_s`) gives no forecast: two samples make a slope of noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autoscaler.policy.config import ForecastConfig
from autoscaler.policy.types import Demand, Sample


@dataclass(frozen=True, slots=True)
class Forecast:
    """Demand expected `lead_s` after the stable mean's samples, and the trend of requests behind it."""

    demand: Demand
    lead_s: float
    """Seconds from the stable mean's mean sample time to the forecast's time (now + the horizon)."""
    requests_per_s: float
    """Slope of the requests figure over the trend window (requests per second; may be negative)."""


def forecast_demand(
    samples: Sequence[Sample],
    stable: Demand,
    config: ForecastConfig,
    *,
    horizon_s: float,
    stable_since: float,
    now: float,
) -> Forecast | None:
    """The demand at `now + horizon_s`, from the stable mean (of the samples after `stable_since`) and the trend
    of the samples within `config.window_s`; None when the history is too short to have a trend."""
    trend = [s for s in samples if s.at > now - config.window_s]
    if not trend or trend[-1].at - trend[0].at < config.window_s / 2:
        return None
    stable_times = [s.at for s in samples if s.at > stable_since] or [samples[-1].at]
    lead_s = horizon_s + now - sum(stable_times) / len(stable_times)
    times = [s.at for s in trend]
    t_mean = sum(times) / len(times)
    spread = sum((t - t_mean) ** 2 for t in times)

    def slope(values: Sequence[float]) -> float:
        y_mean = sum(values) / len(values)
        return sum((t - t_mean) * (y - y_mean) for t, y in zip(times, values, strict=True)) / spread

    def ahead(level: float, per_s: float) -> float:
        return min(level + max(0.0, per_s) * lead_s, level * config.max_ratio)

    requests_per_s = slope([s.demand.requests for s in trend])
    kv = [s.demand.kv_usage for s in trend]
    kv_usage = stable.kv_usage
    if kv_usage is not None and all(k is not None for k in kv):
        kv_usage = ahead(kv_usage, slope([k or 0.0 for k in kv]))
    demand = Demand(
        requests=ahead(stable.requests, requests_per_s),
        waiting=ahead(stable.waiting, slope([s.demand.waiting for s in trend])),
        prefill_backlog_tokens=ahead(
            stable.prefill_backlog_tokens, slope([s.demand.prefill_backlog_tokens for s in trend])
        ),
        kv_usage=kv_usage,
    )
    return Forecast(demand=demand, lead_s=lead_s, requests_per_s=requests_per_s)
