"""`shoal simulate`: replay a trace or a scenario through several routing policies and compare them.

    shoal simulate fetch-traces --traces-dir ~/traces       # the public traces the scenarios replay (see below)
    shoal simulate --scenario simulations/scenarios/01_mooncake_moderate.yaml --traces-dir ~/traces --out runs/01
    shoal simulate --trace ~/traces/mooncake/synthetic_trace.jsonl --replicas 16 --out runs/x
    shoal simulate --matrix simulations/matrices/engines_x_traces.yaml --traces-dir ~/traces --out runs/matrix

A scenario file sets everything (see `scenario.Scenario`); flags override it. Without one, the five policies of
`scenario.DEFAULT_POLICIES` run on 16 replicas of the LLaMA-70B preset.
Prints one table row per policy (per fleet variant and policy when the scenario has `variants`), then a line per
row whose fleet speculates, writes `results.json` and, unless `--no-plots`, `ttft_cdf.png` and `timeseries.png`
into `--out`. Every run replays the same requests; runs go to worker processes, `--jobs` at once (default: every
core; `simulations.sweep`), with the same results as one after the other. Stderr shows runs done / total and the
time left; a run that fails is named there and in results.json's `failures`, the others' results are kept, and the
exit status is 1.
`shoal simulate plan` finds the cheapest fleet (policy, replicas, autoscaler settings) that meets an SLO on a trace
and writes it as Helm values (`shoal simulate plan --help`, `simulations.plan`).
`--matrix FILE` runs every policy on every (engine, trace) cell of a matrix file (`simulations.matrix`) and prints
one table of TTFT mean and p99 per cell with each policy's ratios to the cell's best; `--set KEY=VALUE` changes a
field of the file for the run.

A scenario names its trace files relative to a traces directory: `--traces-dir DIR`, or else $SHOAL_TRACES_DIR.
`shoal simulate fetch-traces` downloads them there (Mooncake, Azure LLM inference 2023, ServeGen), checked by
sha256; `--trace` is a path like any other, from the working directory.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from router.policy.config import POLICY_NAMES

_INDEX_MODES = ("approximate", "exact", "exact_predicted")


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the workload, fleet and router that `resolve_scenario` reads, for `shoal simulate` and its
    `plan`."""
    parser.add_argument("--scenario", metavar="FILE", help="scenario YAML (simulations/scenarios/)")
    parser.add_argument(
        "--trace",
        metavar="PATH",
        help="Mooncake .jsonl, Azure .csv or ServeGen aggregate-rate .csv (replaces the scenario's trace)",
    )
    parser.add_argument(
        "--policies", metavar="A,B,...", help=f"policy kinds, comma-separated: {', '.join(POLICY_NAMES)}"
    )
    parser.add_argument(
        "--speed",
        type=float,
        metavar="X",
        help="replay the trace X times faster (a ServeGen curve: X times shorter, its `compress`, rates unchanged)",
    )
    parser.add_argument("--limit", type=int, metavar="N", help="replay only the trace's first N requests")
    parser.add_argument(
        "--tile",
        type=int,
        metavar="N",
        help="replay a Mooncake or Azure trace N times back to back, each copy a period (the trace's span plus its "
        "mean gap) later with fresh block ids: a longer input of the trace's shape",
    )
    parser.add_argument(
        "--tile-to",
        type=int,
        metavar="REQUESTS",
        help="tile the trace as --tile does until it has REQUESTS requests, the last copy cut short "
        "(e.g. 1000000 with --speed 3: a synthetic day of the Mooncake trace)",
    )
    parser.add_argument(
        "--preset",
        metavar="NAME",
        help="engine preset (simulations/presets/), a preset YAML file, or a `shoal replica profile` JSON to fit",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        metavar="TOKENS",
        help="KV block of the engines and the router, the KV cache keeping its tokens (default: the preset's, 16); "
        "512 on a Mooncake trace (its own block) runs several times faster in a tenth of the memory, and hits only "
        "whole blocks (simulations/README.md)",
    )
    parser.add_argument("--index-mode", choices=_INDEX_MODES, help="prefix index fed by decisions or by KV events")
    parser.add_argument("--routers", type=int, metavar="N", help="routers, each with its own view (default 1)")
    parser.add_argument(
        "--sharing", choices=("on", "off"), help="with several routers: share decisions and loads (Redis) or not"
    )
    parser.add_argument(
        "--seed", type=int, help="seed of the trace jitter, the policies' random choices and the accepted drafts"
    )
    parser.add_argument(
        "--traces-dir",
        metavar="DIR",
        help="directory of a scenario's relative trace paths (default: $SHOAL_TRACES_DIR)",
    )
    parser.add_argument(
        "--acceptance-length",
        type=float,
        metavar="TAU",
        help="speculate with this mean acceptance length (tokens per sequence per speculative step, bonus included) "
        "on the preset's or the scenario's speculation, e.g. one fitted from a profile",
    )


