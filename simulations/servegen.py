"""ServeGen aggregate rate curves as a workload: Poisson arrivals that follow a day's load shape.

ServeGen's `servegen_aggregate_rate.csv` (Alibaba Bailian, arXiv 2505.09999) gives, per model and per 600 s window,
the summed request rate of all clients (`category, model, window_start_s, total_rate_req_per_s, active_clients,
rate_weighted_mean_iat_cv`): 14 days for the language models, one for the others. It has no requests, so this
workload makes them:

- rate: `num_days` days from `day`, the rate at time t interpolated linearly between the windows' midpoints (held
  flat before the first and after the last), the time axis compressed `compress` times (48: a day in 30 min, each
  window 12.5 s) and the rates scaled so the curve's peak is `peak_rate_per_s` (None: the recorded rates, hundreds
  of requests per second for the language models). Compression shortens the curve; it does not raise the rates.
- arrivals: a Poisson process at the peak rate, thinned (Lewis and Shedler): a candidate at t is kept with
  probability rate(t) / peak. The windows' inter-arrival CV (burstiness within a window) is not reproduced.
- lengths: (prompt, output) pairs drawn uniformly from an Azure trace's rows, or from configured uniform ranges.
  Every prompt is its own tokens, as in the Azure workload: no shared prefixes, so this is a load shape only.

One `random.Random(seed)` drives it all, in a fixed order per candidate (inter-arrival gap, thinning draw, then
the lengths of a kept one), so a workload is identical on every call of `requests()`.
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from router.policy.hashing import namespace_seed
from simulations.traces import TraceRow, read_azure
from simulations.workload import ChainState, Request, SegmentTokens, tokens_of

SECONDS_PER_DAY = 86400.0


class _Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class AzureLengths(_Config):
    """Prompt and output lengths of an Azure LLM inference CSV's rows, drawn uniformly with replacement."""

    kind: Literal["azure"] = "azure"
    path: Path


class UniformLengths(_Config):
    """Prompt and output lengths drawn uniformly from inclusive ranges."""

    kind: Literal["uniform"] = "uniform"
    prompt_tokens: tuple[int, int] = (100, 2000)
    output_tokens: tuple[int, int] = (20, 400)
    """At least 1 is generated whatever the range says."""


LengthsConfig = Annotated[AzureLengths | UniformLengths, Field(discriminator="kind")]


class ServeGenTraceConfig(_Config):
    """A ServeGen aggregate-rate curve: Poisson arrivals at its rate, lengths from `lengths`."""

    kind: Literal["servegen"] = "servegen"
    path: Path
    model: str = "m-large"
    """The `model` column to follow: m-large, m-mid, m-small (14 days), mm-image, deepseek-r1 (1 day)."""
    day: int = Field(default=0, ge=0)
    """First day to replay, counted from the file's first window."""
    num_days: int = Field(default=1, ge=1)
    compress: float = Field(default=1.0, gt=0.0)
    """Time compression of the curve: each 600 s window lasts 600 / compress seconds; rates are unchanged (scale
    them with `peak_rate_per_s`). `shoal simulate --speed` sets it for this kind."""
    peak_rate_per_s: float | None = Field(default=None, gt=0.0)
    """Requests per second at the curve's peak, all rates scaled alike; None keeps the recorded rates."""
    lengths: LengthsConfig = Field(default_factory=UniformLengths)
    limit: int | None = Field(default=None, ge=1)
    """Replay only the first `limit` requests."""

    @model_validator(mode="after")
    def _lengths_are_ranges(self) -> ServeGenTraceConfig:
        if isinstance(self.lengths, UniformLengths):
            for low, high in (self.lengths.prompt_tokens, self.lengths.output_tokens):
                if not 0 <= low <= high:
                    raise ValueError(f"a length range must be 0 <= min <= max, got ({low}, {high})")
        return self


def read_servegen(path: str | Path, *, model: str, day: int = 0, num_days: int = 1) -> tuple[list[float], float]:
    """`num_days` days from `day` of one model's aggregate rate (req/s per window), and the window in seconds."""
    with Path(path).open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["model"] == model]
    if len(rows) < 2:
        raise ValueError(f"{path}: no rate curve for model {model!r}")
    rows.sort(key=lambda r: float(r["window_start_s"]))
    window_s = float(rows[1]["window_start_s"]) - float(rows[0]["window_start_s"])
    per_day = round(SECONDS_PER_DAY / window_s)
    start, stop = day * per_day, (day + num_days) * per_day
    if stop > len(rows):
        raise ValueError(
            f"{path}: model {model!r} has {len(rows) // per_day} day(s), asked for days {day}..{stop // per_day - 1}"
        )
    return [float(r["total_rate_req_per_s"]) for r in rows[start:stop]], window_s


