"""A sweep's runs on every local core: independent simulations in worker processes.

The runs of a sweep (a scenario's policies and fleet variants, a matrix's cells x seeds x policies) share nothing:
each depends only on its own scenario, policy, seed and trace files. So each is a picklable `Run` (a label and a
`functools.partial` of a module-level function), a `ProcessPoolExecutor` runs them, and every worker reads its
trace itself. A run's figures are those of running it alone: the same seeds give the same results, serial or
parallel, whatever order the runs end in; outcomes come back in the sweep's order.

A run that raises is a failed `Outcome` that carries the run's label and the error; the other runs go on. A
worker process that dies (out of memory, killed) breaks the pool: every run not finished by then fails with that
error, and the finished ones keep their results. With `jobs=1`, or a single run, runs go one after the other in
this process, and each gets a callback for its progress in requests (`Run.call(on_finished)`); in a worker
process it gets None. `SweepProgress` shows a sweep on stderr: runs done / total with the time left, failures as
they come.
"""

from __future__ import annotations

import multiprocessing
import sys
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Generic, TypeVar

from simulations.scenario import PolicyEntry, Scenario, build_workload
from simulations.simulation import RunResult, Simulation

T = TypeVar("T")

Progress = Callable[[int], None]
"""`progress(n)`: n more requests of the run ended."""


@dataclass(frozen=True, slots=True)
class Run(Generic[T]):
    """One run of a sweep."""

    label: str
    """Names the run in progress lines and failure messages: its cell, policy, replicas and settings."""
    call: Callable[[Progress | None], T]
    """Does the run; a `functools.partial` of a module-level function, so that it pickles to a worker."""


@dataclass(frozen=True, slots=True)
class Outcome(Generic[T]):
    """What one run gave: its result, or the error that ended it."""

    label: str
    result: T | None = None
    error: str | None = None
    """`ExceptionType: message` of a failed run; None when it succeeded."""
    details: str | None = None
    """The failed run's traceback."""

    @property
    def is_ok(self) -> bool:
        return self.error is None

    def record(self) -> dict[str, str | None]:
        """A failed run in results.json: its label (cell, policy, replicas, settings), the error and its traceback."""
        return {"run": self.label, "error": self.error, "traceback": self.details}


