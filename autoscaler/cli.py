"""`shoal autoscaler`: settings from flags, environment and YAML; the control loop; `/metrics`.

With `actuator: local` the loop runs at once and owns its replica processes. With `actuator: kubernetes` the
Kubernetes actuator and leader election (`autoscaler.actuators.kubernetes`, `autoscaler.leader`) are imported only
then, so the local case never needs a cluster; the loop runs only while this process holds the Lease, and the
process exits when it loses it. `/metrics` is served either way, so standbys are visible too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

from autoscaler.settings import AutoscalerSettings
from router.common.command_settings import settings_help

log = logging.getLogger("autoscaler")


class SetupError(RuntimeError):
    """The autoscaler cannot start, or must stop: a clear message and an exit status for the command line."""

    def __init__(self, message: str, exit_status: int = 2) -> None:
        super().__init__(message)
        self.exit_status = exit_status


def add_autoscaler_command(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "autoscaler",
        help="scale replicas on the routers' queue metrics (local processes or a Kubernetes Deployment)",
        description="Run the autoscaler. Every setting below can also come from the environment or a YAML file "
        "(--config); flags override both.",
        epilog=settings_help(AutoscalerSettings),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", metavar="FILE", help="YAML file of settings (SHOAL_AUTOSCALER_CONFIG_FILE)")
    parser.add_argument("--actuator", choices=["local", "kubernetes"], help="what is scaled (default local)")
    parser.add_argument("--router", action="append", metavar="URL", help="router base URL, repeatable")
    parser.add_argument(
        "--prometheus",
        metavar="URL",
        help="read demand from this Prometheus HTTP API instead of the routers' /metrics (metrics.source prometheus)",
    )
    parser.add_argument("--dry-run", action="store_true", help="log and export decisions; change nothing")
    parser.add_argument("--interval", type=float, metavar="SECONDS", help="seconds between decisions (default 2)")
    parser.add_argument("--host", help="address of /metrics (default 127.0.0.1)")
    parser.add_argument("--metrics-port", type=int, help="port of /metrics (default 9090)")
    parser.add_argument(
        "--min-replicas",
        type=int,
        help="fewest replicas while there is traffic; 0: scale to zero when idle (policy.scale_to_zero.enabled)",
    )
    parser.add_argument("--max-replicas", type=int, help="most replicas")
    parser.add_argument("--model", help="local actuator: checkpoint folder, or `demo`")
    parser.add_argument("--served-model-name", help="local actuator: model name in the API")
    parser.add_argument("--replica-base-port", type=int, help="local actuator: port of the first replica")
    parser.add_argument("--log-level", help="logging level (default INFO)")
    parser.set_defaults(run=_run)


def settings_from_args(args: argparse.Namespace) -> AutoscalerSettings:
    overrides: dict[str, Any] = {}
    if args.config:
        overrides["config_file"] = args.config
    for flag, field in (
        ("actuator", "actuator"),
        ("router", "routers"),
        ("interval", "interval_s"),
        ("host", "host"),
        ("metrics_port", "metrics_port"),
        ("log_level", "log_level"),
    ):
        value = getattr(args, flag)
        if value is not None:
            overrides[field] = value
    if args.dry_run:
        overrides["dry_run"] = True
    # Nested values merge field by field with the environment's and the file's (pydantic-settings deep-merges).
    policy: dict[str, Any] = {
        k: v for k, v in (("min_replicas", args.min_replicas), ("max_replicas", args.max_replicas)) if v
    }
    if args.min_replicas == 0:  # the policy's floor while serving stays 1; zero is scale to zero's
        policy["scale_to_zero"] = {"enabled": True}
    elif args.min_replicas is not None and args.min_replicas < 0:
        raise ValueError(f"--min-replicas must be >= 0, not {args.min_replicas}")
    local = {
        k: v
        for k, v in (
            ("model", args.model),
            ("served_model_name", args.served_model_name),
            ("base_port", args.replica_base_port),
        )
        if v is not None
    }
    if args.prometheus:
        overrides["metrics"] = {"source": "prometheus", "prometheus": {"url": args.prometheus}}
    if policy:
        overrides["policy"] = policy
    if local:
        overrides["local"] = local
    return AutoscalerSettings(**overrides)


def _run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    try:
        settings = settings_from_args(args)
    except (ValidationError, ValueError) as exc:
        print(f"shoal autoscaler: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        return asyncio.run(_main(settings))
    except SetupError as exc:
        print(f"shoal autoscaler: {exc}", file=sys.stderr)
        return exc.exit_status


async def _main(settings: AutoscalerSettings) -> int:
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await run_autoscaler(settings)
    except asyncio.CancelledError:
        log.info("stopped")
    return 0


async def run_autoscaler(settings: AutoscalerSettings) -> None:
    """Build everything from the settings and run until cancelled (or until leadership is lost)."""
    import aiohttp
    from aiohttp import web

    from autoscaler.controller import Controller
    from autoscaler.observe import RouterClient, RouterSource, static_routers
    from autoscaler.service import AutoscalerMetrics, create_app

    if settings.admin_token is None and not settings.dry_run:
        raise SetupError(
            "admin_token (SHOAL_AUTOSCALER_ADMIN_TOKEN) is needed to drain replicas before removing them and to "
            "register local ones; without it, run with --dry-run"
        )
    token = settings.admin_token.get_secret_value() if settings.admin_token else None
    loop = asyncio.get_running_loop()
    metrics = AutoscalerMetrics()
    async with aiohttp.ClientSession() as session:
        actuator: Any
        routers: RouterSource = static_routers(settings.routers)
        if settings.actuator == "kubernetes":
            actuator = _kubernetes_actuator(settings)
            routers = _with_router_service(actuator, settings, routers)
        else:
            from autoscaler.actuators.local import LocalActuator

            actuator = LocalActuator(settings.local, session, num_slots=settings.policy.max_replicas)
        if not settings.routers and settings.kubernetes.router_service is None:
            raise SetupError("no router to observe: set routers (--router URL) or kubernetes.router_service")
        router_client = RouterClient(
            session,
            routers,
            admin_token=token,
            timeout_s=settings.scrape_timeout_s,
            ttft_quantile=settings.policy.ttft_quantile,
            clock=loop.time,
            demand_source=_demand_source(settings, session),
        )
        controller = Controller(
            actuator=actuator,
            routers=router_client,
            config=settings.policy,
            metrics=metrics,
            interval_s=settings.interval_s,
            drain_timeout_s=settings.drain_timeout_s,
            dry_run=settings.dry_run,
            register_replicas=settings.actuator == "local",
            clock=loop.time,
        )
        runner = web.AppRunner(create_app(metrics), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, settings.host, settings.metrics_port).start()
        log.info(
            "autoscaler up: %s actuator, routers %s, demand from %s, metrics on http://%s:%d/metrics%s",
            settings.actuator,
            settings.routers or settings.kubernetes.router_service,
            settings.metrics.prometheus.url if settings.metrics.source == "prometheus" else "the routers",
            settings.host,
            settings.metrics_port,
            " (dry run)" if settings.dry_run else "",
        )
        try:
            if settings.actuator == "kubernetes":
                run_with_leader_election = _import("autoscaler.leader", "run_with_leader_election")
                leadership_lost = _import("autoscaler.leader", "LeadershipLost")
                try:
                    await run_with_leader_election(settings.kubernetes, leader_identity(), controller.run)
                except leadership_lost as exc:
                    raise SetupError(f"{exc}; exiting, so that this pod restarts as a follower", 1) from exc
            else:
                await controller.run()
        finally:
            close = getattr(actuator, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()
            await runner.cleanup()


def _demand_source(settings: AutoscalerSettings, session: Any) -> Any:
    """The Prometheus reader with `metrics.source: prometheus`; None: the routers' /metrics."""
    if settings.metrics.source != "prometheus":
        return None
    from autoscaler.prometheus import PrometheusDemand

    return PrometheusDemand(session, settings.metrics.prometheus, ttft_quantile=settings.policy.ttft_quantile)


