"""Autoscaling policies in the simulator: replica-seconds and TTFT SLO attainment, Shoal against HPA, KEDA, static.

Two workloads with 120 s cold starts (scenarios 08 and 09): (a) the Azure code trace, bursty; (b) one day of a
ServeGen diurnal rate curve compressed into 30 minutes (the ServeGen workload is built here: no trace kind reads
the rate file yet). For each, the static peak fleet is found first: the fewest static replicas whose run meets
`--attainment` (99%) TTFT SLO attainment, by bisection over 1..max_replicas. Then shoal, hpa and keda run with
the scenario's shared bounds and per-replica target. The issue's goal per workload: shoal at >= 99% attainment
with <= 70% of static peak's replica-seconds, and fewer replica-seconds than hpa at equal attainment.

    .venv/bin/python benchmarks/bench_autoscale.py                      # both workloads, ~3 min of one core
    .venv/bin/python benchmarks/bench_autoscale.py --workload azure --static-replicas 11   # skip the search
    .venv/bin/python benchmarks/bench_autoscale.py --workload azure --static-replicas 11 \
        --shoal-variant '{"min_replicas": 6, "shoal": {"scale_down": {"stabilization_window_s": 900}}}'

Attainment is TTFT-only: requests with TTFT <= the scenario's `slo.ttft_s`, over all requests (rejected ones
count as missed). Replica-seconds count each replica from creation (start-up included) to removal or the run's end.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router.policy.hashing import namespace_seed
from simulations.scaling import AutoscaleConfig, PolicyFleet
from simulations.scenario import Scenario, build_workload, load_scenario
from simulations.simulation import Simulation
from simulations.traces import TraceRow, read_azure
from simulations.workload import ChainState, Request, SegmentTokens, Workload, tokens_of

SCENARIOS = Path(__file__).resolve().parent.parent / "simulations" / "scenarios"
SERVEGEN = "/work/shared/traces/servegen/servegen_aggregate_rate.csv"
AZURE_CONV = "/work/shared/traces/azure-llm-2023/AzureLLMInferenceTrace_conv.csv"


class ServeGenWorkload:
    """Poisson arrivals following a ServeGen aggregate rate curve, lengths drawn from a trace's rows.

    The rate at time t is interpolated linearly between the midpoints of the 600 s windows, compressed `compress`
    times and scaled so its peak is `peak_rate_per_s`; arrivals are drawn by thinning a Poisson process at the
    peak rate. Prompts are their own tokens (no shared prefixes), as in the Azure workload."""

    def __init__(
        self,
        rates_per_s: list[float],
        window_s: float,
        lengths: list[TraceRow],
        *,
        compress: float,
        peak_rate_per_s: float,
        seed: int,
        block_size: int,
    ) -> None:
        self.name = "servegen"
        self.block_size = block_size
        self.seed_bytes = namespace_seed("servegen")
        peak = max(rates_per_s)
        self.rates_per_s = [r * peak_rate_per_s / peak for r in rates_per_s]
        self.window_s = window_s / compress
        self.duration_s = self.window_s * len(rates_per_s)
        self.peak_rate_per_s = peak_rate_per_s
        self.lengths = lengths
        self.seed = seed

    def rate_at(self, t_s: float) -> float:
        position = t_s / self.window_s - 0.5
        low = min(max(0, math.floor(position)), len(self.rates_per_s) - 1)
        high = min(low + 1, len(self.rates_per_s) - 1)
        frac = min(max(position - low, 0.0), 1.0)
        return self.rates_per_s[low] + (self.rates_per_s[high] - self.rates_per_s[low]) * frac

    def requests(self) -> Iterator[Request]:
        rng = random.Random(self.seed)
        now, i = 0.0, 0
        while True:
            now += rng.expovariate(self.peak_rate_per_s)
            if now >= self.duration_s:
                return
            if rng.random() * self.peak_rate_per_s > self.rate_at(now):
                continue
            row = self.lengths[rng.randrange(len(self.lengths))]
            segments = ((i, row.input_tokens),)
            chain = ChainState(self.seed_bytes, self.block_size)
            chain.extend(tokens_of(segments, 0, row.input_tokens))
            yield Request(
                id=i,
                arrival_s=now,
                prompt_tokens=row.input_tokens,
                output_tokens=max(1, row.output_tokens),
                hashes=chain.hashes,
                tokens=SegmentTokens(segments, self.block_size),
            )
            i += 1


def read_servegen(path: str, *, model: str, day: int) -> tuple[list[float], float]:
    """One day (144 windows) of a model's aggregate rate, and the window length in seconds."""
    with Path(path).open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["model"] == model]
    rows.sort(key=lambda r: float(r["window_start_s"]))
    window_s = float(rows[1]["window_start_s"]) - float(rows[0]["window_start_s"])
    per_day = round(86400 / window_s)
    return [float(r["total_rate_req_per_s"]) for r in rows[day * per_day : (day + 1) * per_day]], window_s


@dataclass(slots=True)
class Row:
    policy: str
    replica_seconds: float
    attainment: float
    ttft_p50_s: float
    ttft_p99_s: float
    max_replicas: int
    mean_replicas: float
    cpu_s: float
    reasons: dict[str, int]


