"""The autoscaler's control loop and removals under supervision (router/service/supervise.py), each failed once
for real: a router (a real HTTP peer on loopback) whose replica listing lacks a replica's id, which the observer
cannot read. The failure is logged in one line with its traceback, counted in
`shoal_autoscaler_task_failures_total{task}`, and the loop goes on; state is polled with deadlines.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from prometheus_client import generate_latest

from autoscaler.actuators.base import ReplicaInfo, ReplicaPhase
from autoscaler.controller import Controller
from autoscaler.observe import RouterClient, static_routers
from autoscaler.policy import ScaleDownConfig, ScalingPolicyConfig
from autoscaler.service import AutoscalerMetrics
from tests.integration.conftest import ADMIN_TOKEN, eventually, metric_value
from tests.integration.scripted_peer import Answer, ScriptedPeer, json_answer, scripted_peer

pytestmark = pytest.mark.integration

REPLICA_URL = "http://127.0.0.1:9"
"""The replica the actuator reports; nothing is sent to it."""


@dataclass
class ListedActuator:
    """The Actuator protocol over a fixed list of replicas, recording removals."""

    replicas: dict[str, ReplicaPhase]
    removed: list[str] = field(default_factory=list)

    async def observe(self) -> list[ReplicaInfo]:
        return [ReplicaInfo(name, REPLICA_URL, phase, 0.0) for name, phase in self.replicas.items()]

    async def desired_replicas(self) -> int:
        return len(self.replicas)

    async def scale_up(self, target: int) -> None:
        pass

    async def scale_down(self, victim: ReplicaInfo, target: int) -> None:
        del self.replicas[victim.name]
        self.removed.append(victim.name)


def listing(entry: dict[str, object]) -> Answer:
    return json_answer({"replicas": [entry]})


GOOD = listing({"id": "r1", "url": REPLICA_URL, "status": "healthy", "eligible": True, "in_flight": 0})
NO_ID = listing({"url": REPLICA_URL, "status": "healthy"})


def router_answers(*listings: Answer) -> dict[str, list[Answer]]:
    return {
        "/metrics": [Answer(b"shoal_router_in_flight 0\n", content_type="text/plain")],
        "/admin/replicas": list(listings),
        "/admin/index": [json_answer({"blocks_per_replica": {}})],
        "/admin/replicas/r1": [json_answer({"removed": "r1"})],
        "/admin/replicas/r1/drain": [json_answer({"draining": "r1"})],
        "/admin/replicas/r1/undrain": [json_answer({"undrained": "r1"})],
    }


@asynccontextmanager
async def running(
    http: aiohttp.ClientSession, answers: dict[str, list[Answer]], phases: dict[str, ReplicaPhase], **config: Any
) -> AsyncIterator[tuple[Controller, ListedActuator, ScriptedPeer]]:
    """A controller stepping every 50 ms against a scripted router, running until the block ends."""
    async with scripted_peer(answers) as router:
        loop = asyncio.get_running_loop()
        actuator = ListedActuator(dict(phases))
        controller = Controller(
            actuator=actuator,
            routers=RouterClient(http, static_routers([router.url]), admin_token=ADMIN_TOKEN, clock=loop.time),
            config=ScalingPolicyConfig(min_replicas=1, max_replicas=2, **config),
            metrics=AutoscalerMetrics(),
            interval_s=0.05,
            drain_poll_s=0.01,
            register_replicas=True,
            clock=loop.time,
            wall_clock=loop.time,
        )
        task = asyncio.ensure_future(controller.run())
        try:
            yield controller, actuator, router
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def sample(controller: Controller, name: str, labels: dict[str, str] | None = None) -> float | None:
    return metric_value(generate_latest(controller.metrics.registry).decode(), name, labels)


def failure_lines(caplog: pytest.LogCaptureFixture, task: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "shoal.autoscaler.tasks" and f"task {task} " in r.getMessage()]


async def test_a_control_loop_that_fails_is_restarted_and_goes_on(
    http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    # Observing reads the listing first (well); removing the failed replica reads it again (no id), then well.
    caplog.set_level(logging.ERROR, logger="shoal.autoscaler.tasks")
    answers = router_answers(GOOD, NO_ID, GOOD)
    async with running(http, answers, {"r1": "failed", "r2": "ready"}) as (controller, actuator, router):
        await eventually(lambda: actuator.removed == ["r1"], what="the failed replica removed after the restart")
        assert router.num_requests["/admin/replicas/r1"] == 1  # deregistered once, on the second try
        assert sample(controller, "shoal_autoscaler_task_failures_total", {"task": "control"}) == 1
        assert sample(controller, "shoal_autoscaler_tasks_down", {"task": "control"}) == 0
        assert sample(controller, "shoal_autoscaler_leader") == 1
        lines = failure_lines(caplog, "control")
        assert len(lines) == 1 and "(KeyError: 'id')" in lines[0].getMessage() and lines[0].exc_info is not None
        num_steps = router.num_requests["/metrics"]
        await eventually(lambda: router.num_requests["/metrics"] > num_steps + 2, what="steps going on")
    assert sample(controller, "shoal_autoscaler_leader") == 0


async def test_a_removal_that_fails_ends_as_an_error_and_is_tried_again(
    http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    # No load: one of the two ready replicas goes. Once it is drained, the listing that says when its requests
    # are done lacks its id.
    caplog.set_level(logging.ERROR, logger="shoal.autoscaler.tasks")
    scale_down = ScaleDownConfig(stabilization_window_s=0, period_s=0.05)
    phases: dict[str, ReplicaPhase] = {"r1": "ready", "r2": "ready"}
    async with running(http, router_answers(GOOD), phases, scale_down=scale_down) as (controller, actuator, router):
        router.after["/admin/replicas/r1/drain"] = lambda: router.then("/admin/replicas", NO_ID)
        await eventually(lambda: len(controller.removals) >= 1, what="a removal tried")
        del router.after["/admin/replicas/r1/drain"]
        router.then("/admin/replicas", GOOD)
        first = controller.removals[0]
        assert (first.name, first.outcome) == ("r1", "error")
        assert sample(controller, "shoal_autoscaler_task_failures_total", {"task": "removal"}) == 1
        assert sample(controller, "shoal_autoscaler_removals_total", {"outcome": "error"}) == 1
        lines = failure_lines(caplog, "removal")
        assert len(lines) == 1 and "removal (r1) failed (KeyError: 'id')" in lines[0].getMessage()
        # The next decisions take it from there: the removal is tried again, and this time it goes through.
        await eventually(lambda: actuator.removed == ["r1"], what="the removal done on a later try")
        assert sample(controller, "shoal_autoscaler_task_failures_total", {"task": "control"}) == 0
