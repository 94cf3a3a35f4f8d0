"""`shoal`: one command, a subcommand per part of the project.

Each part registers its subcommand under the `shoal.commands` entry-point group (pyproject.toml), and only the
chosen one is imported: `shoal router` never imports torch, and this module knows no other part by name.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Any


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {ep.name: ep for ep in entry_points(group="shoal.commands")}
    parser = argparse.ArgumentParser(prog="shoal", description="Cache-aware router and autoscaler for LLM fleets.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = argv[0] if argv and argv[0] in commands else None
    for name in sorted(commands):
        if name == chosen:
            commands[name].load()(subparsers)
        else:
            subparsers.add_parser(name, help=f"run `shoal {name} --help` for its options", add_help=False)
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.error(f"unknown command {args.command!r}")
    result: int = args.run(args)
    return result


def add_router_command(subparsers: Any) -> None:
    from router.common.command_settings import settings_help
    from router.policy.config import POLICY_NAMES
    from router.service.settings import RouterSettings

    parser = subparsers.add_parser(
        "router",
        help="the cache-aware OpenAI-compatible router",
        description="Run the cache-aware router. Every setting below can also come from the environment or a "
        "YAML file (--config); flags override both.",
        epilog=settings_help(RouterSettings),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", metavar="FILE", help="YAML file of settings (SHOAL_ROUTER_CONFIG_FILE)")
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (default 8000)")
    parser.add_argument(
        "--replica", action="append", metavar="URL", help="replica base URL, repeatable (e.g. http://10.0.0.5:8000)"
    )
    parser.add_argument(
        "--policy", choices=POLICY_NAMES, metavar="KIND", help=f"routing policy: {', '.join(POLICY_NAMES)}"
    )
    parser.add_argument("--session-header", metavar="NAME", help="header that pins a session to a replica")
    parser.add_argument("--seed", type=int, help="seed of the policies' random choices")
    parser.add_argument(
        "--redis-url", metavar="URL", help="Redis shared with the fleet's other routers (redis://host:port/db)"
    )
    parser.add_argument(
        "--tokenizer",
        action="append",
        metavar="MODEL=DIR",
        help="route MODEL's chat and text prompts on token ids, with the tokenizer.json and tokenizer_config.json "
        "in DIR (needs the `tokenize` extra); repeatable",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    parser.add_argument("--no-request-log", action="store_true", help="do not log one line per request")
    parser.add_argument(
        "--reuse-port", action="store_true", help="SO_REUSEPORT: let several router processes share the port"
    )
    parser.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="N router processes on the one port (SO_REUSEPORT), sharing their view through --redis-url",
    )
    parser.set_defaults(run=_run_router)


def _run_router(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from router.service.settings import RouterSettings

    overrides: dict[str, Any] = {}
    if args.config:
        overrides["config_file"] = args.config
    for flag, field in (
        ("host", "host"),
        ("port", "port"),
        ("replica", "replicas"),
        ("seed", "seed"),
        ("session_header", "session_header"),
        ("redis_url", "redis_url"),
        ("workers", "workers"),
    ):
        value = getattr(args, flag)
        if value is not None:
            overrides[field] = value
    if args.policy:
        overrides["policy"] = {"kind": args.policy}
    if args.no_request_log:
        overrides["log_requests"] = False
    if args.reuse_port:
        overrides["reuse_port"] = True
    if args.tokenizer:
        models = {}
        for spec in args.tokenizer:
            model, _, folder = spec.partition("=")
            if not model or not folder:
                print(f"shoal router: --tokenizer takes MODEL=DIR, got {spec!r}", file=sys.stderr)
                return 2
            models[model] = folder
        overrides["tokenizer"] = {"models": models}
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        settings = RouterSettings(**overrides)
    except (ValidationError, ValueError) as exc:
        print(f"shoal router: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    if settings.tokenizer.models:
        try:
            import router.service.chat_tokenizer  # noqa: F401
        except ImportError as exc:
            print(f"shoal router: {exc}", file=sys.stderr)
            return 2
    if settings.workers > 1:
        from router.service.workers import run_workers

        try:
            return run_workers(settings, settings.workers, args.log_level.upper())
        except ValueError as exc:
            print(f"shoal router: {exc}", file=sys.stderr)
            return 2
    from router.service.server import serve

    serve(settings)
    return 0
