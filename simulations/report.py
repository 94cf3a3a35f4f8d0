"""A run's outputs: the comparison table (stdout) and `results.json`.

The table has one row per policy; `results.json` holds the scenario as run, each policy's summary (see
`metrics` for the definitions), its time series and a 201-point TTFT CDF, so plots can be redrawn and runs
compared without rerunning.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from simulations.metrics import percentile
from simulations.scenario import Scenario
from simulations.simulation import RunResult

_COLUMNS: tuple[tuple[str, str, str], ...] = (
    # (header, summary key, format)
    ("TTFT p50", "ttft_p50_s", "{:.2f}"),
    ("p90", "ttft_p90_s", "{:.2f}"),
    ("p99", "ttft_p99_s", "{:.2f}"),
    ("mean", "ttft_mean_s", "{:.2f}"),
    ("E2E p50", "e2e_p50_s", "{:.2f}"),
    ("p99", "e2e_p99_s", "{:.2f}"),
    ("hit", "hit_ratio", "{:.3f}"),
    ("pred hit", "predicted_hit_ratio", "{:.3f}"),
    ("SLO", "slo_attainment", "{:.3f}"),
    ("replica-s", "replica_seconds", "{:.0f}"),
    ("preempt", "preemptions", "{:d}"),
    ("rejected", "rejected", "{:d}"),
)


def _cell(value: Any, fmt: str) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return fmt.format(value)


def floor_summary(ttfts: Iterable[float], hit_ratio: float) -> dict[str, float]:
    """The floor's figures (see `floor`), under the table's keys."""
    ordered = sorted(ttfts)
    return {
        "ttft_p50_s": percentile(ordered, 0.50),
        "ttft_p90_s": percentile(ordered, 0.90),
        "ttft_p99_s": percentile(ordered, 0.99),
        "ttft_mean_s": sum(ordered) / len(ordered) if ordered else math.nan,
        "hit_ratio": hit_ratio,
    }


def format_table(results: Sequence[RunResult], floor: dict[str, float] | None = None) -> str:
    """A Markdown table of the policies' summaries (latencies in seconds), then their decision branches; the
    `floor` (each request alone with the hit ceiling) as a last row when given."""
    headers = ["policy", *(h for h, _, _ in _COLUMNS), "branches"]
    rows = []
    for result in results:
        s = result.summary
        branches = ", ".join(f"{k} {v}" for k, v in s["branches"].items())
        rows.append([result.label, *(_cell(s[key], fmt) for _, key, fmt in _COLUMNS), branches])
    if floor is not None:
        cells = [_cell(floor[key], fmt) if key in floor else "" for _, key, fmt in _COLUMNS]
        rows.append(["floor: alone, ceiling hits", *cells, ""])
    return markdown_table(headers, rows)


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A Markdown table padded to its columns: the first and last column left-aligned, the others right-aligned."""
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows, strict=True)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    for row in rows:
        cells = [
            c.ljust(w) if i in (0, len(row) - 1) else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_speculation(results: Sequence[RunResult]) -> str:
    """One line per run whose fleet speculates: how many decode steps did, why the others did not, and the tokens
    a decoding sequence emitted per speculative step. Empty when none does."""
    lines = []
    for result in results:
        spec = result.summary.get("speculation")
        if spec is None:
            continue
        plain = spec["plain_decode_steps"]
        total = spec["spec_steps"] + sum(plain.values())
        why = ", ".join(f"{reason} {n:,}" for reason, n in plain.items())
        share = spec["spec_steps"] / total if total else 0.0
        lines.append(
            f"speculation, {result.label}: {spec['spec_steps']:,} of {total:,} decode steps ({share:.1%})"
            f"{f'; plain: {why}' if why else ''}; {spec['spec_tokens_per_step']:.2f} tokens per sequence per "
            "speculative step"
        )
    return "\n".join(lines)


def results_document(
    scenario: Scenario, results: Sequence[RunResult], *, command: str, floor: dict[str, float] | None
) -> dict[str, Any]:
    """What `results.json` holds."""
    return {
        "command": command,
        "scenario": scenario.model_dump(mode="json"),
        "floor": floor,
        "policies": {
            r.label: {
                "summary": r.summary,
                "ttft_cdf_s": r.recorder.ttft_quantiles(),
                "series": [
                    {
                        "time_s": x.time_s,
                        "engine_waiting": x.engine_waiting,
                        "engine_running": x.engine_running,
                        "in_flight": x.in_flight,
                        "num_replicas": x.num_replicas,
                        "window_hit_ratio": x.window_hit_ratio,
                        "mean_kv_usage": x.mean_kv_usage,
                    }
                    for x in r.recorder.samples
                ],
            }
            for r in results
        },
    }


def write_results(path: Path, document: dict[str, Any]) -> None:
    path.write_text(json.dumps(document, indent=1, allow_nan=True) + "\n")
