"""supervise: a background task's unforeseen failure is logged, reported and followed by a restart."""

from __future__ import annotations

import asyncio
import logging

import pytest

from router.service.supervise import supervise


async def test_a_failing_task_is_restarted_reported_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    runs: list[int] = []
    failures: list[str] = []

    async def run() -> None:
        runs.append(len(runs))
        if len(runs) <= 2:
            raise ValueError(f"bad input {len(runs)}")

    loop = asyncio.get_running_loop()
    with caplog.at_level(logging.ERROR, logger="shoal.router.supervise"):
        await asyncio.wait_for(
            supervise("t", run, on_failure=lambda exc: failures.append(str(exc)), clock=loop.time, min_backoff_s=0.01),
            timeout=5,
        )
    assert runs == [0, 1, 2]  # two failures, then a run that finished
    assert failures == ["bad input 1", "bad input 2"]
    lines = [r for r in caplog.records if "background task 't' failed" in r.getMessage()]
    assert len(lines) == 2 and lines[0].exc_info and not lines[1].exc_info  # a traceback the first time only


async def test_cancelling_stops_it_at_once() -> None:
    started = asyncio.Event()

    async def run() -> None:
        started.set()
        await asyncio.Event().wait()

    task = asyncio.ensure_future(
        supervise("t", run, on_failure=lambda exc: None, clock=asyncio.get_running_loop().time)
    )
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
