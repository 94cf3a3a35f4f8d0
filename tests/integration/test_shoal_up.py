"""`shoal up` (what `make demo` runs) end to end: real processes, a router and two replicas, the demo requests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.ports import free_ports, is_free

pytestmark = pytest.mark.integration


def test_shoal_up_serves_the_demo_requests(tiny_checkpoint: Path) -> None:
    shoal = Path(sys.executable).parent / "shoal"
    base = free_ports(2)
    router_port = free_ports(2)
    proc = subprocess.run(
        [
            str(shoal),
            "up",
            "--model",
            str(tiny_checkpoint),
            "--replicas",
            "2",
            "--port",
            str(router_port),
            "--replica-base-port",
            str(base),
            "--demo-requests",
            "--exit-after-demo",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert f"Shoal is up: http://127.0.0.1:{router_port}/v1" in out
    # What it did while it started, in order, each line with the seconds since it began.
    steps = [line for line in out.splitlines() if line.startswith("shoal up [")]
    assert any(f"starting replica 2 of 2 on port {base + 1}" in line for line in steps), out
    assert out.index("waiting for the replicas") < out.index("router ready") < out.index("Shoal is up")
    assert out.index("Shoal is up") < out.index("sending the demo requests") < out.index("finish_reason:")
    assert "finish_reason:" in out
    warm = next(line for line in out.splitlines() if line.startswith("warm"))
    cached = int(warm.split()[-2])  # columns: request, replica and branch, prompt, cached, TTFT
    assert cached > 0, out
    # Every child process is gone: the ports are free again.
    for port in (base, base + 1, router_port):
        assert is_free(port), port
