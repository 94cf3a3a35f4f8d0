"""Sweeps on a Ray cluster (`--ray`): a Ray instance started here (`local`) gives the results of running the sweep
one run after the other, a failed run is named and the others kept, and a worker that dies fails only its run."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from simulations.sweep import Progress, Run, run_sweep

from .test_sweep import run_scenario

ray = pytest.importorskip("ray", reason="the `ray` extra is not installed")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    """One Ray instance for the module, as `--ray local` starts it, on two CPUs."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _square(x: int, progress: Progress | None) -> int:
    assert progress is None  # a run on Ray reports no requests
    return x * x


def _fail(message: str, progress: Progress | None) -> int:
    raise RuntimeError(message)


def _die(progress: Progress | None) -> int:
    os._exit(3)  # a worker killed mid-run (out of memory, a signal)


def test_a_scenario_on_ray_gives_the_serial_results(tmp_path: Path) -> None:
    serial = run_scenario(tmp_path / "serial", jobs=1)
    on_ray = run_scenario(tmp_path / "ray", jobs=3, extra=["--ray", "local"])
    assert serial.pop("command") != on_ray.pop("command")
    assert on_ray == serial  # every figure, series and CDF point, in the same order


def test_on_ray_a_failed_run_is_named_and_a_dead_worker_fails_only_its_run() -> None:
    runs = [
        Run("a", partial(_square, 2)),
        Run("cell b: round_robin (4 x preset)", partial(_fail, "no replica")),
        Run("killed", partial(_die)),
        Run("c", partial(_square, 3)),
    ]
    done: list[str] = []
    outcomes = run_sweep(runs, jobs=2, on_done=lambda o: done.append(o.label), ray_address="local")
    assert [o.label for o in outcomes] == [run.label for run in runs]
    assert [o.result for o in outcomes] == [4, None, None, 9]
    assert outcomes[1].error == "RuntimeError: no replica"
    assert outcomes[1].details is not None and "_fail" in outcomes[1].details
    assert outcomes[2].error is not None and "WorkerCrashedError" in outcomes[2].error
    assert sorted(done) == sorted(run.label for run in runs)


def test_without_ray_the_error_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ValueError, match=r"pip install 'shoal\[ray\]'"):
        run_sweep([Run("a", partial(_square, 2))], jobs=1, ray_address="local")
