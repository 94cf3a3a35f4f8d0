"""Scale to zero end to end: `shoal up --autoscale --min-replicas 0`, woken by its first requests, back to zero.

Real processes (router, autoscaler, a replica of the tiny checkpoint) and the official `openai` client. The
router holds the first requests while no replica exists; the autoscaler sees them held, starts a replica and
registers it; the router releases them to it. After the idle window (5 s here) the replica is drained and
stopped. Deadlines are generous for a replica that loads on two shared cores; nothing sleeps a fixed time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.ports import free_ports, is_free

pytestmark = pytest.mark.integration

IDLE_S = 5.0


def _wait_for(predicate: Callable[[], bool], *, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.2)


def _metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _num_replicas(router: str) -> float:
    return sum(v for (name, _), v in _metrics(router + "/metrics").items() if name == "shoal_router_replicas")


def _decisions(autoscaler: str, reason: str) -> float:
    return sum(
        v
        for (name, labels), v in _metrics(autoscaler + "/metrics").items()
        if name == "shoal_autoscaler_decisions_total" and ("reason", reason) in labels
    )


def test_a_fleet_at_zero_wakes_on_its_first_requests_and_returns_to_zero(tiny_checkpoint: Path, tmp_path: Path) -> None:
    shoal = Path(sys.executable).parent / "shoal"
    replica_port = free_ports(1)
    router_port = free_ports(2)  # the router, and the autoscaler's /metrics on the next port
    router, autoscaler = f"http://127.0.0.1:{router_port}", f"http://127.0.0.1:{router_port + 1}"
    env = {
        **os.environ,
        "SHOAL_AUTOSCALER_INTERVAL_S": "0.5",
        "SHOAL_AUTOSCALER_POLICY__SCALE_TO_ZERO__IDLE_S": str(IDLE_S),
    }
    out = (tmp_path / "up.out").open("w+")
    proc = subprocess.Popen(
        [
            str(shoal), "up", "--model", str(tiny_checkpoint), "--autoscale", "--min-replicas", "0",
            "--max-replicas", "1", "--port", str(router_port), "--replica-base-port", str(replica_port),
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env,
    )  # fmt: skip
    try:
        _wait_for(lambda: "Shoal is up" in (tmp_path / "up.out").read_text(), timeout_s=90, what="shoal up")
        log = (tmp_path / "up.out").read_text()
        assert "autoscaling 0-1 replica(s)" in log and "the first request wakes a replica" in log, log[-2000:]
        # Up, and at zero: no replica at the router, none listening, the policy idle at zero.
        assert _num_replicas(router) == 0 and is_free(replica_port)
        _wait_for(lambda: _decisions(autoscaler, "idle_at_zero") > 0, timeout_s=30, what="idle at zero")

        client = openai.OpenAI(base_url=router + "/v1", api_key="unused", max_retries=0, timeout=240)
        model = tiny_checkpoint.resolve().name

        def ask(i: int) -> str:
            reply = client.completions.create(model=model, prompt=f"wake {i}: the quick brown fox", max_tokens=4)
            return reply.choices[0].finish_reason or ""

        # Three requests at once at a fleet of none: all held, all answered by the replica they woke.
        with ThreadPoolExecutor(3) as pool:
            reasons = list(pool.map(ask, range(3)))
        assert all(r in ("length", "stop") for r in reasons), reasons
        assert _decisions(autoscaler, "wake_from_zero") >= 1
        assert not is_free(replica_port), "the woken replica serves on its slot"
        # Idle for the window: the replica is drained and stopped, and the router lists none again.
        _wait_for(lambda: _decisions(autoscaler, "scale_to_zero") > 0, timeout_s=60, what="scale to zero")
        _wait_for(
            lambda: _num_replicas(router) == 0 and is_free(replica_port), timeout_s=60, what="the replica stopped"
        )
        assert proc.poll() is None, (tmp_path / "up.out").read_text()[-3000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        out.close()
    for port in (router_port, router_port + 1, replica_port):
        assert is_free(port), port
