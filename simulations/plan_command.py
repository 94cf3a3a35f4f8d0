"""`shoal simulate plan`: the cheapest fleet that meets an SLO on a trace (`simulations.plan`), as a table, a plot
and Helm values.

    shoal simulate plan --trace trace.jsonl --slo ttft_p99=2s --slo attainment=0.99 --max-replicas 32 --out plan/

Prints the number of runs it may make, then a table of every run (fleet, replicas, replica-seconds, attainment,
latencies, which bounds it missed) and the plan; writes into `--out` `plan.yaml` (Helm values for helm/shoal:
`helm install shoal helm/shoal -f plan.yaml`), `plan.json` (every run's summary) and `plan.png` (replica-seconds
against attainment, a point per run). Exit status 0 with a plan; 1 when no fleet within the bounds meets the SLO
(it says so, with what the largest fleets missed) or a run failed (named; the others' results are kept); 2 for a
bad flag or scenario.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from simulations.objectives import FleetObjective
    from simulations.plan import Planner, Scaling, Trial
    from simulations.scaling import AutoscaleConfig
    from simulations.scenario import Scenario


def add_plan_command(subparsers: Any) -> None:
    from simulations.cli import add_workload_arguments
    from simulations.objectives import KEYS
    from simulations.sweep import add_ray_argument

    parser = subparsers.add_parser(
        "plan",
        help="find the cheapest fleet (policy, replicas, autoscaler settings) that meets an SLO on a trace",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_workload_arguments(parser)
    parser.add_argument(
        "--slo",
        action="append",
        metavar="KEY=VALUE",
        help=f"a bound every run is judged by, repeatable: {', '.join(KEYS)} (e.g. ttft_p99=2s, "
        "attainment=0.99; ttft=2s and tpot=100ms set what attainment counts). Durations need their unit (s, ms)",
    )
    parser.add_argument("--min-replicas", type=int, default=1, metavar="N", help="fewest replicas (default 1)")
    parser.add_argument(
        "--max-replicas", type=int, default=16, metavar="N", help="most replicas, static or autoscaled (default 16)"
    )
    parser.add_argument(
        "--targets",
        default="4,8,16",
        metavar="A,B,...",
        help="autoscaler grid: target requests per replica (default 4,8,16)",
    )
    parser.add_argument(
        "--scale-up-steps",
        default="1,4",
        metavar="A,B,...",
        help="autoscaler grid: replicas added per scale-up period, scale_up.max_replicas (default 1,4)",
    )
    parser.add_argument(
        "--windows",
        default="120,600",
        metavar="S,S,...",
        help="autoscaler grid: scale-down stabilization windows, seconds (default 120,600)",
    )
    parser.add_argument(
        "--startup-s",
        type=float,
        metavar="S",
        help="seconds from a new replica's creation to ready in the autoscaled runs (default: the scenario's "
        "autoscale.startup_s, 120)",
    )
    parser.add_argument("--no-autoscale", action="store_true", help="size static fleets only")
    parser.add_argument("--out", metavar="DIR", help="directory for plan.yaml, plan.json and plan.png (required)")
    parser.add_argument("--jobs", type=int, metavar="N", help="runs at once (default: every core)")
    add_ray_argument(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=run_plan, replicas=None)  # replicas are what the plan searches


def run_plan(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from simulations.cli import _jobs, resolve_scenario
    from simulations.objectives import parse_objective
    from simulations.plan import Planner, bisection_runs, scaling_grid
    from simulations.scaling import AutoscaleConfig
    from simulations.scenario import TRACES_DIR_ENV, build_workload

    if not args.out:
        print("shoal simulate plan: give --out DIR", file=sys.stderr)
        return 2
    traces_dir = args.traces_dir or os.environ.get(TRACES_DIR_ENV) or None
    try:
        objective = parse_objective(args.slo or [])
        lo, hi = args.min_replicas, args.max_replicas
        if not 1 <= lo <= hi:
            raise ValueError(f"need 1 <= --min-replicas <= --max-replicas, got {lo} and {hi}")
        grid = scaling_grid(
            _numbers("--targets", args.targets, float),
            _numbers("--scale-up-steps", args.scale_up_steps, int),
            _numbers("--windows", args.windows, float),
        )
        jobs = _jobs(args)
        scenario = resolve_scenario(args)
        if scenario.variants:
            raise ValueError("the scenario has fleet variants; a plan sizes one fleet: remove `variants`")
        labels = [entry.label for entry in scenario.policies]
        if len(set(labels)) != len(labels):
            raise ValueError(f"policy labels must differ, got {labels}")
        slo = scenario.slo.model_copy(update=objective.request_slo)
        scenario = scenario.model_copy(update={"slo": slo})
        objective = dataclasses.replace(objective, request_slo=slo.model_dump())
        autoscale = scenario.autoscale or AutoscaleConfig()
        if args.startup_s is not None:
            autoscale = AutoscaleConfig.model_validate({**autoscale.model_dump(), "startup_s": args.startup_s})
        for scaling in grid:  # a bad grid value fails now, not in a worker
            Planner(scenario, objective, None, 1, autoscale).autoscale_config(lo, scaling, lo, hi).policy_config()
        workload = build_workload(scenario, traces_dir=Path(traces_dir) if traces_dir else None)
    except (ValidationError, ValueError, OSError) as exc:
        print(f"shoal simulate plan: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    grid = [] if args.no_autoscale else grid
    per_policy = bisection_runs(lo, hi)
    bound = len(labels) * per_policy + len(grid)
    print(
        f"plan: {workload.name}, {scenario.fleet.preset}; SLO {objective.describe()}\n"
        f"at most {bound} runs: {len(labels)} {'policy' if len(labels) == 1 else 'policies'} x at most "
        f"{per_policy} (bisection on {lo}..{hi} replicas)"
        + (f", then {len(grid)} autoscaler settings for the best policy" if grid else "")
    )
    return _search_and_report(args, scenario, objective, autoscale, grid, lo, hi, jobs, traces_dir, out_dir, bound)


def _search_and_report(
    args: argparse.Namespace,
    scenario: Scenario,
    objective: FleetObjective,
    autoscale: AutoscaleConfig,
    grid: list[Scaling],
    lo: int,
    hi: int,
    jobs: int,
    traces_dir: str | None,
    out_dir: Path,
    bound: int,
) -> int:
    from simulations.plan import Candidate, Planner, best_static, cheapest, search_replicas
    from simulations.sweep import SweepProgress

    labels = [entry.label for entry in scenario.policies]
    with SweepProgress(bound, requests_per_run=None, is_disabled=args.no_progress) as progress:
        planner = Planner(
            scenario,
            objective,
            Path(traces_dir) if traces_dir else None,
            jobs,
            autoscale,
            on_done=progress.done,
            on_progress=progress.start,
            ray_address=args.ray,
        )
        answers = search_replicas(
            planner,
            labels,
            lo,
            hi,
            on_round=lambda left: progress.resize(len(planner.trials) + left + len(grid)),
        )
        best = best_static(answers)
        scaled: list[Trial] = []
        if best is None:
            progress.resize(len(planner.trials))
        elif grid:
            candidates = [Candidate(best.candidate.policy, best.candidate.replicas, scaling) for scaling in grid]
            scaled = planner.run(candidates, lo, hi)
    trials = planner.trials
    failures = [t for t in trials if t.error is not None]
    best_scaled = cheapest(scaled)
    chosen = best
    if best is not None and best_scaled is not None and best_scaled.replica_seconds < best.replica_seconds:
        chosen = best_scaled
    print(format_plan_table(trials, chosen))
    command = plan_command_line(args)
    records = [_record(t, t is chosen) for t in trials]
    document: dict[str, Any] = {
        "command": command,
        "objective": objective.describe(),
        "runs": len(trials),
        "max_runs": bound,
        "trials": records,
        "failures": [{"run": t.candidate.label, "error": t.error} for t in failures],
        "plan": _record(chosen, True) if chosen is not None else None,
    }
    (out_dir / "plan.json").write_text(json.dumps(document, indent=1, allow_nan=True) + "\n")
    from simulations.plots import write_plan_plot

    attainment = next((b.limit for b in objective.bounds if b.is_attainment), None)
    write_plan_plot(out_dir / "plan.png", records, attainment_bound=attainment, title=scenario.name)
    print(f"{len(trials)} runs (at most {bound}), {len(failures)} failed")
    for trial in failures:
        print(f"shoal simulate plan: run failed: {trial.candidate.label}: {trial.error}", file=sys.stderr)
    if best is None:
        print(_no_plan(objective, trials, lo, hi), file=sys.stderr)
        return 1
    assert chosen is not None
    for line in _plan_lines(answers, best, best_scaled, scaled, chosen, trials, grid):
        print(line)
    values = _values_of(planner, chosen, best, lo, hi)
    (out_dir / "plan.yaml").write_text(_values_text(command, objective, chosen, best, values))
    print(f"Helm values: {out_dir / 'plan.yaml'} (helm install shoal helm/shoal -f plan.yaml)")
    return 1 if failures else 0


def _numbers(flag: str, text: str, kind: type) -> list[Any]:
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated numbers") from None
    if not values:
        raise ValueError(f"{flag}: give at least one value")
    return values


def plan_command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this plan (for plan.json and plan.yaml)."""
    words = ["shoal", "simulate", "plan"]
    for flag in ("scenario", "trace", "traces_dir", "policies", "speed", "limit", "preset", "seed"):
        value = getattr(args, flag)
        if value is not None:
            words += [f"--{flag.replace('_', '-')}", str(value)]
    for item in args.slo or []:
        words += ["--slo", item]
    words += ["--min-replicas", str(args.min_replicas), "--max-replicas", str(args.max_replicas)]
    if args.no_autoscale:
        words.append("--no-autoscale")
    else:
        words += ["--targets", args.targets, "--scale-up-steps", args.scale_up_steps, "--windows", args.windows]
        if args.startup_s is not None:
            words += ["--startup-s", str(args.startup_s)]
    return shlex.join([*words, "--out", args.out])