def leader_identity() -> str:
    """This process in the Lease: its pod's name (the hostname) and a random suffix, as client-go does, so a
    restarted container never mistakes its predecessor's record for its own."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def _kubernetes_actuator(settings: AutoscalerSettings) -> Any:
    actuator_cls = _import("autoscaler.actuators.kubernetes", "KubernetesActuator")
    return actuator_cls(settings.kubernetes)


def _with_router_service(actuator: Any, settings: AutoscalerSettings, static: Any) -> Any:
    """Routers from the static list plus, when `kubernetes.router_service` is set, its endpoints as the Kubernetes
    actuator reports them (`router_urls()`)."""
    if settings.kubernetes.router_service is None:
        return static
    discover = cast(Callable[[], Awaitable[Sequence[str]]] | None, getattr(actuator, "router_urls", None))
    if discover is None:
        raise SetupError("kubernetes.router_service is set, but the Kubernetes actuator has no router_urls()")

    async def routers() -> Sequence[str]:
        found = list(await static())
        assert discover is not None
        return found + [u for u in await discover() if u not in found]

    return routers


def _import(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise SetupError(
            f"actuator 'kubernetes' needs {module}.{name}, which cannot be imported ({exc}); "
            "use actuator 'local', or install a build of Shoal that includes the Kubernetes actuator"
        ) from exc
    except AttributeError as exc:
        raise SetupError(f"{module} has no {name}: this build's Kubernetes support is incomplete") from exc


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m autoscaler.cli ...`: the same command without the `shoal` entry point (what `shoal up` runs)."""
    parser = argparse.ArgumentParser(prog="shoal")
    add_autoscaler_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["autoscaler", *(sys.argv[1:] if argv is None else argv)])
    result: int = args.run(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
