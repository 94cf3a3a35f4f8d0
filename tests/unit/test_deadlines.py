"""Swept timeouts (router/service/deadlines.py): they fire, at most one sweep late; cancelled ones never do; and
`Deadlines.timeout` behaves as `asyncio.timeout`."""

from __future__ import annotations

import asyncio

import pytest

from router.service.deadlines import Deadlines

INTERVAL_S = 0.05  # timeouts from 0.2 s on are swept


async def test_a_long_timeout_is_swept_and_fires_at_most_one_interval_late() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(loop, INTERVAL_S)
    fired = loop.create_future()
    started = loop.time()
    deadlines.call_later(0.3, fired.set_result, "late enough")
    cancelled = deadlines.call_later(0.25, fired.set_result, "cancelled")
    assert len(deadlines) == 2
    cancelled.cancel()
    assert await asyncio.wait_for(fired, 5) == "late enough"
    elapsed_s = loop.time() - started
    assert 0.3 <= elapsed_s < 0.3 + INTERVAL_S + 0.2, elapsed_s
    assert len(deadlines) == 0


async def test_a_short_timeout_gets_a_timer_of_its_own() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(loop, INTERVAL_S)
    handle = deadlines.call_later(0.1, lambda: None)
    assert isinstance(handle, asyncio.TimerHandle) and len(deadlines) == 0
    handle.cancel()


async def test_timeout_raises_timeout_error_like_asyncio_timeout() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(loop, INTERVAL_S)
    started = loop.time()
    with pytest.raises(TimeoutError):
        async with deadlines.timeout(0.2):
            await asyncio.sleep(30)  # the work that takes too long
    assert 0.2 <= loop.time() - started < 0.2 + INTERVAL_S + 0.5
    async with deadlines.timeout(0.2) as finished_in_time:
        await asyncio.sleep(0)
    assert not finished_in_time.expired and len(deadlines) == 0
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


async def test_a_cancellation_from_outside_stays_a_cancellation() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(loop, INTERVAL_S)
    entered = asyncio.Event()

    async def work() -> None:
        async with deadlines.timeout(10.0):
            entered.set()
            await asyncio.sleep(30)

    task = asyncio.create_task(work())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(deadlines) == 0


async def test_nested_in_asyncio_timeout_the_inner_one_that_expires_is_reported() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(loop, INTERVAL_S)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.1):  # the outer, shorter bound expires first
            async with deadlines.timeout(10.0):
                await asyncio.sleep(30)
    async with asyncio.timeout(10.0) as outer:
        with pytest.raises(TimeoutError):
            async with deadlines.timeout(0.2):
                await asyncio.sleep(30)
    assert not outer.expired()
