"""Real vLLM servers for the tests: its CPU build from `make vllm`, serving the packaged demo checkpoint.

`vllm_servers` (module scope) starts two servers on loopback, each on a core of its own where the host has two,
and stops them by process id after the module's last test. The second one's replay port is taken by a listening
socket while they start, so that it fails with its address in use and `start_all` starts it again on fresh ports
(`RunningVllm.first_port` keeps the port it was given); where vLLM's virtualenv is absent the module's tests
are skipped and say how to build it. Starting one takes about a minute on a 2-core machine.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from replica.demo.build import PACKAGED_DIR
from replica.vllm_engine import VllmServer, find_vllm_python, start_all, stop
from tests.integration.ports import free_ports

MODEL = "shoal-demo"
CHECKPOINT = PACKAGED_DIR
START_TIMEOUT_S = 420.0
"""A cold start on a busy 2-core machine (imports, model load, CPU kernels' warm-up) took up to ~3 minutes."""


@dataclass
class RunningVllm:
    server: VllmServer
    proc: subprocess.Popen[bytes]
    log: Path
    first_port: int
    """The HTTP port it was first started on (a server started again has another)."""

    @property
    def url(self) -> str:
        return self.server.url

    def is_running(self) -> bool:
        return self.proc.poll() is None


def vllm_python_or_skip() -> Path:
    python = find_vllm_python()
    if python is None:
        pytest.skip(
            "vLLM's CPU build is not installed: `make vllm` builds it into .venv-vllm (or set SHOAL_VLLM_PYTHON)"
        )
    return python


def _cores(index: int) -> str | None:
    import os

    cores = sorted(os.sched_getaffinity(0))
    return str(cores[index % len(cores)]) if len(cores) > 1 else None


@pytest.fixture(scope="module")
def vllm_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RunningVllm]]:
    python = vllm_python_or_skip()
    log_dir = tmp_path_factory.mktemp("vllm")
    base = free_ports(8)
    servers = [
        VllmServer(CHECKPOINT, MODEL, port=base + 4 * i, events_port=base + 4 * i + 1, cpus=_cores(i), max_num_seqs=4)
        for i in range(2)
    ]
    with socket.create_server(("", servers[1].events_port + 1)):  # listening: no other bind gets the port
        started = start_all(servers, python, log_dir, timeout_s=START_TIMEOUT_S)
    running = [
        RunningVllm(s, p, log_dir / f"vllm-{s.port}.log", first.port)
        for first, (s, p) in zip(servers, started, strict=True)
    ]
    try:
        yield running
    finally:
        for r in running:
            stop(r.proc)
