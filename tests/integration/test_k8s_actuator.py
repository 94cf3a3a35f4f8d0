"""The Kubernetes actuator and leader election against kmock, through the official client over HTTP.

A rival writer is a second official client whose request lands between the actuator's read and its write
(`KubeApi.interpose`); a partitioned leader is a client the API refuses (`KubeApi.refuse`). Leader election runs
on real time with a 1 s lease; state is awaited by polling with deadlines.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import kmock
import pytest
from kubernetes import client as k8s

from autoscaler.actuators.base import ActuatorError, ReplicaInfo
from autoscaler.actuators.kubernetes import DELETION_COST, VICTIM_COST, KubernetesActuator
from autoscaler.leader import LeadershipLost, run_with_leader_election
from autoscaler.settings import KubernetesSettings
from tests.integration.conftest import eventually
from tests.integration.kmock_support import (
    DEPLOYMENTS,
    ENDPOINT_SLICES,
    LEASES,
    PODS,
    KubeApi,
    api_client_for,
    running_kube_api,
)

pytestmark = pytest.mark.integration

NS = "shoal"
DEPLOYMENT = "shoal-replica"
LABELS = {"app.kubernetes.io/name": "shoal-replica"}


def k8s_settings(**overrides: Any) -> KubernetesSettings:
    """The autoscaler's Kubernetes settings, with test-sized leases (1 s)."""
    values: dict[str, Any] = {
        "namespace": NS,
        "deployment": DEPLOYMENT,
        "router_service": "shoal-router",
        "lease_duration_s": 1.0,
        "renew_deadline_s": 0.6,
        "retry_period_s": 0.1,
    }
    return KubernetesSettings(**{**values, **overrides})


@pytest.fixture
async def kube_api() -> AsyncIterator[KubeApi]:
    async with running_kube_api() as api:
        yield api


@pytest.fixture
def kube_client(kube_api: KubeApi) -> Iterator[k8s.ApiClient]:
    client = api_client_for(kube_api)
    yield client
    client.close()


def deployment(replicas: int) -> dict[str, Any]:
    return {
        "metadata": {"name": DEPLOYMENT, "labels": LABELS},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": LABELS},
            "template": {
                "metadata": {"labels": LABELS},
                "spec": {"containers": [{"name": "replica", "image": "shoal/replica"}]},
            },
        },
    }


def pod(
    name: str,
    ip: str | None,
    *,
    phase: str = "Running",
    is_ready: bool = True,
    node: str | None = "node-1",
    waiting: str | None = None,
    is_deleting: bool = False,
    labels: dict[str, str] | None = None,
    created: str = "2025-01-01T00:00:00Z",
) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "name": name,
        "labels": {**(LABELS if labels is None else labels), "pod-template-hash": "7d9f"},
        "creationTimestamp": created,
    }
    if is_deleting:
        metadata["deletionTimestamp"] = "2025-01-01T01:00:00Z"
    state = {"waiting": {"reason": waiting}} if waiting else {"running": {}}
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [{"type": "Ready", "status": "True" if is_ready else "False"}],
        "containerStatuses": [
            {
                "name": "replica",
                "image": "shoal/replica",
                "imageID": "",
                "ready": is_ready,
                "restartCount": 0,
                "state": state,
            }
        ],
    }
    if ip:
        status["podIP"] = ip
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": "replica",
                "image": "shoal/replica",
                "ports": [{"name": "metrics", "containerPort": 9100}, {"name": "http", "containerPort": 8000}],
            }
        ]
    }
    if node:
        spec["nodeName"] = node
    return {"metadata": metadata, "spec": spec, "status": status}


def replicas_of(api: KubeApi) -> int:
    obj = api.read_object(DEPLOYMENTS, NS, DEPLOYMENT)
    assert obj is not None
    return int(obj["spec"]["replicas"])


def is_scale_patch(request: kmock.Request) -> bool:
    return str(request.method.value) == "PATCH" and request.subresource == "scale"


def rival(api: KubeApi, changes: dict[str, Any]) -> Callable[[], Any]:
    """Another writer, with its own official client, patching the Deployment (no precondition: it always lands)."""

    def write() -> None:
        client = api_client_for(api, user_agent="rival")
        try:
            k8s.AppsV1Api(client).patch_namespaced_deployment(
                DEPLOYMENT, NS, changes, _content_type="application/merge-patch+json"
            )
        finally:
            client.close()

    return lambda: asyncio.to_thread(write)


# --- scaling ---------------------------------------------------------------------------------------------------


