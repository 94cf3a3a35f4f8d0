"""Load the model the settings name and serve it until SIGINT or SIGTERM."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from replica.loading import checkpoint_dir, load_drafter_for_serving, load_for_serving
from replica.settings import ReplicaSettings
from router.common.heap import freeze_loaded

log = logging.getLogger(__name__)

T = TypeVar("T")


def serve(settings: ReplicaSettings, *, threads: int | None = None) -> int:
    """`threads`: torch's threads for the engine (per rank under tensor parallelism); None: torch's choice."""
    import torch
    from aiohttp import web

    from replica.model.model import MoEForCausalLM
    from replica.server.app import create_app
    from replica.tokenizer import Tokenizer

    ranks = None
    if settings.tensor_parallel_size > 1:  # `replica.ranks`: the other ranks start first and load alongside
        from replica.ranks import RankGroup

        try:
            ranks = RankGroup.start(settings, threads=threads)
        except (OSError, ValueError) as exc:
            print(f"shoal replica: cannot start tensor parallelism: {exc}", file=sys.stderr)
            return 1
        threads = ranks.threads
    # Every multi-threaded torch operation runs on the engine's thread, loading included: OpenMP gives each thread
    # that starts parallel work a team of its own, and once a process has more team threads than cores, libgomp
    # cuts how long idle threads spin (decode steps 2.4x slower on 2 owned cores than where one team ran them).
    engine_thread = ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="shoal-engine", initializer=_leave_signals_to_the_main_thread
    )

    def load() -> tuple[object, object]:
        if threads:
            torch.set_num_threads(threads)
        model, tokenizer = load_for_serving(settings)
        if ranks is not None:
            assert isinstance(model, MoEForCausalLM)
            ranks.join(model)
        return model, tokenizer

    try:
        model, tokenizer = _on(engine_thread, load)
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"shoal replica: cannot load the model: {exc}", file=sys.stderr)
        engine_thread.shutdown()
        if ranks is not None:
            ranks.stop()
        return 1
    torch.set_num_threads(1)  # this thread's own torch work (the app's buffers) starts no second team
    checkpoint = checkpoint_dir(settings)
    try:
        drafter = _on(engine_thread, lambda: load_drafter_for_serving(settings, model, checkpoint))
    except (OSError, ValueError) as exc:
        print(f"shoal replica: cannot load the drafter: {exc}", file=sys.stderr)
        engine_thread.shutdown()
        if ranks is not None:
            ranks.stop()
        return 1
    assert isinstance(model, MoEForCausalLM) and isinstance(tokenizer, Tokenizer)
    app = create_app(
        settings,
        model,
        tokenizer,
        checkpoint_dir=checkpoint,
        drafter=drafter,
        warm_up=True,
        engine_thread=engine_thread,
    )
    ready = {"event": "ready", "model": settings.model_name, "url": f"http://{settings.host}:{settings.port}"}

    def on_ready(_: str) -> None:  # started and warmed up
        freeze_loaded()
        print(json.dumps(ready), flush=True)

    try:
        web.run_app(
            app,
            host=settings.host,
            port=settings.port,
            handler_cancellation=True,
            print=on_ready,
            access_log=None,
            shutdown_timeout=10.0,
        )
    finally:
        code = 0 if ranks is None else ranks.stop()
    return code


def _leave_signals_to_the_main_thread() -> None:
    """Block SIGINT and SIGTERM in the engine's thread (and the OpenMP threads it starts, which inherit the mask), so
    the kernel hands them to the main thread. One handed to this thread would leave the main thread asleep in its
    wait for the load, and Ctrl-C would do nothing until the load ended."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


def _on(engine_thread: ThreadPoolExecutor, load: Callable[[], T]) -> T:
    """`load()` on the engine thread. Ctrl-C ends the process at once, as it did when loading ran on this thread:
    an executor's thread cannot be interrupted, and the interpreter would wait at exit for the load to finish."""
    try:
        return engine_thread.submit(load).result()
    except KeyboardInterrupt:
        print("shoal replica: interrupted while loading", file=sys.stderr, flush=True)
        os._exit(130)