def run(scenario: Scenario, workload: Workload, policy: str, **overrides: Any) -> Row:
    assert scenario.autoscale is not None
    autoscale = scenario.autoscale.model_copy(update={"policy": policy, **overrides})
    scn = scenario.model_copy(update={"autoscale": AutoscaleConfig.model_validate(autoscale.model_dump())})
    started = time.process_time()
    simulation = Simulation(scn, scn.policies[0], workload)
    result = simulation.run()
    summary = result.summary
    ttft = result.recorder.ttft_s
    total = len(ttft) + summary["rejected"]
    attained = sum(1 for t in ttft if t <= scn.slo.ttft_s)
    reasons = dict(simulation.scaling.reasons) if isinstance(simulation.scaling, PolicyFleet) else {}
    return Row(
        policy=policy,
        replica_seconds=summary["replica_seconds"],
        attainment=attained / total if total else math.nan,
        ttft_p50_s=summary["ttft_p50_s"],
        ttft_p99_s=summary["ttft_p99_s"],
        max_replicas=max(s.num_replicas for s in result.recorder.samples),
        mean_replicas=summary["replica_seconds"] / summary["duration_s"] if summary["duration_s"] else 0.0,
        cpu_s=time.process_time() - started,
        reasons=reasons,
    )


def static_peak(scenario: Scenario, workload: Workload, goal: float) -> Row:
    """The fewest static replicas meeting `goal` attainment (bisection; attainment grows with the fleet)."""
    assert scenario.autoscale is not None
    low, high = 1, scenario.autoscale.max_replicas
    best = run(scenario, workload, "static", static_replicas=high)
    while low < high:
        mid = (low + high) // 2
        row = run(scenario, workload, "static", static_replicas=mid)
        if row.attainment >= goal:
            high, best = mid, row
        else:
            low = mid + 1
    return best


def table(title: str, rows: list[Row], static: Row, goal: float) -> None:
    print(f"\n{title}")
    print("| policy | replica-s | % of static peak | TTFT SLO attainment | TTFT p50 s | p99 s | max replicas | mean |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row.policy} | {row.replica_seconds:.0f} | {100 * row.replica_seconds / static.replica_seconds:.0f}% "
            f"| {100 * row.attainment:.2f}% | {row.ttft_p50_s:.2f} | {row.ttft_p99_s:.2f} | {row.max_replicas} "
            f"| {row.mean_replicas:.1f} |"
        )
    by_policy = {row.policy: row for row in rows}
    shoal, hpa = by_policy.get("shoal"), by_policy.get("hpa")
    if shoal is not None and hpa is not None:
        is_met = (
            shoal.attainment >= goal
            and shoal.replica_seconds <= 0.7 * static.replica_seconds
            and (shoal.replica_seconds < hpa.replica_seconds or shoal.attainment > hpa.attainment)
        )
        print(f"goal (>= {100 * goal:.0f}%, <= 70% of static peak, below hpa): {'met' if is_met else 'NOT met'}")
    for row in rows:
        print(f"  {row.policy}: {row.cpu_s:.1f} s CPU; reasons {row.reasons}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=["azure", "servegen", "both"], default="both")
    parser.add_argument("--attainment", type=float, default=0.99, help="the goal's SLO attainment")
    parser.add_argument("--static-replicas", type=int, help="static peak fleet; default: searched")
    parser.add_argument(
        "--shoal-variant", type=json.loads, help="JSON overrides of the `autoscale` section: one more shoal row"
    )
    parser.add_argument("--servegen-model", default="m-large")
    parser.add_argument("--servegen-day", type=int, default=0)
    parser.add_argument("--servegen-compress", type=float, default=48.0)
    parser.add_argument("--servegen-peak-rate", type=float, default=40.0, help="req/s at the curve's peak")
    args = parser.parse_args()

    experiments: list[tuple[str, Scenario, Workload]] = []
    if args.workload in ("azure", "both"):
        scenario = load_scenario(SCENARIOS / "08_autoscale_azure_code.yaml")
        experiments.append(("(a) Azure code trace, bursty, 1 h", scenario, build_workload(scenario)))
    if args.workload in ("servegen", "both"):
        scenario = load_scenario(SCENARIOS / "09_autoscale_servegen_diurnal.yaml")
        rates, window_s = read_servegen(SERVEGEN, model=args.servegen_model, day=args.servegen_day)
        workload = ServeGenWorkload(
            rates,
            window_s,
            read_azure(AZURE_CONV),
            compress=args.servegen_compress,
            peak_rate_per_s=args.servegen_peak_rate,
            seed=scenario.seed,
            block_size=scenario.fleet.resolve()[0].block_size,
        )
        title = (
            f"(b) ServeGen {args.servegen_model} day {args.servegen_day}, {args.servegen_compress:g}x compressed "
            f"({workload.duration_s / 60:.0f} min), peak {args.servegen_peak_rate:g} req/s, "
            f"trough {min(workload.rates_per_s):.1f} req/s"
        )
        experiments.append((title, scenario, workload))

    for title, scenario, workload in experiments:
        assert scenario.autoscale is not None
        if args.static_replicas is not None:
            static = run(scenario, workload, "static", static_replicas=args.static_replicas)
        else:
            static = static_peak(scenario, workload, args.attainment)
        static.policy = f"static peak ({static.max_replicas})"
        rows = [run(scenario, workload, policy) for policy in ("shoal", "hpa", "keda")]
        if args.shoal_variant:
            variant = run(scenario, workload, "shoal", **args.shoal_variant)
            variant.policy = f"shoal {json.dumps(args.shoal_variant)}"
            rows.insert(1, variant)
        slo = f"TTFT <= {scenario.slo.ttft_s:g} s"
        a = scenario.autoscale
        table(
            f"{title}; {scenario.fleet.preset}, {a.startup_s:g} s cold starts, {slo}, "
            f"{a.target_requests_per_replica:g} requests per replica, {a.min_replicas}..{a.max_replicas} replicas",
            [*rows, static],
            static,
            args.attainment,
        )


if __name__ == "__main__":
    main()
