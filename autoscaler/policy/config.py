"""`ScalingPolicyConfig`: every knob of Shoal's scaling policy, as one frozen pydantic model.

The autoscaler's settings, the simulator's scenario files, the Helm chart's values and the tests parse the same
model, so a policy means the same thing wherever it runs. `kind` leaves room for baseline policies (HPA, KEDA)
beside Shoal's own; unknown fields are errors, never silently ignored. Times are seconds on the caller's clock.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class ScaleUpConfig(_Config):
    """How fast the fleet may grow: HPA's default behaviour, the larger of a replica step and a percent step per
    period (`selectPolicy: Max`)."""

    max_replicas: int = Field(4, ge=0)
    """Replicas that may be added per period. HPA's default (4 pods per 15 s): a fleet of one can reach five
    within one period, which covers most bursts that panic mode sizes."""
    max_percent: float = Field(100.0, ge=0)
    """Percent of the fleet at the period's start that may be added per period (rounded up). HPA's default
    (100%, doubling): large fleets grow geometrically instead of four at a time."""
    period_s: float = Field(15.0, gt=0)
    """Seconds over which additions are counted. HPA's default."""
    is_step_from_ready: bool = True
    """The step is measured from the ready replicas only: replicas still starting are capacity on its way, not a
    base for more, so one step must serve before the next grows the fleet further. On. During a cold start the
    requests in flight at overloaded replicas keep rising (their batches slow down) without the load rising as
    much; stacking a step on them every period overshot (a sinusoid of 1-24 requests/s reached 16 replicas where
    5 static ones meet the SLO). Off: HPA's rule, a step per period whatever is still starting."""


class ScaleDownConfig(_Config):
    """How the fleet shrinks: to the highest recommendation over a window, then at most a step per period."""

    stabilization_window_s: float = Field(600.0, ge=0)
    """Seconds of recommendations whose maximum a scale-down may go to: a lull shorter than this never removes a
    replica that a cold start of minutes would have to bring back. Ten minutes, five 120 s cold starts, twice
    HPA's default: a load that returns within it (a 10-minute cycle) still finds its replicas. Recommendations
    made while replicas start are not kept (`is_kept_while_starting`), so the longer window does not hold the
    overshoot of a spike. On the workloads of `bench_autoscale.py --workload frontier`, 600 s against 300 s: fewer
    replica-seconds and more attainment on the Azure code hour and the sinusoid (goodput 93% against 84%), up to
    8% more replica-seconds on the other two."""
    is_kept_while_starting: bool = False
    """Recommendations made while replicas are starting are kept in the window. Off: they measure a fleet short
    of the capacity it asked for (requests in flight at overloaded replicas rise as their batches slow), so the
    window holds what the fleet measures once that capacity serves. HPA keeps them (on): a spike on the Azure
    conversation hour then held five replicas for five minutes where two carried the load once ready."""
    max_replicas: int = Field(1, ge=0)
    """Replicas that may be removed per period. One: each removal drains a replica (its in-flight requests
    finish, its prefix cache is lost), so removals are spread out and each is observed before the next."""
    max_percent: float = Field(10.0, ge=0)
    """Percent of the fleet at the period's start that may be removed per period (rounded up; the larger of
    this and `max_replicas` applies). 10% lets a large fleet shrink within minutes, not hours."""
    period_s: float = Field(30.0, gt=0)
    """Seconds over which removals are counted. 30 s is longer than a typical drain, so a removal is usually
    finished and its load spread over the rest before the next one."""


