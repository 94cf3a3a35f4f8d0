"""Several router processes on one port (`shoal router --workers N`): throughput beyond one core.

The parent process serves nothing. It starts N workers (processes started fresh, `spawn`, so none inherits an
event loop or a thread), each a whole router bound with SO_REUSEPORT to the same address; the kernel spreads new
connections over them. Workers share their view of the fleet the way separate routers do, through Redis
(`redis_url`, router/service/fleet.py); without it each worker sees only the requests it serves, which costs
cache hits, and the parent says so at start. Each worker's `/metrics` carries a `worker` label.

Supervision:
- SIGTERM / SIGINT to the parent are passed to every worker, which drains as a lone router does; the parent
  exits once all have, with the highest exit status among them.
- A worker that dies after it was listening is started again (its state comes back from Redis, as a restarted
  router's does). One that dies before it was listening (a port in use, settings the process cannot honour)
  stops the whole group: starting it again would fail the same way.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
from multiprocessing.context import SpawnProcess
from multiprocessing.synchronize import Event
from types import FrameType
from typing import cast

from router.service.settings import RouterSettings

log = logging.getLogger("shoal.router")


def _worker_main(settings: RouterSettings, index: int, log_level: str, listening: Event) -> None:
    from router.service.server import serve

    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s[w{index}] %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the parent, which passes it on
    serve(settings, worker=str(index), on_listening=listening.set)


class _Worker:
    def __init__(self, index: int) -> None:
        self.index = index
        self.process: SpawnProcess | None = None
        self.listening: Event | None = None


def run_workers(settings: RouterSettings, num_workers: int, log_level: str) -> int:
    """Run `num_workers` routers on `settings.host:settings.port` until a signal stops them; the exit status."""
    if settings.port == 0:
        raise ValueError("--workers needs a fixed port: with port 0 each worker would pick a port of its own")
    settings = settings.model_copy(update={"reuse_port": True})
    if settings.redis_url is None:
        log.warning(
            "%d workers without redis_url: each sees only the requests it serves (no shared index or load)",
            num_workers,
        )
    context = multiprocessing.get_context("spawn")
    workers = [_Worker(i) for i in range(num_workers)]
    stopping: list[signal.Signals] = []

    def start(worker: _Worker) -> None:
        worker.listening = context.Event()
        worker.process = context.Process(
            target=_worker_main,
            args=(settings, worker.index, log_level, worker.listening),
            name=f"shoal-router-w{worker.index}",
        )
        worker.process.start()

    def stop_all(sig: signal.Signals) -> None:
        for worker in workers:
            if worker.process is not None and worker.process.pid is not None and worker.process.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.process.pid, sig)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if not stopping:
            log.info("%s: stopping %d workers", sig.name, num_workers)
        stopping.append(sig)
        stop_all(signal.SIGTERM if sig == signal.SIGTERM else signal.SIGINT)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    status = 0
    try:
        for worker in workers:
            start(worker)
        log.info("shoal router: %d workers on http://%s:%d", num_workers, settings.host, settings.port)
        while True:
            alive = {w.process.sentinel: w for w in workers if w.process is not None and w.process.exitcode is None}
            if not alive:
                return status
            for sentinel in multiprocessing.connection.wait(list(alive), timeout=1.0):
                worker = alive[cast(int, sentinel)]
                assert worker.process is not None and worker.listening is not None
                worker.process.join()
                code = _exit_status(worker.process.exitcode)
                if stopping:
                    status = max(status, code)
                    continue
                if not worker.listening.is_set():
                    log.error("worker %d exited (status %d) before it listened: stopping", worker.index, code)
                    status = max(status, code, 1)
                    stopping.append(signal.SIGTERM)
                    stop_all(signal.SIGTERM)
                    continue
                log.warning("worker %d exited (status %d); starting it again", worker.index, code)
                start(worker)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _exit_status(exitcode: int | None) -> int:
    """A process's exit code as a shell reports it: 128 + N for death by signal N."""
    if exitcode is None:
        return 0
    return 128 - exitcode if exitcode < 0 else exitcode
