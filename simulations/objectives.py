"""A fleet's service-level objective for `shoal simulate plan`: bounds on the figures of a run's summary.

`--slo KEY=VALUE`, repeatable; a run meets the objective when it meets every bound (`FleetObjective.misses` says
which it does not, with the figure and the bound, so a table can show why a fleet falls short).

- `ttft_p50`, `ttft_p90`, `ttft_p99`, `ttft_mean`, `e2e_p50`, `e2e_p90`, `e2e_p99`, `tpot_p50`, `tpot_p99`: that
  figure of `metrics.Recorder.summary` at most VALUE, a duration with its unit (`2s`, `500ms`).
- `attainment`: the share of requests that meet the per-request SLO at least VALUE (`0.99` or `99%`); rejected
  requests count as missed (`metrics`).
- `ttft`, `tpot`: the per-request SLO that `attainment` counts, durations (the scenario's `slo.ttft_s` and
  `slo.tpot_s`; 10 s and 100 ms by default). They bound nothing themselves.

A duration needs its unit: a bare `2` could be seconds or milliseconds, and a plan sized on the wrong one is
silently wrong by a factor of a thousand.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

LATENCY_KEYS = (
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "ttft_mean",
    "e2e_p50",
    "e2e_p90",
    "e2e_p99",
    "tpot_p50",
    "tpot_p99",
)
"""Bounds from above on a latency of the summary (its `<key>_s`)."""
REQUEST_KEYS = {"ttft": "ttft_s", "tpot": "tpot_s"}
"""The per-request SLO (`metrics.SLOConfig` fields) that `attainment` counts."""
KEYS = (*LATENCY_KEYS, "attainment", *REQUEST_KEYS)

_DURATION = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)(ms|s)$")


@dataclass(frozen=True, slots=True)
class Bound:
    """One figure of a run's summary and its limit: a latency at most `limit` seconds, or attainment at least
    `limit` (a fraction)."""

    key: str
    limit: float

    @property
    def is_attainment(self) -> bool:
        return self.key == "attainment"

    def value(self, summary: dict[str, Any]) -> float:
        return float(summary["slo_attainment" if self.is_attainment else f"{self.key}_s"])

    def miss(self, summary: dict[str, Any]) -> str | None:
        """Why `summary` falls short of this bound (`ttft_p99 3.21 s > 2 s`), or None when it meets it. A figure
        with no value (nan: no request finished) misses."""
        value = self.value(summary)
        if self.is_attainment:
            if value >= self.limit:
                return None
            return f"attainment {value:.3f} < {self.limit:g}"
        if value <= self.limit:
            return None
        return f"{self.key} {_seconds(value)} > {_seconds(self.limit)}"

    def describe(self) -> str:
        if self.is_attainment:
            return f"attainment >= {self.limit:g}"
        return f"{self.key} <= {_seconds(self.limit)}"


@dataclass(frozen=True, slots=True)
class FleetObjective:
    """What a fleet must achieve: every bound, with attainment counted against `request_slo`."""

    bounds: tuple[Bound, ...]
    request_slo: dict[str, float]
    """Fields of the scenario's `slo` (`metrics.SLOConfig`) that `ttft` and `tpot` set; empty: the scenario's."""

    def misses(self, summary: dict[str, Any]) -> list[str]:
        """The bounds `summary` misses, each saying by how much; empty when it meets the objective."""
        return [why for bound in self.bounds if (why := bound.miss(summary)) is not None]

    def describe(self) -> str:
        words = [bound.describe() for bound in self.bounds]
        counted = [
            f"{key} <= {_seconds(self.request_slo[f])}" for key, f in REQUEST_KEYS.items() if f in self.request_slo
        ]
        if counted and any(bound.is_attainment for bound in self.bounds):
            words.append(f"a request attains with {' and '.join(counted)}")
        return ", ".join(words)


def parse_objective(items: list[str]) -> FleetObjective:
    """The objective of `--slo KEY=VALUE` items; a ValueError that says what is wrong with the first bad one."""
    bounds: dict[str, Bound] = {}
    request_slo: dict[str, float] = {}
    for item in items:
        key, sep, text = (part.strip() for part in item.partition("="))
        if not sep or not key or not text:
            raise ValueError(f"--slo {item!r}: expected KEY=VALUE, e.g. ttft_p99=2s or attainment=0.99")
        if key not in KEYS:
            raise ValueError(f"--slo {item!r}: unknown key {key!r}; known: {', '.join(KEYS)}")
        if key in bounds or REQUEST_KEYS.get(key) in request_slo:
            raise ValueError(f"--slo {item!r}: {key} is given twice")
        if key == "attainment":
            bounds[key] = Bound(key, _fraction(item, text))
        elif key in REQUEST_KEYS:
            request_slo[REQUEST_KEYS[key]] = _duration_s(item, text)
        else:
            bounds[key] = Bound(key, _duration_s(item, text))
    if not bounds:
        raise ValueError(
            "--slo: give at least one bound (ttft_p99=2s, attainment=0.99, ...); ttft and tpot only say what "
            "attainment counts"
        )
    return FleetObjective(tuple(bounds.values()), request_slo)


def _duration_s(item: str, text: str) -> float:
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"--slo {item!r}: {text!r} is not a duration with its unit, e.g. 2s or 500ms")
    value = float(match.group(1)) / (1000.0 if match.group(2) == "ms" else 1.0)
    if value <= 0:
        raise ValueError(f"--slo {item!r}: a duration must be above 0")
    return value


def _fraction(item: str, text: str) -> float:
    is_percent = text.endswith("%")
    try:
        value = float(text.removesuffix("%")) / (100.0 if is_percent else 1.0)
    except ValueError:
        raise ValueError(f"--slo {item!r}: {text!r} is not a share of requests, e.g. 0.99 or 99%") from None
    if not (0.0 < value <= 1.0) or math.isnan(value):
        raise ValueError(f"--slo {item!r}: attainment is a share of requests in (0, 1] (or a percent), got {text}")
    return value


def _seconds(value: float) -> str:
    if math.isnan(value):
        return "none"
    return f"{value * 1000:.3g} ms" if value < 1.0 else f"{value:.3g} s"
