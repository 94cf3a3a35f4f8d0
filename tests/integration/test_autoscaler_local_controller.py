"""The controller and the router observer against real routers and real fake replicas, on loopback.

The actuator here starts `FakeReplica` servers (real HTTP peers) and lets the test say when each is ready; the
controller is stepped by hand on a clock the test advances, so the policy's windows pass without sleeping. What
is checked is what crosses the wire: registrations, drains, undrains and removals at the router, and requests that
finish while their replica is drained.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from pytest_aiohttp import AiohttpClient

from autoscaler.actuators.base import ReplicaInfo, ReplicaPhase
from autoscaler.controller import Controller, choose_victims
from autoscaler.observe import ReplicaLoad, RouterClient, histogram_quantile, static_routers
from autoscaler.policy import Action, PanicConfig, Reason, ScaleDownConfig, ScalingPolicyConfig
from autoscaler.service import AutoscalerMetrics, create_app
from tests.fakes import FakeReplica, FakeReplicaConfig
from tests.integration.conftest import (
    ADMIN_TOKEN,
    MODEL,
    RouterHandle,
    StartFakes,
    StartRouter,
    eventually,
    unique_text,
)

pytestmark = pytest.mark.integration

# Small windows: one controller step is one virtual second.
POLICY = ScalingPolicyConfig(
    min_replicas=1,
    max_replicas=4,
    target_requests_per_replica=2,
    stable_window_s=2,
    panic=PanicConfig(window_s=1),
    expected_start_s=10,
    scale_down=ScaleDownConfig(stabilization_window_s=3, max_replicas=1, max_percent=0, period_s=1),
)


@dataclass
class _Fake:
    replica: FakeReplica
    phase: ReplicaPhase
    created_s: float


@dataclass
class FakeActuator:
    """The Actuator protocol over FakeReplica servers; new replicas stay `starting` until `make_ready()`."""

    clock: Callable[[], float]
    """The actuator's clock (`ReplicaInfo.created_s`)."""
    fake_config: dict[str, Any] = field(default_factory=dict)
    replicas: dict[str, _Fake] = field(default_factory=dict)
    removed: list[tuple[str, int, int]] = field(default_factory=list)
    """(name, requests in flight at the replica when it was removed, target)."""
    num_started: int = 0

    async def observe(self) -> list[ReplicaInfo]:
        return [ReplicaInfo(n, f.replica.url, f.phase, f.created_s) for n, f in self.replicas.items()]

    async def desired_replicas(self) -> int:
        return len(self.replicas)

    async def scale_up(self, target: int) -> None:
        while len(self.replicas) < target:
            name = f"r{self.num_started}"
            self.num_started += 1
            fake = FakeReplica(FakeReplicaConfig(name=name, **self.fake_config))
            await fake.start()
            self.replicas[name] = _Fake(fake, "starting", self.clock())

    async def scale_down(self, victim: ReplicaInfo, target: int) -> None:
        fake = self.replicas.pop(victim.name)
        self.removed.append((victim.name, fake.replica.in_flight, target))
        await fake.replica.stop()

    def make_ready(self) -> None:
        for f in self.replicas.values():
            if f.phase == "starting":
                f.phase = "ready"

    def fake(self, name: str) -> FakeReplica:
        return self.replicas[name].replica

    async def close(self) -> None:
        for f in self.replicas.values():
            await f.replica.stop()


@dataclass
class Rig:
    controller: Controller
    actuator: FakeActuator
    router: RouterHandle
    clock: list[float]

    async def step(self, seconds: float = 1.0) -> Any:
        self.clock[0] += seconds
        return await self.controller.step()


