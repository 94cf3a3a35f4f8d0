"""Child processes that do not outlive their parent: `shoal up`'s router, replicas and autoscaler, the local
actuator's replicas, a replica's tensor-parallel ranks, the vLLM servers of tests and benchmarks.

A parent stops its children on Ctrl-C, SIGTERM or the death of one of them; a parent killed outright (SIGKILL, a
crash) gets no such chance. On Linux the kernel then sends each child SIGTERM, through `PR_SET_PDEATHSIG`, which a
child asks for between fork and exec (`parent_death_signal`). Elsewhere children are only stopped by a parent that
lives to stop them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def shoal_command() -> list[str]:
    """How to run `shoal`: the script beside this Python, else the one on PATH, else the module."""
    exe = Path(sys.executable).parent / "shoal"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("shoal")
    if found:
        return [found]
    return [sys.executable, "-c", "import sys; from router.cli import main; sys.exit(main())"]


def parent_death_signal() -> Callable[[], None] | None:
    """A `preexec_fn` that asks the kernel to SIGTERM the child when this process dies; None off Linux.

    libc's `prctl` is looked up here, in the parent, so the child between fork and exec runs one foreign call and
    no imports or allocations of note. The signal follows the thread that started the child: start children from a
    thread that lives as long as the process (the main thread, or the event loop's under `asyncio.run`). A child
    whose parent died before the call is not signalled; the parent is alive while it starts children, so that race
    is its own death during the start.
    """
    if not sys.platform.startswith("linux"):
        return None
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return None
    prctl = ctypes.CDLL(libc_name, use_errno=True).prctl
    signal_number = int(signal.SIGTERM)

    def set_parent_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, signal_number, 0, 0, 0)

    return set_parent_death_signal


def start_child(command: Sequence[str], env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`command` as a child that gets SIGTERM when this process dies (on Linux)."""
    return subprocess.Popen(list(command), env=env, preexec_fn=parent_death_signal())
