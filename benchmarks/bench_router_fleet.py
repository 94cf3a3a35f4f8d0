"""Several routers in front of one fleet, with and without sharing their views (`simulations.routers`).

Runs scenario 01 (the Mooncake synthetic trace at 2x on 16 replicas) and scenario 10 (agent tool loops on 8
replicas) with 1, 2, 4 and 8 routers, each count without sharing and with it (one router has nothing to share),
under one policy; requests reach the routers as `--spread` says. Prints one table, then, per workload, the hit
ratio of 4 sharing routers against one router's. One core, some 6 CPU-minutes for both workloads in full:

    export SHOAL_TRACES_DIR=DIR   # where `shoal simulate fetch-traces` put the traces
    taskset -c 0 .venv/bin/python -m benchmarks.bench_router_fleet
    taskset -c 0 .venv/bin/python -m benchmarks.bench_router_fleet --workloads agentic --spread session
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from simulations.scenario import Scenario, build_workload, load_scenario, policy_entry
from simulations.simulation import Simulation

SCENARIOS = {
    "mooncake": Path(__file__).parent.parent / "simulations/scenarios/01_mooncake_moderate.yaml",
    "agentic": Path(__file__).parent.parent / "simulations/scenarios/10_agentic_tool_loops.yaml",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--traces-dir", type=Path, default=os.environ.get("SHOAL_TRACES_DIR"), help="default: $SHOAL_TRACES_DIR"
    )
    parser.add_argument("--workloads", default="mooncake,agentic", help="comma-separated: mooncake, agentic")
    parser.add_argument("--counts", default="1,2,4,8", help="router counts, comma-separated")
    parser.add_argument("--policy", default="estimated_ttft")
    parser.add_argument("--spread", default="random", choices=("random", "round_robin", "session"))
    parser.add_argument("--limit", type=int, help="replay only the Mooncake trace's first N requests")
    parser.add_argument("--lag", type=float, help="seconds from a decision to the peers applying it (`lag_s`)")
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]

    header = f"| {'workload':<8} | routers | sharing | {'hit':>5} | TTFT p50 | TTFT p99 | {'SLO':>5} | {'CPU s':>5} |"
    rows = [header, "|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|"]
    verdicts = []
    for name in args.workloads.split(","):
        base = load_scenario(SCENARIOS[name])
        data = base.model_dump()
        if args.limit is not None and data["trace"]["kind"] == "mooncake":
            data["trace"]["limit"] = args.limit
        data["policies"] = [policy_entry(args.policy).model_dump()]
        base = Scenario.model_validate(data)
        workload = build_workload(base, traces_dir=args.traces_dir)
        hits: dict[tuple[int, bool], float] = {}
        for count in counts:
            for sharing in (False, True) if count > 1 else (False,):
                routers = {"count": count, "sharing": sharing, "spread": args.spread, "lag_s": args.lag}
                scenario = base.model_copy(update={"routers": base.routers.model_validate(routers)})
                started = time.process_time()
                summary = Simulation(scenario, scenario.policies[0], workload).run().summary
                cpu_s = time.process_time() - started
                hits[count, sharing] = summary["hit_ratio"]
                rows.append(
                    f"| {name:<8} | {count:>7} | {('on' if sharing else 'off') if count > 1 else '-':>7} "
                    f"| {summary['hit_ratio']:.3f} | {summary['ttft_p50_s']:8.2f} | {summary['ttft_p99_s']:8.2f} "
                    f"| {summary['slo_attainment']:.3f} | {cpu_s:5.0f} |"
                )
                print(rows[-1], flush=True)
        if (1, False) in hits and (4, True) in hits:
            one, shared = hits[1, False], hits[4, True]
            off = hits.get((4, False))
            verdicts.append(
                f"{name}: 4 routers sharing {shared:.3f} against one router's {one:.3f} "
                f"({(shared - one) / one:+.1%}: goal of 2% {'met' if abs(shared - one) <= 0.02 * one else 'missed'})"
                + (f"; without sharing {off:.3f} ({(off - one) / one:+.1%})" if off is not None else "")
            )
    print()
    lag = f"{args.lag} s" if args.lag is not None else "flush interval + round trip"
    print(f"policy {args.policy}, requests spread over routers: {args.spread}, decisions shared after {lag}")
    print("\n".join(rows))
    print()
    print("\n".join(verdicts))


if __name__ == "__main__":
    main()
