"""A replica's prefill rate, learned online from observed time to first byte.

`estimated_ttft` divides prompt tokens by each replica's prefill rate, so the rate must track what the replica
really does (its GPU, its model, its batch mix) rather than a datasheet figure. Each finished prefill gives one
observation:

    work_tokens = uncached_tokens + queue_tokens_ahead      # its own uncached prompt + the backlog ahead of it
    observed    = work_tokens / (ttfb_s - overhead_s)       # tokens per second

`queue_tokens_ahead` is the replica's prefill backlog (`ReplicaState.waiting_prompt_tokens`) when the request
was routed: engines prefill first come, first served, so the request's TTFB paid for those tokens too.

The estimate is an exponentially weighted moving average in rate space:

    rate <- rate + alpha * (clamp(observed, rate / max_step_ratio, rate * max_step_ratio) - rate)
    alpha = max(1 - 2 ** (-1 / half_life_observations), 1 / n)     # n = accepted observations, this one included

- The prior (`prior_tokens_per_s`) holds until the first observation, which replaces it (alpha = 1); the
  following ones form a running mean until alpha reaches its floor, so a cold replica converges in a handful
  of requests, however wrong the prior was.
- From the second observation on, an observation is clamped to within `max_step_ratio` of the current rate, so
  a single stall (a preemption, a GC pause, a mispredicted cache hit) moves the rate by a bounded step.
- Observations with fewer than `min_tokens` of work are ignored: for tiny prompts, fixed costs (HTTP,
  tokenisation, one engine step) dominate the TTFB and say nothing about the rate. So are those with a
  non-positive TTFB after `overhead_s`.
- The result always lies within [min_tokens_per_s, max_tokens_per_s], so it is never 0 or negative.

The state of one replica is a `PrefillRate` value, kept by the routing core (`routing_core`); `update` is pure.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field


@dataclass(frozen=True, slots=True)
class PrefillRate:
    """One replica's learned prefill rate."""

    tokens_per_s: float
    """Current estimate, tokens per second."""
    num_observations: int = 0
    """Observations accepted so far."""


class PrefillRateEstimator(BaseModel):
    """Parameters of the online prefill-rate estimate, and its pure update."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    prior_tokens_per_s: float = Field(default=10_000.0, gt=0.0)
    """Rate assumed before the first observation, tokens/s. The order of a mid-size model's prefill throughput
    on one current datacenter GPU; it only orders replicas until each has served one prompt."""

    half_life_observations: float = Field(default=8.0, gt=0.0)
    """Observations after which an old observation's weight has halved. Prefill throughput drifts slowly (with
    the batch mix), and 8 averages TTFB noise of ~30% down to under 10% while following a real change within a
    few dozen requests."""

    min_tokens: int = Field(default=256, ge=1)
    """Work tokens (uncached prompt plus backlog ahead) below which an observation is ignored: under ~256 tokens
    fixed per-request costs are a large part of the TTFB."""

    max_step_ratio: float = Field(default=4.0, gt=1.0)
    """Outlier clamp: an observation is first clamped to [rate / ratio, rate * ratio]. 4 bounds the damage of
    one stall while letting a truly different replica converge geometrically."""

    min_tokens_per_s: float = Field(default=10.0, gt=0.0)
    """Lower bound of the estimate, tokens/s: below any real engine, CPU reference path included, and > 0."""

    max_tokens_per_s: float = Field(default=10_000_000.0, gt=0.0)
    """Upper bound of the estimate, tokens/s: well above any single replica, so only nonsense is clamped."""

    overhead_s: float = Field(default=0.0, ge=0.0)
    """Seconds of each TTFB not spent prefilling (network, tokenisation, first decode step), subtracted before
    dividing. 0 by default: `min_tokens` already keeps the observations where it matters out; set it to the
    fleet's measured TTFB of a one-token prompt to refine."""

    def initial(self, fleet: Iterable[PrefillRate] = ()) -> PrefillRate:
        """The state of a replica never observed: the mean learned rate of the `fleet`'s observed replicas,
        else the prior.

        With the prior alone, a prior below the replicas' true rate makes every observed replica look faster than
        every unobserved one, so all cache misses would go to the first replica that streamed, the only one that
        learns. Drivers re-seed their unobserved replicas with this when a replica takes its first observation.
        """
        observed = [state.tokens_per_s for state in fleet if state.num_observations > 0]
        if not observed:
            return PrefillRate(tokens_per_s=self.prior_tokens_per_s)
        return PrefillRate(tokens_per_s=sum(observed) / len(observed))

    def update(
        self,
        state: PrefillRate,
        *,
        uncached_tokens: int,
        ttfb_s: float,
        queue_tokens_ahead: int = 0,
    ) -> PrefillRate:
        """The state after one observed prefill; `state` itself when the observation is rejected."""
        work_tokens = max(uncached_tokens, 0) + max(queue_tokens_ahead, 0)
        prefill_s = ttfb_s - self.overhead_s
        if work_tokens < self.min_tokens or not prefill_s > 0.0:
            return state
        observed = work_tokens / prefill_s
        rate = state.tokens_per_s
        num_observations = state.num_observations + 1
        if state.num_observations > 0:
            observed = min(max(observed, rate / self.max_step_ratio), rate * self.max_step_ratio)
        alpha = max(1.0 - 2.0 ** (-1.0 / self.half_life_observations), 1.0 / num_observations)
        rate += alpha * (observed - rate)
        rate = min(max(rate, self.min_tokens_per_s), self.max_tokens_per_s)
        return PrefillRate(tokens_per_s=rate, num_observations=num_observations)
