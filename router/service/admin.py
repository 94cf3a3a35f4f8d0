"""Admin API under /admin/ (DESIGN.md contract 4): list, add, remove and drain replicas; index statistics.

Bearer-token protected. Without a configured token the whole API answers 404, so an unconfigured router never
exposes it; a wrong or missing token gets 401. Tokens are compared in constant time.

    GET    /admin/replicas                   -> {"replicas": [...]}
    POST   /admin/replicas  {"url", "name"?, "kv_capacity_blocks"?}
    DELETE /admin/replicas/{id}
    POST   /admin/replicas/{id}/drain        (stop new requests; in-flight ones finish; poll in_flight)
    POST   /admin/replicas/{id}/undrain
    GET    /admin/index                      -> prefix index statistics
"""

from __future__ import annotations

import dataclasses
import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from router.service.errors import error_response
from router.service.pool import Replica, ReplicaPool, replica_id, split_url
from router.service.routing import RoutingCore

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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
    def __init__(self, token: str, pool: ReplicaPool, core: RoutingCore, on_changed: Callable[[Replica], None]) -> None:
        self._token = f"Bearer {token}".encode()
        self.pool = pool
        self.core = core
        self.on_changed = on_changed
        """Called after an add or an undrain: the replica may take traffic (held requests look again)."""

    def routes(self) -> list[web.RouteDef]:
        guard = self._authenticated
        return [
            web.get("/admin/replicas", guard(self.list_replicas)),
            web.post("/admin/replicas", guard(self.add_replica)),
            web.delete("/admin/replicas/{id}", guard(self.remove_replica)),
            web.post("/admin/replicas/{id}/drain", guard(self.drain_replica)),
            web.post("/admin/replicas/{id}/undrain", guard(self.undrain_replica)),
            web.get("/admin/index", guard(self.index_stats)),
        ]

    def _authenticated(self, handler: Handler) -> Handler:
        """Wrap an admin handler with the bearer-token check (per route, so the proxy path pays nothing)."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, self._token):
                return error_response(
                    401,
                    "missing or wrong admin bearer token",
                    type_="authentication_error",
                    code="invalid_token",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            return await handler(request)

        return guarded

    async def list_replicas(self, request: web.Request) -> web.Response:
        return web.json_response({"replicas": [replica_view(r) for r in self.pool]})

    async def add_replica(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
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
        if name is not None and (not isinstance(name, str) or not name or "/" in name):
            return error_response(400, "'name' must be a non-empty string without '/'", param="name")
        if capacity is not None and (type(capacity) is not int or capacity <= 0):
            return error_response(400, "'kv_capacity_blocks' must be a positive integer", param="kv_capacity_blocks")
        is_new = (name or replica_id(url.rstrip("/"))) not in self.pool
        try:
            replica = self.pool.add(url, name=name, kv_capacity_blocks=capacity)
        except ValueError as exc:
            return error_response(409, str(exc), code="conflict")
        if is_new:
            self.core.add_replica(replica)
        self.on_changed(replica)
        return web.json_response(replica_view(replica), status=201 if is_new else 200)

    def _replica(self, request: web.Request) -> Replica:
        replica = self.pool.get(request.match_info["id"])
        if replica is None:
            raise web.HTTPNotFound(
                text=json.dumps(
                    {
                        "error": {
                            "message": f"no replica {request.match_info['id']!r}",
                            "type": "invalid_request_error",
                            "param": "id",
                            "code": "not_found",
                        }
                    }
                ),
                content_type="application/json",
            )
        return replica

    async def remove_replica(self, request: web.Request) -> web.Response:
        replica = self._replica(request)
        self.pool.remove(replica.id)
        self.core.remove_replica(replica.id)
        return web.json_response(replica_view(replica))

    async def drain_replica(self, request: web.Request) -> web.Response:
        replica = self._replica(request)
        replica.is_draining = True
        return web.json_response(replica_view(replica))

    async def undrain_replica(self, request: web.Request) -> web.Response:
        replica = self._replica(request)
        replica.is_draining = False
        self.on_changed(replica)
        return web.json_response(replica_view(replica))

    async def index_stats(self, request: web.Request) -> web.Response:
        stats = self.core.index.stats()
        data = dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(vars(stats))
        return web.json_response(data)