def _record(trial: Trial, is_chosen: bool) -> dict[str, Any]:
    c = trial.candidate
    scaling = c.scaling
    return {
        "run": c.label,
        "policy": c.policy,
        "replicas": c.replicas,
        "autoscaled": None
        if scaling is None
        else {
            "target_requests_per_replica": scaling.target_requests_per_replica,
            "scale_up_replicas": scaling.scale_up_replicas,
            "stabilization_window_s": scaling.stabilization_window_s,
        },
        "meets": trial.is_met,
        "misses": list(trial.misses),
        "error": trial.error,
        "chosen": is_chosen,
        "replica_seconds": trial.replica_seconds,
        "attainment": trial.summary["slo_attainment"] if trial.summary is not None else math.nan,
        "summary": {k: v for k, v in (trial.summary or {}).items() if k != "branches"},
    }


_COLUMNS = (
    ("attainment", "slo_attainment", "{:.3f}"),
    ("TTFT p50", "ttft_p50_s", "{:.2f}"),
    ("p90", "ttft_p90_s", "{:.2f}"),
    ("p99", "ttft_p99_s", "{:.2f}"),
    ("E2E p99", "e2e_p99_s", "{:.2f}"),
)


def format_plan_table(trials: list[Trial], chosen: Trial | None) -> str:
    """A Markdown table of every run: static fleets by policy and size, then autoscaled ones by cost. Latencies in
    seconds; `meets` says which bounds a run missed and by how much; `*` marks the plan."""
    from simulations.report import markdown_table

    order: dict[str, int] = {}
    for trial in trials:
        order.setdefault(trial.candidate.policy, len(order))
    static = sorted(
        (t for t in trials if t.candidate.scaling is None),
        key=lambda t: (order[t.candidate.policy], t.candidate.replicas),
    )
    scaled = sorted((t for t in trials if t.candidate.scaling is not None), key=lambda t: t.replica_seconds)
    headers = ["fleet", "replicas", "replica-s", *(h for h, _, _ in _COLUMNS), "meets"]
    rows = []
    for trial in (*static, *scaled):
        c, s = trial.candidate, trial.summary
        mark = "* " if trial is chosen else ""
        fleet = f"{mark}{c.policy}, static" if c.scaling is None else f"{mark}{c.policy}, {c.scaling.describe()}"
        if s is None:
            rows.append([fleet, str(c.replicas), "-", *("-" for _ in _COLUMNS), f"failed: {trial.error}"])
            continue
        replicas = str(c.replicas)
        if c.scaling is not None and s["duration_s"] > 0:
            replicas = f"{c.replicas}, mean {s['replica_seconds'] / s['duration_s']:.1f}"
        cells = ["-" if math.isnan(s[key]) else fmt.format(s[key]) for _, key, fmt in _COLUMNS]
        rows.append(
            [fleet, replicas, f"{s['replica_seconds']:.0f}", *cells, "yes" if trial.is_met else "; ".join(trial.misses)]
        )
    return markdown_table(headers, rows)


