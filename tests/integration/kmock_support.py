"""kmock as the Kubernetes API of Shoal's tests: the API-server behaviour Shoal relies on that kmock leaves out.

kmock's `KubernetesEmulator` keeps objects in memory and serves them over real HTTP, but it keeps no
resourceVersions, ignores subresources and label selectors, has no PUT, and its watches replay every object and
never end. `KubeApi` subclasses it (kmock's docs suggest inheriting for special treatment) and serves every
Kubernetes request itself, with the real API server's semantics for what the autoscaler and discovery use:

- one resourceVersion counter stamped on every write; a PATCH or PUT whose body names a `metadata.resourceVersion`
  that is no longer current gets 409 Conflict (optimistic concurrency), POST of an existing name 409 AlreadyExists;
- `deployments/{name}/scale` (GET, PATCH, PUT) as an autoscaling/v1 Scale carrying the Deployment's
  resourceVersion and, in `status.selector`, its label selector as a string;
- `labelSelector` on lists and watches (`k=v`, `k!=v`, `k in (a,b)`, `k notin (a)`, `k`, `!k`);
- watches that begin after `resourceVersion` (or with the current objects when none is given), end after
  `timeoutSeconds`, and answer an ERROR event with 410 Gone when that version is older than the compacted
  history. `watch_outage()` breaks every watch and compacts history when it ends, as a lost connection plus an
  etcd compaction would.

Objects stay in kmock's `objects` store (with their history, for assertions) and every request in its request
log. Tests write through `create_object`, `patch_object` and `delete_object`, the code the HTTP handlers run, so
watchers see their writes.
`interpose(match, action)` runs `action` once, just before the first request that `match`es is served: a rival
writer that lands between a client's read and its write.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import kmock
import pytest
from kubernetes import client as k8s

DEPLOYMENTS = kmock.resource("apps", "v1", "deployments")
PODS = kmock.resource("", "v1", "pods")
LEASES = kmock.resource("coordination.k8s.io", "v1", "leases")
ENDPOINT_SLICES = kmock.resource("discovery.k8s.io", "v1", "endpointslices")

# Watches without timeoutSeconds end after this long, as the API server's own request timeout would end them.
_MAX_WATCH_S = 1800.0


class ApiError(Exception):
    """A Kubernetes `Status` failure: rendered with its HTTP code."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message

    def status(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "code": self.code,
            "reason": self.reason,
            "message": self.message,
        }


@dataclass(frozen=True)
class _Event:
    resource_version: int
    resource: kmock.resource
    namespace: str | None
    type: str
    object: dict[str, Any]


def _never(request: kmock.Request) -> bool:
    return False


