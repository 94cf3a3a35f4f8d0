"""`shoal autoscaler --actuator kubernetes` end to end: the real process against kmock as the Kubernetes API.

The process finds kmock through a kubeconfig, as it would outside a cluster, and the routers through the
EndpointSlices of the router Service. The router is the real one (conftest's `start_router`), discovering the
replica pods from their EndpointSlices; the pods are fake replicas on their own loopback addresses, one port for
all, as pods behind one Service are. The test plays the cluster's controllers (`Cluster`): the ReplicaSet
controller creates a pod when the Deployment's replicas go up and deletes the pod of lowest
`controller.kubernetes.io/pod-deletion-cost` when they go down, and the EndpointSlice controller lists ready
pods. Policy windows are a second or two, so the whole run takes about ten seconds; state is awaited by polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml

from autoscaler.actuators.kubernetes import DELETION_COST, VICTIM_COST
from router.service.settings import DiscoverySettings
from tests.fakes import FakeReplica, FakeReplicaConfig
from tests.integration.conftest import ADMIN_TOKEN, MODEL, RouterHandle, StartRouter, eventually, unique_text
from tests.integration.kmock_support import (
    DEPLOYMENTS,
    ENDPOINT_SLICES,
    LEASES,
    PODS,
    KubeApi,
    running_kube_api,
    use_kubeconfig,
)
from tests.integration.ports import free_ports

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

NS = "shoal"
DEPLOYMENT = "shoal-replica"
ROUTER_SERVICE = "shoal-router"
LEASE = "shoal-autoscaler"
LABELS = {"app.kubernetes.io/name": "shoal-replica"}
POD_NAME = "autoscaler-e2e"


@dataclass
class Cluster:
    """The Deployment's pods and the replicas' EndpointSlice, kept in step with `spec.replicas` as the ReplicaSet
    and EndpointSlice controllers would; each pod is a fake replica on 127.0.0.<21 + i>, all on one port."""

    api: KubeApi
    router: RouterHandle | None = None
    port: int = 0
    fakes: dict[str, FakeReplica] = field(default_factory=dict)
    live: list[str] = field(default_factory=list)
    deleted: list[tuple[str, str | None, str | None]] = field(default_factory=list)
    """(pod, its deletion cost, its status at the router) for each pod deleted, at the moment it was chosen."""

    async def add_pod(self) -> FakeReplica:
        index = len(self.fakes)
        name = f"replica-{'abcdefgh'[index]}"
        fake = FakeReplica(FakeReplicaConfig(name=name))
        await fake.start(f"127.0.0.{21 + index}", self.port)
        self.port = fake.port
        self.fakes[name] = fake
        await self.api.create_object(PODS, NS, _pod(name, fake.host))
        self.live.append(name)
        await self._publish()
        return fake

    async def run(self) -> None:
        while True:
            deployment = self.api.read_object(DEPLOYMENTS, NS, DEPLOYMENT)
            wanted = int(deployment["spec"]["replicas"]) if deployment else len(self.live)
            if wanted > len(self.live):
                await self.add_pod()
            elif wanted < len(self.live):
                await self._delete_one()
            await asyncio.sleep(0.02)

    async def _delete_one(self) -> None:
        def cost(name: str) -> int:
            pod = self.api.read_object(PODS, NS, name) or {}
            return int((pod["metadata"].get("annotations") or {}).get(DELETION_COST, "0"))

        name = min(self.live, key=lambda n: (cost(n), -self.live.index(n)))  # then the newest, as a ReplicaSet
        status = (await self.router.replicas()).get(name, {}).get("status") if self.router else None
        annotations = (self.api.read_object(PODS, NS, name) or {})["metadata"].get("annotations") or {}
        self.deleted.append((name, annotations.get(DELETION_COST), status))
        self.live.remove(name)
        await self.api.delete_object(PODS, NS, name)
        await self._publish()

    async def _publish(self) -> None:
        body = _slice(
            "shoal-replica-1",
            DEPLOYMENT,
            self.port,
            [(self.fakes[n].host, n) for n in self.live],
        )
        if self.api.read_object(ENDPOINT_SLICES, NS, "shoal-replica-1") is None:
            await self.api.create_object(ENDPOINT_SLICES, NS, body)
        else:
            await self.api.patch_object(ENDPOINT_SLICES, NS, "shoal-replica-1", {"endpoints": body["endpoints"]})

    async def close(self) -> None:
        for fake in self.fakes.values():
            await fake.stop()


def _pod(name: str, ip: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {**LABELS, "pod-template-hash": "7d9f"}},
        "spec": {"nodeName": "node-1", "containers": [{"name": "replica", "image": "shoal/replica"}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [
                {"name": "replica", "image": "shoal/replica", "imageID": "", "ready": True, "restartCount": 0}
            ],
        },
    }


def _slice(name: str, service: str, port: int, endpoints: list[tuple[str, str]]) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [ip],
                "conditions": {"ready": True, "serving": True, "terminating": False},
                "targetRef": {"kind": "Pod", "namespace": NS, "name": pod},
            }
            for ip, pod in endpoints
        ],
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
    }


def _deployment(replicas: int) -> dict[str, Any]:
    return {
        "metadata": {"name": DEPLOYMENT, "labels": LABELS},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": LABELS},
            "template": {"metadata": {"labels": LABELS}, "spec": {"containers": [{"name": "replica"}]}},
        },
    }


@pytest.fixture
async def kube_api() -> AsyncIterator[KubeApi]:
    async with running_kube_api() as api:
        yield api


@pytest.fixture
def kubeconfig(kube_api: KubeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """kmock as the current context, for the router in this process and the autoscaler process alike."""
    return use_kubeconfig(kube_api, tmp_path / "kubeconfig", monkeypatch)


def autoscaler_config(path: Path, *, replica_port: int, metrics_port: int, **policy: Any) -> Path:
    """Second-long windows: 4 queued requests at 2 per replica want 2 replicas at once; one request left wants 1
    after a 2 s stabilization window; at most one removal per 5 s. `policy` overrides the policy's fields."""
    config = {
        "actuator": "kubernetes",
        "interval_s": 0.25,
        "scrape_timeout_s": 1.0,
        "drain_timeout_s": 5.0,
        "metrics_port": metrics_port,
        "kubernetes": {
            "namespace": NS,
            "deployment": DEPLOYMENT,
            "replica_port": replica_port,
            "router_service": ROUTER_SERVICE,
            "lease_name": LEASE,
            "lease_duration_s": 2.0,
            "renew_deadline_s": 1.5,
            "retry_period_s": 0.2,
        },
        "policy": {
            "min_replicas": 1,
            "max_replicas": 2,
            "target_requests_per_replica": 2,
            "stable_window_s": 1,
            "panic": {"window_s": 0.5},
            "expected_start_s": 10,
            "scale_up": {"period_s": 1},
            "scale_down": {"stabilization_window_s": 2, "max_replicas": 1, "max_percent": 0, "period_s": 5},
            **policy,
        },
    }
    path.write_text(yaml.safe_dump(config))
    return path


