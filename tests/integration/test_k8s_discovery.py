"""Router discovery from EndpointSlices: the real router (conftest's `start_router`) watches kmock through the
official client, found through a kubeconfig as it would be outside a cluster. The "pods" are fake replicas on
their own loopback addresses, all on one port, as pods behind one Service are. State is awaited by polling.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import pytest

from router.service.settings import DiscoverySettings
from tests.fakes import FakeReplica, FakeReplicaConfig
from tests.integration.conftest import RouterHandle, StartRouter, eventually, metric_value, unique_text
from tests.integration.kmock_support import ENDPOINT_SLICES, KubeApi, running_kube_api, use_kubeconfig

pytestmark = pytest.mark.integration

NS = "shoal"
SERVICE = "shoal-replica"


@pytest.fixture
async def kube_api() -> AsyncIterator[KubeApi]:
    async with running_kube_api() as api:
        yield api


@pytest.fixture
async def pods() -> AsyncIterator[dict[str, FakeReplica]]:
    """Three fake replicas on 127.0.0.11-13, sharing one port."""
    fakes: dict[str, FakeReplica] = {}
    port = 0
    try:
        for i, name in enumerate(("replica-a", "replica-b", "replica-c")):
            fake = FakeReplica(FakeReplicaConfig(name=name))
            await fake.start(f"127.0.0.{11 + i}", port)
            port = fake.port
            fakes[name] = fake
        yield fakes
    finally:
        for fake in fakes.values():
            await fake.stop()


@pytest.fixture
def kubeconfig(kube_api: KubeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return use_kubeconfig(kube_api, tmp_path / "kubeconfig", monkeypatch)


def endpoint(fake: FakeReplica, state: str) -> dict[str, Any]:
    conditions = {
        "ready": {"ready": True, "serving": True, "terminating": False},
        "starting": {"ready": False, "serving": False, "terminating": False},
        "terminating": {"ready": False, "serving": True, "terminating": True},
    }[state]
    return {
        "addresses": [fake.host],
        "conditions": conditions,
        "targetRef": {"kind": "Pod", "namespace": NS, "name": fake.config.name},
    }


def endpoint_slice(name: str, port: int, endpoints: list[dict[str, Any]], service: str = SERVICE) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [
            {"name": "metrics", "port": 9100, "protocol": "TCP"},
            {"name": "http", "port": port, "protocol": "TCP"},
        ],
    }


def discovery() -> DiscoverySettings:
    return DiscoverySettings(kind="kubernetes", namespace=NS, service=SERVICE, port_name="http")


async def statuses(router: RouterHandle) -> dict[str, str]:
    return {rid: view["status"] for rid, view in (await router.replicas()).items()}


async def has_statuses(router: RouterHandle, expected: dict[str, str]) -> bool:
    return await statuses(router) == expected


def discovery_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "shoal-discovery"]


async def test_watch_events_add_drain_and_remove_replicas(
    kube_api: KubeApi, kubeconfig: Path, pods: dict[str, FakeReplica], start_router: StartRouter
) -> None:
    a, b, c = pods["replica-a"], pods["replica-b"], pods["replica-c"]
    await kube_api.create_object(
        ENDPOINT_SLICES, NS, endpoint_slice("replica-1", a.port, [endpoint(a, "ready"), endpoint(b, "starting")])
    )
    # Another Service's slice, listing c as ready: not ours.
    await kube_api.create_object(
        ENDPOINT_SLICES, NS, endpoint_slice("other-1", c.port, [endpoint(c, "ready")], service="other")
    )

    router = await start_router(num_ready=1, discovery=discovery())
    assert await statuses(router) == {"replica-a": "healthy"}  # b is not ready yet, c belongs to another Service
    assert (await router.replicas())["replica-a"]["url"] == a.url

    # A slow request is in flight on a when a starts terminating and b becomes ready (one MODIFIED event).
    a.config.first_byte_delay_s = 1.0
    in_flight = asyncio.create_task(router.complete(unique_text(200, "slow")))
    await eventually(lambda: a.requests_by_path["/v1/completions"] == 1, what="the request reached a")
    await kube_api.patch_object(
        ENDPOINT_SLICES, NS, "replica-1", {"endpoints": [endpoint(a, "terminating"), endpoint(b, "ready")]}
    )
    await eventually(
        lambda: has_statuses(router, {"replica-a": "draining", "replica-b": "healthy"}), what="a drained, b in"
    )
    reply = await in_flight
    assert (reply.status, reply.replica) == (200, "replica-a")  # in-flight requests finish on a draining replica
    for i in range(4):
        assert (await router.complete(unique_text(200, f"after {i}"))).replica == "replica-b"
    assert a.requests_by_path["/v1/completions"] == 1

    # ADDED: a second slice of the Service (the endpoint-slice controller makes several) brings c.
    await kube_api.create_object(ENDPOINT_SLICES, NS, endpoint_slice("replica-2", c.port, [endpoint(c, "ready")]))
    await router.wait_eligible(["replica-c"])

    # An endpoint gone from its slice is removed; a deleted slice takes its endpoints along.
    await kube_api.patch_object(ENDPOINT_SLICES, NS, "replica-1", {"endpoints": [endpoint(b, "ready")]})
    await eventually(lambda: has_statuses(router, {"replica-b": "healthy", "replica-c": "healthy"}), what="a removed")
    await kube_api.delete_object(ENDPOINT_SLICES, NS, "replica-2")
    await eventually(lambda: has_statuses(router, {"replica-b": "healthy"}), what="c removed")

    # One list, then watches only: discovery never polls.
    assert len(kube_api.received(ENDPOINT_SLICES, methods=("GET",), is_watch=False)) == 1
    [watch] = kube_api.received(ENDPOINT_SLICES, methods=("GET",), is_watch=True)
    assert watch.params["labelSelector"] == f"kubernetes.io/service-name={SERVICE}"

    # Stopping the app stops the watch thread at once, although its watch request had 2 minutes to run.
    assert len(discovery_threads()) == 1
    loop = asyncio.get_running_loop()
    started = loop.time()
    await router.cleanup()
    assert loop.time() - started < 3.0
    assert discovery_threads() == []


async def test_an_expired_watch_lists_again_and_keeps_an_admin_drain(
    kube_api: KubeApi, kubeconfig: Path, pods: dict[str, FakeReplica], start_router: StartRouter
) -> None:
    a, b, c = pods["replica-a"], pods["replica-b"], pods["replica-c"]
    await kube_api.create_object(
        ENDPOINT_SLICES, NS, endpoint_slice("replica-1", a.port, [endpoint(a, "ready"), endpoint(b, "ready")])
    )
    router = await start_router(num_ready=2, discovery=discovery())
    # The autoscaler drains b through the admin API before removing it.
    assert (await router.admin("POST", "/replicas/replica-b/drain")).status == 200

    async with kube_api.watch_outage():
        # Missed by the broken watch, then compacted away: resuming from the old version gets 410 Gone.
        await kube_api.patch_object(
            ENDPOINT_SLICES, NS, "replica-1", {"endpoints": [endpoint(b, "ready"), endpoint(c, "ready")]}
        )

    await eventually(
        lambda: has_statuses(router, {"replica-b": "draining", "replica-c": "healthy"}), what="the relist applied"
    )
    assert len(kube_api.received(ENDPOINT_SLICES, methods=("GET",), is_watch=False)) == 2
    # Discovery undoes only its own drains: c, drained while not ready, comes back; b, drained through the admin
    # API, stays drained although it too went unready and ready again.
    await kube_api.patch_object(
        ENDPOINT_SLICES, NS, "replica-1", {"endpoints": [endpoint(b, "starting"), endpoint(c, "starting")]}
    )
    await eventually(lambda: has_statuses(router, {"replica-b": "draining", "replica-c": "draining"}), what="c drained")
    await kube_api.patch_object(
        ENDPOINT_SLICES,
        NS,
        "replica-1",
        {"endpoints": [endpoint(b, "ready"), endpoint(c, "ready"), endpoint(a, "ready")]},
    )
    await router.wait_eligible(["replica-a", "replica-c"])
    assert await statuses(router) == {"replica-a": "healthy", "replica-b": "draining", "replica-c": "healthy"}


async def test_a_slice_the_client_cannot_read_is_a_counted_failure_and_discovery_recovers(
    kube_api: KubeApi,
    kubeconfig: Path,
    pods: dict[str, FakeReplica],
    start_router: StartRouter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    a, b = pods["replica-a"], pods["replica-b"]
    await kube_api.create_object(ENDPOINT_SLICES, NS, endpoint_slice("replica-1", a.port, [endpoint(a, "ready")]))
    caplog.set_level(logging.ERROR, logger="shoal.router.tasks")
    router = await start_router(num_ready=1, discovery=discovery())

    async def task_metric(name: str) -> float | None:
        return metric_value(await router.metrics(), name, {"task": "discovery"})

    assert await task_metric("shoal_router_task_failures_total") == 0
    # An endpoint without addresses, which the API requires: the official client refuses the event and every list.
    await kube_api.create_object(
        ENDPOINT_SLICES, NS, endpoint_slice("replica-2", b.port, [{"conditions": {"ready": True}}])
    )
    await eventually(lambda: _is_one(task_metric("shoal_router_tasks_down")), what="discovery down")
    assert (await task_metric("shoal_router_task_failures_total") or 0) >= 1
    assert await statuses(router) == {"replica-a": "healthy"}  # what it knew still serves

    fixed = endpoint_slice("replica-2", b.port, [endpoint(b, "ready")])
    await kube_api.replace_object(ENDPOINT_SLICES, NS, "replica-2", fixed)
    expected = {"replica-a": "healthy", "replica-b": "healthy"}
    await eventually(lambda: has_statuses(router, expected), timeout_s=10.0, what="b discovered after the failures")
    assert await task_metric("shoal_router_tasks_down") == 0
    num_failures = await task_metric("shoal_router_task_failures_total")
    lines = [r for r in caplog.records if r.name == "shoal.router.tasks" and "task discovery " in r.getMessage()]
    assert len(lines) == num_failures  # one line each, the traceback with the first only
    assert lines[0].exc_info is not None and all(r.exc_info is None for r in lines[1:])


async def _is_one(value: Awaitable[float | None]) -> bool:
    return await value == 1
