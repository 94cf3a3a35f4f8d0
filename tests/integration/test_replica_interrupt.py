"""Ctrl-C while `shoal replica` loads its model ends the process at once. The load runs on the engine's thread, which
nothing can interrupt, and which blocks SIGINT and SIGTERM so that the kernel hands them to the main thread. A long
load is stood in for by one that first opens a FIFO nobody writes (blocked in the kernel, the GIL released, as
reading a large checkpoint mostly is), so a replica that waited for its load, at exit or anywhere, would never
end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.replica_checkpoint import build_tiny_checkpoint

DEADLINE_S = 60.0


def _thread_opening_a_fifo(pid: int) -> Path | None:
    """The /proc task of the thread of `pid` that waits in the kernel for a FIFO's writer (its wchan), if one does."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "wchan").read_text() == "wait_for_partner":
                return task
        except OSError:
            continue
    return None


def _sigint_as_in_a_terminal() -> None:
    """In the child: SIGINT at its default, as a terminal's foreground process has it. A shell's background job
    (`make test &`) inherits it ignored, and Python then leaves it ignored: Ctrl-C could not reach it at all."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _status(task: Path) -> dict[str, str]:
    """The fields of a /proc task's `status` file, by name."""
    lines = (task / "status").read_text().splitlines()
    return {name: value.strip() for name, value in (line.split(":", 1) for line in lines if ":" in line)}


def _threads(pid: int) -> list[tuple[str, str, str, str]]:
    """(name, wchan, SigBlk, SigCgt) of each thread of `pid`: where each waits, and which signals it blocks and
    catches, for a failure's message."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = _status(task)
            wchan = (task / "wchan").read_text()
        except OSError:
            continue
        found.append((status.get("Name", "?"), wchan, status.get("SigBlk", "?"), status.get("SigCgt", "?")))
    return found


def _kernel_names_waits() -> bool:
    """Whether /proc/*/wchan names where a sleeping task waits (some kernels hide it: "0")."""
    with subprocess.Popen(["sleep", "30"]) as sleeper:
        try:
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline:
                wchan = Path(f"/proc/{sleeper.pid}/wchan").read_text()
                if wchan not in ("", "0"):
                    return True
                time.sleep(0.05)  # until the sleeper sleeps, with a deadline
            return False
        finally:
            sleeper.kill()


def test_ctrl_c_during_the_load_ends_the_replica(tmp_path: Path) -> None:
    if not _kernel_names_waits():
        pytest.skip("this kernel does not say where a task waits (/proc/*/wchan)")
    checkpoint = build_tiny_checkpoint(tmp_path / "tiny")
    fifo = tmp_path / "load-gate"
    os.mkfifo(fifo)
    main = (
        "import pathlib, replica.server.serve as serve\n"
        "real = serve.load_for_serving\n"
        f"serve.load_for_serving = lambda settings: (pathlib.Path({str(fifo)!r}).read_bytes(), real(settings))[1]\n"
        "from router.cli import main\n"
        "raise SystemExit(main())\n"
    )
    command = [sys.executable, "-c", main, "replica", f"--model={checkpoint}", "--port=0", "--threads=1"]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_as_in_a_terminal
    )
    try:
        deadline = time.monotonic() + DEADLINE_S
        while (loader := _thread_opening_a_fifo(process.pid)) is None:
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "the replica never started loading"
            time.sleep(0.05)  # polling another process's progress, with a deadline
        # The kernel hands a process's signal to any thread that does not block it; handed to the loading thread,
        # it would leave the main thread asleep in its wait.
        blocked = int(_status(loader)["SigBlk"], 16)  # bit n - 1 is signal n
        assert blocked >> (signal.SIGINT - 1) & 1 and blocked >> (signal.SIGTERM - 1) & 1, f"SigBlk {blocked:x}"
        before = _threads(process.pid)
        process.send_signal(signal.SIGINT)
        try:
            _, stderr = process.communicate(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"no exit {DEADLINE_S:.0f} s after SIGINT; threads before it: {before}; now: {_threads(process.pid)}"
            ) from None
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, stderr
    assert "interrupted while loading" in stderr