async def test_scale_up_is_a_conditional_patch_of_the_scale_subresource(
    kube_api: KubeApi, kube_client: k8s.ApiClient
) -> None:
    await kube_api.create_object(DEPLOYMENTS, NS, deployment(2))
    actuator = KubernetesActuator(k8s_settings(), api_client=kube_client)
    assert await actuator.desired_replicas() == 2
    version = kube_api.read_object(DEPLOYMENTS, NS, DEPLOYMENT)["metadata"]["resourceVersion"]  # type: ignore[index]

    await actuator.scale_up(4)

    assert replicas_of(kube_api) == 4 and await actuator.desired_replicas() == 4
    [patch] = kube_api.received(DEPLOYMENTS, methods=("PATCH",))
    assert patch.subresource == "scale"
    assert patch.data == {"metadata": {"resourceVersion": version}, "spec": {"replicas": 4}}
    # Already there: no write at all.
    await actuator.scale_up(3)
    assert len(kube_api.received(DEPLOYMENTS, methods=("PATCH", "PUT"))) == 1


async def test_scale_up_after_a_conflict_rereads_and_keeps_a_rivals_larger_count(
    kube_api: KubeApi, kube_client: k8s.ApiClient
) -> None:
    await kube_api.create_object(DEPLOYMENTS, NS, deployment(2))
    kube_api.interpose(is_scale_patch, rival(kube_api, {"spec": {"replicas": 5}}))

    await KubernetesActuator(k8s_settings(), api_client=kube_client).scale_up(4)

    assert replicas_of(kube_api) == 5  # not overwritten with 4
    [ours] = kube_api.received(DEPLOYMENTS, methods=("PATCH",), user_agent="shoal-tests")
    assert ours.subresource == "scale"  # one attempt, refused with 409; the re-read showed 5 >= 4


async def test_scale_up_after_an_unrelated_conflicting_write_retries_on_the_new_version(
    kube_api: KubeApi, kube_client: k8s.ApiClient
) -> None:
    await kube_api.create_object(DEPLOYMENTS, NS, deployment(2))
    kube_api.interpose(is_scale_patch, rival(kube_api, {"metadata": {"annotations": {"touched": "yes"}}}))

    await KubernetesActuator(k8s_settings(), api_client=kube_client).scale_up(4)

    assert replicas_of(kube_api) == 4
    first, second = kube_api.received(DEPLOYMENTS, methods=("PATCH",), user_agent="shoal-tests")
    assert first.data["metadata"]["resourceVersion"] != second.data["metadata"]["resourceVersion"]
    assert kube_api.read_object(DEPLOYMENTS, NS, DEPLOYMENT)["metadata"]["annotations"] == {"touched": "yes"}  # type: ignore[index]


async def seed_fleet(api: KubeApi, names: list[str]) -> None:
    await api.create_object(DEPLOYMENTS, NS, deployment(len(names)))
    for i, name in enumerate(names):
        await api.create_object(PODS, NS, pod(name, f"10.0.0.{i + 1}"))


def victim(name: str) -> ReplicaInfo:
    return ReplicaInfo(name=name, url=None, phase="ready", created_s=0.0)


async def test_scale_down_marks_the_victim_once_then_lowers_replicas(
    kube_api: KubeApi, kube_client: k8s.ApiClient
) -> None:
    await seed_fleet(kube_api, ["r-a", "r-b", "r-c"])

    await KubernetesActuator(k8s_settings(), api_client=kube_client).scale_down(victim("r-b"), 2)

    assert replicas_of(kube_api) == 2
    pods = {n: kube_api.read_object(PODS, NS, n) or {} for n in ("r-a", "r-b", "r-c")}
    annotations = {n: p["metadata"].get("annotations") for n, p in pods.items()}
    assert annotations == {"r-a": None, "r-b": {DELETION_COST: VICTIM_COST}, "r-c": None}
    trail = [(str(r.method.value), r.resource.plural, r.name, r.subresource) for r in kube_api.received()]  # type: ignore[union-attr]
    assert trail[-3:] == [  # read, mark the victim (its only write), lower replicas
        ("GET", "deployments", DEPLOYMENT, "scale"),
        ("PATCH", "pods", "r-b", None),
        ("PATCH", "deployments", DEPLOYMENT, "scale"),
    ]
    assert len(kube_api.received(PODS, methods=("PATCH",))) == 1


async def test_scale_down_with_a_conflicting_writer_removes_only_the_victim(
    kube_api: KubeApi, kube_client: k8s.ApiClient
) -> None:
    await seed_fleet(kube_api, ["r-a", "r-b", "r-c"])
    kube_api.interpose(is_scale_patch, rival(kube_api, {"spec": {"replicas": 5}}))

    await KubernetesActuator(k8s_settings(), api_client=kube_client).scale_down(victim("r-c"), 2)

    # The rival's 5 stands, less exactly one pod: the victim, which is the only one marked, and marked once.
    assert replicas_of(kube_api) == 4
    ours = kube_api.received(DEPLOYMENTS, methods=("PATCH",), user_agent="shoal-tests")
    assert [p.data["spec"]["replicas"] for p in ours] == [2, 4]
    assert [p.name for p in kube_api.received(PODS, methods=("PATCH",))] == ["r-c"]


