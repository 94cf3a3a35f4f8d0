"""The engine x trace matrix: every policy on every (engine, trace) cell, compared by TTFT mean and p99.

A matrix file (`simulations/matrices/*.yaml`, `Matrix`) names a base fleet, engine variants (each a label and
overrides of that fleet, merged as a scenario's fleet variants are), traces (each a label, a workload and a request
limit), the policies, the seeds and the router. Each cell is a scenario of its own: the engine's fleet, the trace's
workload cut to its limit, every policy on the same requests, once per seed. Per cell and policy the figures are
TTFT mean and p99 (averaged over seeds); the cell's best is the smallest of each over its policies, and a policy's
ratio is its figure over that best. `goal_policy` meets the goal in a cell when both its ratios are at most
`goal_ratio`.

`format_matrix` prints one Markdown table: a row per cell, a column per policy with `mean / p99` in seconds, the
goal column, then a row of each policy's worst ratios over all cells. `shoal simulate --matrix FILE` runs it, its
runs in worker processes (`simulations.sweep`); a run that fails is left out of its cell's figures and listed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from simulations.metrics import SLOConfig
from simulations.scenario import (
    DEFAULT_POLICIES,
    FleetConfig,
    PolicyEntry,
    RouterConfig,
    Scenario,
    TraceConfig,
    build_workload,
    merge_fleet,
    policy_entry,
)
from simulations.simulation import Simulation
from simulations.sweep import Outcome, Progress, Run, run_sweep
from simulations.workload import Request, Workload

GOAL_POLICY = "estimated_ttft"
_KEYS = ("ttft_mean_s", "ttft_p99_s")


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class MatrixEngine(_Model):
    """One engine of the matrix: the matrix's `fleet` with some fields changed."""

    label: str
    description: str = ""
    fleet: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the matrix's `fleet` (`engine`, `step_model` and `speculation` merge into it; other fields,
    `preset`, `step_time_factors`, `output_scale`, replace it)."""
    arrival_speed: float = Field(default=1.0, gt=0.0)
    """Every trace's arrivals come this many times faster on this engine (0.5: half the rate), for an engine whose
    capacity differs from the base fleet's. 1: the trace's own times."""


class MatrixTrace(_Model):
    """One trace of the matrix."""

    label: str
    description: str = ""
    trace: TraceConfig
    """The workload, as a scenario's `trace` (relative paths from the traces directory). A synthetic workload's
    `seed` is replaced by each of the matrix's seeds."""
    limit: int | None = Field(default=None, ge=1)
    """Replay only the first `limit` requests; None: the matrix's `limit`."""