@attrs.define(kw_only=True)
class KubeApi(kmock.KubernetesEmulator):
    _resource_version: int = attrs.field(default=0, init=False)
    _events: list[_Event] = attrs.field(factory=list, init=False)
    _compacted_version: int = attrs.field(default=0, init=False)
    _changed: asyncio.Condition = attrs.field(factory=asyncio.Condition, init=False)
    _watch_gate: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)
    _watch_epoch: int = attrs.field(default=0, init=False)
    _interposed: list[tuple[Callable[[kmock.Request], bool], Callable[[], Awaitable[Any]]]] = attrs.field(
        factory=list, init=False
    )
    refuse: Callable[[kmock.Request], bool] = attrs.field(default=_never)
    """Requests for which this returns True get 503 and change nothing: a client cut off from the API."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._watch_gate.set()

    # --- what the tests call ------------------------------------------------------------------------------------

    @property
    def resource_version(self) -> int:
        return self._resource_version

    def read_object(self, resource: kmock.resource, namespace: str | None, name: str) -> dict[str, Any] | None:
        key = (resource, namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    async def create_object(
        self, resource: kmock.resource, namespace: str | None, body: Mapping[str, Any]
    ) -> dict[str, Any]:
        obj = copy.deepcopy(dict(body))
        meta = obj.setdefault("metadata", {})
        name = meta.get("name")
        if not name:
            raise ApiError(422, "Invalid", "metadata.name is required")
        key = (resource, namespace, name)
        if key in self.objects and not self.objects[key].deleted:
            raise ApiError(409, "AlreadyExists", f"{resource.plural} {name!r} already exists")
        if namespace is not None:
            meta["namespace"] = namespace
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", _now_rfc3339())
        meta["resourceVersion"] = str(self._next_version())
        if key in self.objects:
            self.objects[key].create(obj)
        else:
            self.objects[key] = obj
        await self._record(resource, namespace, "ADDED", obj)
        return copy.deepcopy(obj)

    async def patch_object(
        self, resource: kmock.resource, namespace: str | None, name: str, changes: Mapping[str, Any]
    ) -> dict[str, Any]:
        """A JSON merge patch (RFC 7386); a `metadata.resourceVersion` in it is a precondition."""
        current = self._current(resource, namespace, name)
        _check_precondition(current, changes)
        return await self._store(resource, namespace, name, _merge_patch(current, changes))

    async def replace_object(
        self, resource: kmock.resource, namespace: str | None, name: str, body: Mapping[str, Any]
    ) -> dict[str, Any]:
        """PUT: the whole object; a `metadata.resourceVersion` in it must be the current one."""
        current = self._current(resource, namespace, name)
        _check_precondition(current, body)
        obj = copy.deepcopy(dict(body))
        meta = obj.setdefault("metadata", {})
        for field in ("name", "namespace", "uid", "creationTimestamp"):
            if field in current["metadata"]:
                meta[field] = current["metadata"][field]
        return await self._store(resource, namespace, name, obj)

    async def delete_object(self, resource: kmock.resource, namespace: str | None, name: str) -> dict[str, Any]:
        current = self._current(resource, namespace, name)
        current["metadata"]["resourceVersion"] = str(self._next_version())
        self.objects[resource, namespace, name].delete()
        await self._record(resource, namespace, "DELETED", current)
        return current

    def interpose(self, match: Callable[[kmock.Request], bool], action: Callable[[], Awaitable[Any]]) -> None:
        """Run `action` once, before serving the first request that `match`es."""
        self._interposed.append((match, action))

    def received(
        self,
        resource: kmock.resource | None = None,
        *,
        methods: tuple[str, ...] = ("GET", "POST", "PUT", "PATCH", "DELETE"),
        name: str | None = None,
        user_agent: str | None = None,
        is_watch: bool | None = None,
    ) -> list[kmock.Request]:
        """The Kubernetes requests received (for `resource`, or all), in arrival order, narrowed by method, object
        name, client (User-Agent) and whether they were watches."""
        return [
            r
            for r in self._requests
            if r.resource is not None
            and (resource is None or r.resource == resource)
            and str(r.method.value) in methods
            and (name is None or r.name == name)
            and (user_agent is None or r.headers.get("User-Agent") == user_agent)
            and (is_watch is None or (r.params.get("watch", "").lower() in ("true", "1")) == is_watch)
        ]

    @contextlib.asynccontextmanager
    async def watch_outage(self) -> AsyncIterator[None]:
        """Every open watch ends and new ones wait; on exit, the history until now is compacted away, so a watch
        that resumes from a version seen before the outage gets 410 Gone and must list again."""
        self._watch_gate.clear()
        self._watch_epoch += 1
        await self._notify()
        try:
            yield
        finally:
            self._compacted_version = self._resource_version
            self._events.clear()
            self._watch_gate.set()

    async def end_watches(self) -> None:
        """End every open watch (at teardown, so the server's shutdown does not wait for them)."""
        self._watch_epoch += 1
        self._watch_gate.set()
        await self._notify()

    # --- the store ---------------------------------------------------------------------------------------------

    def _next_version(self) -> int:
        self._resource_version += 1
        return self._resource_version

    def _current(self, resource: kmock.resource, namespace: str | None, name: str) -> dict[str, Any]:
        obj = self.read_object(resource, namespace, name)
        if obj is None:
            raise ApiError(404, "NotFound", f"{resource.plural} {name!r} not found")
        return obj

    async def _store(
        self, resource: kmock.resource, namespace: str | None, name: str, obj: dict[str, Any]
    ) -> dict[str, Any]:
        obj.setdefault("metadata", {})["resourceVersion"] = str(self._next_version())
        self.objects[resource, namespace, name].history.append(obj)
        await self._record(resource, namespace, "MODIFIED", obj)
        return copy.deepcopy(obj)

    async def _record(self, resource: kmock.resource, namespace: str | None, type_: str, obj: dict[str, Any]) -> None:
        version = int(obj["metadata"]["resourceVersion"])
        self._events.append(_Event(version, resource, namespace, type_, copy.deepcopy(obj)))
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _matching(self, request: kmock.Request, selector: _Selector) -> Iterator[dict[str, Any]]:
        for (resource, namespace, _), obj in self.objects.items():
            if obj.deleted or resource != request.resource:
                continue
            if request.namespace is not None and namespace != request.namespace:
                continue
            if selector.matches(obj.raw):
                yield copy.deepcopy(obj.raw)

    # --- HTTP ---------------------------------------------------------------------------------------------------

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is None or request.resource.plural is None:
            return await super()._handle(request)  # discovery documents, /version
        for entry in list(self._interposed):
            if entry[0](request):
                self._interposed.remove(entry)
                await entry[1]()
        try:
            if self.refuse(request):
                raise ApiError(503, "ServiceUnavailable", "this client is cut off from the API")
            status, payload = await self._serve(request)
        except ApiError as exc:
            status, payload = exc.code, exc.status()
        # kmock renders the payload: a dict as JSON, the watch's async generator as a stream of JSON lines.
        return await kmock.Response(status=status, payload=payload)(request)  # type: ignore[attr-defined]

    async def _serve(self, request: kmock.Request) -> tuple[int, Any]:
        resource, namespace, name = request.resource, request.namespace, request.name
        assert resource is not None
        method = str(request.method.value)
        if request.subresource not in (None, "scale") or (request.subresource and resource != DEPLOYMENTS):
            raise ApiError(404, "NotFound", f"no subresource {request.subresource!r} here")
        if method == "GET" and request.params.get("watch", "").lower() in ("true", "1"):
            return 200, self._watch(request)
        if method == "GET" and name is None:
            selector = _Selector.parse(request.params.get("labelSelector", ""))
            items = list(self._matching(request, selector))
            return 200, {"kind": "List", "metadata": {"resourceVersion": str(self._resource_version)}, "items": items}
        if method == "POST" and name is None:
            return 201, await self.create_object(resource, namespace, _body(request))
        if name is None:
            raise ApiError(405, "MethodNotAllowed", f"{method} needs an object name")
        if request.subresource == "scale":
            return 200, await self._serve_scale(method, namespace, name, request)
        if method == "GET":
            return 200, self._current(resource, namespace, name)
        if method == "PATCH":
            return 200, await self.patch_object(resource, namespace, name, _merge_body(request))
        if method == "PUT":
            return 200, await self.replace_object(resource, namespace, name, _body(request))
        if method == "DELETE":
            return 200, await self.delete_object(resource, namespace, name)
        raise ApiError(405, "MethodNotAllowed", f"{method} is not served")

    async def _serve_scale(
        self, method: str, namespace: str | None, name: str, request: kmock.Request
    ) -> dict[str, Any]:
        if method in ("PATCH", "PUT"):
            body = _merge_body(request) if method == "PATCH" else _body(request)
            deployment = self._current(DEPLOYMENTS, namespace, name)
            _check_precondition(deployment, body)
            replicas = body.get("spec", {}).get("replicas")
            if replicas is not None and (type(replicas) is not int or replicas < 0):
                raise ApiError(422, "Invalid", f"spec.replicas must be a non-negative integer, got {replicas!r}")
            if replicas is not None:
                await self.patch_object(DEPLOYMENTS, namespace, name, {"spec": {"replicas": replicas}})
        return _scale_of(self._current(DEPLOYMENTS, namespace, name))

    async def _watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        await self._watch_gate.wait()
        epoch = self._watch_epoch
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(request.params.get("timeoutSeconds") or _MAX_WATCH_S)
        selector = _Selector.parse(request.params.get("labelSelector", ""))
        since = request.params.get("resourceVersion", "")
        yield b""  # the headers go out now, as a real watch sends them before any event
        if since in ("", "0"):
            cursor = self._resource_version
            for obj in self._matching(request, selector):
                yield {"type": "ADDED", "object": obj}
        elif int(since) < self._compacted_version:
            gone = ApiError(410, "Expired", f"too old resource version: {since} ({self._compacted_version})")
            yield {"type": "ERROR", "object": gone.status()}
            return
        else:
            cursor = int(since)
        while True:
            for event in [e for e in self._events if e.resource_version > cursor]:
                cursor = event.resource_version
                if event.resource != request.resource:
                    continue
                if request.namespace is not None and event.namespace != request.namespace:
                    continue
                if selector.matches(event.object):
                    yield {"type": event.type, "object": copy.deepcopy(event.object)}
            remaining_s = deadline - loop.time()
            if remaining_s <= 0 or self._watch_epoch != epoch:
                return
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait_for(partial(self._has_news, cursor, epoch)), remaining_s)

    def _has_news(self, cursor: int, epoch: int) -> bool:
        return self._resource_version > cursor or self._watch_epoch != epoch