async def test_scale_down_refuses_when_the_cost_cannot_pick_the_victim(
    kube_api: KubeApi, kube_client: k8s.ApiClient
) -> None:
    await seed_fleet(kube_api, ["r-a", "r-b"])
    # A pod still starting ranks before any ready pod, whatever its cost: lowering replicas would remove it.
    await kube_api.create_object(PODS, NS, pod("r-new", None, phase="Pending", is_ready=False, node=None))
    actuator = KubernetesActuator(k8s_settings(), api_client=kube_client)

    with pytest.raises(ActuatorError, match="r-new would be removed before r-a"):
        await actuator.scale_down(victim("r-a"), 1)
    with pytest.raises(ActuatorError, match="not an active pod"):
        await actuator.scale_down(victim("r-gone"), 1)

    assert replicas_of(kube_api) == 2
    assert kube_api.received(PODS, methods=("PATCH",)) == [] == kube_api.received(DEPLOYMENTS, methods=("PATCH",))


async def test_observe_classifies_the_deployments_pods(kube_api: KubeApi, kube_client: k8s.ApiClient) -> None:
    await kube_api.create_object(DEPLOYMENTS, NS, deployment(6))
    for body in (
        pod("ready", "10.0.0.1", created="2025-01-01T00:00:01Z"),
        pod("loading-weights", "10.0.0.2", is_ready=False, created="2025-01-01T00:00:02Z"),
        pod("unscheduled", None, phase="Pending", is_ready=False, node=None, created="2025-01-01T00:00:03Z"),
        pod("crash-looping", "10.0.0.4", is_ready=False, waiting="CrashLoopBackOff", created="2025-01-01T00:00:04Z"),
        pod("exited", "10.0.0.5", phase="Failed", is_ready=False, created="2025-01-01T00:00:05Z"),
        pod("leaving", "10.0.0.6", is_deleting=True, created="2025-01-01T00:00:06Z"),
        pod("ipv6", "fd00::7", created="2025-01-01T00:00:07Z"),
        pod("not-ours", "10.0.0.8", labels={"app.kubernetes.io/name": "something-else"}),
    ):
        await kube_api.create_object(PODS, NS, body)
    actuator = KubernetesActuator(k8s_settings(), api_client=kube_client)

    replicas = await actuator.observe()

    assert [(r.name, r.phase, r.url) for r in replicas] == [
        ("ready", "ready", "http://10.0.0.1:8000"),
        ("loading-weights", "starting", "http://10.0.0.2:8000"),
        ("unscheduled", "starting", None),
        ("crash-looping", "failed", "http://10.0.0.4:8000"),
        ("exited", "failed", "http://10.0.0.5:8000"),
        ("leaving", "terminating", "http://10.0.0.6:8000"),
        ("ipv6", "ready", "http://[fd00::7]:8000"),
    ]
    assert replicas[0].created_s == 1735689601.0
    [listed] = kube_api.received(PODS, methods=("GET",))
    assert listed.params["labelSelector"] == "app.kubernetes.io/name=shoal-replica"
    # An API outage is an ActuatorError, never a hang or a crash of the controller.
    kube_api.refuse = lambda request: True
    with pytest.raises(ActuatorError, match="HTTP 503"):
        await actuator.observe()


async def test_router_urls_are_the_ready_endpoints_of_the_router_service(
    kube_api: KubeApi, kube_client: k8s.ApiClient
) -> None:
    def slice_(name: str, service: str, endpoints: list[tuple[str, dict[str, bool]]]) -> dict[str, Any]:
        return {
            "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [ip], "conditions": conditions} for ip, conditions in endpoints],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}, {"name": "admin", "port": 9000}],
        }

    ready, leaving = {"ready": True}, {"ready": False, "serving": True, "terminating": True}
    await kube_api.create_object(
        ENDPOINT_SLICES, NS, slice_("r1", "shoal-router", [("10.1.0.1", ready), ("10.1.0.2", leaving)])
    )
    await kube_api.create_object(ENDPOINT_SLICES, NS, slice_("r2", "shoal-router", [("10.1.0.3", {})]))
    await kube_api.create_object(ENDPOINT_SLICES, NS, slice_("x1", "shoal-replica", [("10.2.0.1", ready)]))

    urls = await KubernetesActuator(k8s_settings(), api_client=kube_client).router_urls()

    assert urls == ["http://10.1.0.1:8080", "http://10.1.0.3:8080"]
    assert await KubernetesActuator(k8s_settings(router_service=None), api_client=kube_client).router_urls() == []