async def _stream(router: RouterHandle, tag: str) -> None:
    body = {"model": MODEL, "prompt": unique_text(200, tag), "max_tokens": 4, "stream": True}
    with contextlib.suppress(aiohttp.ClientError):
        async with router.http.post(router.url + "/v1/completions", json=body) as resp:
            await resp.read()


def _holder(api: KubeApi) -> str | None:
    lease = api.read_object(LEASES, NS, LEASE)
    return None if lease is None else lease["spec"].get("holderIdentity")


def _scale_patches(api: KubeApi) -> list[int]:
    return [
        r.data["spec"]["replicas"] for r in api.received(DEPLOYMENTS, methods=("PATCH",)) if r.subresource == "scale"
    ]


async def test_the_autoscaler_process_leads_scales_up_on_queued_demand_and_drains_its_victim(
    kube_api: KubeApi, kubeconfig: Path, start_router: StartRouter, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    cluster = Cluster(kube_api)
    await kube_api.create_object(DEPLOYMENTS, NS, _deployment(1))
    first = await cluster.add_pod()
    router = await start_router(
        num_ready=1, discovery=DiscoverySettings(kind="kubernetes", namespace=NS, service=DEPLOYMENT, port_name="http")
    )
    cluster.router = router
    router_port = int(router.url.rsplit(":", 1)[1])
    await kube_api.create_object(
        ENDPOINT_SLICES, NS, _slice("shoal-router-1", ROUTER_SERVICE, router_port, [("127.0.0.1", "router-0")])
    )
    metrics_port = free_ports(1)
    config = autoscaler_config(tmp_path / "autoscaler.yaml", replica_port=first.port, metrics_port=metrics_port)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env |= {"SHOAL_AUTOSCALER_ADMIN_TOKEN": ADMIN_TOKEN, "POD_NAME": POD_NAME}
    log_path = tmp_path / "autoscaler.log"
    shoal = Path(sys.executable).parent / "shoal"
    playing = asyncio.create_task(cluster.run())
    clients: list[asyncio.Task[None]] = []
    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            str(shoal), "autoscaler", "--config", str(config), env=env, stdout=log, stderr=asyncio.subprocess.STDOUT
        )
    try:
        # It takes the Lease, then holds the one replica while nothing is queued.
        await eventually(
            lambda: (_holder(kube_api) or "").startswith(POD_NAME + "_"), timeout_s=15, what="the Lease taken"
        )
        await eventually(lambda: _router_polled(kube_api), timeout_s=5, what="the router Service listed")
        assert _scale_patches(kube_api) == []

        # Four requests wait for a first byte at the only replica: two replicas wanted, at once.
        first.config.hang = True
        clients = [asyncio.create_task(_stream(router, f"queued{i}")) for i in range(4)]
        await eventually(lambda: first.in_flight == 4, what="4 requests at replica-a")
        await eventually(lambda: _scale_patches(kube_api) == [2], timeout_s=5, what="the scale patched to 2")
        await eventually(lambda: len(cluster.live) == 2, what="replica-b created")
        await router.wait_eligible(["replica-b"])

        # Three clients go away: one request left wants one replica. After the stabilization window the
        # autoscaler drains the idle replica-b (replica-a still serves one), marks it, and lowers replicas.
        for client in clients[1:]:
            client.cancel()
        await eventually(lambda: first.in_flight == 1, what="1 request left at replica-a")
        await eventually(lambda: cluster.deleted != [], timeout_s=10, what="a pod removed")

        assert _scale_patches(kube_api) == [2, 1]
        assert cluster.deleted == [("replica-b", VICTIM_COST, "draining")], "drained at the router, then marked"
        [mark] = kube_api.received(PODS, methods=("PATCH",))
        assert mark.name == "replica-b" and mark.data == {"metadata": {"annotations": {DELETION_COST: VICTIM_COST}}}
        assert first.in_flight == 1, "the replica kept serves its request throughout"
        async with http.get(f"http://127.0.0.1:{metrics_port}/metrics") as resp:
            text = await resp.text()
        assert "shoal_autoscaler_leader 1.0" in text
        assert 'shoal_autoscaler_removals_total{outcome="drained"} 1.0' in text

        # SIGTERM: a clean exit that hands the Lease back.
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), timeout=30) == 0
        assert _holder(kube_api) == ""
    except BaseException:
        print(log_path.read_text(errors="replace")[-6000:])
        raise
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        playing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await playing
        await cluster.close()
        for client in clients:
            client.cancel()
        await asyncio.gather(*clients, return_exceptions=True)


