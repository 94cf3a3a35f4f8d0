"""Running the router: uvloop where available, every endpoint on one port served by the front, graceful drain.

One listener, not an admin port beside it: the admin API, /metrics and the probes are a few small handlers on the
front (`app.front_routes`), so one parser, one set of limits and one set of timeouts guard every byte the router
reads, and the chart, `shoal up` and the autoscaler reach the router at the one address they already know. A second
listener on aiohttp's server would be a second HTTP implementation to keep robust against hostile input, with
timeouts of its own (no header timeout) that the router's settings do not govern.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

from aiohttp import web

from router.common.heap import freeze_loaded
from router.service.app import SHUTTING_DOWN, create_app, front_routes
from router.service.front import FrontServer
from router.service.settings import RouterSettings

log = logging.getLogger("shoal.router")


def serve(
    settings: RouterSettings, *, worker: str | None = None, on_listening: Callable[[], object] | None = None
) -> None:
    """Run the router until SIGTERM or SIGINT. `worker`: this process's label among `--workers` (router/service/
    workers.py), on its metrics; `on_listening` is called once the port is bound."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
        runner = asyncio.run
    else:
        runner = uvloop.run
    runner(_serve(settings, worker, on_listening))


class RouterServer:
    """The router listening on one address: the app's services run under aiohttp's `AppRunner` (its startup and
    cleanup), and the front (`router.service.front`) owns the connections and serves every endpoint."""

    def __init__(self, app: web.Application, settings: RouterSettings) -> None:
        self.app = app
        self.settings = settings
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=settings.limits.shutdown_grace_s)
        self.front: FrontServer | None = None

    async def start(self, host: str, port: int) -> None:
        """Starts the app (its services included) and listens; port 0 picks a free port (see `address`)."""
        await self.runner.setup()
        routes, fallback = front_routes(self.app)
        self.front = FrontServer(routes, fallback, self.settings.limits)
        await self.front.start(host, port, reuse_port=self.settings.reuse_port or None)

    @property
    def address(self) -> tuple[str, int]:
        assert self.front is not None
        return self.front.addresses[0]

    async def stop(self) -> None:
        """Stops accepting, lets requests in flight finish within `limits.shutdown_grace_s`, then stops the app."""
        self.app[SHUTTING_DOWN].set()
        if self.front is not None:
            await self.front.shutdown(self.settings.limits.shutdown_grace_s)
        await self.runner.cleanup()


async def _serve(settings: RouterSettings, worker: str | None, on_listening: Callable[[], object] | None) -> None:
    server = RouterServer(create_app(settings, worker=worker), settings)
    await server.start(settings.host, settings.port)
    if on_listening is not None:
        on_listening()
    app = server.app
    freeze_loaded()
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