@pytest.fixture
async def rig(start_router: StartRouter, http: aiohttp.ClientSession) -> AsyncIterator[Rig]:
    router = await start_router(num_ready=0)
    clock = [1000.0]
    actuator = FakeActuator(lambda: clock[0], fake_config={"per_token_delay_s": 0.02, "num_output_tokens": 20})
    router_client = RouterClient(
        http, static_routers([router.url]), admin_token=ADMIN_TOKEN, timeout_s=2.0, clock=lambda: clock[0]
    )
    controller = Controller(
        actuator=actuator,
        routers=router_client,
        config=POLICY,
        metrics=AutoscalerMetrics(),
        drain_timeout_s=5.0,
        drain_poll_s=0.02,
        register_replicas=True,
        clock=lambda: clock[0],
        wall_clock=lambda: clock[0],
    )
    yield Rig(controller, actuator, router, clock)
    await controller.close()
    await actuator.close()


async def _stream(router: RouterHandle, tag: str, max_tokens: int = 20) -> tuple[int, str]:
    """One streamed completion through the router: (status, the whole body)."""
    body = {"model": MODEL, "prompt": unique_text(200, tag), "max_tokens": max_tokens, "stream": True}
    async with router.http.post(router.url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.text()


async def _bring_up(rig: Rig, num: int) -> None:
    """Have the controller start `num` replicas (a floor of `num` for a moment), register them, and wait until
    the router routes to all of them."""
    rig.controller.config = POLICY.model_copy(update={"min_replicas": num})
    decision = await rig.step()
    assert decision.action is Action.UP and decision.target_replicas == num
    rig.actuator.make_ready()
    await rig.step()
    rig.controller.config = POLICY
    await eventually(lambda: _eligible(rig.router, num), what=f"{num} replicas eligible at the router")


async def _eligible(router: RouterHandle, num: int) -> bool:
    return sum(1 for v in (await router.replicas()).values() if v["eligible"]) == num


async def test_new_replicas_are_registered_with_the_router_once_ready(rig: Rig) -> None:
    decision = await rig.step()
    assert (decision.reason, decision.target_replicas) == (Reason.SCALE_UP, 1)
    assert list(rig.actuator.replicas) == ["r0"]
    await rig.step()
    assert await rig.router.replicas() == {}, "a starting replica must not be registered"
    rig.actuator.make_ready()
    await rig.step()
    views = await rig.router.replicas()
    assert list(views) == ["r0"] and views["r0"]["url"] == rig.actuator.fake("r0").url
    await eventually(lambda: _eligible(rig.router, 1), what="r0 eligible")
    status, body = await _stream(rig.router, "first")
    assert status == 200 and "r0/tok" in body


async def test_load_through_the_router_scales_up(rig: Rig) -> None:
    await _bring_up(rig, 1)
    rig.actuator.fake("r0").config.hang = True
    requests = [asyncio.create_task(_stream(rig.router, f"load{i}")) for i in range(6)]
    await eventually(lambda: rig.actuator.fake("r0").in_flight == 6, what="6 requests at r0")
    decision = await rig.step()
    # 6 requests at 2 per replica: 3 replicas. The 1 s panic window sees 3x the one ready replica.
    assert decision.action is Action.UP and decision.target_replicas == 3 and decision.is_panicking
    assert len(rig.actuator.replicas) == 3
    decision = await rig.step()
    assert decision.action is Action.HOLD and decision.current_replicas == 3, "starting replicas are capacity"
    await rig.actuator.fake("r0").stop()  # releases the hung requests (503s) so the test can end
    await asyncio.gather(*requests)


async def test_scale_down_drains_the_least_loaded_replica_and_its_requests_finish(rig: Rig) -> None:
    await _bring_up(rig, 2)
    rig.controller.config = POLICY.model_copy(update={"target_requests_per_replica": 4})
    for name in ("r0", "r1"):
        rig.actuator.fake(name).config.per_token_delay_s = 0.05  # 20 tokens: ~1 s per request
    requests = [asyncio.create_task(_stream(rig.router, f"busy{i}")) for i in range(3)]
    await eventually(
        lambda: sorted(rig.actuator.fake(n).in_flight for n in ("r0", "r1")) == [1, 2], what="requests at both"
    )
    lighter = min(("r0", "r1"), key=lambda n: rig.actuator.fake(n).in_flight)
    decision = None
    for _ in range(6):  # the stabilization window (3 s) passes
        decision = await rig.step()
        if decision.action is Action.DOWN:
            break
    assert decision is not None and decision.action is Action.DOWN and decision.target_replicas == 1

    async def is_draining() -> bool:
        return (await rig.router.replicas())[lighter]["status"] == "draining"

    await eventually(is_draining, what=f"{lighter} draining")
    await rig.controller.wait_for_removals()
    # The victim was removed only once its request had finished, and every request succeeded.
    assert rig.actuator.removed == [(lighter, 0, 1)]
    record = rig.controller.removals[-1]
    assert (record.name, record.outcome, record.in_flight_at_drain) == (lighter, "drained", 1)
    results = await asyncio.gather(*requests)
    assert all(status == 200 and "[DONE]" in body for status, body in results), results
    assert lighter not in await rig.router.replicas(), "a removed local replica leaves the router"
    assert (await rig.step()).current_replicas == 1


async def test_demand_coming_back_cancels_a_drain(rig: Rig) -> None:
    await _bring_up(rig, 2)
    for name in ("r0", "r1"):
        rig.actuator.fake(name).config.hang = True
    stuck = [asyncio.create_task(_stream(rig.router, f"stuck{i}")) for i in range(2)]
    await eventually(lambda: [rig.actuator.fake(n).in_flight for n in ("r0", "r1")] == [1, 1], what="one at each")
    for _ in range(6):
        if (await rig.step()).action is Action.DOWN:
            break
    (victim,) = rig.controller.draining

    async def is_draining() -> bool:
        return (await rig.router.replicas())[victim]["status"] == "draining"

    await eventually(is_draining, what=f"{victim} draining")
    # Load returns while the victim still drains its hung request: it is kept (undrained), and only the rest of
    # the new demand starts replicas.
    more = [asyncio.create_task(_stream(rig.router, f"more{i}")) for i in range(5)]
    await eventually(lambda: sum(rig.actuator.fake(n).in_flight for n in ("r0", "r1")) == 7, what="7 requests")
    decision = await rig.step()
    assert decision.action is Action.UP and decision.current_replicas == 1
    assert not rig.controller.draining and rig.actuator.removed == []
    assert (await rig.router.replicas())[victim]["status"] == "healthy"
    assert rig.controller.removals[-1].outcome == "cancelled"
    assert len(rig.actuator.replicas) == decision.target_replicas
    assert rig.actuator.num_started == 2 + decision.target_replicas - 2
    for name in list(rig.actuator.replicas):
        await rig.actuator.fake(name).stop()
    await asyncio.gather(*stuck, *more)


async def test_a_drain_that_times_out_still_removes_the_replica(rig: Rig) -> None:
    await _bring_up(rig, 2)
    rig.controller.drain_timeout_s = 0.0
    for name in ("r0", "r1"):
        rig.actuator.fake(name).config.hang = True
    stuck = asyncio.create_task(_stream(rig.router, "stuck"))
    await eventually(lambda: sum(rig.actuator.fake(n).in_flight for n in ("r0", "r1")) == 1, what="one request")
    loaded = next(n for n in ("r0", "r1") if rig.actuator.fake(n).in_flight)
    for _ in range(6):
        if (await rig.step()).action is Action.DOWN:
            break
    await rig.controller.wait_for_removals()
    (name, _, _), record = rig.actuator.removed[0], rig.controller.removals[-1]
    assert name != loaded, "the replica with a request in flight is not the victim"
    assert record.outcome == "drained"
    await rig.actuator.fake(loaded).stop()
    await stuck


async def test_failed_replicas_are_removed_and_replaced(rig: Rig) -> None:
    await _bring_up(rig, 1)
    rig.actuator.replicas["r0"].phase = "failed"
    decision = await rig.step()
    assert rig.actuator.removed[0][0] == "r0"
    assert rig.controller.removals[-1].outcome == "failed"
    assert "r0" not in await rig.router.replicas()
    assert decision.action is Action.UP and list(rig.actuator.replicas) == ["r1"]


async def test_a_replica_that_never_gets_ready_is_replaced_after_its_deadline(rig: Rig) -> None:
    await rig.step()
    assert list(rig.actuator.replicas) == ["r0"]
    for _ in range(int(POLICY.start_deadline_s) - 2):
        await rig.step()
    assert list(rig.actuator.replicas) == ["r0"], "within its deadline it counts as capacity"
    await rig.step(3.0)
    assert list(rig.actuator.replicas) == ["r1"]
    assert rig.controller.removals[-1].name == "r0" and rig.controller.removals[-1].outcome == "failed"


async def test_a_drain_left_behind_is_undone_and_a_lost_registration_redone(rig: Rig) -> None:
    await _bring_up(rig, 1)
    # An earlier autoscaler stopped mid-drain: the replica is still draining, and nothing of ours removes it.
    assert (await rig.router.admin("POST", "/replicas/r0/drain")).status == 200
    await rig.step()
    assert (await rig.router.replicas())["r0"]["status"] == "healthy"
    # The router lost it (a restart, or an operator's DELETE): it is registered again.
    assert (await rig.router.admin("DELETE", "/replicas/r0")).status == 200
    await rig.step()
    assert list(await rig.router.replicas()) == ["r0"]


async def test_without_an_admin_token_the_observer_still_reads_demand(
    start_fakes: StartFakes, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    router = await start_router(await start_fakes(1))
    router_client = RouterClient(
        http, static_routers([router.url]), admin_token=None, clock=asyncio.get_running_loop().time
    )
    reading = await router_client.observe()
    assert reading.demand is not None and reading.demand.requests == 0 and reading.demand.kv_usage is None
    assert reading.replicas == {} and reading.listed == {} and not reading.errors


async def test_dry_run_decides_but_changes_nothing(rig: Rig) -> None:
    rig.controller.dry_run = True
    decision = await rig.step()
    assert decision.action is Action.UP
    assert rig.actuator.replicas == {}
    await rig.actuator.scale_up(1)
    rig.actuator.make_ready()
    await rig.step()
    assert await rig.router.replicas() == {}, "dry run registers nothing"


async def test_missing_router_figures_hold_the_fleet(rig: Rig) -> None:
    await _bring_up(rig, 2)
    await rig.router.cleanup()
    decisions = [await rig.step() for _ in range(8)]
    assert {d.reason for d in decisions} == {Reason.METRICS_STALE, Reason.METRICS_UNAVAILABLE}
    assert all(d.action is Action.HOLD for d in decisions) and len(rig.actuator.replicas) == 2
    assert rig.controller.routers.last_reading is not None and rig.controller.routers.last_reading.errors


async def test_observer_sums_every_router_and_reads_ttft(
    start_fakes: StartFakes, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    fakes = await start_fakes(2, first_byte_delay_s=0.3, num_output_tokens=2)
    routers = [await start_router(fakes), await start_router(fakes)]
    router_client = RouterClient(
        http, static_routers([r.url for r in routers]), admin_token=ADMIN_TOKEN, clock=asyncio.get_running_loop().time
    )
    first = await router_client.observe()
    assert first.demand is not None and first.demand.requests == 0 and first.demand.ttft_s is None
    assert set(first.replicas) == {f.url for f in fakes}
    pending = [asyncio.create_task(_stream(r, f"r{i}-{j}")) for i, r in enumerate(routers) for j in range(3)]
    await eventually(lambda: sum(f.in_flight for f in fakes) == 6, what="6 requests at the replicas")
    busy = await router_client.observe()
    assert busy.demand is not None and busy.demand.requests == 6 and busy.demand.waiting == 6
    assert sum(load.in_flight for load in busy.replicas.values()) == 6
    assert all(load.cached_blocks > 0 for load in busy.replicas.values() if load.in_flight)
    await asyncio.gather(*pending)
    after = await router_client.observe()
    assert after.demand is not None and after.demand.requests == 0
    assert after.demand.ttft_s is not None and 0.25 <= after.demand.ttft_s <= 0.5
    quiet = await router_client.observe()
    assert quiet.demand is not None and quiet.demand.ttft_s is None, "only requests since the last round count"
    await routers[1].cleanup()
    missing = await router_client.observe()
    assert missing.demand is None and missing.errors and routers[1].url in missing.errors[0]


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    buckets = ((0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (float("inf"), 40.0))
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.3)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.9, buckets) == pytest.approx(0.5 + 0.5 * 6 / 10)
    assert histogram_quantile(0.99, ((1.0, 1.0), (float("inf"), 10.0))) == 1.0
    assert histogram_quantile(0.5, ((1.0, 0.0), (float("inf"), 0.0))) is None


def test_victims_are_the_cheapest_to_remove() -> None:
    def info(name: str, phase: ReplicaPhase = "ready", created: float = 0.0) -> ReplicaInfo:
        return ReplicaInfo(name, f"http://{name}", phase, created)

    loads = {
        "http://busy": ReplicaLoad("http://busy", 5, 0, None),
        "http://warm": ReplicaLoad("http://warm", 1, 900, None),
        "http://cold": ReplicaLoad("http://cold", 1, 10, None),
        "http://idle": ReplicaLoad("http://idle", 0, 5000, None),
    }
    ready = [info("busy"), info("warm"), info("cold"), info("idle")]
    assert [v.name for v in choose_victims(ready, loads, 3)] == ["idle", "cold", "warm"]
    starting = [*ready, info("new", "starting", created=5.0), info("newer", "starting", created=9.0)]
    assert [v.name for v in choose_victims(starting, loads, 2)] == ["newer", "new"]


async def test_metrics_endpoint(aiohttp_client: AiohttpClient, rig: Rig) -> None:
    await rig.step()
    client = await aiohttp_client(create_app(rig.controller.metrics))
    resp = await client.get("/metrics")
    text = await resp.text()
    assert resp.status == 200
    assert "shoal_autoscaler_desired_replicas 1.0" in text
    assert "shoal_autoscaler_current_replicas 0.0" in text
    assert 'shoal_autoscaler_decisions_total{action="up",reason="scale_up"} 1.0' in text
    assert 'shoal_autoscaler_capped_decisions_total{cap="min_replicas"} 1.0' in text
    for name in ("ready", "starting", "draining"):
        assert f"shoal_autoscaler_{name}_replicas" in text


async def test_a_ttft_breach_at_the_router_scales_up_in_one_step(rig: Rig) -> None:
    # One replica, one slow first byte (0.8 s, over the 0.5 s target): the requests signal wants one replica,
    # the router's TTFT histogram since the previous step shows the breach, and the very next step adds one.
    await _bring_up(rig, 1)
    rig.controller.config = POLICY.model_copy(update={"target_ttft_s": 0.5})
    assert (await rig.step()).action is Action.HOLD
    rig.actuator.fake("r0").config.first_byte_delay_s = 0.8
    status, _ = await _stream(rig.router, "slow")
    assert status == 200
    decision = await rig.step()
    assert decision.action is Action.UP and decision.target_replicas == 2
    assert decision.reason is Reason.TTFT_BREACH and "breaches the 0.5 s target" in decision.detail
    assert len(rig.actuator.replicas) == 2


async def test_requests_queued_in_the_engine_count_as_demand(rig: Rig) -> None:
    # The engine reports 6 requests waiting that never went through this router; the router scrapes the gauge
    # and lists it, and the controller sizes on it: 6 at 2 per replica is 3 replicas.
    await _bring_up(rig, 1)
    rig.actuator.fake("r0").config.metric_overrides = {"running": 0, "waiting": 6}

    async def is_scraped() -> bool:
        return (await rig.router.replicas())["r0"]["engine"].get("num_waiting") == 6

    await eventually(is_scraped, what="the engine's queue scraped by the router")
    decision = await rig.step()
    assert decision.action is Action.UP and decision.target_replicas == 3
    reading = rig.controller.routers.last_reading
    assert reading is not None and reading.demand is not None and reading.demand.waiting == 6