def add_simulate_command(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="replay a trace through the routing policies on simulated replicas",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_workload_arguments(parser)
    parser.add_argument(
        "--matrix",
        metavar="FILE",
        help="engine x trace matrix YAML (simulations/matrices/): every policy on every cell, one table",
    )
    parser.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="with --matrix: set a field of the matrix file (dotted key, YAML value), e.g. "
        "router.service_time.learn_fixed=true; repeatable",
    )
    parser.add_argument("--replicas", type=int, metavar="N", help="replicas in the fleet (default 16)")
    parser.add_argument("--out", metavar="DIR", help="directory for results.json and the plots (required)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--no-floor",
        action="store_true",
        help="skip the floor row (each request alone, every shareable prefix cached): it keeps every distinct block "
        "of the trace (of one copy at a time when tiled), where a run's memory follows the requests in flight",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        metavar="N",
        help="runs at once, each in its own process (default: every core, or with --ray every run); 1 runs them one "
        "after the other here. Results are the same either way",
    )
    from simulations.sweep import add_ray_argument

    add_ray_argument(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=run_simulate)
    commands = parser.add_subparsers(dest="simulate_command", metavar="{fetch-traces,plan}", required=False)
    _add_fetch_traces_command(commands)
    from simulations.plan_command import add_plan_command

    add_plan_command(commands)


def _add_fetch_traces_command(subparsers: Any) -> None:
    from simulations.fetch import BASE_URL_ENV, TRACES

    parser = subparsers.add_parser(
        "fetch-traces",
        help="download the public traces into the traces directory",
        description="Download the public traces the scenarios replay into the traces directory, each checked by "
        "sha256: " + "; ".join(f"{s.name}: {s.description}" for s in TRACES) + ". Files already there with the "
        "right checksum are kept.",
    )
    parser.add_argument(
        "--traces-dir", metavar="DIR", help="where to put them (default: $SHOAL_TRACES_DIR); created if missing"
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=[s.name for s in TRACES],
        metavar="NAME",
        help=f"only this trace, repeatable: {', '.join(s.name for s in TRACES)}",
    )
    parser.add_argument(
        "--base-url",
        metavar="URL",
        help=f"a mirror laid out as URL/<trace>/<file> instead of the published locations (default: ${BASE_URL_ENV})",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=run_fetch_traces)


def run_fetch_traces(args: argparse.Namespace) -> int:
    from simulations.fetch import BASE_URL_ENV, FetchError, fetch_traces
    from simulations.scenario import TRACES_DIR_ENV

    traces_dir = args.traces_dir or os.environ.get(TRACES_DIR_ENV)
    if not traces_dir:
        print(f"shoal simulate fetch-traces: give --traces-dir DIR or set {TRACES_DIR_ENV}", file=sys.stderr)
        return 2
    base_url = args.base_url or os.environ.get(BASE_URL_ENV) or None
    try:
        fetch_traces(
            Path(traces_dir),
            only=args.only,
            base_url=base_url,
            progress=not args.no_progress,
            log=lambda line: print(line, file=sys.stderr),
        )
    except FetchError as exc:
        print(f"shoal simulate fetch-traces: {exc}", file=sys.stderr)
        return 1
    print(f"traces in {traces_dir}: run scenarios with --traces-dir {traces_dir} or {TRACES_DIR_ENV}={traces_dir}")
    return 0


_TRACE_KINDS = ("mooncake", "azure", "servegen")
"""Workloads read from a file, which `--trace`, `--speed` and `--limit` apply to."""
_TILED_KINDS = ("mooncake", "azure")
"""Trace files that `--tile` and `--tile-to` repeat (a ServeGen curve is a rate over time, not requests)."""


def trace_kind(path: str) -> str:
    """The trace kind of a file: Mooncake JSONL, or a CSV whose header says Azure or ServeGen."""
    if not path.endswith(".csv"):
        return "mooncake"
    try:
        with Path(path).open(newline="") as f:
            header = f.readline()
    except OSError:
        return "azure"  # the workload's own read reports the missing file
    columns = {column.strip() for column in header.split(",")}
    return "servegen" if "total_rate_req_per_s" in columns else "azure"


def _trace_config(path: str, current: Any) -> dict[str, Any]:
    kind = trace_kind(path)
    keep = {}
    if getattr(current, "kind", None) == kind:
        keep = current.model_dump(exclude={"path"})
    return {**keep, "kind": kind, "path": path}