class PanicConfig(_Config):
    """Knative's panic mode: a burst is sized on a short window, and nothing is removed while it lasts."""

    enabled: bool = True
    """Panic mode on. Without it a burst is followed only as fast as the stable window's average rises."""
    window_s: float = Field(6.0, gt=0)
    """Seconds of demand averaged for panic sizing. Knative's default (10% of its 60 s stable window): long
    enough to ignore a single scrape's noise, short enough to see a burst within a few ticks."""
    threshold: float = Field(2.0, gt=1.0)
    """Panic when short-window demand needs at least this many times the ready replicas. Knative's default
    (200%): twice the ready capacity cannot be absorbed by queueing, and lower values make ordinary growth
    look like a burst. Panic ends once a stable window has passed without the condition. Unlike Knative, the
    demand is compared before rounding up to whole replicas: at a few requests per replica the rounding alone
    reads 1.6x as 2x."""
    noise_margin_sd: float = Field(2.5, ge=0)
    """On the requests signal, panic also needs the short window's requests to exceed the ready replicas'
    capacity (ready x `target_requests_per_replica`) by more than this many standard deviations of a Poisson
    count of that mean (this x sqrt(capacity)). It binds only where that capacity is under (this / (threshold
    - 1))^2 requests (6.25 by default: one or two replicas at a small target), where a 2x reading is often
    noise. 2.5: at 3 requests per replica one replica's noise (3 on average) never panics in hours, while a 3x
    burst does at any capacity from 2 requests up (6 requests on one replica of 2). 0: the threshold alone."""


class ForecastConfig(_Config):
    """Predictive scale-up: size the fleet on the demand expected when a replica started now is ready, carried
    forward along the recent trend (see `autoscaler.policy.forecast`). It only ever raises the recommendation."""

    enabled: bool = False
    """Off by default: on bursty traffic a trend fitted just after a burst adds replicas that arrive once it is
    over (on the Azure code trace, scenario 08, more replica-seconds for lower attainment), and a fleet whose cold
    starts are short has little to gain. Turn it on for smooth curves (a diurnal day) with cold starts of minutes."""
    window_s: float = Field(600.0, gt=0)
    """Seconds of demand samples the trend (a least-squares slope) is fitted on; at least the stable window, so
    the trend is less noisy than the level it extends. Ten minutes, five 120 s cold starts: at a few requests per
    replica a shorter window fits its slope to Poisson noise (on scenario 13, 300 s added replicas that 600 s
    did not, for less attainment per replica-second), a longer one still reports a rise that has stopped."""
    horizon_s: float | None = Field(None, gt=0)
    """Seconds ahead of now to forecast. Unset: `expected_start_s`, when a replica started now would serve."""
    max_ratio: float = Field(1.5, gt=1.0)
    """The forecast is at most this many times the measured (stable window) demand. 1.5: a trend never asks for
    more than half again what is measured; faster rises are bursts, which panic mode sizes on its own window."""


class CapacityConfig(_Config):
    """What a replica carries, taken from the fleet's own figures instead of on trust (both parts off by default).

    In flight, an overloaded replica's requests pile up as its batches slow: the count rises with the overload
    more than with the load, so a fleet sized on it asks, one cold start later, for replicas the load never
    needed. And `target_requests_per_replica` is a guess about the model, the GPU and the traffic that only the
    TTFT the routers observe can check."""

    from_arrivals: bool = False
    """The requests signal counts what the arrivals keep in flight at a healthy pace (Little's law: arrivals per
    second x the nominal request time) plus the waiting requests (queued or held), in place of the requests in
    flight. Until a request has finished, or where the arrivals are not measured, the requests in flight count.
    With `learn_target`, on the four workloads of `bench_autoscale.py --workload frontier` (its capacity row,
    docs/simulation-results.md) it cut replica-seconds on the conversation hour and the ServeGen day (1.02x and
    1.09x static peak at 99%) and cost the sinusoid its goodput (84% against 93%: ramps that outrun a cold start
    are followed later), hence off by default."""
    nominal_window_s: float = Field(600.0, gt=0)
    """Seconds over which the nominal request time is averaged (exponentially), over healthy intervals only:
    those whose TTFT quantile meets `target_ttft_s` (every interval without a TTFT target). Ten minutes: longer
    than a burst's overload, short enough to follow a change of traffic within the hour."""
    learn_target: bool = False
    """`target_requests_per_replica` is where learning starts: on an interval measured on a settled fleet, a
    TTFT quantile below `raise_below` x `target_ttft_s` raises the target by `raise_percent_per_min` (up to the
    load per replica over `near_target`), and one above `target_ttft_s` cuts it by `cut_factor` (at most once
    per `expected_start_s`: the replicas a cut asks for must serve before the next is judged). Additive
    increase, multiplicative decrease: the target settles under the load at which TTFT reaches its target (see
    `autoscaler.policy.capacity`). Needs `target_ttft_s`."""
    near_target: float = Field(0.7, gt=0, le=1)
    """The target grows to at most the load per replica it was seen to carry well over this (0.7: a shrink of
    the fleet asks each replica for at most 43% more than it showed it carries), and a breach cuts it only at a
    load of at least this share of it (a lightly loaded fleet's breach is not the target's doing)."""
    raise_below: float = Field(0.5, gt=0, lt=1)
    """Share of `target_ttft_s` under which the TTFT quantile raises the target. Half: room for the queue a
    rise of the load builds during a cold start."""
    raise_percent_per_min: float = Field(10.0, gt=0)
    """Growth of the target per minute of healthy, near-target intervals."""
    cut_factor: float = Field(0.8, gt=0, lt=1)
    """The target after a breach, as a share of what it was."""
    min_factor: float = Field(0.25, gt=0, le=1)
    """The learnt target never goes below this share of `target_requests_per_replica`."""
    max_factor: float = Field(4.0, ge=1)
    """Nor above this many times it."""


