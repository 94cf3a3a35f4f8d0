"""How long a new replica takes from creation to ready: a fixed time, or a distribution of measured starts.

A pod's cold start is image pull + weight load + warm-up, and it varies: a node with the image cached starts in
half the time of one that pulls it. `startup_s` in an engine preset or a scenario's `autoscale` section is either
seconds (every start alike) or one of:

- `{kind: lognormal, p50_s: 90, p90_s: 180}`: lognormal with that median and 90th percentile (sigma =
  ln(p90 / p50) / z_0.9); start times are skewed to the right, as measured pod starts are.
- `{kind: empirical, samples_s: [72, 95, 140, ...]}`: each start is one of the measured seconds, drawn uniformly.

Draws come from a `StartupSampler` seeded by the scenario's seed, so a run is deterministic. A policy that must
assume one start time (Shoal's `expected_start_s`, the clairvoyant fleet's lead) takes the distribution's p90
(`startup_quantile_s`): the start deadline, twice that, is then passed by few real starts.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Z_90 = statistics.NormalDist().inv_cdf(0.9)
"""The standard normal's 90th percentile (1.2816): ln(p90 / p50) = sigma x this for a lognormal."""
PLANNING_QUANTILE = 0.9
"""The quantile of start times that policies plan with (`startup_quantile_s`)."""


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class LognormalStartup(_Model):
    """Lognormal start times, given by their median and 90th percentile."""

    kind: Literal["lognormal"] = "lognormal"
    p50_s: float = Field(gt=0.0)
    """Median seconds from creation to ready."""
    p90_s: float = Field(gt=0.0)
    """90th percentile seconds; at least `p50_s` (equal: every start takes `p50_s`)."""

    @model_validator(mode="after")
    def _check(self) -> LognormalStartup:
        if self.p90_s < self.p50_s:
            raise ValueError(f"p90_s ({self.p90_s}) must be at least p50_s ({self.p50_s})")
        return self

    @property
    def sigma(self) -> float:
        return math.log(self.p90_s / self.p50_s) / Z_90

    def quantile(self, q: float) -> float:
        return self.p50_s * math.exp(self.sigma * statistics.NormalDist().inv_cdf(q))

    def describe(self) -> str:
        return f"lognormal cold starts (p50 {self.p50_s:g} s, p90 {self.p90_s:g} s)"


class EmpiricalStartup(_Model):
    """Start times drawn uniformly from measured ones."""

    kind: Literal["empirical"] = "empirical"
    samples_s: list[float] = Field(min_length=1)
    """Measured seconds from creation to ready, one per start (e.g. pod creation to Ready, from `kubectl get
    events`), each >= 0."""

    @model_validator(mode="after")
    def _check(self) -> EmpiricalStartup:
        if any(not (s >= 0.0 and math.isfinite(s)) for s in self.samples_s):
            raise ValueError(f"samples_s must be finite seconds >= 0, got {self.samples_s}")
        return self

    def quantile(self, q: float) -> float:
        """Nearest-rank quantile of the samples."""
        ordered = sorted(self.samples_s)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    def describe(self) -> str:
        return (
            f"empirical cold starts ({len(self.samples_s)} samples, p50 {self.quantile(0.5):g} s, "
            f"p90 {self.quantile(0.9):g} s)"
        )


StartupDistribution = Annotated[LognormalStartup | EmpiricalStartup, Field(discriminator="kind")]
StartupTime = Annotated[float, Field(ge=0.0, allow_inf_nan=False)] | StartupDistribution
"""Seconds (every start alike), or a distribution of them."""


def startup_quantile_s(startup: StartupTime, q: float = PLANNING_QUANTILE) -> float:
    """The `q` quantile of start times (a fixed time is its own quantile)."""
    return float(startup) if isinstance(startup, int | float) else startup.quantile(q)


def describe_startup(startup: StartupTime) -> str:
    """For a table's title: which start times a run used."""
    return f"{float(startup):g} s cold starts" if isinstance(startup, int | float) else startup.describe()


class StartupSampler:
    """Draws one start time per new replica, from its own seeded generator (the run's other draws are unmoved)."""

    def __init__(self, startup: StartupTime, *, seed: int) -> None:
        self.startup = startup
        self._rng = random.Random(f"startup:{seed}")

    def __call__(self) -> float:
        startup = self.startup
        if isinstance(startup, int | float):
            return float(startup)
        if isinstance(startup, LognormalStartup):
            return self._rng.lognormvariate(math.log(startup.p50_s), startup.sigma)
        return self._rng.choice(startup.samples_s)
