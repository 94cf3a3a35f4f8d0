"""Arrivals and request times as the autoscaler reads them off real routers' /metrics (`capacity.from_arrivals`).

A request that reached a router was answered, or is still in flight or held, so arrivals over a round are the
answered count's change plus the change of those in flight and held; request time is the whole-request histogram's
sum over its count, both between two rounds. The observer's clock is the test's: rates come out exact.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from autoscaler.observe import RouterClient, static_routers
from tests.integration.conftest import ADMIN_TOKEN, StartFakes, StartRouter, eventually, metric_value, unique_text

pytestmark = pytest.mark.integration


async def test_arrivals_and_request_time_between_two_rounds(
    http: aiohttp.ClientSession, start_fakes: StartFakes, start_router: StartRouter
) -> None:
    (fake,) = await start_fakes(1, first_byte_delay_s=0.05)
    routers = [await start_router([fake]), await start_router([fake])]
    now = [100.0]
    router_client = RouterClient(
        http, static_routers([r.url for r in routers]), admin_token=ADMIN_TOKEN, clock=lambda: now[0]
    )
    first = await router_client.observe()
    assert first.demand is not None and first.demand.arrivals_per_s is None  # no earlier round to measure from

    # Six answered through one router, two through the other, over 10 s of the observer's clock.
    for i in range(8):
        reply = await routers[1 if i in (3, 7) else 0].complete(unique_text(64, f"a{i}"), max_tokens=4)
        assert reply.status == 200
    now[0] += 10.0
    second = await router_client.observe()
    assert second.demand is not None
    assert second.demand.arrivals_per_s == pytest.approx(0.8)
    # The mean of the routers' own request times over those eight.
    seconds = [metric_value(await r.metrics(), "shoal_router_request_seconds_sum") or 0.0 for r in routers]
    assert second.demand.request_s == pytest.approx(sum(seconds) / 8)
    assert second.demand.request_s >= 0.05

    # Three that have not finished count as arrivals too (in flight now, none then); no request finished, so
    # there is no request time for the round.
    await fake.stop()
    (slow,) = await start_fakes(1, first_byte_delay_s=30.0)
    held = [await start_router([slow])]
    router_client = RouterClient(http, static_routers([held[0].url]), admin_token=ADMIN_TOKEN, clock=lambda: now[0])
    await router_client.observe()
    pending = [asyncio.create_task(held[0].complete(unique_text(64, f"s{i}"), max_tokens=4)) for i in range(3)]

    async def three_in_flight() -> bool:
        return metric_value(await held[0].metrics(), "shoal_router_in_flight") == 3

    await eventually(three_in_flight, timeout_s=5.0, what="three requests in flight")
    now[0] += 5.0
    third = await router_client.observe()
    assert third.demand is not None
    assert third.demand.arrivals_per_s == pytest.approx(0.6) and third.demand.request_s is None
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
