"""Admin API under /admin/ (DESIGN.md contract 4): list, add, remove and drain replicas; index statistics.

Bearer-token protected. Without a configured token the whole API answers 404, so an unconfigured router never
exposes it; a wrong or missing token gets 401. Tokens are compared in constant time.

    GET    /admin/replicas                   -> {"replicas": [...]}
    POST   /admin/replicas  {"url", "name"?, "kv_capacity_blocks"?}
    DELETE /admin/replicas/{id}
    POST   /admin/replicas/{id}/drain        (stop new requests; in-flight ones finish; poll in_flight)
    POST   /admin/replicas/{id}/undrain
    GET    /admin/index                      -> prefix index statistics

`handle` dispatches on the path's segments: six routes need no routing table.
"""

from __future__ import annotations

import dataclasses
import hmac
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import orjson
from aiohttp import web

from router.service.errors import error_response
from router.service.front import Body, FrontRequest
from router.service.pool import Replica, ReplicaPool
from router.service.replica_url import replica_id, split_url
from router.service.routing import PoolRouting


def replica_view(replica: Replica) -> dict[str, Any]:
    s = replica.state
    return {
        "id": replica.id,
        "url": replica.url,
        "status": replica.status.value,
        "eligible": replica.is_eligible,
        "models": sorted(replica.models),
        "in_flight": s.in_flight,
        "waiting": s.waiting,
        "streaming": s.streaming,
        "prefill_backlog_tokens": s.waiting_prompt_tokens,
        "prefill_tokens_per_s": s.prefill_tokens_per_s,
        "kv_capacity_blocks": s.kv_capacity_blocks,
        "engine": {
            name: value
            for name, value in (
                ("num_running", s.num_running),
                ("num_waiting", s.num_waiting),
                ("kv_usage", s.kv_usage),
            )
            if value is not None
        },
        "last_error": replica.last_error,
    }


class AdminApi:
    def __init__(
        self, token: str, pool: ReplicaPool, routing: PoolRouting, on_changed: Callable[[Replica], None]
    ) -> None:
        self._token = f"Bearer {token}".encode()
        self.pool = pool
        self.routing = routing
        self.on_changed = on_changed
        """Called after an add or an undrain: the replica may take traffic (held requests look again)."""

    async def handle(self, request: FrontRequest, body: Body) -> web.Response:
        """Any request under /admin: 401 without the token, else the route's answer, or 404."""
        # The header's bytes as received: a value that is not UTF-8 is a wrong token, not an error.
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, self._token):
            return error_response(
                401,
                "missing or wrong admin bearer token",
                type_="authentication_error",
                code="invalid_token",
                headers={"WWW-Authenticate": "Bearer"},
            )
        parts = request.path.split("/")[2:]  # "/admin/replicas/x/drain" -> ["replicas", "x", "drain"]
        method = request.method
        if parts == ["replicas"] and method == "GET":
            return self.list_replicas()
        if parts == ["replicas"] and method == "POST":
            return self.add_replica(body)
        if parts == ["index"] and method == "GET":
            return self.index_stats()
        if len(parts) == 2 and parts[0] == "replicas" and method == "DELETE":
            return self.remove_replica(unquote(parts[1]))
        if len(parts) == 3 and parts[0] == "replicas" and method == "POST" and parts[2] == "drain":
            return self.drain_replica(unquote(parts[1]))
        if len(parts) == 3 and parts[0] == "replicas" and method == "POST" and parts[2] == "undrain":
            return self.undrain_replica(unquote(parts[1]))
        return error_response(404, f"no route for {method} {request.path}", code="not_found")

    def list_replicas(self) -> web.Response:
        return web.json_response({"replicas": [replica_view(r) for r in self.pool]})

    def add_replica(self, raw: Body) -> web.Response:
        try:
            body = orjson.loads(raw)
        except (ValueError, RecursionError):
            return error_response(400, 'body must be JSON: {"url": ..., "name"?: ...}', code="invalid_json")
        url = body.get("url") if isinstance(body, dict) else None
        if not isinstance(url, str):
            return error_response(400, "'url' must be an http:// URL", param="url")
        try:
            split_url(url)
        except ValueError as exc:
            return error_response(400, str(exc), param="url")
        name = body.get("name")
        capacity = body.get("kv_capacity_blocks")
        if name is not None and (
            not isinstance(name, str) or not name or "/" in name or not name.isprintable() or not name.isascii()
        ):  # a name goes into response headers (x-shoal-replica): no control characters
            return error_response(400, "'name' must be printable ASCII, non-empty, without '/'", param="name")
        if capacity is not None and (type(capacity) is not int or capacity <= 0):
            return error_response(400, "'kv_capacity_blocks' must be a positive integer", param="kv_capacity_blocks")
        is_new = (name or replica_id(url.rstrip("/"))) not in self.pool
        try:
            replica = self.pool.add(url, name=name, kv_capacity_blocks=capacity)
        except ValueError as exc:
            return error_response(409, str(exc), code="conflict")
        if is_new:
            self.routing.add_replica(replica)
        self.on_changed(replica)
        return web.json_response(replica_view(replica), status=201 if is_new else 200)

    def _not_found(self, name: str) -> web.Response:
        return error_response(404, f"no replica {name!r}", param="id", code="not_found")

    def remove_replica(self, name: str) -> web.Response:
        replica = self.pool.get(name)
        if replica is None:
            return self._not_found(name)
        self.pool.remove(replica.id)
        self.routing.remove_replica(replica.id)
        return web.json_response(replica_view(replica))

    def drain_replica(self, name: str) -> web.Response:
        replica = self.pool.get(name)
        if replica is None:
            return self._not_found(name)
        replica.is_draining = True
        return web.json_response(replica_view(replica))

    def undrain_replica(self, name: str) -> web.Response:
        replica = self.pool.get(name)
        if replica is None:
            return self._not_found(name)
        replica.is_draining = False
        self.on_changed(replica)
        return web.json_response(replica_view(replica))

    def index_stats(self) -> web.Response:
        stats = self.routing.index.stats()
        data = dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(vars(stats))
        return web.json_response(data)
