"""Benchmark scripts that print tables, run as modules from the repository root: `.venv/bin/python -m benchmarks.X`."""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def command_argv() -> list[str]:
    """The running benchmark's command line as typed at the repository root: `-m benchmarks.X ARGS`. (Under `-m`,
    `sys.argv[0]` is the module's absolute path, which would name this machine in a recorded output.)"""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is None:
        return list(sys.argv)
    return ["-m", spec.name, *sys.argv[1:]]


def command_line() -> str:
    """`$ PYTHON -m benchmarks.X ARGS`, the header line of a recorded output: the repository's own venv named
    relative to the repository root, so the record names no path of this machine."""
    python = Path(sys.executable)
    with contextlib.suppress(ValueError):
        python = python.relative_to(REPO)
    return "$ " + shlex.join([str(python), *command_argv()])


def machine_description() -> str:
    """CPU model, cores, kernel and load average, for the header of the tables."""
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    return f"{model}, {os.cpu_count()} cores, Linux {os.uname().release}, load average {load}"
