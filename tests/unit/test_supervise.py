"""supervise: a background task's unforeseen failure is logged, counted, shown as down and followed by a restart."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from router.service.supervise import TaskFailures, backoff_s, supervise


def samples(failures: TaskFailures) -> dict[tuple[str, str], float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(failures.collector("shoal_test"))
    text = generate_latest(registry).decode()
    return {(s.name, s.labels["task"]): s.value for f in text_string_to_metric_families(text) for s in f.samples}


async def test_a_failing_task_is_restarted_counted_shown_down_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    failures = TaskFailures(logging.getLogger("shoal.test.tasks"))
    runs: list[int] = []
    reported: list[str] = []
    third_run = asyncio.Event()

    async def run() -> None:
        runs.append(len(runs))
        if len(runs) <= 2:
            raise ValueError(f"bad input {len(runs)}")
        third_run.set()
        await asyncio.Event().wait()

    loop = asyncio.get_running_loop()
    with caplog.at_level(logging.ERROR, logger="shoal.test.tasks"):
        task = asyncio.ensure_future(
            supervise(
                "t",
                run,
                failures=failures,
                clock=loop.time,
                where="here",
                on_failure=lambda exc: reported.append(str(exc)),
                min_backoff_s=0.01,
            )
        )
        await asyncio.wait_for(third_run.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert runs == [0, 1, 2]  # two failures, then a run that lasted
    assert reported == ["bad input 1", "bad input 2"]
    assert samples(failures) == {("shoal_test_task_failures_total", "t"): 2, ("shoal_test_tasks_down", "t"): 0}
    lines = [r for r in caplog.records if "background task t (here) failed" in r.getMessage()]
    assert len(lines) == 2 and lines[0].exc_info and not lines[1].exc_info  # a traceback the first time only
    assert "ValueError: bad input 2" in lines[1].getMessage()


async def test_a_task_waiting_out_its_backoff_counts_as_down() -> None:
    failures = TaskFailures(logging.getLogger("shoal.test.tasks"))
    failed = asyncio.Event()

    async def run() -> None:
        failed.set()
        raise RuntimeError("broken")

    task = asyncio.ensure_future(
        supervise("t", run, failures=failures, clock=asyncio.get_running_loop().time, min_backoff_s=60)
    )
    await asyncio.wait_for(failed.wait(), 5)  # the task ran on to its backoff before this resumed (no await between)
    assert failures.num_down == {"t": 1} and failures.counts == {"t": 1}
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert failures.num_down == {"t": 0}


async def test_cancelling_stops_it_at_once() -> None:
    started = asyncio.Event()

    async def run() -> None:
        started.set()
        await asyncio.Event().wait()

    failures = TaskFailures(logging.getLogger("shoal.test.tasks"))
    task = asyncio.ensure_future(supervise("t", run, failures=failures, clock=asyncio.get_running_loop().time))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert failures.counts == {"t": 0}  # declared, never failed


def test_backoff_doubles_from_its_minimum_to_its_cap() -> None:
    assert [backoff_s(n, 0.5, 30.0) for n in range(1, 9)] == [0.5, 1, 2, 4, 8, 16, 30, 30]
    assert backoff_s(10_000, 0.5, 30.0) == 30.0
