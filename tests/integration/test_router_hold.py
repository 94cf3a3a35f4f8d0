"""Requests that arrive while no replica can serve them wait (bounded in number and time) instead of failing."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.integration.conftest import (
    RouterHandle,
    StartFakes,
    StartRouter,
    eventually,
    metric_value,
    replica_id,
    unique_text,
)

pytestmark = pytest.mark.integration


async def _held(router: RouterHandle) -> float | None:
    return metric_value(await router.metrics(), "shoal_router_held_requests")


async def test_a_held_request_is_served_once_a_replica_returns(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    fakes = await start_fakes(1)
    router = await start_router(fakes, hold={"max_wait_s": 10.0})
    await fakes[0].kill()

    async def is_down() -> bool:
        return (await router.replicas())[replica_id(fakes[0])]["status"] == "unhealthy"

    await eventually(is_down, timeout_s=3, what="the replica to go down")
    pending = asyncio.create_task(router.complete(unique_text(200, "held")))

    async def is_held() -> bool:
        return await _held(router) == 1

    await eventually(is_held, timeout_s=3, what="the request to be held")
    assert not pending.done()
    await fakes[0].restart()
    reply = await asyncio.wait_for(pending, timeout=5)
    assert (reply.status, reply.replica) == (200, replica_id(fakes[0]))
    assert await _held(router) == 0


async def test_a_held_request_gets_503_after_max_wait(start_router: StartRouter) -> None:
    router = await start_router([], hold={"max_wait_s": 0.3})
    started = time.monotonic()
    reply = await router.complete("nobody is serving")
    waited_s = time.monotonic() - started
    assert reply.status == 503 and reply.json()["error"]["code"] == "no_replica_available"
    assert reply.headers.get("Retry-After") == "1"
    assert 0.3 <= waited_s < 3.0


async def test_held_requests_are_bounded_in_number(start_router: StartRouter) -> None:
    router = await start_router([], hold={"max_wait_s": 5.0, "max_requests": 1})
    first = asyncio.create_task(router.complete("first waits"))

    async def is_held() -> bool:
        return await _held(router) == 1

    await eventually(is_held, timeout_s=3, what="the first request to be held")
    started = time.monotonic()
    second = await router.complete("second is refused")
    assert second.status == 503 and time.monotonic() - started < 1.0
    first.cancel()


async def test_undraining_the_only_replica_releases_held_requests(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    fakes = await start_fakes(1)
    router = await start_router(fakes, hold={"max_wait_s": 10.0})
    rid = replica_id(fakes[0])
    assert (await router.admin("POST", f"/replicas/{rid}/drain")).status == 200
    pending = asyncio.create_task(router.complete(unique_text(200, "waits for undrain")))

    async def is_held() -> bool:
        return await _held(router) == 1

    await eventually(is_held, timeout_s=3, what="the request to be held")
    started = time.monotonic()
    assert (await router.admin("POST", f"/replicas/{rid}/undrain")).status == 200
    reply = await asyncio.wait_for(pending, timeout=5)
    assert reply.status == 200 and time.monotonic() - started < 1.0
