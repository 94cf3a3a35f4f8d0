"""Replica discovery from the EndpointSlices of a Kubernetes Service, watched through the official client.

- A thread runs the client's blocking calls: list the Service's EndpointSlices (label
  `kubernetes.io/service-name=<service>`), then watch from the list's resourceVersion. A watch that times out
  resumes from the last version it saw; one answered with 410 Gone (that version was compacted away) lists
  again. The thread holds no router state: it hands each list and event to the event loop
  (`loop.call_soon_threadsafe`), and the pool changes there only. It stops with the app: a stop flag checked
  between events, `Watch.stop()` to break a blocked read, and a timeout on every request.
- Each endpoint is one pod, named by its targetRef (the name the autoscaler drains it by), or host:port without
  one. The pool follows each endpoint's conditions: ready -> added (it takes traffic after its first good probe,
  as any replica); terminating or no longer ready -> drained (no new requests, in-flight ones finish); ready
  again -> undrained; gone from every slice -> removed.
- Discovery acts only on a change of an endpoint's state and only on the replicas it added, and it undrains only
  what it drained: an unrelated slice update never undoes a drain made through the admin API.
- Failures: the API server unreachable or refusing (an HTTP error, a broken connection) is logged and retried;
  anything else (an object the client cannot read, a slice that breaks `endpoints_of`) is also counted as a
  failure of the `discovery` task and logged with its traceback the first time (router/service/supervise.py).
  Either way discovery counts as down (`shoal_router_tasks_down{task="discovery"}`) until a list is applied again.

`endpoints_of` and `merge` are pure: the slices in, the endpoints out.

RBAC: `discovery.k8s.io` `endpointslices`: list, watch, in `namespace`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes import watch as k8s_watch

from router.service.pool import Replica, ReplicaPool
from router.service.replica_url import replica_id
from router.service.routing import PoolRouting
from router.service.settings import DiscoverySettings
from router.service.supervise import TaskFailures

log = logging.getLogger("shoal.router.discovery")

EndpointState = Literal["ready", "terminating", "unready"]

SERVICE_LABEL = "kubernetes.io/service-name"
_WATCH_TIMEOUT_S = 120
"""Seconds a watch request lasts before it is resumed: short enough that a stop never waits long on a watch
that `Watch.stop()` could not break, long enough that re-watching costs the API server nothing."""
_CONNECT_TIMEOUT_S = 5.0
_LIST_TIMEOUT_S = 30.0
_RETRY_S = (0.5, 1.0, 2.0, 5.0, 10.0)
"""Waits after consecutive failed lists or watches (an API server restart, a network blip), then the last."""
_MIN_WATCH_S = 1.0
"""A watch that ends sooner than this without an event is followed by a pause this long, so a server or proxy
that closes watches at once is not hammered."""
_STOP_TIMEOUT_S = 15.0
"""Seconds `stop()` waits for the thread before it gives up waiting (it ends by its next request timeout)."""

_STATE_RANK: dict[EndpointState, int] = {"unready": 0, "terminating": 1, "ready": 2}


@dataclass(frozen=True)
class Endpoint:
    id: str
    url: str
    state: EndpointState


def endpoints_of(endpoint_slice: k8s.V1EndpointSlice, settings: DiscoverySettings) -> dict[str, Endpoint]:
    """The replicas one slice lists, by id. Conditions: `ready` unset means ready, `terminating` unset means not
    (the API's own reading of nil)."""
    port = _port(endpoint_slice, settings)
    if port is None:
        return {}
    endpoints: dict[str, Endpoint] = {}
    for endpoint in endpoint_slice.endpoints or []:
        if not endpoint.addresses:
            continue
        address = endpoint.addresses[0]
        url = f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"
        ref = endpoint.target_ref
        rid = ref.name if ref is not None and ref.kind == "Pod" and ref.name else replica_id(url)
        conditions = endpoint.conditions
        state: EndpointState
        if conditions is not None and conditions.terminating:
            state = "terminating"
        elif conditions is None or conditions.ready is not False:
            state = "ready"
        else:
            state = "unready"
        endpoints[rid] = Endpoint(rid, url, state)
    return endpoints


def merge(slices: Iterable[Mapping[str, Endpoint]]) -> dict[str, Endpoint]:
    """All slices' endpoints; one listed twice (while the controller moves it between slices) takes the best state."""
    merged: dict[str, Endpoint] = {}
    for endpoints in slices:
        for rid, endpoint in endpoints.items():
            seen = merged.get(rid)
            if seen is None or _STATE_RANK[endpoint.state] > _STATE_RANK[seen.state]:
                merged[rid] = endpoint
    return merged


def _port(endpoint_slice: k8s.V1EndpointSlice, settings: DiscoverySettings) -> int | None:
    if settings.port is not None:
        return settings.port
    ports = [p for p in endpoint_slice.ports or [] if p.port is not None and p.protocol in (None, "TCP")]
    if settings.port_name is not None:
        ports = [p for p in ports if p.name == settings.port_name]
    if len(ports) == 1:
        return ports[0].port
    name = endpoint_slice.metadata.name if endpoint_slice.metadata else "?"
    log.warning(
        "EndpointSlice %s: %d ports match (port_name=%r): set discovery.port_name or discovery.port",
        name,
        len(ports),
        settings.port_name,
    )
    return None


def load_api_client() -> k8s.ApiClient:
    """In-cluster credentials inside a pod, else the kubeconfig ($KUBECONFIG, read now, or ~/.kube/config)."""
    configuration = k8s.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    else:
        k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration
        )
    return k8s.ApiClient(configuration)


