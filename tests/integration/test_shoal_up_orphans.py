"""`shoal up`'s router and replicas never outlive a `shoal up` that is killed outright (Linux: the kernel's
parent-death signal), where its own handlers get no chance to stop them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.ports import free_ports
from tests.integration.test_autoscaler_local_orphans import is_running

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's"),
]


def children_of(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def wait_for(text: str, log: Path, proc: subprocess.Popen[bytes], *, timeout_s: float) -> None:
    """Poll `log` until it holds `text`; fail if `proc` exits first or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text(errors="replace"):
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, f"no {text!r} within {timeout_s:.0f} s"
        time.sleep(0.1)


def test_router_and_replicas_get_sigterm_when_shoal_up_is_killed(tiny_checkpoint: Path, tmp_path: Path) -> None:
    shoal = Path(sys.executable).parent / "shoal"
    replica_base, router_port = free_ports(2), free_ports(2)
    log = tmp_path / "up.log"
    children: list[int] = []
    with log.open("wb") as out:
        parent = subprocess.Popen(
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
                str(replica_base),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for("Shoal is up", log, parent, timeout_s=150)
        children = children_of(parent.pid)
        assert len(children) == 3 and all(is_running(child) for child in children), children
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 30
        while alive := [child for child in children if is_running(child)]:
            assert time.monotonic() < deadline, f"{alive} outlived their killed shoal up"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()
        for child in children:
            if is_running(child):
                os.kill(child, signal.SIGKILL)
