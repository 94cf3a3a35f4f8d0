"""Requests that arrive while no replica can serve them wait (bounded in number and time) instead of failing."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.fakes.fake_replica import FakeReplica
from tests.integration.conftest import (
    Reply,
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


# --- the in-flight limit: requests wait at the router for a free slot --------------------------------------


async def test_at_the_in_flight_limit_requests_wait_at_the_router_and_go_in_arrival_order(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    (fake,) = await start_fakes(1, hang=True)
    router = await start_router([fake], hold={"max_wait_s": 10.0, "max_in_flight_per_replica": 1})
    tasks = {}
    for name in ("first", "second", "third"):
        tasks[name] = asyncio.create_task(router.complete(unique_text(200, name)))
        expected_held = len(tasks) - 1

        async def is_lined_up(expected: int = expected_held) -> bool:
            return fake.in_flight == 1 and await _held(router) == expected

        await eventually(is_lined_up, timeout_s=3, what=f"{name} to be sent or lined up")

    def prompts() -> list[str]:
        return [body["prompt"].split()[1] for body in fake.received_bodies]

    assert prompts() == ["first"]  # one request on the replica, two at the router
    tasks["first"].cancel()  # the client goes: its slot frees, and the oldest held request takes it

    async def second_sent() -> bool:
        return prompts() == ["first", "second"] and fake.in_flight == 1 and await _held(router) == 1

    await eventually(second_sent, timeout_s=3, what="the second request to take the freed slot")
    tasks["second"].cancel()

    async def third_sent() -> bool:
        return prompts() == ["first", "second", "third"] and await _held(router) == 0

    await eventually(third_sent, timeout_s=3, what="the third request to take the freed slot")
    tasks["third"].cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)


async def test_a_request_goes_to_the_replica_with_room_not_the_busy_one(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    fakes = await start_fakes(2, hang=True)
    router = await start_router(fakes, hold={"max_wait_s": 10.0, "max_in_flight_per_replica": 1})
    text = unique_text(2000, "shared prefix")
    first = asyncio.create_task(router.complete(text))
    await eventually(lambda: sum(f.in_flight for f in fakes) == 1, timeout_s=3, what="the first request to land")
    holder, other = fakes if fakes[0].in_flight else fakes[::-1]
    # The same prompt again: its cached replica is at the limit, so it goes to the other one rather than queue.
    second = asyncio.create_task(router.complete(text))
    await eventually(lambda: other.in_flight == 1, timeout_s=3, what="the repeat to go to the replica with room")
    assert holder.in_flight == 1 and await _held(router) == 0
    for task in (first, second):
        task.cancel()
    await asyncio.gather(first, second, return_exceptions=True)


async def _one_slot_taken(
    start_fakes: StartFakes, start_router: StartRouter, *, max_wait_s: float
) -> tuple[FakeReplica, RouterHandle, asyncio.Task[Reply]]:
    """A hanging replica behind a router that keeps one request in flight on it, and the request ("occupies")
    that has taken that slot."""
    (fake,) = await start_fakes(1, hang=True)
    router = await start_router([fake], hold={"max_wait_s": max_wait_s, "max_in_flight_per_replica": 1})
    occupying = asyncio.create_task(router.complete(unique_text(200, "occupies")))
    await eventually(lambda: fake.in_flight == 1, timeout_s=3, what="the first request to take the only slot")
    return fake, router, occupying


async def test_a_request_held_at_the_limit_past_max_wait_gets_503_saying_the_replicas_are_busy(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    fake, router, occupying = await _one_slot_taken(start_fakes, start_router, max_wait_s=0.3)
    started = time.monotonic()
    reply = await router.complete(unique_text(200, "finds no room"))
    assert reply.status == 503 and reply.json()["error"]["code"] == "replicas_busy"
    assert reply.headers.get("Retry-After") == "1"
    assert 0.3 <= time.monotonic() - started < 3.0
    assert fake.in_flight == 1 and len(fake.received_bodies) == 1  # never sent past the limit
    occupying.cancel()
    await asyncio.gather(occupying, return_exceptions=True)


async def test_a_held_request_whose_client_goes_away_leaves_the_line(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    fake, router, occupying = await _one_slot_taken(start_fakes, start_router, max_wait_s=10.0)
    leaving = asyncio.create_task(router.complete(unique_text(200, "leaves")))
    staying = asyncio.create_task(router.complete(unique_text(200, "stays")))

    async def both_held() -> bool:
        return await _held(router) == 2

    await eventually(both_held, timeout_s=3, what="two requests to be held")
    leaving.cancel()

    async def one_held() -> bool:
        return await _held(router) == 1

    await eventually(one_held, timeout_s=3, what="the cancelled request to leave the line")
    occupying.cancel()  # the slot frees: the request still in line takes it, not the one that left

    async def stays_sent() -> bool:
        return await _held(router) == 0 and fake.in_flight == 1

    await eventually(stays_sent, timeout_s=3, what="the remaining held request to be sent")
    assert [body["prompt"].split()[1] for body in fake.received_bodies] == ["occupies", "stays"]
    staying.cancel()
    await asyncio.gather(occupying, leaving, staying, return_exceptions=True)