class KubernetesDiscovery:
    """Keeps the pool in step with a Service's EndpointSlices (see the module docstring)."""

    def __init__(
        self,
        settings: DiscoverySettings,
        pool: ReplicaPool,
        routing: PoolRouting,
        on_changed: Callable[[Replica], None],
        *,
        failures: TaskFailures,
        api_client: k8s.ApiClient | None = None,
    ) -> None:
        if settings.service is None:
            raise ValueError("Kubernetes discovery needs discovery.service")
        self.settings = settings
        self.selector = f"{SERVICE_LABEL}={settings.service}"
        self.pool = pool
        self.routing = routing
        self.on_changed = on_changed
        """Called after discovery added or undrained a replica: probe it now, let held requests look again."""
        self._api_client = api_client
        self._owns_client = api_client is None
        self._slices: dict[str, dict[str, Endpoint]] = {}
        self._endpoints: dict[str, Endpoint] = {}
        self._owned: set[str] = set()
        """Replicas discovery added: the only ones it changes."""
        self._drained: set[str] = set()
        """Replicas discovery drained: the only ones it undrains."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._watch: k8s_watch.Watch | None = None
        self.num_syncs = 0
        """Full lists applied so far (1 after start-up; more after a 410 Gone or a failed watch)."""
        self.failures = failures
        failures.declare("discovery")
        self.is_down = False
        """A list or watch failed and no list has been applied since."""

    def start(self) -> None:
        """Start watching; call on the event loop that owns the pool."""
        if self._api_client is None:
            self._api_client = load_api_client()
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(
            target=self._run, args=(k8s.DiscoveryV1Api(self._api_client),), name="shoal-discovery", daemon=True
        )
        self._thread.start()
        log.info("watching EndpointSlices %s in namespace %s", self.selector, self.settings.namespace)

    async def stop(self) -> None:
        self._stopping.set()
        watch = self._watch
        if watch is not None:
            watch.stop()  # type: ignore[no-untyped-call]
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, _STOP_TIMEOUT_S)
            if self._thread.is_alive():
                log.warning("the discovery thread is still in a request; it ends at that request's timeout")
        if self._owns_client and self._api_client is not None:
            self._api_client.close()  # type: ignore[no-untyped-call]
        self._set_down(False)  # stopped, not failed

    # --- on the event loop ---------------------------------------------------------------------------------------

    def _replace_all(self, slices: list[k8s.V1EndpointSlice]) -> None:
        self._slices = {_slice_name(s): endpoints_of(s, self.settings) for s in slices}
        self.num_syncs += 1
        self._reconcile()
        self._set_down(False)

    def _apply_event(self, kind: str, endpoint_slice: k8s.V1EndpointSlice) -> None:
        name = _slice_name(endpoint_slice)
        if kind == "DELETED":
            self._slices.pop(name, None)
        else:
            self._slices[name] = endpoints_of(endpoint_slice, self.settings)
        self._reconcile()

    def _failed(self, exc: Exception, retry_in_s: float, is_foreseen: bool) -> None:
        if not is_foreseen:
            self.failures.failed("discovery", exc, where=self.settings.service or "", retry_in_s=retry_in_s)
        self._set_down(True)

    def _set_down(self, is_down: bool) -> None:
        if is_down != self.is_down:
            self.is_down = is_down
            (self.failures.down if is_down else self.failures.up)("discovery")

    def _on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """Run what the thread handed over; a failure there is discovery's, not the event loop's."""
        try:
            fn(*args)
        except Exception as exc:
            self.failures.failed("discovery", exc, where=self.settings.service or "")
            self._set_down(True)

    def _reconcile(self) -> None:
        after = merge(self._slices.values())
        for rid in self._endpoints.keys() - after.keys():
            self._remove(rid)
        for rid, endpoint in after.items():
            if self._endpoints.get(rid) != endpoint:
                self._follow(endpoint)
        self._endpoints = after

    def _follow(self, endpoint: Endpoint) -> None:
        replica = self.pool.get(endpoint.id)
        if replica is not None and endpoint.id not in self._owned:
            log.debug("replica %s was added by other means; discovery leaves it alone", endpoint.id)
            return
        if replica is not None and replica.url != endpoint.url:
            log.info("replica %s moved from %s to %s", endpoint.id, replica.url, endpoint.url)
            self._remove(endpoint.id)
            replica = None
        if endpoint.state == "ready":
            if replica is None:
                replica = self.pool.add(endpoint.url, name=endpoint.id)
                self.routing.add_replica(replica)
                self._owned.add(endpoint.id)
                log.info("replica %s at %s discovered", endpoint.id, endpoint.url)
                self.on_changed(replica)
            elif endpoint.id in self._drained:
                replica.is_draining = False
                self._drained.discard(endpoint.id)
                log.info("replica %s is ready again", endpoint.id)
                self.on_changed(replica)
        elif replica is not None and not replica.is_draining:
            replica.is_draining = True
            self._drained.add(endpoint.id)
            log.info("replica %s is %s: draining", endpoint.id, endpoint.state)

    def _remove(self, rid: str) -> None:
        if rid not in self._owned:
            return
        self.pool.remove(rid)
        self.routing.remove_replica(rid)
        self._owned.discard(rid)
        self._drained.discard(rid)
        log.info("replica %s left the Service", rid)

    # --- on the thread -------------------------------------------------------------------------------------------

    def _run(self, api: k8s.DiscoveryV1Api) -> None:
        failures = 0
        while not self._stopping.is_set():
            try:
                version = self._list(api)
                failures = 0
                while not self._stopping.is_set():
                    started = time.monotonic()
                    resumed_from, version = version, self._watch_from(api, version)
                    if version == resumed_from and time.monotonic() - started < _MIN_WATCH_S:
                        self._stopping.wait(_MIN_WATCH_S)
            except k8s.ApiException as exc:
                if exc.status == 410:
                    log.info("watch expired (410 Gone): listing again")
                    continue
                failures += 1
                log.warning("EndpointSlices of %s: HTTP %s %s", self.settings.service, exc.status, exc.reason)
                self._post(self._failed, exc, self._retry_s(failures), True)
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                if self._stopping.is_set():
                    break
                failures += 1
                log.warning("EndpointSlices of %s: %s: %s", self.settings.service, type(exc).__name__, exc)
                self._post(self._failed, exc, self._retry_s(failures), True)
            except Exception as exc:  # the thread must outlive any one failure: it is the router's only discovery
                if self._stopping.is_set():
                    break
                failures += 1
                self._post(self._failed, exc, self._retry_s(failures), False)
            self._stopping.wait(self._retry_s(failures))

    @staticmethod
    def _retry_s(num_failures: int) -> float:
        return _RETRY_S[min(max(num_failures, 1), len(_RETRY_S)) - 1]

    def _list(self, api: k8s.DiscoveryV1Api) -> str:
        listed = api.list_namespaced_endpoint_slice(
            self.settings.namespace,
            label_selector=self.selector,
            _request_timeout=(_CONNECT_TIMEOUT_S, _LIST_TIMEOUT_S),
        )
        self._post(self._replace_all, list(listed.items))
        return (listed.metadata.resource_version if listed.metadata else None) or ""

    def _watch_from(self, api: k8s.DiscoveryV1Api, version: str) -> str:
        """One watch request, from `version`; returns the last version seen. Raises ApiException(410) when
        `version` is too old."""
        watch = k8s_watch.Watch()  # type: ignore[no-untyped-call]
        self._watch = watch
        stream = watch.stream(  # type: ignore[no-untyped-call]
            api.list_namespaced_endpoint_slice,
            self.settings.namespace,
            label_selector=self.selector,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=_WATCH_TIMEOUT_S,
            _request_timeout=(_CONNECT_TIMEOUT_S, _WATCH_TIMEOUT_S + 10),
        )
        try:
            for event in stream:
                if self._stopping.is_set():
                    break
                kind: str = event["type"]
                if kind == "BOOKMARK":
                    version = watch.resource_version or version
                    continue
                endpoint_slice: k8s.V1EndpointSlice = event["object"]
                if endpoint_slice.metadata is not None and endpoint_slice.metadata.resource_version:
                    version = endpoint_slice.metadata.resource_version
                self._post(self._apply_event, kind, endpoint_slice)
        finally:
            self._watch = None
        return version

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._on_loop, fn, *args)
        except RuntimeError:  # the loop is closed: the app is gone
            self._stopping.set()


def _slice_name(endpoint_slice: k8s.V1EndpointSlice) -> str:
    return (endpoint_slice.metadata.name if endpoint_slice.metadata else None) or ""