class Matrix(_Model):
    """A matrix file: engines x traces, each cell every policy once per seed (module docstring)."""

    name: str = "matrix"
    description: str = ""
    fleet: FleetConfig = Field(default_factory=FleetConfig)
    """The base fleet every engine's overrides apply to."""
    engines: list[MatrixEngine] = Field(min_length=1)
    traces: list[MatrixTrace] = Field(min_length=1)
    policies: list[PolicyEntry] = Field(default_factory=lambda: [policy_entry(p) for p in DEFAULT_POLICIES])
    router: RouterConfig = Field(default_factory=RouterConfig)
    slo: SLOConfig = Field(default_factory=SLOConfig)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    """Each cell runs once per seed (the policies' random choices, trace jitter, synthetic workloads)."""
    limit: int | None = Field(default=None, ge=1)
    """Requests replayed per trace unless the trace sets its own `limit`; None: the whole trace."""
    goal_policy: str = GOAL_POLICY
    """The policy whose ratios the goal column judges."""
    goal_ratio: float = Field(default=1.05, ge=1.0)
    """The goal: `goal_policy`'s TTFT mean and p99 at most this many times the cell's best."""

    @field_validator("policies", mode="before")
    @classmethod
    def _entries(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        return [policy_entry(item) if isinstance(item, str | dict) else item for item in value]

    @model_validator(mode="after")
    def _labels(self) -> Matrix:
        for what, labels in (
            ("engine", [e.label for e in self.engines]),
            ("trace", [t.label for t in self.traces]),
            ("policy", [p.label for p in self.policies]),
        ):
            if len(set(labels)) != len(labels):
                raise ValueError(f"{what} labels must differ, got {labels}")
        for engine in self.engines:
            merge_fleet(self.fleet, engine.fleet)  # an override naming no fleet field fails here, not mid-run
        return self

    def scenario(self, engine: MatrixEngine, trace: MatrixTrace, seed: int) -> Scenario:
        """The cell's scenario for one seed."""
        workload = trace.trace
        if hasattr(workload, "seed"):
            workload = workload.model_copy(update={"seed": seed})
        return Scenario(
            name=f"{engine.label} x {trace.label}",
            trace=workload,
            fleet=merge_fleet(self.fleet, engine.fleet),
            router=self.router,
            policies=self.policies,
            slo=self.slo,
            seed=seed,
        )

    def cells(self) -> list[tuple[MatrixEngine, MatrixTrace]]:
        return list(itertools.product(self.engines, self.traces))

    @property
    def num_runs(self) -> int:
        return len(self.engines) * len(self.traces) * len(self.seeds) * len(self.policies)


def load_matrix(path: str | Path, overrides: dict[str, Any] | None = None) -> Matrix:
    """A matrix from YAML, with `overrides` (dotted keys: `router.service_time.learn_fixed`) set on the document."""
    with Path(path).open() as f:
        data = yaml.safe_load(f)
    for key, value in (overrides or {}).items():
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {key}: {part} is not a mapping")
        node[leaf] = value
    return Matrix.model_validate(data)


class _Window:
    """A workload's first `limit` requests, arriving `speed` times faster."""

    def __init__(self, workload: Workload, limit: int | None, speed: float) -> None:
        self.inner = workload
        self.limit = limit
        self.speed = speed
        self.name = workload.name
        self.block_size = workload.block_size
        self.seed_bytes = workload.seed_bytes

    def __len__(self) -> int:
        n: int = len(self.inner)  # type: ignore[arg-type]  # TypeError, as for any unsized workload
        return n if self.limit is None else min(n, self.limit)

    def requests(self) -> Iterator[Request]:
        for request in itertools.islice(self.inner.requests(), self.limit):
            yield request if self.speed == 1.0 else replace(request, arrival_s=request.arrival_s / self.speed)


def cell_workload(
    matrix: Matrix, engine: MatrixEngine, trace: MatrixTrace, scenario: Scenario, traces_dir: Path | None
) -> Workload:
    """The requests of a cell's `scenario`: the trace's first `limit`, at the engine's `arrival_speed`."""
    limit = trace.limit if trace.limit is not None else matrix.limit
    return _Window(build_workload(scenario, traces_dir=traces_dir), limit, engine.arrival_speed)


def matrix_runs(matrix: Matrix, *, traces_dir: Path | None) -> list[Run[dict[str, Any]]]:
    """Every (engine, trace, seed, policy) run, cell by cell; each gives its summary. Builds every cell's workload
    once here, so that a missing trace file fails before any run."""
    runs: list[Run[dict[str, Any]]] = []
    for engine, trace in matrix.cells():
        for seed in matrix.seeds:
            scenario = matrix.scenario(engine, trace, seed)
            cell_workload(matrix, engine, trace, scenario, traces_dir)
            fleet = scenario.fleet
            for entry in scenario.policies:
                label = f"{scenario.name}, seed {seed}: {entry.label} ({fleet.num_replicas} x {fleet.preset})"
                runs.append(Run(label, partial(_run_cell, matrix, engine, trace, seed, entry, traces_dir)))
    return runs


def _run_cell(
    matrix: Matrix,
    engine: MatrixEngine,
    trace: MatrixTrace,
    seed: int,
    entry: PolicyEntry,
    traces_dir: Path | None,
    progress: Progress | None,
) -> dict[str, Any]:
    scenario = matrix.scenario(engine, trace, seed)
    workload = cell_workload(matrix, engine, trace, scenario, traces_dir)
    return Simulation(scenario, entry, workload, on_finished=progress).run().summary


def run_matrix(
    matrix: Matrix,
    *,
    traces_dir: Path | None,
    jobs: int = 1,
    on_done: Callable[[Outcome[dict[str, Any]]], None] | None = None,
    on_progress: Callable[[str], Progress | None] | None = None,
    ray_address: str | None = None,
) -> dict[str, Any]:
    """Every cell's runs, `jobs` at once, on the Ray cluster at `ray_address` if given (`sweep.run_sweep`:
    `on_done` after each run, `on_progress` for a run in this process). Returns the results document
    (`format_matrix` prints it); a failed run is left out of its cell's figures and listed under `failures`."""
    runs = matrix_runs(matrix, traces_dir=traces_dir)
    outcomes = iter(run_sweep(runs, jobs=jobs, on_done=on_done, on_progress=on_progress, ray_address=ray_address))
    cells: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    for engine, trace in matrix.cells():  # in matrix_runs' order
        per_policy: dict[str, list[dict[str, Any]]] = {p.label: [] for p in matrix.policies}
        for seed in matrix.seeds:
            for entry in matrix.policies:
                outcome = next(outcomes)
                if outcome.result is not None:
                    per_policy[entry.label].append({"seed": seed, **outcome.result})
                else:
                    failures.append(outcome.record())
        cells.append(_cell(matrix, engine, trace, per_policy))
    return {
        "matrix": matrix.model_dump(mode="json"),
        "cells": cells,
        "worst_ratios": _worst_ratios(matrix, cells),
        "failures": failures,
    }


def _cell(
    matrix: Matrix, engine: MatrixEngine, trace: MatrixTrace, per_policy: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    figures = {
        label: {
            "ttft_mean_s": _mean(s["ttft_mean_s"] for s in runs),
            "ttft_p99_s": _mean(s["ttft_p99_s"] for s in runs),
            "requests": sum(s["requests"] for s in runs),
            "rejected": sum(s["rejected"] for s in runs),
        }
        for label, runs in per_policy.items()
    }
    # A policy whose every run in the cell failed has nan figures, which are nobody's best.
    best = {key: min((f[key] for f in figures.values() if not math.isnan(f[key])), default=math.nan) for key in _KEYS}
    ratios = {label: {key: f[key] / best[key] for key in best} for label, f in figures.items()}
    goal = ratios.get(matrix.goal_policy)
    return {
        "engine": engine.label,
        "trace": trace.label,
        "figures": figures,
        "best": {
            key: next((label for label, f in figures.items() if f[key] == value), None) for key, value in best.items()
        },
        "ratios": ratios,
        "goal_met": None if goal is None else all(r <= matrix.goal_ratio for r in goal.values()),
        "runs": per_policy,
    }


def _mean(values: Iterator[float]) -> float:
    xs = list(values)
    return sum(xs) / len(xs) if xs else math.nan


def _worst_ratios(matrix: Matrix, cells: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    return {
        p.label: {
            key: max((r for c in cells if not math.isnan(r := c["ratios"][p.label][key])), default=math.nan)
            for key in _KEYS
        }
        for p in matrix.policies
    }


def _seconds(x: float) -> str:
    if math.isnan(x):
        return "-"
    return f"{x:.2f}" if x < 100 else f"{x:.0f}"


def format_matrix(document: dict[str, Any]) -> str:
    """The Markdown table of a `run_matrix` document (module docstring)."""
    matrix = document["matrix"]
    policies = [p["label"] for p in matrix["policies"]]
    goal_policy, goal_ratio = matrix["goal_policy"], matrix["goal_ratio"]
    headers = ["engine", "trace", *policies, f"{goal_policy} <= {goal_ratio:g} x best"]
    rows: list[list[str]] = []
    for cell in document["cells"]:
        row = [cell["engine"], cell["trace"]]
        for label in policies:
            f = cell["figures"][label]
            mean, p99 = (_seconds(f[key]) + ("*" if cell["best"][key] == label else "") for key in _KEYS)
            row.append(f"{mean} / {p99}")
        row.append(_goal_text(cell, goal_policy))
        rows.append(row)
    worst = document["worst_ratios"]
    rows.append(
        [
            "worst ratio",
            "to best",
            *(f"{worst[p]['ttft_mean_s']:.2f} / {worst[p]['ttft_p99_s']:.2f}" for p in policies),
            "",
        ]
    )
    widths = [max(len(x) for x in column) for column in zip(headers, *rows, strict=True)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    for row in rows:
        pairs = enumerate(zip(row, widths, strict=True))
        cells = [c.ljust(w) if i < 2 or i == len(row) - 1 else c.rjust(w) for i, (c, w) in pairs]
        lines.append("| " + " | ".join(cells) + " |")
    met = [c for c in document["cells"] if c["goal_met"]]
    lines.append("")
    lines.append(
        f"TTFT mean / p99 in seconds, averaged over seeds {matrix['seeds']}; * marks the cell's best. Last column: "
        f"{goal_policy}'s ratios to the best mean / p99. "
        f"{goal_policy} meets the goal in {len(met)} of {len(document['cells'])} cells."
    )
    return "\n".join(lines)


def _goal_text(cell: dict[str, Any], goal_policy: str) -> str:
    ratios = cell["ratios"].get(goal_policy)
    if ratios is None:
        return "-"
    text = f"{ratios['ttft_mean_s']:.2f} / {ratios['ttft_p99_s']:.2f}"
    if cell["goal_met"]:
        return f"yes ({text})"
    best = cell["best"]
    return f"no ({text}; best {best['ttft_mean_s']} / {best['ttft_p99_s']})"