class ScaleToZeroConfig(_Config):
    """Removing every replica when there is no traffic, and waking on the first request."""

    enabled: bool = False
    """Off by default: a cold start of a GPU replica takes minutes, during which the routers hold requests
    (bounded) or refuse them. Turn it on for fleets where idle GPUs cost more than a slow first request."""
    idle_s: float = Field(600.0, gt=0)
    """Seconds without any request (in flight, queued or held) before the fleet goes to zero. Ten minutes: a
    few multiples of a cold start, so only real idle periods pay one. Replicas still starting are never
    removed by it."""


class MetricsConfig(_Config):
    """What to do when the routers' figures are missing or old: never shrink on them."""

    stale_after_s: float = Field(30.0, gt=0)
    """Figures older than this many seconds count as missing. A few scrape intervals (the controller's default
    is 5 s): a slow or lost scrape is tolerated, a stuck pipeline is not."""
    hold_after_failures: int = Field(3, ge=1)
    """Consecutive missing or stale observations after which the autoscaler says it holds (reason
    `metrics_unavailable`) and, when set, applies `fallback_replicas`. Three: one lost scrape is noise."""
    fallback_replicas: int | None = Field(None, ge=0)
    """Replicas to hold once metrics have been unavailable for `hold_after_failures` observations, like
    KEDA's fallback; only ever raises the fleet (missing metrics never cause a scale-down). Unset: hold the
    current size."""


