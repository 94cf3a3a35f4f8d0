"""Benchmark scripts that print tables, run as modules from the repository root: `.venv/bin/python -m benchmarks.X`."""

from __future__ import annotations

import sys


def command_argv() -> list[str]:
    """The running benchmark's command line as typed at the repository root: `-m benchmarks.X ARGS`. (Under `-m`,
    `sys.argv[0]` is the module's absolute path, which would name this machine in a recorded output.)"""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is None:
        return list(sys.argv)
    return ["-m", spec.name, *sys.argv[1:]]
