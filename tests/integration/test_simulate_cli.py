"""`python -m simulations simulate` as a process: exit code, table on stdout, progress on stderr, files in --out."""

from __future__ import annotations

import json
import subprocess
import sys
from itertools import islice
from pathlib import Path

import pytest

from tests.data import MOONCAKE

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]


def test_simulate_command_runs_end_to_end(tmp_path: Path) -> None:
    trace = tmp_path / "head.jsonl"
    with MOONCAKE.open() as f:
        trace.write_text("".join(islice(f, 200)))
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "simulations",
            "simulate",
            "--trace",
            str(trace),
            "--policies",
            "estimated_ttft,least_load",
            "--replicas",
            "3",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "| estimated_ttft" in done.stdout and "| least_load" in done.stdout
    assert "runs: 100%" in done.stderr and "2/2" in done.stderr  # the progress: runs done / total
    document = json.loads((out / "results.json").read_text())
    assert document["policies"]["least_load"]["summary"]["requests"] == 200
    assert document["floor"]["hit_ratio"] > 0
    assert (out / "ttft_cdf.png").exists() and (out / "timeseries.png").exists()


def test_a_missing_trace_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "simulations",
            "simulate",
            "--trace",
            str(tmp_path / "none.jsonl"),
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