def _plan_lines(
    answers: dict[str, Trial | None],
    best: Trial,
    best_scaled: Trial | None,
    scaled: list[Trial],
    chosen: Trial,
    trials: list[Trial],
    grid: list[Scaling],
) -> list[str]:
    lines = []
    by_size = {(t.candidate.policy, t.candidate.replicas): t for t in trials if t.candidate.scaling is None}
    for policy, answer in answers.items():
        if answer is None:
            failed = next((t for t in trials if t.candidate.policy == policy and t.error is not None), None)
            lines.append(f"{policy}: " + ("search ended by a failed run" if failed else "no fleet meets the SLO"))
            continue
        n = answer.candidate.replicas
        below = by_size.get((policy, n - 1))
        why = f"; {n - 1} miss: {'; '.join(below.misses)}" if below is not None else ""
        lines.append(f"{policy}: {n} replicas, {answer.replica_seconds:.0f} replica-s{why}")
    static = (
        f"{best.candidate.policy} on {best.candidate.replicas} static replicas ({best.replica_seconds:.0f} replica-s)"
    )
    if not grid:
        lines.append(f"plan: {static}")
    elif best_scaled is None:
        lines.append(f"plan: {static}; none of the {len(scaled)} autoscaler settings meets the SLO")
    else:
        ratio = best_scaled.replica_seconds / best.replica_seconds
        lines.append(
            f"autoscaled: {best_scaled.candidate.label}, {best_scaled.replica_seconds:.0f} replica-s "
            f"({ratio:.0%} of the static fleet's)"
        )
        lines.append(f"plan: {chosen.candidate.label}" if chosen is best_scaled else f"plan: {static}")
    return lines


