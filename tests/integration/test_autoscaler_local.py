"""The local actuator end to end: real `shoal replica` processes of the tiny checkpoint behind a real router.

Under a burst of streamed requests through the router the fleet grows from one replica to three; when most of the
load stops it shrinks, draining each victim while it still serves requests; when all load stops it is back at one.
Not one request fails along the way. Policy windows are seconds long so the whole run fits in about a minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from autoscaler.actuators.local import LocalActuator
from autoscaler.controller import Controller
from autoscaler.observe import RouterClient, static_routers
from autoscaler.policy import PanicConfig, ScaleDownConfig, ScalingPolicyConfig
from autoscaler.service import AutoscalerMetrics
from autoscaler.settings import LocalSettings
from tests.integration.conftest import ADMIN_TOKEN, MODEL, RouterHandle, StartRouter, eventually, unique_text
from tests.integration.ports import free_ports

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

POLICY = ScalingPolicyConfig(
    min_replicas=1,
    max_replicas=3,
    target_requests_per_replica=2,
    stable_window_s=2,
    panic=PanicConfig(window_s=1),
    expected_start_s=30,
    scale_down=ScaleDownConfig(stabilization_window_s=3, max_replicas=1, max_percent=0, period_s=2),
)


@dataclass
class Load:
    """Clients that each send streamed completions back to back until stopped; every outcome is kept."""

    router: RouterHandle
    max_tokens: int
    results: list[tuple[int, bool, str]] = field(default_factory=list)
    """(status, finished with [DONE], replica) per request."""
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self, num_clients: int) -> None:
        self._tasks += [asyncio.create_task(self._client(i)) for i in range(num_clients)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _client(self, index: int) -> None:
        while not self._stop.is_set():
            body = {
                "model": MODEL,
                "prompt": unique_text(120, f"client{index}"),
                "max_tokens": self.max_tokens,
                "ignore_eos": True,
                "stream": True,
            }
            timeout = aiohttp.ClientTimeout(total=60)
            async with self.router.http.post(self.router.url + "/v1/completions", json=body, timeout=timeout) as resp:
                text = await resp.text()
                replica = resp.headers.get("x-shoal-replica", "?")
                self.results.append((resp.status, text.rstrip().endswith("data: [DONE]"), replica))

    @property
    def failures(self) -> list[tuple[int, bool, str]]:
        return [r for r in self.results if r[0] != 200 or not r[1]]


async def test_local_replicas_grow_under_load_and_shrink_without_failing_a_request(
    start_router: StartRouter, http: aiohttp.ClientSession, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    started = time.monotonic()
    router = await start_router(num_ready=0)
    settings = LocalSettings(
        model=str(tiny_checkpoint),
        served_model_name=MODEL,
        base_port=free_ports(POLICY.max_replicas),
        max_replicas=POLICY.max_replicas,
        threads=1,
        stop_timeout_s=10,
        log_dir=tmp_path / "replicas",
    )
    actuator = LocalActuator(settings, http)
    loop = asyncio.get_running_loop()
    controller = Controller(
        actuator=actuator,
        routers=RouterClient(http, static_routers([router.url]), admin_token=ADMIN_TOKEN, clock=loop.time),
        config=POLICY,
        metrics=AutoscalerMetrics(),
        interval_s=0.25,
        drain_timeout_s=30,
        drain_poll_s=0.05,
        register_replicas=True,
        clock=loop.time,
    )
    running = asyncio.create_task(controller.run())
    burst = Load(router, max_tokens=24)
    tail = Load(router, max_tokens=160)
    try:
        await eventually(lambda: _num_eligible(router, 1), timeout_s=40, what="the first replica in rotation")

        # A burst of 8 clients wants 4 replicas at 2 requests each; the policy's budget is 3.
        burst.start(8)
        await eventually(lambda: _num_eligible(router, 3), timeout_s=45, what="3 replicas in rotation")
        assert len(await actuator.observe()) == 3
        await eventually(
            lambda: len({replica for _, _, replica in burst.results}) == 3, timeout_s=15, what="the burst on all 3"
        )

        # Most of the load stops: 3 clients of longer requests want 2 replicas. The victim is drained while its
        # request still streams, and removed only once that request is done. The tail starts once the burst's last
        # requests are done, so that it lands one request per replica (placed beside the burst's, it could leave a
        # replica idle, and the fewest-in-flight victim would then have nothing to drain); the scale-down window
        # still remembers the burst, so the fleet stays at 3 until the tail has spread.
        await burst.stop()
        tail.start(3)
        await eventually(lambda: _num_processes(actuator, 2), timeout_s=40, what="the fleet shrunk to 2")
        drained_busy = [r for r in controller.removals if r.outcome == "drained" and r.in_flight_at_drain]
        assert drained_busy, list(controller.removals)

        # All load stops: back to one replica.
        await tail.stop()
        await eventually(lambda: _num_processes(actuator, 1), timeout_s=40, what="the fleet shrunk to 1")
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        await burst.stop()
        await tail.stop()
        await actuator.close()

    assert burst.failures == [] and tail.failures == [], (burst.failures, tail.failures)
    assert len(burst.results) > 20 and len(tail.results) >= 3
    assert [r.outcome for r in controller.removals] == ["drained", "drained"]
    assert time.monotonic() - started < 90


async def _num_eligible(router: RouterHandle, num: int) -> bool:
    return sum(1 for v in (await router.replicas()).values() if v["eligible"]) >= num


async def _num_processes(actuator: LocalActuator, num: int) -> bool:
    return len(await actuator.observe()) == num
