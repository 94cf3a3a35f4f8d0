"""Simulator speed: the Mooncake synthetic trace (3,993 requests) on 16 replicas under five policies.

Reads and hashes the trace once (the workload is shared by every policy; its memo keeps the sub-block hashes of
the most recent trace blocks, so a run re-hashes what the memo no longer holds), then runs each policy and prints,
per policy, the CPU and wall seconds, the events run and the simulated requests per second of wall time; then the
totals and the process's peak RSS. Run it pinned to one core:

    export SHOAL_TRACES_DIR=DIR   # where `shoal simulate fetch-traces` put the traces
    taskset -c 0 .venv/bin/python -m benchmarks.bench_simulate
    taskset -c 0 .venv/bin/python -m benchmarks.bench_simulate --speed 4          # a more loaded fleet
    taskset -c 0 .venv/bin/python -m benchmarks.bench_simulate --replicas 64 --speed 8 --tile-to 20000
    taskset -c 0 .venv/bin/python -m benchmarks.bench_simulate --synthetic 100000  # scaling: shared-prefix requests

`--tile-to N` replays the trace tiled to N requests (`shoal simulate --tile-to`: copies back to back with fresh
block ids), a longer input of the same shape. With `--synthetic N` the workload is N requests of the
`shared_prefix` generator (about 3k-token prompts over 20 Zipf-popular system prompts) instead of the trace, at a
rate that keeps the 16 replicas moderately loaded.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path

from simulations.scenario import DEFAULT_POLICIES, FleetConfig, Scenario, build_workload, policy_entry, with_block_size
from simulations.simulation import Simulation
from simulations.synthetic import SharedPrefixConfig, SharedPrefixWorkload
from simulations.workload import Workload

MOONCAKE = "mooncake/synthetic_trace.jsonl"
"""Under the traces directory (`--traces-dir`, $SHOAL_TRACES_DIR; `shoal simulate fetch-traces` downloads it)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=MOONCAKE, help="trace file, relative to --traces-dir or absolute")
    parser.add_argument(
        "--traces-dir", type=Path, default=os.environ.get("SHOAL_TRACES_DIR"), help="default: $SHOAL_TRACES_DIR"
    )
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--speed", type=float, default=1.0)
    parser.add_argument("--tile-to", type=int, metavar="N", help="the trace tiled to N requests")
    parser.add_argument("--synthetic", type=int, metavar="N", help="N shared-prefix requests instead of the trace")
    parser.add_argument(
        "--block-size",
        type=int,
        metavar="TOKENS",
        help="KV block of the engines and the router (`shoal simulate --block-size`; default: the preset's, 16)",
    )
    args = parser.parse_args()

    started_cpu, started_wall = time.process_time(), time.perf_counter()
    workload: Workload
    if args.synthetic:
        config = SharedPrefixConfig(
            num_requests=args.synthetic, rate_per_s=20.0, num_system_prompts=20, system_prompt_tokens=(1000, 4000)
        )
        scenario = Scenario.model_validate({"trace": config.model_dump(), "fleet": fleet(args)})
        workload = SharedPrefixWorkload(config, block_size=scenario.fleet.resolve().engine.block_size)
        num_requests = args.synthetic
    else:
        trace: dict[str, object] = {"kind": "mooncake", "path": args.trace, "speed": args.speed}
        if args.tile_to is not None:
            trace.update(tiles=None, limit=args.tile_to)
        scenario = Scenario.model_validate({"trace": trace, "fleet": fleet(args)})
        workload = build_workload(scenario, traces_dir=args.traces_dir)
        num_requests = sum(1 for _ in workload.requests())  # reads and hashes every prompt once
    load_cpu, load_wall = time.process_time() - started_cpu, time.perf_counter() - started_wall
    print(
        f"workload: {workload.name}, {num_requests} requests; "
        f"load and hash: {load_cpu:.1f} s CPU, {load_wall:.1f} s wall"
    )
    engine = scenario.fleet.resolve().engine
    print(f"fleet: {args.replicas} x {scenario.fleet.preset}, {engine.block_size}-token blocks")
    print()
    header = f"{'policy':<20} {'CPU s':>7} {'wall s':>7} {'events':>9} {'req/s wall':>11} {'sim s/wall s':>13}"
    print(header)
    print("-" * len(header))
    total_cpu = total_wall = 0.0
    for name in args.policies.split(","):
        cpu0, wall0 = time.process_time(), time.perf_counter()
        result = Simulation(scenario, policy_entry(name), workload).run()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        total_cpu += cpu
        total_wall += wall
        duration = result.summary["duration_s"]
        print(
            f"{name:<20} {cpu:7.1f} {wall:7.1f} {result.num_events:9d} "
            f"{num_requests / wall:11.0f} {duration / wall:13.0f}"
        )
    print("-" * len(header))
    all_cpu, all_wall = total_cpu + load_cpu, total_wall + load_wall
    print(f"{'all policies':<20} {total_cpu:7.1f} {total_wall:7.1f}")
    print(f"{'with loading':<20} {all_cpu:7.1f} {all_wall:7.1f}")
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(f"peak RSS of this process: {peak_mib:.0f} MiB")


def fleet(args: argparse.Namespace) -> dict[str, object]:
    fleet: dict[str, object] = {"num_replicas": args.replicas}
    if args.block_size is not None:
        fleet["engine"] = with_block_size(FleetConfig().resolve().engine, args.block_size)
    return fleet


if __name__ == "__main__":
    main()
