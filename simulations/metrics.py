"""What a run measured: per-request latencies and cache hits, fleet time series, and their summary.

Definitions (each figure in the table and results.json):
- TTFT: first token time - arrival (router and network overheads are not modelled). End-to-end: last token -
  arrival. TPOT: (end-to-end - TTFT) / (output tokens - 1), for outputs of 2 tokens or more.
- Hit ratio: token-weighted, sum of prompt tokens found in the engine's prefix cache at the request's first
  admission / sum of prompt tokens. The router's predicted hit (`predicted_cached_tokens` of its decisions) is
  reported beside it.
- SLO attainment: fraction of requests with TTFT <= `ttft_s` and TPOT <= `tpot_s`; a rejected request (longer
  than an engine's whole KV cache, or held at the router with no ready replica for `hold_max_wait_s`) counts as
  missed and appears in no latency figure.
- Replica-seconds: each replica from its creation (start-up included) to its removal or the end of the run.
- Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import math
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class SLOConfig(BaseModel):
    """Service-level objectives a request must meet to count as attained."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    ttft_s: float = Field(default=10.0, gt=0.0)
    """Time to first token, seconds. 10 s suits the Mooncake trace's long prompts (mean 15k tokens: ~2 s of prefill
    alone on the 70B preset); short-prompt chat would use ~1 s."""
    tpot_s: float = Field(default=0.1, gt=0.0)
    """Time per output token after the first, seconds (10 tokens/s: faster than reading)."""


def percentile(ordered: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of sorted values, linearly interpolated; nan for no values."""
    if not ordered:
        return math.nan
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(slots=True)
class FleetSample:
    """The fleet at one sampling instant, and what happened since the previous sample."""

    time_s: float
    engine_waiting: int
    """Requests queued in the engines (not yet admitted)."""
    engine_running: int
    in_flight: int
    num_replicas: int
    """Replicas existing (starting, ready or draining)."""
    window_hit_ratio: float | None
    """Hit ratio of the requests admitted since the previous sample (None when none was)."""
    mean_kv_usage: float


@dataclass(slots=True)
class Recorder:
    """Per-request figures (parallel lists, in finishing order) and fleet samples of one run."""

    # Typed arrays: 8 bytes a value, so a million requests take some 60 MB, not a list's 250.
    arrival_s: array[float] = field(default_factory=lambda: array("d"))
    ttft_s: array[float] = field(default_factory=lambda: array("d"))
    e2e_s: array[float] = field(default_factory=lambda: array("d"))
    prompt_tokens: array[int] = field(default_factory=lambda: array("q"))
    hit_tokens: array[int] = field(default_factory=lambda: array("q"))
    predicted_tokens: array[int] = field(default_factory=lambda: array("q"))
    output_tokens: array[int] = field(default_factory=lambda: array("q"))
    branches: Counter[str] = field(default_factory=Counter)
    samples: list[FleetSample] = field(default_factory=list)
    num_preemptions: int = 0
    num_rejected: int = 0
    """Requests never served: refused by an engine (longer than its whole KV cache) or held at the router past
    `hold_max_wait_s`. Not in the latency figures."""

    def finished(
        self,
        *,
        arrival_s: float,
        first_token_s: float,
        finish_s: float,
        prompt_tokens: int,
        hit_tokens: int,
        predicted_tokens: int,
        output_tokens: int,
    ) -> None:
        self.arrival_s.append(arrival_s)
        self.ttft_s.append(first_token_s - arrival_s)
        self.e2e_s.append(finish_s - arrival_s)
        self.prompt_tokens.append(prompt_tokens)
        self.hit_tokens.append(hit_tokens)
        self.predicted_tokens.append(predicted_tokens)
        self.output_tokens.append(output_tokens)

    def summary(self, slo: SLOConfig, *, replica_seconds: float, duration_s: float) -> dict[str, Any]:
        n = len(self.ttft_s)
        ttft = sorted(self.ttft_s)
        e2e = sorted(self.e2e_s)
        tpots = [
            (e - t) / (o - 1) for t, e, o in zip(self.ttft_s, self.e2e_s, self.output_tokens, strict=True) if o > 1
        ]
        attained = sum(
            1
            for t, e, o in zip(self.ttft_s, self.e2e_s, self.output_tokens, strict=True)
            if t <= slo.ttft_s and (o <= 1 or (e - t) / (o - 1) <= slo.tpot_s)
        )
        prompt = sum(self.prompt_tokens)
        tpots.sort()
        return {
            "requests": n,
            "ttft_mean_s": sum(ttft) / n if n else math.nan,
            "ttft_p50_s": percentile(ttft, 0.50),
            "ttft_p90_s": percentile(ttft, 0.90),
            "ttft_p99_s": percentile(ttft, 0.99),
            "e2e_p50_s": percentile(e2e, 0.50),
            "e2e_p90_s": percentile(e2e, 0.90),
            "e2e_p99_s": percentile(e2e, 0.99),
            "tpot_p50_s": percentile(tpots, 0.50),
            "tpot_p99_s": percentile(tpots, 0.99),
            "hit_ratio": sum(self.hit_tokens) / prompt if prompt else 0.0,
            "predicted_hit_ratio": sum(self.predicted_tokens) / prompt if prompt else 0.0,
            "slo_attainment": attained / (n + self.num_rejected) if n + self.num_rejected else math.nan,
            "replica_seconds": replica_seconds,
            "duration_s": duration_s,
            "preemptions": self.num_preemptions,
            "rejected": self.num_rejected,
            "branches": dict(sorted(self.branches.items())),
        }

    def ttft_quantiles(self, num_points: int = 201) -> list[float]:
        """TTFT at evenly spaced quantiles 0..1: a CDF small enough for results.json whatever the request count."""
        ordered = sorted(self.ttft_s)
        return [percentile(ordered, i / (num_points - 1)) for i in range(num_points)]