# --- object shapes -------------------------------------------------------------------------------------------------


def _now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _body(request: kmock.Request) -> dict[str, Any]:
    if not isinstance(request.data, dict):
        raise ApiError(400, "BadRequest", "the body must be a JSON object")
    return request.data


def _merge_body(request: kmock.Request) -> dict[str, Any]:
    content_type = request.headers.get("Content-Type", "")
    if "merge-patch" not in content_type:  # merge-patch+json and strategic-merge-patch+json
        raise ApiError(415, "UnsupportedMediaType", f"this mock applies merge patches only, not {content_type!r}")
    return _body(request)


def _check_precondition(current: Mapping[str, Any], body: Mapping[str, Any]) -> None:
    wanted = (body.get("metadata") or {}).get("resourceVersion")
    actual = current["metadata"]["resourceVersion"]
    if wanted is not None and wanted != actual:
        name = current["metadata"]["name"]
        raise ApiError(
            409,
            "Conflict",
            f"Operation cannot be fulfilled on {name!r}: the object has been modified; please apply your changes "
            f"to the latest version and try again (resourceVersion {wanted} is not {actual})",
        )


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, null deletes, anything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), value)
    return result


def _scale_of(deployment: Mapping[str, Any]) -> dict[str, Any]:
    meta = deployment["metadata"]
    selector = (deployment.get("spec") or {}).get("selector") or {}
    return {
        "apiVersion": "autoscaling/v1",
        "kind": "Scale",
        "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")},
        "spec": {"replicas": deployment["spec"].get("replicas", 1)},
        "status": {
            "replicas": (deployment.get("status") or {}).get("replicas", 0),
            "selector": _selector_string(selector),
        },
    }