def _router_polled(api: KubeApi) -> bool:
    """The autoscaler has listed the router Service's endpoints (its first observation)."""
    return any(
        r.params.get("labelSelector") == f"kubernetes.io/service-name={ROUTER_SERVICE}"
        for r in api.received(ENDPOINT_SLICES, methods=("GET",))
    )


async def test_the_autoscaler_process_wakes_a_deployment_at_zero_and_returns_it_to_zero(
    kube_api: KubeApi, kubeconfig: Path, start_router: StartRouter, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    # The Deployment starts at zero: no pod, no EndpointSlice, a router with nothing to route to, holding.
    cluster = Cluster(kube_api)
    await kube_api.create_object(DEPLOYMENTS, NS, _deployment(0))
    router = await start_router(
        num_ready=0, discovery=DiscoverySettings(kind="kubernetes", namespace=NS, service=DEPLOYMENT, port_name="http")
    )
    cluster.router = router
    router_port = int(router.url.rsplit(":", 1)[1])
    await kube_api.create_object(
        ENDPOINT_SLICES, NS, _slice("shoal-router-1", ROUTER_SERVICE, router_port, [("127.0.0.1", "router-0")])
    )
    metrics_port = free_ports(1)
    replica_port = free_ports(1)
    config = autoscaler_config(
        tmp_path / "autoscaler.yaml",
        replica_port=replica_port,
        metrics_port=metrics_port,
        scale_to_zero={"enabled": True, "idle_s": 2},
    )
    cluster.port = replica_port
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env |= {"SHOAL_AUTOSCALER_ADMIN_TOKEN": ADMIN_TOKEN, "POD_NAME": POD_NAME}
    log_path = tmp_path / "autoscaler.log"
    shoal = Path(sys.executable).parent / "shoal"
    playing = asyncio.create_task(cluster.run())
    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            str(shoal), "autoscaler", "--config", str(config), env=env, stdout=log, stderr=asyncio.subprocess.STDOUT
        )
    try:
        await eventually(
            lambda: (_holder(kube_api) or "").startswith(POD_NAME + "_"), timeout_s=15, what="the Lease taken"
        )
        await eventually(lambda: _router_polled(kube_api), timeout_s=5, what="the router Service listed")
        assert _scale_patches(kube_api) == [] and cluster.live == [], "idle at zero: nothing scaled"

        # Two requests through the official client: held at the router, they wake one pod and are answered.
        async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
            replies = await asyncio.gather(
                *(
                    c.completions.create(model=MODEL, prompt=unique_text(100, f"wake{i}"), max_tokens=4)
                    for i in range(2)
                )
            )
        assert all(r.choices[0].text for r in replies)
        assert _scale_patches(kube_api)[:1] == [1] and cluster.live == ["replica-a"]

        # Idle for 2 s: the pod is drained at the router, marked, and the Deployment goes to zero.
        await eventually(lambda: cluster.deleted != [], timeout_s=15, what="the pod removed")
        assert _scale_patches(kube_api) == [1, 0]
        assert cluster.deleted == [("replica-a", VICTIM_COST, "draining")]
        assert kube_api.read_object(DEPLOYMENTS, NS, DEPLOYMENT)["spec"]["replicas"] == 0
        async with http.get(f"http://127.0.0.1:{metrics_port}/metrics") as resp:
            text = await resp.text()
        assert 'shoal_autoscaler_decisions_total{action="up",reason="wake_from_zero"} 1.0' in text
        assert 'shoal_autoscaler_decisions_total{action="down",reason="scale_to_zero"} 1.0' in text
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), timeout=10) == 0
    except BaseException:
        print(log_path.read_text(errors="replace")[-6000:])
        raise
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        playing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await playing
        await cluster.close()