def resolve_scenario(args: argparse.Namespace) -> Any:
    """The scenario of `--scenario` (or the defaults) with the flags applied."""
    from simulations.scenario import FleetConfig, Scenario, load_scenario, with_block_size

    if args.scenario:
        base = load_scenario(args.scenario).model_dump()
    elif args.trace:
        base = {"name": Path(args.trace).stem, "trace": {"kind": trace_kind(args.trace), "path": args.trace}}
    else:
        raise ValueError("give --trace or --scenario")
    data: dict[str, Any] = dict(base)
    if args.trace:
        current = Scenario.model_validate(base).trace if args.scenario else None
        data["trace"] = _trace_config(str(Path(args.trace).absolute()), current)
    trace = dict(data["trace"]) if isinstance(data["trace"], dict) else data["trace"].model_dump()
    for flag in ("speed", "limit"):
        value = getattr(args, flag)
        if value is not None:
            if trace.get("kind") not in _TRACE_KINDS:
                raise ValueError(f"--{flag} applies to trace files only, not to a {trace.get('kind')} workload")
            trace["compress" if flag == "speed" and trace["kind"] == "servegen" else flag] = value
    if args.tile is not None or args.tile_to is not None:
        if trace.get("kind") not in _TILED_KINDS:
            raise ValueError(f"--tile and --tile-to apply to Mooncake and Azure traces, not to {trace.get('kind')}")
        if args.tile_to is not None:
            if args.tile is not None or args.limit is not None:
                raise ValueError("--tile-to sets the request count: give it without --tile or --limit")
            trace.update(tiles=None, limit=args.tile_to)
        else:
            trace["tiles"] = args.tile
    data["trace"] = trace
    fleet = dict(data.get("fleet") or {})
    if args.replicas is not None:
        fleet["num_replicas"] = args.replicas
    if args.preset is not None:
        fleet["preset"] = args.preset
    if args.acceptance_length is not None:
        fleet["speculation"] = {**(fleet.get("speculation") or {}), "mean_acceptance_length": args.acceptance_length}
    if args.block_size is not None:
        engine = FleetConfig.model_validate(fleet).resolve().engine
        fleet["engine"] = {**(fleet.get("engine") or {}), **with_block_size(engine, args.block_size)}
    data["fleet"] = fleet
    if args.index_mode is not None:
        data["router"] = {**(data.get("router") or {}), "index_mode": args.index_mode}
    routers = dict(data.get("routers") or {})
    if args.routers is not None:
        routers["count"] = args.routers
    if args.sharing is not None:
        routers["sharing"] = args.sharing == "on"
    data["routers"] = routers
    if args.policies:
        data["policies"] = [p.strip() for p in args.policies.split(",") if p.strip()]
    if args.seed is not None:
        data["seed"] = args.seed
    return Scenario.model_validate(data)


