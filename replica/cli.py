"""`shoal replica` (serve a model), `shoal replica build-demo`, `shoal replica calibrate`, `shoal replica profile`,
and `shoal up`.

Torch is imported only once a command runs, so `shoal --help` stays fast and the router's image never needs it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from replica.loading import check_cores, own_cores, sleeping_omp_threads

_ENGINE_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--config", {"metavar": "FILE", "help": "YAML file of settings (SHOAL_REPLICA_CONFIG_FILE)"}),
    ("--model", {"help": "checkpoint folder, or `demo` (default)"}),
    ("--device", {"help": "torch device (default cpu)"}),
    ("--dtype", {"choices": ["float32", "bfloat16", "float16"]}),
    ("--quantization", {"choices": ["none", "nvfp4", "nvfp4-w4a4"]}),
    ("--activation-scales", {"metavar": "FILE", "help": "calibration output, for nvfp4-w4a4"}),
    ("--num-blocks", {"type": int, "help": "KV cache blocks"}),
    ("--max-num-seqs", {"type": int}),
    ("--threads", {"type": int, "help": "torch CPU threads (default: torch's choice)"}),
    (
        "--cpus",
        {"metavar": "LIST", "help": "cores the replica has to itself (0-3, or all): it runs on them, a thread each"},
    ),
    (
        "--drafter",
        {"help": "speculative drafter folder, `none`, or `auto` (default: the checkpoint's drafter/ if it has one)"},
    ),
    (
        "--num-speculative-tokens",
        {
            "type": int,
            "metavar": "K",
            "help": "tokens drafted per sequence per step, at most (default: the drafter's own; 0: off)",
        },
    ),
    (
        "--no-adaptive-speculation",
        {
            "dest": "adaptive_speculation",
            "action": "store_const",
            "const": False,
            "help": "always draft K tokens (default: K shrinks with acceptance, and off where it does not pay)",
        },
    ),
)
"""The model and engine flags of `shoal replica`, which `shoal replica profile` also takes: a profile must time the
engine as it will serve."""


def add_replica_command(subparsers: Any) -> None:
    from replica.demo.build import DemoRecipe  # no torch: the recipe is a dataclass
    from replica.settings import ReplicaSettings
    from router.common.command_settings import settings_help

    parser = subparsers.add_parser(
        "replica",
        help="Shoal's bundled serving engine (OpenAI API)",
        description="Serve a model with Shoal's engine. Every setting can also come from SHOAL_REPLICA_* "
        "environment variables or a YAML file (--config).",
        epilog=settings_help(ReplicaSettings),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for flag, kwargs in _ENGINE_FLAGS:
        parser.add_argument(flag, **kwargs)
    parser.add_argument("--served-model-name", help="model name in the API and in block hashes")
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        metavar="N",
        help="shard the model over N ranks, one process each; --threads is then per rank (default: cores / N)",
    )
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (default 8100)")
    parser.add_argument("--log-level", help="logging level (default INFO)")
    parser.add_argument(
        "--capture-dir",
        type=Path,
        metavar="DIR",
        help="record each request's prompt and output token ids here (JSONL), for training a drafter; off by default",
    )
    parser.add_argument(
        "--capture-text",
        choices=["none", "full"],
        help="with --capture-dir: `full` also records prompt and output text (default none: token ids only)",
    )
    parser.set_defaults(run=_run_serve)
    actions = parser.add_subparsers(dest="action", metavar="ACTION")

    build = actions.add_parser("build-demo", help="train the demo model and tokenizer into the cache directory")
    build.add_argument("--out", type=Path, help="output folder (default: the cache directory's demo model)")
    build.add_argument(
        "--max-seconds", type=float, help=f"training time budget in seconds (default {DemoRecipe.max_seconds:g})"
    )
    build.add_argument("--max-steps", type=int, help=f"training steps (default {DemoRecipe.max_steps})")
    build.add_argument("--force", action="store_true", help="rebuild even if the demo model exists")
    build.set_defaults(run=_run_build_demo)

    cal = actions.add_parser(
        "calibrate",
        help="record per-expert activation ranges on representative chats; write W4A4 activation scales",
    )
    cal.add_argument("--model", default="demo", help="checkpoint folder, or `demo`")
    cal.add_argument("--chats", type=Path, help="JSONL of chat requests (default: the demo's calibration file)")
    cal.add_argument("--out", type=Path, required=True, help="JSON file of activation scales to write")
    cal.add_argument("--min-tokens", type=int, default=16, help="tokens every expert must see (default 16)")
    cal.add_argument(
        "--allow-uncovered", action="store_true", help="write scales even if some experts saw too few tokens"
    )
    cal.set_defaults(run=_run_calibrate)

    prof = actions.add_parser(
        "profile",
        help="time engine steps over a grid of batch shapes; write JSON the simulator fits its step model to",
        description="Time real engine steps (prefill chunks after cached prefixes, decode batches, mixed steps) "
        "for the model and engine settings `shoal replica` would serve with (--model, --config, SHOAL_REPLICA_*), "
        "and write them as JSON. `shoal simulate --preset FILE.json` fits the step model to it.",
    )
    prof.add_argument("--out", type=Path, required=True, help="JSON file to write")
    # The engine's flags again, so they may follow `profile` too (SUPPRESS: absent here, the parent's value stays).
    for flag, kwargs in _ENGINE_FLAGS:
        prof.add_argument(flag, **kwargs, default=argparse.SUPPRESS)
    prof.add_argument("--repeats", type=int, default=5, help="timed steps per grid point; the median is kept (5)")
    prof.add_argument("--seed", type=int, default=0, help="seed of the random prompts (0)")
    prof.add_argument(
        "--quick", action="store_true", help="a coarse grid (a few seconds on the demo model), for smoke tests"
    )
    prof.set_defaults(run=_run_profile)

    train = actions.add_parser(
        "train-drafter",
        help="train a speculative drafter on captured token ids (shoal replica --capture-dir)",
        description="Distil a drafter from the target model on the prompt and output ids a replica captured: the "
        "target runs over each captured request and the drafter learns its distribution at every output position. "
        "Prints the held-out loss, agreement by draft position and the acceptance length of speculative decoding "
        "on held-out prompts. Serve the result with `shoal replica --drafter OUT`.",
    )
    train.add_argument("--traces", type=Path, required=True, help="capture directory (capture-*.jsonl files)")
    train.add_argument("--kind", choices=["block", "dense"], default="block", help="drafter kind (default block)")
    train.add_argument("--out", type=Path, required=True, help="folder to write the drafter to")
    train.add_argument("--model", default="demo", help="the target: checkpoint folder, or `demo` (default)")
    train.add_argument("--max-steps", type=int, help="training steps (default 1200)")
    train.add_argument("--max-seconds", type=float, help="training time budget in seconds (default 1800)")
    train.add_argument("--block-size", type=int, help="block drafter: drafts per pass (default 8)")
    train.add_argument(
        "--eval-prompts", type=int, help="held-out prompts run through the engine for the acceptance length (48)"
    )
    train.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    train.set_defaults(run=_run_train_drafter)


def _settings_from_args(args: argparse.Namespace) -> Any:
    """ReplicaSettings from --config, the serving flags and SHOAL_REPLICA_*; exits 2 naming what is invalid."""
    from pydantic import ValidationError

    from replica.settings import ReplicaSettings

    overrides: dict[str, Any] = {}
    if args.config:
        overrides["config_file"] = args.config
    for flag in (
        "model",
        "served_model_name",
        "host",
        "port",
        "device",
        "dtype",
        "quantization",
        "activation_scales",
        "num_blocks",
        "max_num_seqs",
        "log_level",
        "capture_dir",
        "capture_text",
        "drafter",
        "num_speculative_tokens",
        "adaptive_speculation",
        "tensor_parallel_size",
        "cpus",
    ):
        value = getattr(args, flag, None)
        if value is not None:
            overrides[flag] = value
    try:
        return ReplicaSettings(**overrides)
    except (ValidationError, ValueError) as exc:
        print(f"shoal replica: invalid settings:\n{exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def _cpu_threads(settings: Any, threads: int | None, command: str) -> tuple[Any, int | None]:
    """Before torch loads: the process's cores and how its idle OpenMP threads wait (`replica.loading`); -> the
    settings with their cores listed (`cpus: all` resolved here, before this process pins itself to its share) and
    the engine's torch threads (per rank), None for torch's choice."""
    settings = settings.with_cores_listed()
    cores = settings.rank_cores(0)
    if cores is None:
        sleeping_omp_threads()
        return settings, threads
    if threads is not None and threads != len(cores):
        print(
            f"{command}: --threads {threads} with cpus {settings.cpus}: a replica that owns its cores runs one "
            f"thread per core ({len(cores)} per rank)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    from replica.settings import parse_cpus

    try:
        check_cores(parse_cpus(settings.cpus))
    except ValueError as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    own_cores(cores)
    return settings, len(cores)


def _run_serve(args: argparse.Namespace) -> int:
    settings = _settings_from_args(args)
    settings, threads = _cpu_threads(settings, args.threads, "shoal replica")
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if settings.cpus is not None:
        log = logging.getLogger("replica")
        log.info("owning cpus %s: %d thread(s) per rank on its own share", settings.cpus, threads)
        if os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE":
            log.warning("OMP_WAIT_POLICY=PASSIVE in the environment: idle threads sleep, and steps run slower")
    from replica.server.serve import serve

    return serve(settings, threads=threads)


def _run_build_demo(args: argparse.Namespace) -> int:
    sleeping_omp_threads()
    from dataclasses import replace

    from replica.demo.build import DemoRecipe, build_demo, demo_model_dir, is_built

    out = args.out or demo_model_dir()
    if is_built(out) and not args.force:
        print(f"the demo model is already built at {out} (--force rebuilds it)")
        return 0
    recipe = DemoRecipe()
    if args.max_seconds is not None:
        recipe = replace(recipe, max_seconds=args.max_seconds)
    if args.max_steps is not None:
        recipe = replace(recipe, max_steps=args.max_steps)
    build_demo(out, recipe=recipe)
    return 0


def _run_calibrate(args: argparse.Namespace) -> int:
    sleeping_omp_threads()
    from replica.quant.calibrate import CalibrationError, run_calibration

    try:
        run_calibration(
            model=args.model,
            chats=args.chats,
            out=args.out,
            min_tokens=args.min_tokens,
            allow_uncovered=args.allow_uncovered,
        )
    except CalibrationError as exc:
        print(f"shoal replica calibrate: {exc}", file=sys.stderr)
        return 1
    return 0


def _run_profile(args: argparse.Namespace) -> int:
    settings = _settings_from_args(args)
    settings, threads = _cpu_threads(settings, args.threads, "shoal replica profile")  # times the served threads
    from replica.profile import ProfileGrid, run_profile

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if args.repeats < 1:
        print("shoal replica profile: --repeats must be at least 1", file=sys.stderr)
        return 2
    grid = ProfileGrid(repeats=args.repeats)
    if args.quick:
        grid = ProfileGrid(
            prefill_tokens=(16, 128),
            is_budget_chunk_timed=False,
            prefix_tokens=(0, 128),
            decode_seqs=(1, 4),
            decode_context_tokens=(64,),
            mixed=((2, 32),),
            mixed_context_tokens=64,
            repeats=min(args.repeats, 2),
            warmup_steps=1,
        )
    document = run_profile(settings, out=args.out, grid=grid, threads=threads, seed=args.seed)
    print(f"wrote {len(document['samples'])} step samples to {args.out} in {document['profile_s']} s")
    return 0


def _run_train_drafter(args: argparse.Namespace) -> int:
    sleeping_omp_threads()
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s %(message)s")
    from dataclasses import replace

    from replica.drafters.build import TrainDrafterError, train_drafter_command
    from replica.drafters.train import DrafterRecipe

    recipe = DrafterRecipe(kind=args.kind)
    for name in ("max_steps", "max_seconds", "block_size", "eval_prompts"):
        if getattr(args, name) is not None:
            recipe = replace(recipe, **{name: getattr(args, name)})
    if args.model == "demo":
        from replica.demo.build import ensure_demo_model

        checkpoint = ensure_demo_model()
    else:
        checkpoint = Path(args.model)
    try:
        train_drafter_command(
            checkpoint=checkpoint,
            traces=args.traces,
            out=args.out,
            recipe=recipe,
            threads=args.threads,
        )
    except TrainDrafterError as exc:
        print(f"shoal replica train-drafter: {exc}", file=sys.stderr)
        return 1
    return 0


def add_up_command(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "up",
        help="start a router and N local replicas of the demo model on loopback",
        description="Start `shoal router` and N `shoal replica` processes on loopback (or, with --autoscale, "
        "`shoal autoscaler`, which starts and stops them with the load), wait until they serve, print the "
        "endpoint, and stop them all on Ctrl-C.",
    )
    parser.add_argument("--replicas", type=int, default=2, help="number of replicas (default 2)")
    parser.add_argument("--model", default="demo", help="checkpoint folder, or `demo` (default)")
    parser.add_argument("--port", type=int, default=8000, help="router port (default 8000)")
    parser.add_argument("--replica-base-port", type=int, default=8100, help="first replica port (default 8100)")
    parser.add_argument("--quantization", choices=["none", "nvfp4"], default="none")
    parser.add_argument("--demo-requests", action="store_true", help="send a few example requests once up")
    parser.add_argument("--exit-after-demo", action="store_true", help="stop everything after the demo requests")
    parser.add_argument(
        "--autoscale",
        action="store_true",
        help="let `shoal autoscaler` start and stop replicas with the load (--replicas is then ignored)",
    )
    parser.add_argument(
        "--min-replicas", type=int, default=1, help="with --autoscale: fewest replicas (default 1; 0: scale to zero)"
    )
    parser.add_argument("--max-replicas", type=int, default=4, help="with --autoscale: most replicas (default 4)")
    parser.add_argument(
        "--engine",
        choices=["shoal", "vllm"],
        default="shoal",
        help="replicas: Shoal's own (default), or vLLM's CPU build from `make vllm`, the router in exact mode",
    )
    parser.add_argument(
        "--vllm-python", default=None, help="with --engine vllm: vLLM's Python (default: .venv-vllm/bin/python)"
    )
    parser.set_defaults(run=_run_up)


def _run_up(args: argparse.Namespace) -> int:
    from replica.up import run_up

    return run_up(
        num_replicas=args.replicas,
        model=args.model,
        port=args.port,
        replica_base_port=args.replica_base_port,
        quantization=args.quantization,
        demo_requests=args.demo_requests,
        exit_after_demo=args.exit_after_demo,
        autoscale=args.autoscale,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        engine=args.engine,
        vllm_python=args.vllm_python,
    )
