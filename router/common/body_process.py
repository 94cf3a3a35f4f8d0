"""A child process that reads large request bodies, so that a server's event loop keeps serving meanwhile.

Parsing JSON holds the GIL (orjson reads token ids at some 60 MB/s), and so do a thread's checks of what it parsed:
on the loop or on a thread, a 15-20 MB body stopped every other request of the router or the replica for a quarter
to most of a second. `BodyProcess.run(fn, raw, *args)` calls `fn(view, *args)` in a child, `view` a memoryview of
`raw`, and returns what `fn` returned (pickled back: keep it small). `fn` must be a module-level function of a
module that imports little, which the child imports on its first call.

The body reaches the child through shared memory, copied a MiB at a time with a turn of the event loop between
(copying 20 MB into fresh pages held the loop 15 ms; a process pool's pipe took it in 64 KB writes by a thread that
took the GIL from the loop for each). The child is started on the first call (with `spawn`: servers run threads,
which a fork does not copy), ignores Ctrl-C (its parent stops it) and ends with its parent however that ends
(`PR_SET_PDEATHSIG`). If it dies, the call in it raises `BodyProcessDied` and the next call starts a new child.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.shared_memory import SharedMemory
from typing import Any, TypeVar

from router.common.child_processes import parent_death_signal

log = logging.getLogger("shoal.body_process")

T = TypeVar("T")

_COPY_STEP_BYTES = 1 << 20


class BodyProcessDied(RuntimeError):
    """The child process reading a body exited (killed, out of memory); the request cannot be answered."""


class BodyProcess:
    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    async def run(self, fn: Callable[..., T], raw: bytes | bytearray, *args: Any) -> T:
        """`fn(memoryview of raw, *args)` in the child; raises BodyProcessDied when the child exits meanwhile."""
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("spawn"), initializer=_child_start, initargs=(os.getpid(),)
            )
        pool = self._pool
        shared = SharedMemory(create=True, size=max(1, len(raw)))
        try:
            await _copy(raw, shared)
            result: T = await asyncio.get_running_loop().run_in_executor(
                pool, _call_shared, fn, shared.name, len(raw), args
            )
            return result
        except BrokenProcessPool:
            if self._pool is pool:
                log.error("the body process exited while reading a %d-byte body; starting a new one", len(raw))
                self._pool = None
                pool.shutdown(wait=False, cancel_futures=True)
            raise BodyProcessDied("the process reading the body exited") from None
        finally:
            shared.close()
            shared.unlink()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


async def _copy(raw: bytes | bytearray, shared: SharedMemory) -> None:
    target, source = shared.buf, memoryview(raw)
    assert target is not None
    for start in range(0, len(raw), _COPY_STEP_BYTES):
        end = start + _COPY_STEP_BYTES
        target[start:end] = source[start:end]
        await asyncio.sleep(0)


def _call_shared(fn: Callable[..., T], name: str, size: int, args: tuple[Any, ...]) -> T:
    """In the child: `fn` over the body in shared memory `name`."""
    shared = SharedMemory(name)
    try:
        assert shared.buf is not None
        with shared.buf[:size] as view:
            return fn(view, *args)
    finally:
        shared.close()


def _child_start(parent_pid: int) -> None:
    """In the child, first: leave Ctrl-C to the parent, and die with it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_parent_death_signal = parent_death_signal()
    if set_parent_death_signal is not None:
        set_parent_death_signal()
    if os.getppid() != parent_pid:  # the parent died before the call above
        os._exit(0)
