"""Facts of the full public traces, for sanity checks that a test slice cannot give (tests/data holds slices).

Reads the traces directory that `shoal simulate fetch-traces` fills and prints one table: requests, duration,
mean rate, prompt and output lengths and, for Mooncake, the prefix-hit ceiling of an unbounded cache shared by
all requests (the simulator's scenario 03 must reach it) and the share of requests with no hit at all; for Azure,
the busiest minute against the mean.

    .venv/bin/python -m benchmarks.trace_facts --traces-dir DIR      # or SHOAL_TRACES_DIR=DIR
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import time
from collections import Counter
from pathlib import Path

from benchmarks import command_argv
from simulations.traces import MOONCAKE_BLOCK_TOKENS, TraceRow, prefix_hit_ceiling, read_azure, read_mooncake

FILES = {
    "mooncake synthetic": "mooncake/synthetic_trace.jsonl",
    "azure code": "azure-llm-2023/AzureLLMInferenceTrace_code.csv",
    "azure conv": "azure-llm-2023/AzureLLMInferenceTrace_conv.csv",
}


def no_hit_share(rows: list[TraceRow]) -> float:
    """Requests whose first trace block no earlier request had."""
    seen: set[int] = set()
    misses = 0
    for row in rows:
        misses += not row.hash_ids or row.hash_ids[0] not in seen
        seen.update(row.hash_ids)
    return misses / len(rows)


def peak_minute_ratio(rows: list[TraceRow]) -> float:
    per_minute = Counter(int(row.timestamp_s // 60) for row in rows)
    minutes = max(per_minute) + 1
    return max(per_minute.values()) / (len(rows) / minutes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces-dir", type=Path, default=os.environ.get("SHOAL_TRACES_DIR"))
    args = parser.parse_args()
    if args.traces_dir is None:
        parser.error("give --traces-dir DIR or set SHOAL_TRACES_DIR (`shoal simulate fetch-traces` fills it)")
    print(f"$ {shlex.join(['python', *command_argv()])}")
    print(f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} CPUs")
    print()
    print("| trace | requests | span s | req/s | prompt mean | p50 | p99 | output mean | ceiling | no hit | peak min |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, relative in FILES.items():
        path = args.traces_dir / relative
        is_mooncake = path.suffix == ".jsonl"
        rows = read_mooncake(path) if is_mooncake else read_azure(path)
        duration_s = rows[-1].timestamp_s - rows[0].timestamp_s
        prompts = sorted(row.input_tokens for row in rows)
        quantiles = statistics.quantiles(prompts, n=100)
        cache = f"{prefix_hit_ceiling(rows):.3f}" if is_mooncake else "-"
        no_hit = f"{no_hit_share(rows):.2f}" if is_mooncake else "-"
        peak = "-" if is_mooncake else f"{peak_minute_ratio(rows):.1f}x"
        print(
            f"| {name} | {len(rows)} | {duration_s:.0f} | {len(rows) / duration_s:.2f} | "
            f"{statistics.fmean(prompts):.0f} | {quantiles[49]:.0f} | {quantiles[98]:.0f} | "
            f"{statistics.fmean(row.output_tokens for row in rows):.0f} | {cache} | {no_hit} | {peak} |"
        )
    print()
    print(f"ceiling: prompt tokens an unbounded shared cache hits, in {MOONCAKE_BLOCK_TOKENS}-token trace blocks")


if __name__ == "__main__":
    main()