class ScalingPolicyConfig(_Config):
    """Shoal's scaling policy (see `autoscaler.policy.decide`)."""

    kind: Literal["shoal"] = "shoal"

    min_replicas: int = Field(1, ge=1)
    """Fewest replicas while there is traffic (always, without scale to zero). One: a fleet that serves must
    keep a warm replica; `scale_to_zero` is the only, explicit, way below it."""
    max_replicas: int = Field(10, ge=1)
    """Most replicas, whatever the demand: the budget's bound. Failed replicas being replaced count in it."""
    target_requests_per_replica: float = Field(8.0, gt=0)
    """Requests (waiting plus running) one replica should carry. Demand is absolute: desired replicas =
    ceil(total requests / this). 8 is a quarter of the bundled engine's batch of 32 sequences, leaving room
    for a burst while panic mode sizes it; tune per model and GPU (vLLM on an H100 carries 32 or more), or let
    `capacity.learn_target` move it with the routers' TTFT."""
    requests_headroom_sd: float = Field(0.0, ge=0)
    """Headroom for Poisson noise on the requests signal, in standard deviations: desired replicas =
    ceil((requests + this x sqrt(requests)) / `target_requests_per_replica`), the square-root staffing rule.
    Requests in flight under Poisson arrivals fluctuate around their mean by sqrt(mean), so a fixed per-replica
    target leaves small fleets too little room and large ones more than they need; with this headroom a fleet
    holds about the same queueing probability at every size, and the target can be closer to what a replica
    carries at scale. 0 (off): plain `ceil(requests / target)`, the behaviour of HPA and KEDA."""
    target_prefill_backlog_tokens_per_replica: float | None = Field(None, gt=0)
    """Uncached prompt tokens waiting for prefill that one replica should carry: about its prefill rate
    (tokens/s) times the queueing delay you accept. Unset (off): it depends on the model and the GPU."""
    target_kv_usage_per_replica: float | None = Field(None, gt=0, le=1)
    """KV cache fraction (0..1) one replica should run at; desired = ceil(sum of replicas' usage / this).
    Unset (off): only engines that export a KV gauge can feed it. 0.8 suits long-context workloads."""
    target_ttft_s: float | None = Field(None, gt=0)
    """Time to first token (seconds, at `ttft_quantile`) the fleet should keep, usually the TTFT SLO. Two uses:
    the averaged signal desired = ceil(ready x observed / target), and the breach rule: a latest interval whose
    TTFT exceeds it asks at once for one replica more than are ready (reason `ttft_breach`). Unset (off): TTFT
    is not additive, so it is a guard beside the absolute signals, not their replacement."""
    ttft_quantile: float = Field(0.9, gt=0, lt=1)
    """Quantile of the routers' TTFT histogram compared with `target_ttft_s`. p90: tail enough to matter,
    with enough samples per scrape interval to be stable."""
    tolerance: float = Field(0.1, ge=0, lt=1)
    """Relative band around the current size within which no change is made: HPA's default (10%), so noise
    of a few percent never moves the fleet."""
    stable_window_s: float = Field(60.0, gt=0)
    """Seconds of demand averaged for normal sizing. Knative's default: per-request noise averages out,
    while panic mode sees bursts on its own short window."""
    expected_start_s: float = Field(120.0, gt=0)
    """Seconds a replica usually takes from creation to ready (pull, load weights, warm up). Starting
    replicas count as capacity on its way until `start_deadline_factor` times this."""
    start_deadline_factor: float = Field(2.0, ge=1)
    """A replica still not ready after this many times `expected_start_s` counts as failed: it no longer
    counts as capacity, so another is started in its place. Twice: a slow node is not a failure."""
    scale_up: ScaleUpConfig = Field(default_factory=ScaleUpConfig)
    """Rate cap on growth (HPA's default behaviour)."""
    scale_down: ScaleDownConfig = Field(default_factory=ScaleDownConfig)
    """Stabilization window and step of shrinking."""
    panic: PanicConfig = Field(default_factory=PanicConfig)
    """Burst handling (Knative's panic mode)."""
    forecast: ForecastConfig = Field(default_factory=ForecastConfig)
    """Predictive scale-up on the demand trend (off by default)."""
    capacity: CapacityConfig = Field(default_factory=CapacityConfig)
    """Demand from arrivals and a per-replica target learnt from TTFT (off by default)."""
    scale_to_zero: ScaleToZeroConfig = Field(default_factory=ScaleToZeroConfig)
    """Idle fleets to zero replicas (off by default)."""
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    """Missing and stale figures."""

    @model_validator(mode="after")
    def _check(self) -> ScalingPolicyConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        if self.panic.window_s > self.stable_window_s:
            raise ValueError(
                f"panic.window_s ({self.panic.window_s}) must not exceed stable_window_s ({self.stable_window_s})"
            )
        if self.forecast.enabled and self.forecast.window_s < self.stable_window_s:
            raise ValueError(
                f"forecast.window_s ({self.forecast.window_s}) must not be shorter than stable_window_s "
                f"({self.stable_window_s})"
            )
        if self.capacity.learn_target and self.target_ttft_s is None:
            raise ValueError("capacity.learn_target needs target_ttft_s: the target is learnt from TTFT")
        return self

    @property
    def forecast_horizon_s(self) -> float:
        """Seconds ahead of now that predictive scale-up forecasts demand for."""
        return self.forecast.horizon_s if self.forecast.horizon_s is not None else self.expected_start_s

    @property
    def start_deadline_s(self) -> float:
        """Seconds after creation at which a replica that is still starting counts as failed."""
        return self.expected_start_s * self.start_deadline_factor
