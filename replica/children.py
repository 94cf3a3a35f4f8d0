"""Child processes that do not outlive their parent, for `shoal up`.

`shoal up` stops its router, replicas and autoscaler on Ctrl-C, SIGTERM or the death of one of them; a parent
killed outright (SIGKILL, a crash) gets no such chance. On Linux the kernel then sends each child SIGTERM, through
`PR_SET_PDEATHSIG`, as the autoscaler's local actuator does for its replicas (`autoscaler.actuators.local`, with
its own copy of these few lines: neither package may import the other, by DESIGN.md's layers and because the router
image, which runs the autoscaler, ships no `replica`). Elsewhere children are only stopped by a parent that lives
to stop them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def parent_death_signal() -> Callable[[], None] | None:
    """A `preexec_fn` that asks the kernel to SIGTERM the child when this process dies; None off Linux.

    libc's `prctl` is looked up here, in the parent, so the child between fork and exec runs one foreign call and
    no imports. The signal follows the thread that started the child: `shoal up` starts them from its main thread,
    which lives as long as the process.
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
