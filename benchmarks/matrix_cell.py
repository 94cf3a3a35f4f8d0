"""One cell of a `shoal simulate --matrix` file, looked into: where each policy sent the requests and what the router
learnt, to say why a policy misses the cell's best.

    SHOAL_TRACES_DIR=DIR .venv/bin/python -m benchmarks.matrix_cell simulations/matrices/engines_x_traces.yaml \
        preset hot_prefix_burst --policies estimated_ttft,dynamo_kv [--seed 1] [--set KEY=VALUE ...]

Per policy: TTFT mean and p99, requests per replica, the most sequences running and waiting and the highest KV
cache usage on each replica as seen at arrivals, its preemptions, what the router learnt of each replica by the end
(prefill rate, slot time, batch slots, fixed time; `service_time`), and (estimated_ttft) its mean predicted TTFT
beside the measured one.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter, defaultdict
from pathlib import Path

import yaml

from router.policy.types import Decision
from simulations.matrix import cell_workload, load_matrix
from simulations.scenario import PolicyEntry, Scenario
from simulations.simulation import Simulation
from simulations.workload import Request, Workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("matrix")
    parser.add_argument("engine")
    parser.add_argument("trace")
    parser.add_argument("--policies", help="comma-separated labels (default: all of the matrix's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    overrides = {key: yaml.safe_load(value) for key, _, value in (s.partition("=") for s in args.set)}
    matrix = load_matrix(args.matrix, overrides)
    engine = next(e for e in matrix.engines if e.label == args.engine)
    trace = next(t for t in matrix.traces if t.label == args.trace)
    traces_dir = os.environ.get("SHOAL_TRACES_DIR")
    scenario = matrix.scenario(engine, trace, args.seed)
    workload = cell_workload(matrix, engine, trace, scenario, Path(traces_dir) if traces_dir else None)
    wanted = args.policies.split(",") if args.policies else [p.label for p in matrix.policies]
    for entry in (p for p in scenario.policies if p.label in wanted):
        look(scenario, entry, workload)


def look(scenario: Scenario, entry: PolicyEntry, workload: Workload) -> None:
    """Run one policy on the cell and print what it did."""
    counts: Counter[str] = Counter()
    peaks: dict[str, tuple[int, int]] = {}
    kv_peaks: dict[str, float] = defaultdict(float)
    predicted: list[float] = []

    def routed(request: Request, decision: Decision) -> None:
        counts[decision.replica] += 1
        if decision.predicted_ttft_s is not None:
            predicted.append(decision.predicted_ttft_s)
        for member in simulation.members:
            r = member.replica
            running, waiting = peaks.get(r.id, (0, 0))
            peaks[r.id] = (max(running, r.num_running), max(waiting, r.num_waiting))
            kv_peaks[r.id] = max(kv_peaks[r.id], r.cache.usage)

    simulation = Simulation(scenario, entry, workload, on_routed=routed)
    summary = simulation.run().summary
    print(f"{entry.label}: TTFT mean {summary['ttft_mean_s']:.2f} s, p99 {summary['ttft_p99_s']:.2f} s")
    if predicted:
        print(f"  predicted TTFT, mean of the chosen replicas': {sum(predicted) / len(predicted):.2f} s")
    print(
        "  replica: requests, most running / waiting and KV usage at an arrival, preemptions;"
        " learnt: prefill tokens/s, slot s, slots, fixed s"
    )
    for member in simulation.members:
        state = simulation.router.state(member.replica.id)
        running, waiting = peaks.get(state.id, (0, 0))
        rate = f"{state.prefill_tokens_per_s:.0f}" if state.prefill_tokens_per_s else "-"
        slot = f"{state.slot_s:.1f}" if state.slot_s is not None else "-"
        slots = state.batch_slots
        print(
            f"  {state.id}: {counts[state.id]}, {running} / {waiting}, {kv_peaks[state.id]:.2f},"
            f" {member.replica.num_preemptions}; {rate}, {slot}, "
            f"{'-' if slots is None else f'{slots:.1f}'}, {state.fixed_s:.3f}"
        )


if __name__ == "__main__":
    main()
