"""`shoal up` (what `make demo` runs) end to end: real processes, a router and two replicas, the demo requests."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def _free_port_pair() -> int:
    """A port p with p and p + 1 free right now (the replicas take consecutive ports)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free pair of ports")


def test_shoal_up_serves_the_demo_requests(tiny_checkpoint: Path) -> None:
    shoal = Path(sys.executable).parent / "shoal"
    base = _free_port_pair()
    router_port = _free_port_pair()
    proc = subprocess.run(
        [
            str(shoal), "up", "--model", str(tiny_checkpoint), "--replicas", "2",
            "--port", str(router_port), "--replica-base-port", str(base), "--demo-requests", "--exit-after-demo",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert f"Shoal is up: http://127.0.0.1:{router_port}/v1" in out
    assert "finish_reason:" in out
    warm = next(line for line in out.splitlines() if line.startswith("warm"))
    cached = int(warm.split()[3])
    assert cached > 0, out
    # Every child process is gone: the ports are free again.
    for port in (base, base + 1, router_port):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # closed connections may linger in TIME_WAIT
            s.bind(("127.0.0.1", port))
