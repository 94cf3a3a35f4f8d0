"""Demand from a Prometheus HTTP API: the real observer and controller against a stand-in Prometheus on loopback.

`FakePrometheus` answers the instant-query endpoint with the values or errors each test sets; a real router in
front of real fake replicas gives the per-replica figures through its admin API, as it does with `source: routers`.
The controller is stepped by hand on a clock the test advances (the fake's sample stamps follow it), so windows and
sample ages pass without sleeping. Each kind of failure must freeze the fleet exactly as a router that does not
answer its scrape does, and the same rig with good figures must shrink it, so the freeze is the failure's doing.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest

from autoscaler.actuators.base import ReplicaInfo
from autoscaler.cli import run_autoscaler
from autoscaler.controller import Controller
from autoscaler.observe import RouterClient, static_routers
from autoscaler.policy import (
    Action,
    MetricsConfig,
    Reason,
    ScaleDecision,
)
from autoscaler.prometheus import PrometheusDemand
from autoscaler.service import AutoscalerMetrics
from autoscaler.settings import AutoscalerSettings, PrometheusSettings
from tests.fakes import FakeReplica
from tests.integration.conftest import (
    ADMIN_TOKEN,
    RouterHandle,
    StartFakes,
    StartRouter,
    eventually,
    metric_value,
)
from tests.integration.ports import free_ports
from tests.integration.prometheus_support import Answer, FakePrometheus, error, scalar, vector
from tests.integration.test_autoscaler_local_controller import POLICY as LOCAL_POLICY

pytestmark = pytest.mark.integration

# The local controller tests' small windows, with staleness and hold limits this file's failures run into.
POLICY = LOCAL_POLICY.model_copy(update={"metrics": MetricsConfig(stale_after_s=10, hold_after_failures=3)})
SELECTOR = 'namespace="llm"'
IN_FLIGHT = 'sum(shoal_router_in_flight{namespace="llm"})'
QUEUE_DEPTH = 'sum(shoal_router_queue_depth{namespace="llm"})'
HELD = 'sum(shoal_router_held_requests{namespace="llm"})'
PREFILL = 'sum(shoal_router_prefill_backlog_tokens{namespace="llm"})'
TTFT = 'histogram_quantile(0.9, sum by (le) (rate(shoal_router_ttft_seconds_bucket{namespace="llm"}[1m])))'
ROUTERS_DOWN = 'count(up{namespace="llm"} == 0)'
QUIET = {
    IN_FLIGHT: vector(0.0),
    QUEUE_DEPTH: vector(0.0),
    HELD: vector(0.0),
    PREFILL: vector(0.0),
    TTFT: vector(math.nan),
    ROUTERS_DOWN: Answer(),  # no router down: `count()` of no series is no series
}
"""A fleet without requests, as Prometheus reports it (no request in the rate window: the quantile is NaN)."""


@dataclass
class StaticActuator:
    """Two ready replicas that exist as long as the test says; removals are recorded, not carried out."""

    replicas: list[ReplicaInfo]
    removed: list[str] = field(default_factory=list)

    async def observe(self) -> list[ReplicaInfo]:
        return [r for r in self.replicas if r.name not in self.removed]

    async def desired_replicas(self) -> int:
        return len(self.replicas) - len(self.removed)

    async def scale_up(self, target: int) -> None:
        raise AssertionError(f"nothing here asks for more replicas (asked for {target})")

    async def scale_down(self, victim: ReplicaInfo, target: int) -> None:
        self.removed.append(victim.name)


@dataclass
class Rig:
    prometheus: FakePrometheus
    reader: PrometheusDemand
    router_client: RouterClient
    controller: Controller
    actuator: StaticActuator
    router: RouterHandle
    fakes: list[FakeReplica]
    clock: list[float]
    """[monotonic, Unix]: the controller's clock, and the Unix clock of Prometheus' stamps and the reader."""

    async def step(self, seconds: float = 1.0) -> ScaleDecision:
        self.clock[0] += seconds
        self.clock[1] += seconds
        return await self.controller.step()


def prometheus_settings(url: str, **overrides: object) -> PrometheusSettings:
    values: dict[str, object] = {
        "url": url,
        "selector": SELECTOR,
        "bearer_token": "prom-token",
        "headers": {"X-Scope-OrgID": "tenant-1"},
        "timeout_s": 0.5,
        "max_sample_age_s": 30,
    }
    return PrometheusSettings.model_validate({**values, **overrides})


@pytest.fixture
async def rig(start_fakes: StartFakes, start_router: StartRouter, http: aiohttp.ClientSession) -> AsyncIterator[Rig]:
    fakes = await start_fakes(2)
    router = await start_router(fakes)
    clock = [1000.0, 1_750_000_000.0]
    prometheus = FakePrometheus(clock=lambda: clock[1])
    await prometheus.start()
    reader = PrometheusDemand(
        http, prometheus_settings(prometheus.url), ttft_quantile=POLICY.ttft_quantile, wall_clock=lambda: clock[1]
    )
    router_client = RouterClient(
        http,
        static_routers([router.url]),
        admin_token=ADMIN_TOKEN,
        clock=lambda: clock[0],
        demand_source=reader,
    )
    actuator = StaticActuator([ReplicaInfo(f"r{i}", f.url, "ready", 0.0) for i, f in enumerate(fakes)])
    controller = Controller(
        actuator=actuator,
        routers=router_client,
        config=POLICY,
        metrics=AutoscalerMetrics(),
        drain_timeout_s=2.0,
        drain_poll_s=0.02,
        clock=lambda: clock[0],
        wall_clock=lambda: clock[1],
    )
    yield Rig(prometheus, reader, router_client, controller, actuator, router, fakes, clock)
    await controller.close()
    await prometheus.stop()


async def test_each_query_maps_to_its_figure(rig: Rig) -> None:
    rig.prometheus.set(
        {
            IN_FLIGHT: vector(3.0, 2.0),  # two series (no sum() in a user's query): summed
            QUEUE_DEPTH: scalar(2.0),
            HELD: vector(1.0),
            PREFILL: vector(300.0, age_s=4.0),
            TTFT: vector(0.42),
        }
    )

    async def kv_listed() -> bool:
        return all(r["engine"].get("kv_usage") is not None for r in (await rig.router.replicas()).values())

    await eventually(kv_listed, what="the router's first scrape of the replicas' KV usage")
    reading = await rig.router_client.observe()

    assert not reading.errors and reading.demand is not None
    d = reading.demand
    assert (d.requests, d.waiting, d.prefill_backlog_tokens, d.ttft_s) == (6.0, 3.0, 300.0, 0.42)
    assert reading.measured_at == pytest.approx(rig.clock[0] - 4.0, abs=0.01), "as old as the oldest sample"
    # Per-replica figures, and KV usage when no KV query is set, come from the router's admin API.
    assert set(reading.replicas) == {f.url for f in rig.fakes}
    assert d.kv_usage == pytest.approx(sum(r.kv_usage or 0.0 for r in reading.replicas.values()))
    assert d.kv_usage is not None
    # One instant query per figure, at Prometheus' now (no `time`), with the credentials and headers set.
    assert {r.query for r in rig.prometheus.received} == {IN_FLIGHT, QUEUE_DEPTH, HELD, PREFILL, TTFT, ROUTERS_DOWN}
    for request in rig.prometheus.received:
        assert "time" not in request.params and request.params["timeout"] == "0.5s"
        assert request.headers["Authorization"] == "Bearer prom-token"
        assert request.headers["X-Scope-OrgID"] == "tenant-1"


async def test_optional_figures_may_be_missing_and_a_kv_query_overrides_the_routers(
    rig: Rig, http: aiohttp.ClientSession
) -> None:
    rig.prometheus.set({**QUIET, TTFT: Answer()})  # no TTFT series at all: no figure, no failure
    reading = await rig.router_client.observe()
    assert reading.demand is not None and reading.demand.ttft_s is None and not reading.errors

    kv_query = 'sum(vllm:kv_cache_usage_perc{namespace="llm"})'
    reader = PrometheusDemand(
        http,
        prometheus_settings(rig.prometheus.url, queries={"kv_usage": kv_query}),
        ttft_quantile=0.9,
        wall_clock=lambda: rig.clock[1],
    )
    rig.prometheus.set({kv_query: vector(0.25, 0.5)})
    reading = await reader.read()
    assert reading.demand is not None and reading.demand.kv_usage == 0.75

    # Arrivals and request time (for `capacity.from_arrivals`) are queried only when set; NaN is no figure.
    arrivals = 'sum(rate(shoal_router_requests_total{namespace="llm"}[1m]))'
    request_s = 'sum(rate(shoal_router_request_seconds_sum{namespace="llm"}[1m])) / sum(rate(x[1m]))'
    reader = PrometheusDemand(
        http,
        prometheus_settings(rig.prometheus.url, queries={"arrivals_per_s": arrivals, "request_s": request_s}),
        ttft_quantile=0.9,
        wall_clock=lambda: rig.clock[1],
    )
    rig.prometheus.set({arrivals: vector(1.5, 2.0), request_s: vector(math.nan)})
    reading = await reader.read()
    assert reading.demand is not None and not reading.errors
    assert (reading.demand.arrivals_per_s, reading.demand.request_s) == (3.5, None)


async def test_good_figures_shrink_the_idle_fleet(rig: Rig) -> None:
    """The control for the failure cases below: the same rig, answered well, removes a replica."""
    rig.prometheus.set(QUIET)
    decisions = [await rig.step() for _ in range(6)]
    assert any(d.action is Action.DOWN for d in decisions), decisions
    await rig.controller.wait_for_removals()
    assert len(rig.actuator.removed) == 1 and rig.controller.state.failed_observations == 0


FAULTS = {
    "error status": ({IN_FLIGHT: error("execution", "query processing would load too many samples")}, IN_FLIGHT),
    "empty vector": ({QUEUE_DEPTH: Answer()}, QUEUE_DEPTH),
    "NaN": ({HELD: vector(math.nan)}, HELD),
    "stale sample": ({PREFILL: vector(5.0, age_s=45.0)}, PREFILL),
    "matrix result": ({IN_FLIGHT: Answer(result_type="matrix")}, IN_FLIGHT),
    "proxy error page": ({QUEUE_DEPTH: Answer(raw_body="<html>502 Bad Gateway</html>", http_status=502)}, QUEUE_DEPTH),
    "no answer in time": ({HELD: Answer(values=(({}, 0.0),), delay_s=2.0)}, HELD),
    "TTFT query error": ({TTFT: error("bad_data", "parse error")}, TTFT),
    # A router died: its series left the sums, which now look like less demand than there is.
    "a router target down": ({IN_FLIGHT: vector(0.0), ROUTERS_DOWN: vector(1.0)}, ROUTERS_DOWN),
    "the up query failing": ({ROUTERS_DOWN: error("execution", "too many samples")}, ROUTERS_DOWN),
    "server down": ({}, IN_FLIGHT),
}


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_a_failed_query_freezes_the_fleet_like_a_missing_router_scrape(rig: Rig, fault: str) -> None:
    answers, named = FAULTS[fault]
    rig.prometheus.set({**QUIET, **answers})
    port = rig.prometheus.port
    if fault == "server down":
        await rig.prometheus.stop()

    decisions = [await rig.step() for _ in range(6)]

    assert all(d.action is Action.HOLD for d in decisions), decisions
    assert [d.reason for d in decisions] == [Reason.METRICS_STALE] * 2 + [Reason.METRICS_UNAVAILABLE] * 4
    assert rig.controller.state.failed_observations == 6 and rig.actuator.removed == []
    reading = rig.router_client.last_reading
    assert reading is not None and reading.demand is None
    assert any(named in e for e in reading.errors), reading.errors  # the log and the reading name the failing query
    # Figures that come back end the freeze.
    rig.prometheus.set(QUIET)
    if fault == "server down":
        await rig.prometheus.start(port)
    await rig.step()
    assert rig.controller.state.failed_observations == 0


async def test_a_sample_the_policy_finds_too_old_holds_the_fleet(rig: Rig) -> None:
    """Within the reader's limit (30 s) but past the policy's `stale_after_s` (10 s): the policy's own path."""
    rig.prometheus.set({**QUIET, IN_FLIGHT: vector(0.0, age_s=20.0)})
    decisions = [await rig.step() for _ in range(6)]
    assert {d.reason for d in decisions} == {Reason.METRICS_STALE, Reason.METRICS_UNAVAILABLE}
    assert rig.actuator.removed == [] and not rig.router_client.last_reading.errors  # type: ignore[union-attr]