def run_sweep(
    runs: Sequence[Run[T]],
    *,
    jobs: int,
    on_done: Callable[[Outcome[T]], None] | None = None,
    on_progress: Callable[[str], Progress | None] | None = None,
) -> list[Outcome[T]]:
    """Every run's outcome, in the order of `runs`, with up to `jobs` runs at once in worker processes.

    `on_done(outcome)` after each run ends, in the order they end. `on_progress(label)` gives a run done in this
    process (`jobs=1`, or a single run) its request-progress callback.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    outcomes: list[Outcome[T] | None] = [None] * len(runs)
    if jobs == 1 or len(runs) <= 1:
        for i, run in enumerate(runs):
            progress = on_progress(run.label) if on_progress is not None else None
            outcome = outcomes[i] = _outcome(run.label, *_attempt(run.call, progress))
            if on_done is not None:
                on_done(outcome)
    else:
        # Spawned, not forked: this process may hold threads (a progress bar's monitor) whose locks a fork copies.
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=min(jobs, len(runs)), mp_context=context) as pool:
            futures: dict[Future[tuple[T | None, str | None, str | None]], int] = {
                pool.submit(_attempt, run.call, None): i for i, run in enumerate(runs)
            }
            for future in as_completed(futures):
                i = futures[future]
                try:
                    attempt = future.result()
                except Exception as exc:  # the worker died: BrokenProcessPool, or a result that did not unpickle
                    attempt = (None, f"{type(exc).__name__}: {exc}", None)
                outcome = outcomes[i] = _outcome(runs[i].label, *attempt)
                if on_done is not None:
                    on_done(outcome)
    return [outcome for outcome in outcomes if outcome is not None]


def _attempt(
    call: Callable[[Progress | None], T], progress: Progress | None
) -> tuple[T | None, str | None, str | None]:
    """(result, None, None), or (None, error, traceback): a run's exception is its outcome, not the sweep's."""
    try:
        return call(progress), None, None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}", traceback.format_exc()


def _outcome(label: str, result: T | None, error: str | None, details: str | None) -> Outcome[T]:
    return Outcome(label, result, error, details)


class SweepProgress:
    """Progress of a sweep on stderr: runs done / total with the time left, and, for a run done in this process, its
    requests."""

    def __init__(self, num_runs: int, *, requests_per_run: int | None, is_disabled: bool) -> None:
        from tqdm import tqdm  # type: ignore[import-untyped]

        self._tqdm = tqdm
        self.requests_per_run = requests_per_run
        self.is_disabled = is_disabled
        self.runs = tqdm(total=num_runs, desc="runs", unit="run", file=sys.stderr, disable=is_disabled)
        self._requests: Any = None
        """The bar of the run in progress in this process, if any."""

    def __enter__(self) -> SweepProgress:
        return self

    def __exit__(self, *_: object) -> None:
        self._close_requests()
        self.runs.close()

    def resize(self, num_runs: int) -> None:
        """The sweep will have `num_runs` runs in all: a search that learns its count as it goes (`simulations.plan`)
        starts at its bound and narrows it."""
        self.runs.total = num_runs
        self.runs.refresh()

    def start(self, label: str) -> Progress:
        """A run starts in this process: a bar of its requests; returns its update callback."""
        self._close_requests()
        self._requests = self._tqdm(
            total=self.requests_per_run,
            desc=label,
            unit="req",
            file=sys.stderr,
            disable=self.is_disabled,
            leave=False,
            position=1,
        )
        update: Progress = self._requests.update
        return update

    def done(self, outcome: Outcome[Any]) -> None:
        self._close_requests()
        if not outcome.is_ok:
            self._tqdm.write(f"shoal simulate: run failed: {outcome.label}: {outcome.error}", file=sys.stderr)
        self.runs.set_postfix_str(outcome.label, refresh=False)
        self.runs.update(1)

    def _close_requests(self) -> None:
        if self._requests is not None:
            self._requests.close()
            self._requests = None


def report_failures(failures: list[dict[str, Any]], num_runs: int) -> int:
    """Name the failed runs (`Outcome.record`s) on stderr after the results; the exit status: 1 when any failed."""
    if not failures:
        return 0
    print(f"shoal simulate: {len(failures)} of {num_runs} runs failed; the others' results are above:", file=sys.stderr)
    for failure in failures:
        print(f"  {failure['run']}: {failure['error']}", file=sys.stderr)
    return 1


def scenario_runs(scenario: Scenario, *, traces_dir: Path | None) -> list[Run[RunResult]]:
    """A run per policy (and fleet variant) of `scenario`, each replaying the scenario's own workload."""
    return [
        Run(run_label(run_scenario, entry), partial(_simulate, run_scenario, entry, scenario, traces_dir))
        for run_scenario, entry in scenario.runs()
    ]


def run_label(scenario: Scenario, entry: PolicyEntry) -> str:
    """A run's row label with its fleet, index mode and seed: what names it in progress and failure lines."""
    fleet, index_mode = scenario.fleet, scenario.router.index_mode
    return f"{entry.label} ({fleet.num_replicas} x {fleet.preset}, index {index_mode}, seed {scenario.seed})"


def _simulate(
    scenario: Scenario,
    entry: PolicyEntry,
    workload_scenario: Scenario,
    traces_dir: Path | None,
    progress: Progress | None,
) -> RunResult:
    workload = build_workload(workload_scenario, traces_dir=traces_dir)
    return Simulation(scenario, entry, workload, on_finished=progress).run()