def _selector_string(selector: Mapping[str, Any]) -> str:
    """A LabelSelector as the query-string form the API server puts into Scale.status.selector."""
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], ",".join(sorted(expr.get("values") or []))
        parts.append(
            {"In": f"{key} in ({values})", "NotIn": f"{key} notin ({values})", "Exists": key}.get(op, f"!{key}")
        )
    return ",".join(parts)


@dataclass(frozen=True)
class _Selector:
    requirements: tuple[tuple[str, str, frozenset[str]], ...]

    _TERM = re.compile(r"\s*(!?)\s*([\w./-]+)\s*(?:(==|=|!=)\s*([\w.-]*)|\s(in|notin)\s*\(([^)]*)\))?\s*(?:,|$)")

    @classmethod
    def parse(cls, text: str) -> _Selector:
        requirements: list[tuple[str, str, frozenset[str]]] = []
        pos = 0
        while pos < len(text):
            m = cls._TERM.match(text, pos)
            if m is None or m.end() == pos:
                raise ApiError(400, "BadRequest", f"unable to parse labelSelector {text!r}")
            negated, key, op, value, set_op, values = m.groups()
            if set_op:
                requirements.append((key, set_op, frozenset(v.strip() for v in values.split(",") if v.strip())))
            elif op:
                requirements.append((key, "!=" if op == "!=" else "=", frozenset([value])))
            else:
                requirements.append((key, "!exists" if negated else "exists", frozenset()))
            pos = m.end()
        return cls(tuple(requirements))

    def matches(self, obj: Mapping[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        for key, op, values in self.requirements:
            has, value = key in labels, labels.get(key)
            ok = {
                "=": has and value in values,
                "in": has and value in values,
                "!=": not has or value not in values,
                "notin": not has or value not in values,
                "exists": has,
                "!exists": not has,
            }[op]
            if not ok:
                return False
        return True


# --- for the tests' fixtures ---------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def running_kube_api() -> AsyncIterator[KubeApi]:
    """A fresh API server on a loopback port, for the duration of the block."""
    async with KubeApi() as api, kmock.Server(api):
        try:
            yield api
        finally:
            await api.end_watches()


def api_client_for(api: KubeApi, user_agent: str = "shoal-tests") -> k8s.ApiClient:
    """An official-client `ApiClient` that talks to `api`; the user agent tells clients apart in its request log."""
    configuration = k8s.Configuration(host=str(api.url).rstrip("/"))
    configuration.retries = 0  # a refused request fails at once instead of retrying for seconds
    api_client = k8s.ApiClient(configuration)
    api_client.user_agent = user_agent
    return api_client


def use_kubeconfig(api: KubeApi, path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Write a kubeconfig at `path` whose current context is `api`, and point this process (and its children)
    at it, out of any in-cluster configuration."""
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: kmock, cluster: {{server: '{str(api.url).rstrip('/')}'}}}}]\n"
        "users: [{name: tester, user: {token: test-token}}]\n"
        "contexts: [{name: kmock, context: {cluster: kmock, user: tester}}]\n"
        "current-context: kmock\n"
    )
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return path