async def test_a_router_whose_admin_api_fails_freezes_the_fleet_too(rig: Rig) -> None:
    """Prometheus answers, but the victim could not be chosen on what the routers see: no demand."""
    rig.prometheus.set(QUIET)
    await rig.router.cleanup()
    decisions = [await rig.step() for _ in range(4)]
    assert all(d.action is Action.HOLD for d in decisions) and rig.actuator.removed == []
    assert rig.router_client.last_reading is not None and rig.router.url in rig.router_client.last_reading.errors[0]


async def test_shoal_autoscaler_reads_the_prometheus_its_settings_name(
    start_router: StartRouter, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command's wiring (`run_autoscaler`, dry run): demand from the settings' Prometheus, nowhere else."""
    for name in list(os.environ):
        if name.startswith("SHOAL_AUTOSCALER_"):
            monkeypatch.delenv(name)
    router = await start_router(num_ready=0)
    prometheus = FakePrometheus()
    await prometheus.start()
    prometheus.set({"sum(shoal_router_in_flight)": vector(5.0), "sum(shoal_router_held_requests)": vector(1.0)})
    for query in ("sum(shoal_router_queue_depth)", "sum(shoal_router_prefill_backlog_tokens)"):
        prometheus.set({query: vector(0.0)})
    port = free_ports(1)
    settings = AutoscalerSettings(
        routers=[router.url],
        dry_run=True,
        interval_s=0.1,
        metrics_port=port,
        metrics={"source": "prometheus", "prometheus": {"url": prometheus.url}},
        policy={"max_replicas": 4, "target_requests_per_replica": 2},
    )
    running = asyncio.create_task(run_autoscaler(settings))

    async def wants_three() -> bool:
        try:
            async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                text = await resp.text()
        except aiohttp.ClientError:
            return False
        # The target it sized on is exported too (the configured one: nothing is learnt here).
        is_target = metric_value(text, "shoal_autoscaler_target_requests_per_replica") == 2.0
        return metric_value(text, "shoal_autoscaler_desired_replicas") == 3.0 and is_target

    try:
        await eventually(wants_three, timeout_s=10, what="3 replicas wanted for the 6 requests Prometheus reports")
        assert "sum(shoal_router_in_flight)" in {r.query for r in prometheus.received}
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        await prometheus.stop()
