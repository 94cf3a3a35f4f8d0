"""Sweeps on every core: a sweep's runs give the same results in worker processes as one after the other, come back
in the sweep's order, and a run that fails is named while the others' results are kept."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import pytest
import yaml

from simulations.sweep import Outcome, Progress, Run, SweepProgress, run_sweep
from tests.data import TRACES_DIR

from .test_cli import simulate
from .test_matrix import MATRIX

SWEEP_SMALL = Path(__file__).parents[2] / "data" / "scenarios" / "sweep_small.yaml"


def run_scenario(out: Path, jobs: int, extra: Sequence[str] = ()) -> dict[str, object]:
    argv = ["--scenario", str(SWEEP_SMALL), "--traces-dir", str(TRACES_DIR), "--out", str(out), *extra]
    assert simulate([*argv, "--jobs", str(jobs), "--no-plots", "--no-progress"]) == 0
    document: dict[str, object] = json.loads((out / "results.json").read_text())
    return document


def test_parallel_runs_give_the_serial_results(tmp_path: Path) -> None:
    serial = run_scenario(tmp_path / "serial", jobs=1)
    parallel = run_scenario(tmp_path / "parallel", jobs=3)
    policies = serial["policies"]
    assert isinstance(policies, dict)
    assert list(policies) == [
        f"{fleet}: {p}" for fleet in ("eight", "six") for p in ("estimated_ttft", "dynamo_kv", "random")
    ]
    assert all(run["summary"]["requests"] == 120 for run in policies.values())
    assert len({run["summary"]["ttft_mean_s"] for run in policies.values()}) == 6  # six different runs
    assert serial.pop("command") != parallel.pop("command")  # only the --out differs
    assert parallel == serial  # every figure, series and CDF point, in the same order


def _square(x: int, progress: Progress | None) -> int:
    if progress is not None:
        progress(1)
    return x * x


def _fail(message: str, progress: Progress | None) -> int:
    raise RuntimeError(message)


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_failed_run_is_named_and_the_others_are_kept(jobs: int) -> None:
    runs = [
        Run("a", partial(_square, 2)),
        Run("cell b: round_robin (4 x preset)", partial(_fail, "no replica")),
        Run("c", partial(_square, 3)),
    ]
    done: list[str] = []
    progressed: list[str] = []

    def on_progress(label: str) -> Progress:
        progressed.append(label)
        return lambda n: None

    outcomes = run_sweep(runs, jobs=jobs, on_done=lambda o: done.append(o.label), on_progress=on_progress)
    assert [o.label for o in outcomes] == ["a", "cell b: round_robin (4 x preset)", "c"]
    assert [o.result for o in outcomes] == [4, None, 9]
    failed = outcomes[1]
    assert not failed.is_ok and failed.error == "RuntimeError: no replica"
    assert failed.details is not None and "_fail" in failed.details
    assert sorted(done) == sorted(o.label for o in outcomes)
    # Runs in this process get a request-progress callback; runs in workers do not.
    assert progressed == (["a", "cell b: round_robin (4 x preset)", "c"] if jobs == 1 else [])


def _die(progress: Progress | None) -> int:
    os._exit(3)  # a worker killed mid-run (out of memory, a signal)


def test_a_worker_that_dies_fails_its_run_and_the_sweep_returns() -> None:
    runs = [Run("a", partial(_square, 2)), Run("killed", partial(_die)), Run("c", partial(_square, 3))]
    outcomes = run_sweep(runs, jobs=2)
    assert [o.label for o in outcomes] == ["a", "killed", "c"]
    killed = outcomes[1]
    assert not killed.is_ok and killed.error is not None and killed.error.startswith("BrokenProcessPool")
    # Runs the broken pool did not finish fail with it; those it finished keep their results.
    for outcome, expected in zip(outcomes, [4, None, 9], strict=True):
        assert outcome.result == expected or (outcome.result is None and not outcome.is_ok)


def test_a_failed_matrix_run_is_named_in_the_output_and_its_cell_keeps_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import simulations.matrix

    real = simulations.matrix._run_cell

    def fail_one(matrix, engine, trace, seed, entry, traces_dir, progress):  # type: ignore[no-untyped-def]
        if engine.label == "overhead" and entry.label == "round_robin" and seed == 1:
            raise ValueError("injected")
        return real(matrix, engine, trace, seed, entry, traces_dir, progress)

    monkeypatch.setattr(simulations.matrix, "_run_cell", fail_one)  # runs with --jobs 1 stay in this process
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(MATRIX))
    out = tmp_path / "out"
    argv = ["--matrix", str(path), "--traces-dir", str(TRACES_DIR), "--out", str(out), "--no-progress", "--jobs", "1"]
    assert simulate(argv) == 1
    err = capsys.readouterr().err
    assert "overhead x mooncake, seed 1: round_robin (2 x llama70b_8xa100): ValueError: injected" in err
    document = json.loads((out / "results.json").read_text())
    assert [f["run"] for f in document["failures"]] == [
        "overhead x mooncake, seed 1: round_robin (2 x llama70b_8xa100)"
    ]
    cell = document["cells"][1]
    assert [r["seed"] for r in cell["runs"]["round_robin"]] == [0]
    assert [r["seed"] for r in cell["runs"]["estimated_ttft"]] == [0, 1]
    assert cell["figures"]["round_robin"]["ttft_mean_s"] == cell["runs"]["round_robin"][0]["ttft_mean_s"]


def test_jobs_must_be_positive() -> None:
    with pytest.raises(ValueError, match="jobs"):
        run_sweep([Run("a", partial(_square, 2))], jobs=0)
    assert run_sweep([], jobs=4) == []
    assert isinstance(run_sweep([Run("a", partial(_square, 2))], jobs=4)[0], Outcome)


def test_progress_shows_runs_done_of_total_and_names_a_failure(capsys: pytest.CaptureFixture[str]) -> None:
    with SweepProgress(3, requests_per_run=10, is_disabled=False) as progress:
        update = progress.start("a (4 x preset)")
        update(10)
        progress.done(Outcome("a (4 x preset)", result=1))
        progress.done(Outcome("cell b: round_robin (4 x preset)", error="RuntimeError: no replica"))
    err = capsys.readouterr().err
    assert "a (4 x preset):" in err  # the bar of the requests of the run done in this process
    assert "run failed: cell b: round_robin (4 x preset): RuntimeError: no replica" in err
    last = err.rsplit("\r", 1)[-1]
    assert "runs:" in last and "2/3" in last and "<" in last  # runs done / total, then elapsed<left