def run_simulate(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from simulations.floor import floor_ttfts
    from simulations.report import (
        floor_summary,
        format_speculation,
        format_table,
        results_document,
        write_results,
    )
    from simulations.scenario import TRACES_DIR_ENV, build_workload
    from simulations.simulation import RunResult
    from simulations.sweep import SweepProgress, report_failures, run_sweep, scenario_runs

    if not args.out:
        print("shoal simulate: give --out DIR (or run `shoal simulate fetch-traces`)", file=sys.stderr)
        return 2
    if args.matrix:
        return run_matrix_command(args)
    traces_dir = args.traces_dir or os.environ.get(TRACES_DIR_ENV) or None
    try:
        jobs = _jobs(args)
        scenario = resolve_scenario(args)
        workload = build_workload(scenario, traces_dir=Path(traces_dir) if traces_dir else None)
        for variant_scenario, _ in scenario.runs():
            variant_scenario.fleet.resolve()  # a bad override fails now, not after the runs before it
    except (ValidationError, ValueError, OSError) as exc:
        print(f"shoal simulate: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        total: int | None = len(workload)  # type: ignore[arg-type]
    except TypeError:
        total = None
    engine, step_model, _ = scenario.fleet.resolve()
    if scenario.fleet.preset.endswith(".json"):
        from simulations.step_model import load_preset

        print(f"step model: {load_preset(scenario.fleet.preset).description}", file=sys.stderr)
    floor = None if args.no_floor else floor_summary(*floor_ttfts(workload, engine, step_model))
    runs = scenario_runs(scenario, traces_dir=Path(traces_dir) if traces_dir else None)
    with SweepProgress(len(runs), requests_per_run=total, is_disabled=args.no_progress) as progress:
        outcomes = run_sweep(runs, jobs=jobs, on_done=progress.done, on_progress=progress.start, ray_address=args.ray)
    results: list[RunResult] = [o.result for o in outcomes if o.result is not None]
    failures = [o.record() for o in outcomes if not o.is_ok]
    command = command_line(args)
    print(
        f"{scenario.name}: {workload.name}, {scenario.fleet.num_replicas} x {scenario.fleet.preset}, "
        f"index {scenario.router.index_mode}"
        + (f", hit ceiling {floor['hit_ratio']:.3f}" if floor is not None else "")
        + (
            f"; {scenario.routers.count} routers, sharing {'on' if scenario.routers.sharing else 'off'}"
            if scenario.routers.count > 1
            else ""
        )
        + (f"; variants: {', '.join(v.label for v in scenario.variants)}" if scenario.variants else "")
    )
    print(format_table(results, floor))
    speculation = format_speculation(results)
    if speculation:
        print(speculation)
    document = results_document(scenario, results, command=command, floor=floor)
    document["failures"] = failures
    write_results(out_dir / "results.json", document)
    if not args.no_plots and results:
        from simulations.plots import write_plots

        write_plots(out_dir, document)
    return report_failures(failures, len(outcomes))


def _jobs(args: argparse.Namespace) -> int:
    """Runs at once: --jobs, else every core here, or with --ray no bound of ours (Ray queues them by CPUs)."""
    default = 1 << 20 if getattr(args, "ray", None) else os.cpu_count() or 1
    jobs: int = args.jobs if args.jobs is not None else default
    if jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {jobs}")
    return jobs


_NOT_MATRIX_FLAGS = (
    "scenario",
    "trace",
    "replicas",
    "speed",
    "limit",
    "tile",
    "tile_to",
    "preset",
    "block_size",
    "index_mode",
    "acceptance_length",
    "routers",
    "sharing",
)
"""Flags `--matrix` refuses: the matrix file sets these, per engine or trace."""


def run_matrix_command(args: argparse.Namespace) -> int:
    """`shoal simulate --matrix FILE`: run every cell, print the table, write `results.json`."""
    import json

    import yaml
    from pydantic import ValidationError

    from simulations.matrix import format_matrix, load_matrix, run_matrix
    from simulations.scenario import TRACES_DIR_ENV
    from simulations.sweep import SweepProgress, report_failures

    others = [k for k in _NOT_MATRIX_FLAGS if getattr(args, k, None) is not None]
    if others:
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in others)
        print(f"shoal simulate: --matrix does not take {flags}; set it in the matrix file", file=sys.stderr)
        return 2
    traces_dir = args.traces_dir or os.environ.get(TRACES_DIR_ENV) or None
    try:
        overrides: dict[str, Any] = {}
        for item in args.set or []:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ValueError(f"--set {item!r}: expected KEY=VALUE")
            overrides[key] = yaml.safe_load(value)
        if args.policies:
            overrides["policies"] = [p.strip() for p in args.policies.split(",") if p.strip()]
        if args.seed is not None:
            overrides["seeds"] = [args.seed]
        matrix = load_matrix(args.matrix, overrides)
        jobs = _jobs(args)
    except (ValidationError, ValueError, OSError, yaml.YAMLError) as exc:
        print(f"shoal simulate: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with SweepProgress(matrix.num_runs, requests_per_run=None, is_disabled=args.no_progress) as progress:
        try:
            document = run_matrix(
                matrix,
                traces_dir=Path(traces_dir) if traces_dir else None,
                jobs=jobs,
                on_done=progress.done,
                on_progress=progress.start,
                ray_address=args.ray,
            )
        except (ValidationError, ValueError, OSError) as exc:
            print(f"shoal simulate: {exc}", file=sys.stderr)
            return 2
    document = {"command": command_line(args), **document}
    sizes = f"{len(matrix.engines)} engines x {len(matrix.traces)} traces, {len(matrix.policies)} policies"
    print(f"{matrix.name}: {sizes}")
    print(format_matrix(document))
    (out_dir / "results.json").write_text(json.dumps(document, indent=1, allow_nan=True) + "\n")
    return report_failures(document["failures"], matrix.num_runs)


def command_line(args: argparse.Namespace) -> str:
    """The `shoal simulate` command line that reproduces `args` (for results.json and the README)."""
    words = ["shoal", "simulate"]
    flags = ("scenario", "matrix", "trace", "policies", "replicas", "speed", "limit", "tile", "tile_to", "preset")
    more = ("index_mode", "seed", "routers", "sharing", "traces_dir", "acceptance_length", "out")
    for flag in (*flags, *more):
        value = getattr(args, flag, None)
        if value is not None:
            words += [f"--{flag.replace('_', '-')}", str(value)]
    for item in getattr(args, "set", None) or []:
        words += ["--set", item]
    switches = ("no_plots", "no_floor", "no_progress")
    words += [f"--{flag.replace('_', '-')}" for flag in switches if getattr(args, flag, False)]
    return " ".join(shlex.quote(w) for w in words)


def main(argv: list[str] | None = None) -> int:
    """`python -m simulations simulate ...`, for use before the `shoal` entry point is registered."""
    parser = argparse.ArgumentParser(prog="python -m simulations")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_simulate_command(subparsers)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    result: int = args.run(args)
    return result
