"""Running the router: uvloop where available, the front and aiohttp on one port, handler cancellation on client
disconnect, graceful drain."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal

from aiohttp import web

from router.service.app import PROXY, SHUTTING_DOWN, create_app
from router.service.front import FrontServer, Handler
from router.service.settings import RouterSettings

log = logging.getLogger("shoal.router")


def serve(settings: RouterSettings) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
        runner = asyncio.run
    else:
        runner = uvloop.run
    runner(_serve(settings))


class RouterServer:
    """The router listening on one address: the front (`router.service.front`) owns its connections and serves the
    routed endpoints; aiohttp's runner serves the app's other endpoints on connections the front hands over."""

    def __init__(self, app: web.Application, settings: RouterSettings) -> None:
        self.app = app
        self.settings = settings
        self.runner = web.AppRunner(
            app,
            handler_cancellation=True,  # a client that goes away cancels its handler, and so the upstream request
            access_log=None,  # the proxy logs one structured line per request itself
            shutdown_timeout=settings.limits.shutdown_grace_s,
            keepalive_timeout=settings.limits.keepalive_timeout_s,
        )
        self.front: FrontServer | None = None

    async def start(self, host: str, port: int) -> None:
        """Starts the app (its services included) and listens; port 0 picks a free port (see `address`)."""
        await self.runner.setup()
        reuse_port = self.settings.reuse_port or None
        if not self.settings.front:
            site = web.TCPSite(self.runner, host, port, backlog=1024, reuse_address=True, reuse_port=reuse_port)
            await site.start()
            return
        assert self.runner.server is not None
        proxy = self.app[PROXY]
        routes: dict[tuple[str, str], Handler] = {
            ("POST", "/v1/chat/completions"): proxy.handle_front,
            ("POST", "/v1/completions"): proxy.handle_front,
            ("GET", "/v1/models"): lambda request, body: proxy.handle_models(request),
        }
        self.front = FrontServer(routes, self.runner.server, self.settings.limits)
        await self.front.start(host, port, reuse_port=reuse_port)

    @property
    def address(self) -> tuple[str, int]:
        if self.front is None:
            host, port = self.runner.addresses[0][:2]
            return host, port
        return self.front.addresses[0]

    async def stop(self) -> None:
        """Stops accepting, lets requests in flight finish within `limits.shutdown_grace_s`, then stops the app."""
        self.app[SHUTTING_DOWN].set()
        if self.front is not None:
            await self.front.shutdown(self.settings.limits.shutdown_grace_s)
        await self.runner.cleanup()


async def _serve(settings: RouterSettings) -> None:
    server = RouterServer(create_app(settings), settings)
    await server.start(settings.host, settings.port)
    app = server.app
    # Everything built so far lives as long as the process: keep it out of the collector's full passes.
    gc.freeze()
    log.info(
        "shoal router listening on http://%s:%d with %d replicas, policy %s",
        settings.host,
        settings.port,
        len(settings.replicas),
        settings.policy.kind,
    )
    loop = asyncio.get_running_loop()
    received: asyncio.Future[signal.Signals] = loop.create_future()

    def on_signal(sig: signal.Signals) -> None:
        if not received.done():
            received.set_result(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        sig = await received
        limits = settings.limits
        if sig == signal.SIGTERM and limits.unready_delay_s > 0:
            # Kubernetes removes a terminating pod from its Service endpoints asynchronously: keep serving while
            # /ready says 503, so requests already on their way here are not refused.
            app[SHUTTING_DOWN].set()
            log.info("SIGTERM: /ready is now 503; serving %.1f s more before draining", limits.unready_delay_s)
            await asyncio.sleep(limits.unready_delay_s)
        log.info("shutting down: draining in-flight requests for up to %.0f s", limits.shutdown_grace_s)
    finally:
        await server.stop()
