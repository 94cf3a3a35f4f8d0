"""`shoal up --autoscale` end to end: a router, the autoscaler as its own process, and the replicas it starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.ports import free_ports, is_free

pytestmark = pytest.mark.integration


def test_shoal_up_autoscale_serves_the_demo_requests_and_cleans_up(tiny_checkpoint: Path) -> None:
    shoal = Path(sys.executable).parent / "shoal"
    replica_base = free_ports(2)
    router_port = free_ports(2)  # the router, and the autoscaler's /metrics on the next port
    proc = subprocess.run(
        [
            str(shoal), "up", "--model", str(tiny_checkpoint), "--autoscale", "--min-replicas", "1",
            "--max-replicas", "2", "--port", str(router_port), "--replica-base-port", str(replica_base),
            "--demo-requests", "--exit-after-demo",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert f"Shoal is up: http://127.0.0.1:{router_port}/v1 (OpenAI API), autoscaling 1-2 replica(s)" in out
    assert f"autoscaler: http://127.0.0.1:{router_port + 1}/metrics" in out
    assert "finish_reason:" in out
    assert "registered local-" in proc.stderr, "the autoscaler registered its replica with the router"
    # The router, the autoscaler and every replica it started are gone: their ports are free again.
    for port in (router_port, router_port + 1, replica_base, replica_base + 1):
        assert is_free(port), port