def _no_plan(objective: FleetObjective, trials: list[Trial], lo: int, hi: int) -> str:
    largest = [t for t in trials if t.candidate.scaling is None and t.candidate.replicas == hi and t.summary]
    missed = "; ".join(f"{t.candidate.policy}: {', '.join(t.misses)}" for t in largest)
    text = f"shoal simulate plan: no fleet of {lo}..{hi} replicas meets the SLO ({objective.describe()})"
    return text + (f". At {hi} replicas, {missed}" if missed else "")


def _values_of(planner: Planner, chosen: Trial, best: Trial, lo: int, hi: int) -> dict[str, Any]:
    from simulations.plan import helm_values

    entry = planner.entry(best.candidate.policy)
    scaling = chosen.candidate.scaling
    autoscale = None if scaling is None else planner.autoscale_config(best.candidate.replicas, scaling, lo, hi)
    return helm_values(entry, best.candidate.replicas, autoscale)


def _values_text(command: str, objective: FleetObjective, chosen: Trial, best: Trial, values: dict[str, Any]) -> str:
    import yaml

    header = [
        "# Helm values for helm/shoal: `helm install shoal helm/shoal -f plan.yaml`. Written by",
        f"#   {command}",
        f"# SLO: {objective.describe()}.",
        f"# Static: {best.candidate.label}, {best.replica_seconds:.0f} replica-s (replicas.replicas).",
    ]
    if chosen.candidate.scaling is not None:
        header.append(f"# Autoscaled (autoscaling): {chosen.candidate.label}, {chosen.replica_seconds:.0f} replica-s.")
    return "\n".join(header) + "\n" + yaml.safe_dump(values, sort_keys=False)
