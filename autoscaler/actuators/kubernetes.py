"""Kubernetes actuator: the replica Deployment's `scale` subresource and its pods, through the official client.

- Replicas change only through the Deployment's `scale` subresource (what `kubectl scale` and the HPA write), and
  every write is conditional: the merge patch names the resourceVersion it was decided on, so when another writer
  got in first the API answers 409 Conflict. The actuator then reads again and decides again from what it finds,
  never overwriting blindly: a scale-up that finds the Deployment at or above its target does nothing, a
  scale-down lowers replicas by exactly one from what it finds, so it removes the victim and nothing that someone
  else added meanwhile.
- The controller picks the victim. Kubernetes removes a ReplicaSet's pods unscheduled first, then pending, then not
  ready, and only among equals by `controller.kubernetes.io/pod-deletion-cost` (lower first). So `scale_down` sets
  the victim's cost to the lowest value, once, just before lowering replicas (every other pod keeps the default,
  0), and refuses when the cost cannot decide: another pod ranks before the victim, or pods of two ReplicaSets
  exist (a rollout, where the Deployment controller picks which ReplicaSet shrinks).
- Pods are selected by the label selector the Scale reports (`status.selector`) and classified: terminating
  (deletionTimestamp set), failed (phase Failed, Succeeded or Unknown, or a container waiting in a crash or
  image back-off), ready (Ready condition True), otherwise starting. Start deadlines are the controller's: each
  `ReplicaInfo` says when its pod was created. A replica's URL is http://<pod IP>:<replica_port>, the URL the
  routers list it under, which is how the controller finds it at every router.
- `router_urls()` lists the ready endpoints of `router_service` (its EndpointSlices), the routers to observe.
- The client is synchronous: each call runs in a worker thread (`asyncio.to_thread`) with a request timeout, so
  the controller's event loop never blocks.

RBAC, a Role in the Deployment's namespace (the chart grants exactly this):
    apps                 deployments/scale   get, patch
    ""                   pods                list, patch    (patch: the victim's deletion-cost annotation)
    discovery.k8s.io     endpointslices      list           (only with router_service set)
    coordination.k8s.io  leases              get, create, update    (leader election, autoscaler/leader.py)
The selector comes from the Scale, so the Deployment object itself is never read; pods and router endpoints
are listed on each call, never watched.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from autoscaler.actuators.base import ActuatorError, ReplicaInfo, ReplicaPhase

log = logging.getLogger("shoal.autoscaler.kubernetes")

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
VICTIM_COST = str(-(2**31))
"""The lowest cost the API accepts (int32), so the victim goes first even where users set negative costs."""

_MERGE_PATCH = "application/merge-patch+json"
_REQUEST_TIMEOUT_S = 10.0
"""Seconds one API call may take; a hung API server fails the call instead of stalling the controller."""
_MAX_ATTEMPTS = 5
"""Conditional writes retried after a conflict before giving up (each retry re-reads and re-decides)."""

# Container waiting reasons that mean the pod will not become ready without someone's help.
_FAILED_WAITING = frozenset(
    {
        "CrashLoopBackOff",
        "ImagePullBackOff",
        "ErrImagePull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)

T = TypeVar("T")


class DeploymentTarget(Protocol):
    """What the actuator reads from `KubernetesSettings`."""

    @property
    def namespace(self) -> str: ...

    @property
    def deployment(self) -> str: ...

    @property
    def replica_port(self) -> int: ...

    @property
    def router_service(self) -> str | None: ...


class _Conflict(Exception):
    """A conditional write lost to another writer (HTTP 409)."""


def load_api_client() -> k8s.ApiClient:
    """In-cluster credentials inside a pod, else the kubeconfig ($KUBECONFIG, read now, or ~/.kube/config)."""
    configuration = k8s.Configuration()
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration
            )
    except k8s_config.ConfigException as exc:
        raise ActuatorError(f"no Kubernetes credentials (in-cluster or kubeconfig): {exc}") from exc
    return k8s.ApiClient(configuration)


class KubernetesActuator:
    """Scales `settings.deployment` in `settings.namespace` (see the module docstring)."""

    def __init__(self, settings: DeploymentTarget, *, api_client: k8s.ApiClient | None = None) -> None:
        self.namespace = settings.namespace
        self.deployment = settings.deployment
        self.replica_port = settings.replica_port
        self.router_service = settings.router_service
        self._owns_client = api_client is None
        self._api_client = api_client if api_client is not None else load_api_client()
        self._apps = k8s.AppsV1Api(self._api_client)
        self._core = k8s.CoreV1Api(self._api_client)
        self._discovery = k8s.DiscoveryV1Api(self._api_client)
        self._selector: str | None = None

    async def close(self) -> None:
        """Close the API client's connections if the actuator made the client itself."""
        if self._owns_client:
            self._api_client.close()  # type: ignore[no-untyped-call]

    # --- the Actuator protocol ---------------------------------------------------------------------------------

    async def observe(self) -> list[ReplicaInfo]:
        return [replica_info(pod, self.replica_port) for pod in await self._pods()]

    async def desired_replicas(self) -> int:
        return _replicas(await self._read_scale())

    async def scale_up(self, target: int) -> None:
        for _ in range(_MAX_ATTEMPTS):
            scale = await self._read_scale()
            current = _replicas(scale)
            if current >= target:
                log.info("scale up to %d: %s already holds %d replicas", target, self.deployment, current)
                return
            try:
                await self._patch_replicas(target, scale)
            except _Conflict:
                log.info("scale up to %d: %s changed meanwhile; reading it again", target, self.deployment)
                continue
            log.info("scaled %s up from %d to %d replicas", self.deployment, current, target)
            return
        raise ActuatorError(f"scale up of {self.deployment} to {target}: still conflicting after {_MAX_ATTEMPTS} tries")

    async def scale_down(self, victim: ReplicaInfo, target: int) -> None:
        pods = await self._pods()
        refusal = why_cost_cannot_decide(victim.name, pods)
        if refusal is not None:
            raise ActuatorError(f"scale down of {self.deployment}: {refusal}")
        is_annotated = False
        try:
            for _ in range(_MAX_ATTEMPTS):
                scale = await self._read_scale()
                current = _replicas(scale)
                if current <= target:
                    raise ActuatorError(
                        f"scale down of {self.deployment} to {target}: it already holds {current} replicas (another "
                        f"writer lowered it), so {victim.name} may not be the pod removed; observe again"
                    )
                if current - 1 != target:
                    log.info(
                        "scale down: %s holds %d replicas, not %d; removing only %s",
                        self.deployment,
                        current,
                        target + 1,
                        victim.name,
                    )
                if not is_annotated:
                    await self._set_cost(victim.name, VICTIM_COST)
                    is_annotated = True
                try:
                    await self._patch_replicas(current - 1, scale)
                except _Conflict:
                    log.info("scale down: %s changed meanwhile; reading it again", self.deployment)
                    continue
                log.info(
                    "scaled %s down from %d to %d replicas, removing %s",
                    self.deployment,
                    current,
                    current - 1,
                    victim.name,
                )
                is_annotated = False  # the victim is on its way out: its cost stays
                return
            raise ActuatorError(
                f"scale down of {self.deployment}: still conflicting after {_MAX_ATTEMPTS} tries; {victim.name} stays"
            )
        finally:
            if is_annotated:  # the replicas were not lowered: the pod must not stay first in line
                try:
                    await self._set_cost(victim.name, None)
                except ActuatorError as exc:
                    log.warning("could not clear %s on %s: %s", DELETION_COST, victim.name, exc)

    async def router_urls(self) -> list[str]:
        """Base URLs of the ready endpoints of `router_service`; none when it is unset."""
        if not self.router_service:
            return []
        slices = await self._call(
            "list the endpoints of " + self.router_service,
            self._discovery.list_namespaced_endpoint_slice,
            self.namespace,
            label_selector=f"kubernetes.io/service-name={self.router_service}",
        )
        urls: set[str] = set()
        for endpoint_slice in slices.items:
            ports = [p for p in endpoint_slice.ports or [] if p.port is not None and p.protocol in (None, "TCP")]
            named = [p.port for p in ports if p.name == "http"]
            port = named[0] if named else ports[0].port if len(ports) == 1 else None
            for endpoint in endpoint_slice.endpoints or []:
                conditions = endpoint.conditions
                is_ready = conditions is None or (conditions.ready is not False and not conditions.terminating)
                if port is not None and endpoint.addresses and is_ready:
                    urls.add(_url(endpoint.addresses[0], port))
        return sorted(urls)

    # --- API calls ---------------------------------------------------------------------------------------------

    async def _read_scale(self) -> k8s.V1Scale:
        scale = await self._call(
            "read the scale of " + self.deployment,
            self._apps.read_namespaced_deployment_scale,
            self.deployment,
            self.namespace,
        )
        if self._selector is None and scale.status is not None and scale.status.selector:
            self._selector = scale.status.selector
        return scale

    async def _patch_replicas(self, replicas: int, decided_on: k8s.V1Scale) -> None:
        version = decided_on.metadata.resource_version if decided_on.metadata else None
        if not version:
            raise ActuatorError(f"the scale of {self.deployment} has no resourceVersion: cannot write conditionally")
        body = {"metadata": {"resourceVersion": version}, "spec": {"replicas": replicas}}
        await self._call(
            f"set {self.deployment} to {replicas} replicas",
            self._apps.patch_namespaced_deployment_scale,
            self.deployment,
            self.namespace,
            body,
            _content_type=_MERGE_PATCH,
        )

    async def _pods(self) -> list[k8s.V1Pod]:
        if self._selector is None:
            await self._read_scale()
        if not self._selector:
            raise ActuatorError(f"the scale of {self.deployment} reports no pod selector")
        pods = await self._call(
            "list the pods of " + self.deployment,
            self._core.list_namespaced_pod,
            self.namespace,
            label_selector=self._selector,
        )
        return sorted(pods.items, key=lambda p: (_created_s(p), _name(p)))

    async def _set_cost(self, pod_name: str, cost: str | None) -> None:
        body = {"metadata": {"annotations": {DELETION_COST: cost}}}
        await self._call(
            f"set {DELETION_COST}={cost} on {pod_name}",
            self._core.patch_namespaced_pod,
            pod_name,
            self.namespace,
            body,
            _content_type=_MERGE_PATCH,
        )

    async def _call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return await asyncio.to_thread(fn, *args, _request_timeout=_REQUEST_TIMEOUT_S, **kwargs)
        except k8s.ApiException as exc:
            if exc.status == 409:
                raise _Conflict(what) from exc
            raise ActuatorError(f"could not {what}: HTTP {exc.status} {exc.reason}") from exc
        except urllib3.exceptions.HTTPError as exc:
            raise ActuatorError(f"could not {what}: {exc}") from exc


