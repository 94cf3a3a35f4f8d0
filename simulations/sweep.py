"""A sweep's runs on every local core: independent simulations in worker processes.

The runs of a sweep (a scenario's policies and fleet variants, a matrix's cells x seeds x policies) share nothing:
each depends only on its own scenario, policy, seed and trace files. So each is a picklable `Run` (a label and a
`functools.partial` of a module-level function), a `ProcessPoolExecutor` runs them, and every worker reads its
trace itself. A run's figures are those of running it alone: the same seeds give the same results, serial or
parallel, whatever order the runs end in; outcomes come back in the sweep's order.

On a Ray cluster (`ray_address`: an address, `auto` for the cluster this machine belongs to, or `local` for a Ray
instance started here; the `ray` extra), each run is a Ray task of one CPU, at most `jobs` in flight. Every node
needs the same Shoal installed (`pip install 'shoal[simulate,ray]'`) and the traces at the same path.

A run that raises is a failed `Outcome` that carries the run's label and the error; the other runs go on. A
worker process that dies (out of memory, killed) breaks a local pool: every run not finished by then fails with
that error, and the finished ones keep their results; on Ray only the run whose worker died fails. With `jobs=1`,
or a single run, runs go one after the other in this process, and each gets a callback for its progress in
requests (`Run.call(on_finished)`); elsewhere it gets None. `SweepProgress` shows a sweep on stderr: runs done /
total with the time left, failures as they come.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
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
    ray_address: str | None = None,
) -> list[Outcome[T]]:
    """Every run's outcome, in the order of `runs`, with up to `jobs` runs at once in worker processes (on the Ray
    cluster at `ray_address` when given).

    `on_done(outcome)` after each run ends, in the order they end. `on_progress(label)` gives a run done in this
    process (`jobs=1`, or a single run) its request-progress callback.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    outcomes: list[Outcome[T] | None] = [None] * len(runs)
    if ray_address is not None:
        for i, attempt in _on_ray(runs, ray_address, jobs):
            outcome = outcomes[i] = _outcome(runs[i].label, *attempt)
            if on_done is not None:
                on_done(outcome)
    elif jobs == 1 or len(runs) <= 1:
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


Attempt = tuple[T | None, str | None, str | None]


def _on_ray(runs: Sequence[Run[T]], address: str, max_in_flight: int) -> Iterator[tuple[int, Attempt[T]]]:
    """(index, attempt) of each run as it ends, each run a Ray task of one CPU, at most `max_in_flight` at once."""
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'shoal[ray]'") from None
    if not ray.is_initialized():
        if address == "local":
            ray.init(include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    # One retry where a worker or its node died (a node lost on a cluster); a run's own errors are its outcome.
    attempt: Any = ray.remote(num_cpus=1, max_retries=1)(_attempt)
    waiting = iter(enumerate(runs))
    in_flight: dict[Any, int] = {}
    while True:
        for i, run in itertools.islice(waiting, max(0, max_in_flight - len(in_flight))):
            in_flight[attempt.remote(run.call, None)] = i
        if not in_flight:
            return
        (ready,), _ = ray.wait(list(in_flight), num_returns=1)
        i = in_flight.pop(ready)
        try:
            yield i, ray.get(ready)
        except ray.exceptions.RayError as exc:  # the worker or its node died; `_attempt` catches the run's own errors
            yield i, (None, f"{type(exc).__name__}: {exc}", None)


def add_ray_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run the sweep's runs as tasks on a Ray cluster: its address, `auto` for the cluster this machine "
        "belongs to, or `local` for a Ray instance started here (needs `pip install 'shoal[ray]'`; every node needs "
        "Shoal and the traces at the same path)",
    )


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
