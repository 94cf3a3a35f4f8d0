"""`create_app(settings)`: the router as an aiohttp application (STYLE.md 5).

State lives under typed `web.AppKey`s; the HTTP client session, the health and scrape tasks and, with
`discovery.kind: kubernetes`, the EndpointSlice watch and, with `kv_events.source` set, the replicas' KV-event
streams are started and stopped in `cleanup_ctx`. Tests build the app with this same factory.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router.policy.config import build_policy
from router.policy.prefix_index import PrefixIndex
from router.service.admin import AdminApi
from router.service.deadlines import Deadlines
from router.service.errors import error_response
from router.service.fleet import FleetSharing
from router.service.health import HealthChecker, MetricsScraper
from router.service.kv_events import KVEventSubscribers
from router.service.metrics import RouterMetrics
from router.service.pool import Replica, ReplicaPool
from router.service.proxy import Proxy
from router.service.routing import RoutingCore
from router.service.settings import RouterSettings
from router.service.upstream import UpstreamPool

SETTINGS = web.AppKey("settings", RouterSettings)
POOL = web.AppKey("pool", ReplicaPool)
CORE = web.AppKey("core", RoutingCore)
METRICS = web.AppKey("metrics", RouterMetrics)
PROXY = web.AppKey("proxy", Proxy)
HEALTH = web.AppKey("health", HealthChecker)
KV_EVENTS = web.AppKey("kv_events", KVEventSubscribers)
FLEET = web.AppKey("fleet", FleetSharing)
SHUTTING_DOWN = web.AppKey("shutting_down", asyncio.Event)

# Index sweeps (TTL expiry) run this often; the sweep is cheap and bounded by the number of entries.
_SWEEP_INTERVAL_S = 5.0


def create_app(settings: RouterSettings) -> web.Application:
    # No middlewares: each one wraps every proxied request, and the proxy path is the router's hot path.
    app = web.Application(client_max_size=settings.limits.max_body_bytes)
    pool = ReplicaPool()
    index = PrefixIndex(settings.index)
    core = RoutingCore(settings, pool, index, build_policy(settings.policy, seed=settings.seed), settings.prefill_rate)
    for url in settings.replicas:
        core.add_replica(pool.add(url))
    app[SETTINGS] = settings
    app[POOL] = pool
    app[CORE] = core
    app[METRICS] = RouterMetrics(pool)
    app[SHUTTING_DOWN] = asyncio.Event()
    app.cleanup_ctx.append(_services)
    app.on_shutdown.append(_begin_shutdown)

    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/v1/completions", _proxy_routed)
    app.router.add_post("/v1/chat/completions", _proxy_routed)
    app.router.add_get("/v1/models", _proxy_models)
    app.router.add_route("*", "/v1/{tail:.*}", _proxy_passthrough)
    if settings.admin_token is not None:
        admin = AdminApi(
            settings.admin_token.get_secret_value(), pool, core, on_changed=lambda r: _replica_changed(app, r)
        )
        app.router.add_routes(admin.routes())
    app.router.add_route("*", "/{tail:.*}", _not_found)
    return app


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
    core = app[CORE]
    app[PROXY] = Proxy(settings, app[POOL], core, app[METRICS], upstream, on_unreachable=lambda r: _wake(app, r))
    proxy = app[PROXY]
    kv_events = None
    if settings.kv_events.source != "none":
        kv_events = app[KV_EVENTS] = KVEventSubscribers(settings, app[POOL], core.index, app[METRICS], loop.time)

    def on_down(replica: Replica) -> None:
        core.drop_cache(replica.id)
        if kv_events is not None:
            kv_events.replica_down(replica)

    def on_up(replica: Replica) -> None:
        proxy.replica_ready()
        if kv_events is not None:
            kv_events.replica_up(replica)

    health = HealthChecker(settings.health, app[POOL], probe_session, on_down=on_down, clock=loop.time, on_up=on_up)
    app[HEALTH] = health
    tasks = [asyncio.create_task(health.run(), name="health"), asyncio.create_task(_sweep(core, loop))]
    if settings.scrape.enabled:
        scraper = MetricsScraper(settings.scrape, app[POOL], probe_session)
        tasks.append(asyncio.create_task(scraper.run(), name="scrape"))
    discovery = None
    fleet = None
    try:
        if settings.redis_url is not None:  # loads the fleet's state before the app serves (router/service/fleet.py)
            fleet = app[FLEET] = FleetSharing(
                settings.redis_url,
                settings.fleet,
                core,
                app[POOL],
                loop.time,
                on_undrained=lambda r: _replica_changed(app, r),
            )
            app[METRICS].registry.register(fleet.collector())
            await fleet.start()
            core.publisher = fleet
        if kv_events is not None:
            await kv_events.start()
        if settings.discovery.kind == "kubernetes":
            # Imported here: only the routers that use it load the kubernetes client.
            from router.service.discovery import KubernetesDiscovery

            discovery = KubernetesDiscovery(
                settings.discovery, app[POOL], core, on_changed=lambda r: _replica_changed(app, r)
            )
            discovery.start()
        yield
    finally:
        if fleet is not None:
            core.publisher = None
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


async def _sweep(core: RoutingCore, loop: asyncio.AbstractEventLoop) -> None:
    while True:
        await asyncio.sleep(_SWEEP_INTERVAL_S)
        core.index.expire(loop.time())


async def _begin_shutdown(app: web.Application) -> None:
    app[SHUTTING_DOWN].set()


async def _not_found(request: web.Request) -> web.Response:
    return error_response(404, f"no route for {request.method} {request.path}", code="not_found")


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _ready(request: web.Request) -> web.Response:
    """503 while shutting down, and while no replica is eligible unless requests are held meanwhile: a router
    that holds requests for a cold start or a scale from zero must keep receiving them."""
    app = request.app
    if app[SHUTTING_DOWN].is_set():
        return web.json_response({"status": "shutting down"}, status=503)
    eligible = app[POOL].eligible(None)
    if not eligible:
        hold = app[SETTINGS].hold
        if hold.max_requests > 0 and hold.max_wait_s > 0:
            return web.json_response({"status": "holding requests until a replica is ready", "replicas": 0})
        return web.json_response({"status": "no replica ready", "replicas": len(app[POOL])}, status=503)
    return web.json_response({"status": "ready", "replicas": len(eligible)})


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _proxy_routed(request: web.Request) -> web.StreamResponse:
    return await request.app[PROXY].handle_routed(request)


async def _proxy_models(request: web.Request) -> web.Response:
    return await request.app[PROXY].handle_models(request)


async def _proxy_passthrough(request: web.Request) -> web.StreamResponse:
    return await request.app[PROXY].handle_passthrough(request)