# --- pods, pure ------------------------------------------------------------------------------------------------


def replica_info(pod: k8s.V1Pod, port: int) -> ReplicaInfo:
    ip = pod.status.pod_ip if pod.status else None
    url = _url(ip, port) if ip else None
    return ReplicaInfo(name=_name(pod), url=url, phase=classify(pod), created_s=_created_s(pod))


def _url(address: str, port: int) -> str:
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


def classify(pod: k8s.V1Pod) -> ReplicaPhase:
    if pod.metadata is not None and pod.metadata.deletion_timestamp is not None:
        return "terminating"
    status = pod.status
    if status is None:
        return "starting"
    if status.phase in ("Failed", "Succeeded", "Unknown"):
        return "failed"
    for container in [*(status.init_container_statuses or []), *(status.container_statuses or [])]:
        waiting = container.state.waiting if container.state else None
        if waiting is not None and waiting.reason in _FAILED_WAITING:
            return "failed"
    if _is_ready(pod):
        return "ready"
    return "starting"


def why_cost_cannot_decide(victim: str, pods: Sequence[k8s.V1Pod]) -> str | None:
    """Why lowering replicas by one might remove a pod other than `victim`, or None when its cost decides."""
    active = [
        p
        for p in pods
        if (p.metadata is None or p.metadata.deletion_timestamp is None)
        and (p.status is None or p.status.phase not in ("Failed", "Succeeded"))
    ]
    chosen = next((p for p in active if _name(p) == victim), None)
    if chosen is None:
        return f"{victim} is not an active pod of the Deployment"
    hashes = {((p.metadata.labels or {}) if p.metadata else {}).get("pod-template-hash") for p in active}
    if len(hashes) > 1:
        return "its pods belong to several ReplicaSets (a rollout): the Deployment controller picks the pod"
    first = [_name(p) for p in active if _removal_rank(p) < _removal_rank(chosen)]
    if first:
        return f"{', '.join(first)} would be removed before {victim} (unscheduled, pending or not ready)"
    return None


def _removal_rank(pod: k8s.V1Pod) -> tuple[int, int, int]:
    """The ReplicaSet controller's order before deletion cost: unscheduled, then pending/unknown, then not ready."""
    is_assigned = bool(pod.spec and pod.spec.node_name)
    phase = pod.status.phase if pod.status else None
    return (int(is_assigned), {"Pending": 0, "Unknown": 1}.get(phase or "Pending", 2), int(_is_ready(pod)))


def _is_ready(pod: k8s.V1Pod) -> bool:
    conditions = pod.status.conditions if pod.status else None
    return any(c.type == "Ready" and c.status == "True" for c in conditions or [])


def _name(pod: k8s.V1Pod) -> str:
    return (pod.metadata.name if pod.metadata else None) or ""


def _created_s(pod: k8s.V1Pod) -> float:
    created = pod.metadata.creation_timestamp if pod.metadata else None
    return created.timestamp() if created is not None else time.time()


def _replicas(scale: k8s.V1Scale) -> int:
    return (scale.spec.replicas if scale.spec else None) or 0