class ServeGenWorkload:
    """Poisson arrivals following a rate curve (one rate per window), lengths from a trace's rows or ranges."""

    def __init__(
        self,
        rates_per_s: list[float],
        window_s: float,
        lengths: list[TraceRow] | UniformLengths,
        *,
        compress: float = 1.0,
        peak_rate_per_s: float | None = None,
        seed: int = 0,
        block_size: int = 16,
        model: str = "servegen",
        limit: int | None = None,
    ) -> None:
        if not rates_per_s or max(rates_per_s) <= 0:
            raise ValueError("the rate curve needs at least one positive rate")
        if isinstance(lengths, list) and not lengths:
            raise ValueError("no rows to draw lengths from")
        self.name = "servegen"
        self.block_size = block_size
        self.seed_bytes = namespace_seed(model)
        peak = max(rates_per_s)
        if peak_rate_per_s is None:
            peak_rate_per_s = peak
        self.rates_per_s = [r * peak_rate_per_s / peak for r in rates_per_s]
        """Rate of each window after scaling, requests per second."""
        self.window_s = window_s / compress
        """Seconds one window lasts after compression."""
        self.duration_s = self.window_s * len(rates_per_s)
        self.peak_rate_per_s = peak_rate_per_s
        """Rate of the Poisson process that thinning keeps from; no window's rate is above it."""
        self.lengths = lengths
        self.seed = seed
        self.limit = limit

    @classmethod
    def from_config(cls, config: ServeGenTraceConfig, *, seed: int, block_size: int) -> ServeGenWorkload:
        rates, window_s = read_servegen(config.path, model=config.model, day=config.day, num_days=config.num_days)
        lengths = read_azure(config.lengths.path) if isinstance(config.lengths, AzureLengths) else config.lengths
        workload = cls(
            rates,
            window_s,
            lengths,
            compress=config.compress,
            peak_rate_per_s=config.peak_rate_per_s,
            seed=seed,
            block_size=block_size,
            limit=config.limit,
        )
        workload.name = f"servegen:{config.model}:day{config.day}"
        return workload

    def rate_at(self, t_s: float) -> float:
        """Requests per second at `t_s`: linear between window midpoints, flat beyond the first and last."""
        position = t_s / self.window_s - 0.5
        low = min(max(0, math.floor(position)), len(self.rates_per_s) - 1)
        high = min(low + 1, len(self.rates_per_s) - 1)
        frac = min(max(position - low, 0.0), 1.0)
        return self.rates_per_s[low] + (self.rates_per_s[high] - self.rates_per_s[low]) * frac

    def expected_requests(self, start_s: float = 0.0, stop_s: float | None = None, *, steps: int = 64) -> float:
        """The integral of the rate over [start_s, stop_s) (midpoint rule, `steps` per window it spans)."""
        stop = self.duration_s if stop_s is None else stop_s
        n = max(1, math.ceil((stop - start_s) / self.window_s * steps))
        dt = (stop - start_s) / n
        return sum(self.rate_at(start_s + (k + 0.5) * dt) for k in range(n)) * dt

    def requests(self) -> Iterator[Request]:
        rng = random.Random(self.seed)
        peak = self.peak_rate_per_s
        rows = self.lengths if isinstance(self.lengths, list) else None
        ranges = self.lengths if isinstance(self.lengths, UniformLengths) else None
        now, i = 0.0, 0
        while self.limit is None or i < self.limit:
            now += rng.expovariate(peak)
            if now >= self.duration_s:
                return
            if rng.random() * peak > self.rate_at(now):
                continue
            if rows is not None:
                row = rows[rng.randrange(len(rows))]
                prompt_tokens, output_tokens = row.input_tokens, row.output_tokens
            else:
                assert ranges is not None
                prompt_tokens = rng.randint(*ranges.prompt_tokens)
                output_tokens = rng.randint(*ranges.output_tokens)
            segments = ((i, prompt_tokens),)  # segment id = request id: no two prompts share a token run
            chain = ChainState(self.seed_bytes, self.block_size)
            chain.extend(tokens_of(segments, 0, prompt_tokens))
            yield Request(
                id=i,
                arrival_s=now,
                prompt_tokens=prompt_tokens,
                output_tokens=max(1, output_tokens),
                hashes=chain.hashes,
                tokens=SegmentTokens(segments, self.block_size),
            )
            i += 1
