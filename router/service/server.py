"""Running the app: uvloop where available, handler cancellation on client disconnect, graceful drain."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal

from aiohttp import web

from router.service.app import SHUTTING_DOWN, create_app
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


def make_runner(app: web.Application, settings: RouterSettings) -> web.AppRunner:
    """The runner `shoal router` uses; tests start the router through it too."""
    return web.AppRunner(
        app,
        handler_cancellation=True,  # a client that goes away cancels its handler, and so the upstream request
        access_log=None,  # the proxy logs one structured line per request itself
        shutdown_timeout=settings.limits.shutdown_grace_s,
        keepalive_timeout=settings.limits.keepalive_timeout_s,
    )


async def _serve(settings: RouterSettings) -> None:
    app = create_app(settings)
    runner = make_runner(app, settings)
    await runner.setup()
    site = web.TCPSite(
        runner, settings.host, settings.port, backlog=1024, reuse_address=True, reuse_port=settings.reuse_port or None
    )
    await site.start()
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
        await runner.cleanup()
