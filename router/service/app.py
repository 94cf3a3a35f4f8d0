"""`create_app(settings)`: the router's state and lifecycle as an aiohttp application (STYLE.md 5); `front_routes`:
its endpoints, served by `router.service.front`.

State lives under typed `web.AppKey`s; the HTTP client session, the health and scrape tasks and, with
`discovery.kind: kubernetes`, the EndpointSlice watch and, with `kv_events.source` set, the replicas' KV-event
streams are started and stopped in `cleanup_ctx`, each background task under `router.service.supervise`. Tests
build the app with this same factory. Every endpoint, the admin API, /metrics and the probes included, is served
on the one port by the front, so that one parser and one set of limits guard it (router/service/server.py says
why there is no second listener).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from router.policy.config import build_policy
from router.policy.prefix_index import PrefixIndex
from router.service.admin import AdminApi
from router.service.deadlines import Deadlines
from router.service.errors import error_response
from router.service.fleet import FleetSharing
from router.service.front import Answer, Body, FrontRequest, Handler
from router.service.health import HealthChecker, MetricsScraper
from router.service.kv_events import KVEventSubscribers
from router.service.metrics import RouterMetrics
from router.service.pool import Replica, ReplicaPool
from router.service.proxy import Proxy
from router.service.request_log import RequestLog, open_sink
from router.service.routing import PoolRouting
from router.service.settings import RouterSettings
from router.service.supervise import supervise
from router.service.upstream import UpstreamPool

SETTINGS = web.AppKey("settings", RouterSettings)
POOL = web.AppKey("pool", ReplicaPool)
ROUTING = web.AppKey("routing", PoolRouting)
METRICS = web.AppKey("metrics", RouterMetrics)
PROXY = web.AppKey("proxy", Proxy)
HEALTH = web.AppKey("health", HealthChecker)
KV_EVENTS = web.AppKey("kv_events", KVEventSubscribers)
FLEET = web.AppKey("fleet", FleetSharing)
SHUTTING_DOWN = web.AppKey("shutting_down", asyncio.Event)
ADMIN = web.AppKey("admin", AdminApi)
TOKENIZERS = web.AppKey("tokenizers", dict)
"""Served model name -> `chat_tokenizer.ChatTokenizer` (`tokenizer.models`); empty without the setting."""

# Index sweeps (TTL expiry) run this often; the sweep is cheap and bounded by the number of entries.
_SWEEP_INTERVAL_S = 5.0


def create_app(settings: RouterSettings, *, worker: str | None = None) -> web.Application:
    """The router's app. `worker`: this process's label among `--workers` (router/service/workers.py)."""
    app = web.Application()
    pool = ReplicaPool()
    index = PrefixIndex(settings.index)
    routing = PoolRouting(
        settings, pool, index, build_policy(settings.policy, seed=settings.seed), settings.prefill_rate
    )
    for url in settings.replicas:
        routing.add_replica(pool.add(url))
    app[SETTINGS] = settings
    app[TOKENIZERS] = _load_tokenizers(settings)
    app[POOL] = pool
    app[ROUTING] = routing
    app[METRICS] = RouterMetrics(pool, worker)
    app[SHUTTING_DOWN] = asyncio.Event()
    app.cleanup_ctx.append(_services)
    app.on_shutdown.append(_begin_shutdown)
    if settings.admin_token is not None:
        app[ADMIN] = AdminApi(
            settings.admin_token.get_secret_value(), pool, routing, on_changed=lambda r: _replica_changed(app, r)
        )
    return app


def _load_tokenizers(settings: RouterSettings) -> dict[str, Any]:
    """The configured models' tokenizers; imported only when configured, so a plain router install needs neither
    `tokenizers` nor `jinja2`."""
    if not settings.tokenizer.models:
        return {}
    from router.service.chat_tokenizer import load_tokenizers

    return dict(load_tokenizers(settings.tokenizer))


def front_routes(app: web.Application) -> tuple[dict[tuple[str, str], Handler], Handler]:
    """The endpoints of a started app ((method, path) -> handler), and the handler of every other request: /v1/*
    passthrough, the admin API, 404."""
    proxy = app[PROXY]
    admin = app.get(ADMIN)

    async def health(request: FrontRequest, body: Body) -> Answer:
        return web.json_response({"status": "ok"})

    async def ready(request: FrontRequest, body: Body) -> Answer:
        return _ready(app)

    async def metrics(request: FrontRequest, body: Body) -> Answer:
        return web.Response(body=app[METRICS].exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(request: FrontRequest, body: Body) -> Answer:
        return await proxy.handle_models(request)

    async def other(request: FrontRequest, body: Body) -> Answer:
        path = request.path
        if path.startswith("/v1/"):
            return await proxy.handle_passthrough(request, body)
        if admin is not None and (path == "/admin" or path.startswith("/admin/")):
            return await admin.handle(request, body)
        return error_response(404, f"no route for {request.method} {path}", code="not_found")

    routes: dict[tuple[str, str], Handler] = {
        ("POST", "/v1/chat/completions"): proxy.handle_front,
        ("POST", "/v1/completions"): proxy.handle_front,
        ("GET", "/v1/models"): models,
    }
    for method in ("GET", "HEAD"):
        routes[(method, "/health")] = health
        routes[(method, "/ready")] = ready
        routes[(method, "/metrics")] = metrics
    return routes, other


def _replica_changed(app: web.Application, replica: Replica) -> None:
    """Added or undrained through the admin API: probe it now, and let held requests look again."""
    _wake(app, replica)
    proxy = app.get(PROXY)
    if proxy is not None:
        proxy.replica_ready()


def _wake(app: web.Application, replica: Replica) -> None:
    replica.probe_now = True
    health = app.get(HEALTH)
    if health is not None:
        health.wake.set()


async def _services(app: web.Application) -> AsyncIterator[None]:
    """The proxy's upstream connection pool, the probes' HTTP session, and the background tasks."""
    settings = app[SETTINGS]
    loop = asyncio.get_running_loop()
    upstream = UpstreamPool(
        connect_timeout_s=settings.retry.connect_timeout_s,
        read_timeout_s=settings.limits.upstream_idle_timeout_s,
        deadlines=Deadlines(loop),
    )
    # Probes and scrapes are off the hot path: aiohttp's client is fine there.
    probe_session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300), skip_auto_headers=("User-Agent",)
    )
    routing = app[ROUTING]
    request_log = _start_request_log(settings, app[METRICS]) if settings.log_requests else None
    app[PROXY] = Proxy(
        settings,
        app[POOL],
        routing,
        app[METRICS],
        upstream,
        on_unreachable=lambda r: _wake(app, r),
        request_log=request_log,
        tokenizers=app[TOKENIZERS],
    )
    proxy = app[PROXY]
    kv_events = None
    if settings.kv_events.source != "none":
        kv_events = app[KV_EVENTS] = KVEventSubscribers(settings, app[POOL], routing.index, app[METRICS], loop.time)

    def on_down(replica: Replica) -> None:
        routing.drop_cache(replica.id)
        if kv_events is not None:
            kv_events.replica_down(replica)

    def on_up(replica: Replica) -> None:
        proxy.replica_ready()
        if kv_events is not None:
            kv_events.replica_up(replica)

    failures = app[METRICS].tasks
    health = HealthChecker(
        settings.health, app[POOL], probe_session, on_down=on_down, clock=loop.time, failures=failures, on_up=on_up
    )
    app[HEALTH] = health

    def supervised(task: str, run: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        return asyncio.create_task(supervise(task, run, failures=failures, clock=loop.time), name=task)

    tasks = [supervised("health", health.run), supervised("index_sweep", lambda: _sweep(routing, loop))]
    if settings.scrape.enabled:
        scraper = MetricsScraper(
            settings.scrape,
            app[POOL],
            probe_session,
            on_gauges=lambda replica, running, waiting, kv, limit: routing.core.set_gauges(
                replica.id, running, waiting, kv, limit
            ),
            clock=loop.time,
            failures=failures,
            on_kv_capacity=lambda replica, tokens: routing.core.set_kv_capacity(replica.id, tokens),
        )
        tasks.append(supervised("scrape", scraper.run))
    discovery = None
    fleet = None
    try:
        if settings.redis_url is not None:  # loads the fleet's state before the app serves (router/service/fleet.py)
            fleet = app[FLEET] = FleetSharing(
                settings.redis_url,
                settings.fleet,
                routing,
                app[POOL],
                loop.time,
                failures=failures,
                on_undrained=lambda r: _replica_changed(app, r),
            )
            app[METRICS].registry.register(fleet.collector())
            await fleet.start()
            routing.publisher = fleet
        if kv_events is not None:
            await kv_events.start()
        if settings.discovery.kind == "kubernetes":
            # Imported here: only the routers that use it load the kubernetes client.
            from router.service.discovery import KubernetesDiscovery

            discovery = KubernetesDiscovery(
                settings.discovery, app[POOL], routing, on_changed=lambda r: _replica_changed(app, r), failures=failures
            )
            discovery.start()
        yield
    finally:
        if fleet is not None:
            routing.publisher = None
            await fleet.stop()
        if discovery is not None:
            await discovery.stop()
        if kv_events is not None:
            await kv_events.stop()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await probe_session.close()
        await upstream.close()
        proxy.parser.close()
        if request_log is not None:
            await asyncio.to_thread(request_log.close)  # flushes what is queued; bounded by its close timeout


def _start_request_log(settings: RouterSettings, metrics: RouterMetrics) -> RequestLog:
    request_log = RequestLog(
        open_sink(settings.request_log.path),
        max_pending_lines=settings.request_log.max_pending_lines,
        flush_interval_s=settings.request_log.flush_interval_s,
        on_drop=metrics.request_log_dropped.inc,
        worker=metrics.worker,
    )
    request_log.start()
    return request_log


async def _sweep(routing: PoolRouting, loop: asyncio.AbstractEventLoop) -> None:
    while True:
        await asyncio.sleep(_SWEEP_INTERVAL_S)
        routing.index.expire(loop.time())


async def _begin_shutdown(app: web.Application) -> None:
    app[SHUTTING_DOWN].set()


def _ready(app: web.Application) -> web.Response:
    """503 while shutting down, and while no replica is eligible unless requests are held meanwhile: a router
    that holds requests for a cold start or a scale from zero must keep receiving them."""
    if app[SHUTTING_DOWN].is_set():
        return web.json_response({"status": "shutting down"}, status=503)
    eligible = app[POOL].eligible(None)
    if not eligible:
        hold = app[SETTINGS].hold
        if hold.max_requests > 0 and hold.max_wait_s > 0:
            return web.json_response({"status": "holding requests until a replica is ready", "replicas": 0})
        return web.json_response({"status": "no replica ready", "replicas": len(app[POOL])}, status=503)
    return web.json_response({"status": "ready", "replicas": len(eligible)})
