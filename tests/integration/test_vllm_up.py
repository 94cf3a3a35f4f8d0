"""`shoal up --engine vllm`: two vLLM servers of the demo checkpoint (its CPU build from `make vllm`) and the router
in exact mode in front, from one command, answering the demo requests; every process gone after it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.ports import free_ports, is_free
from tests.integration.vllm_support import START_TIMEOUT_S, vllm_python_or_skip

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def test_shoal_up_starts_a_vllm_fleet_behind_the_router_in_exact_mode() -> None:
    python = vllm_python_or_skip()
    shoal = Path(sys.executable).parent / "shoal"
    base = free_ports(60)  # HTTP on base, base + 1; KV events on base + 50 ...
    router_port = free_ports(2)
    command = [str(shoal), "up", "--engine", "vllm", "--vllm-python", str(python), "--replicas", "2"]
    command += ["--port", str(router_port), "--replica-base-port", str(base), "--demo-requests", "--exit-after-demo"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=START_TIMEOUT_S + 120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"Shoal is up: http://127.0.0.1:{router_port}/v1 (OpenAI API), 2 vLLM replica(s)" in out
    assert out.count("KV events of 127.0.0.1:") >= 2 and "in sync" in out, out[-4000:]  # exact mode, both streams
    warm = next(line for line in out.splitlines() if line.startswith("warm"))
    assert int(warm.split()[-2]) > 0, out[-4000:]  # the cached tokens vLLM reports for the second request
    for port in (base, base + 1, base + 50, base + 52, router_port):
        assert is_free(port), port