# --- leader election -------------------------------------------------------------------------------------------


class Candidate:
    """One autoscaler process: `run_with_leader_election` around work that runs until cancelled or told to end."""

    def __init__(self, api: KubeApi, identity: str, settings: KubernetesSettings) -> None:
        self.identity = identity
        self.client = api_client_for(api, user_agent=identity)
        self.started_at: float | None = None
        self.stopped_at: float | None = None
        self.finish = asyncio.Event()
        self.task = asyncio.create_task(
            run_with_leader_election(settings, identity, self.work, api_client=self.client), name=identity
        )

    async def work(self) -> None:
        loop = asyncio.get_running_loop()
        self.started_at = loop.time()
        try:
            await self.finish.wait()
        finally:
            self.stopped_at = loop.time()

    def close(self) -> None:
        self.task.cancel()
        self.client.close()


def holder(api: KubeApi) -> str | None:
    lease = api.read_object(LEASES, NS, k8s_settings().lease_name)
    return None if lease is None else lease["spec"].get("holderIdentity")


async def test_two_candidates_one_leads_and_the_other_takes_over_when_it_stops_renewing(kube_api: KubeApi) -> None:
    settings = k8s_settings()
    loop = asyncio.get_running_loop()
    a = Candidate(kube_api, "autoscaler-a", settings)
    await eventually(lambda: a.started_at is not None, what="a leads")
    b = Candidate(kube_api, "autoscaler-b", settings)
    try:
        # b keeps reading while a renews, and waits.
        await eventually(
            lambda: len(kube_api.received(LEASES, methods=("GET",), user_agent="autoscaler-b")) >= 8,
            what="b's reads",
        )
        assert b.started_at is None and holder(kube_api) == "autoscaler-a"
        assert len(kube_api.received(LEASES, methods=("PUT",), user_agent="autoscaler-a")) >= 5  # renewals

        cut_at = loop.time()
        kube_api.refuse = lambda request: request.headers.get("User-Agent") == "autoscaler-a"
        with pytest.raises(LeadershipLost):
            await asyncio.wait_for(a.task, timeout=3.0)
        assert a.stopped_at is not None and a.stopped_at - cut_at < settings.lease_duration_s
        await eventually(lambda: b.started_at is not None, timeout_s=3.0, what="b takes over")

        assert b.started_at is not None and a.stopped_at < b.started_at  # never two leaders at once
        # b waited a whole lease duration after the last renewal it saw (sent at most a retry period before the cut).
        assert b.started_at - cut_at >= settings.lease_duration_s - settings.retry_period_s - 0.05
        lease = kube_api.read_object(LEASES, NS, settings.lease_name)
        assert lease is not None
        assert (lease["spec"]["holderIdentity"], lease["spec"]["leaseTransitions"]) == ("autoscaler-b", 1)
        assert lease["spec"]["leaseDurationSeconds"] == 1
    finally:
        a.close()
        b.close()


async def test_a_clean_exit_releases_the_lease_so_the_next_leader_need_not_wait(kube_api: KubeApi) -> None:
    settings = k8s_settings(lease_duration_s=5.0, renew_deadline_s=3.0, retry_period_s=0.1)
    loop = asyncio.get_running_loop()
    a = Candidate(kube_api, "autoscaler-a", settings)
    await eventually(lambda: a.started_at is not None, what="a leads")
    b = Candidate(kube_api, "autoscaler-b", settings)
    try:
        await eventually(
            lambda: len(kube_api.received(LEASES, methods=("GET",), user_agent="autoscaler-b")) >= 3,
            what="b's reads",
        )
        a.finish.set()
        await asyncio.wait_for(a.task, timeout=2.0)
        assert a.task.result() is None
        released_at = loop.time()
        assert holder(kube_api) in ("", "autoscaler-b")

        await eventually(lambda: b.started_at is not None, timeout_s=2.0, what="b takes over")
        assert b.started_at is not None and b.started_at - released_at < 1.0  # far less than the 5 s lease
        assert holder(kube_api) == "autoscaler-b"
    finally:
        a.close()
        b.close()


async def test_work_that_fails_is_reraised_after_the_lease_is_released(kube_api: KubeApi) -> None:
    client = api_client_for(kube_api, user_agent="autoscaler-a")

    async def broken() -> None:
        raise RuntimeError("controller bug")

    try:
        with pytest.raises(RuntimeError, match="controller bug"):
            await asyncio.wait_for(
                run_with_leader_election(k8s_settings(), "autoscaler-a", broken, api_client=client), timeout=3.0
            )
        assert holder(kube_api) == ""
    finally:
        client.close()
