"""`cpus`: the cores a replica has to itself. The list parses as `taskset -c` writes it (or `all`: the process's
affinity, written out before ranks take their shares), splits evenly over tensor-parallel ranks, and `shoal replica`
refuses what it cannot own before it loads anything."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from replica.settings import ReplicaSettings, parse_cpus


@pytest.mark.parametrize(
    ("text", "cores"),
    [("0", [0]), ("0-3", [0, 1, 2, 3]), ("0,2,4-6", [0, 2, 4, 5, 6]), (" 3 , 1-2", [1, 2, 3]), ("1,1-2", [1, 2])],
)
def test_cpu_lists_parse_as_taskset_writes_them(text: str, cores: list[int]) -> None:
    assert parse_cpus(text) == cores


@pytest.mark.parametrize("text", ["", "a", "0-", "-1", "1-0", "0,,1", "0.5", "0-3x"])
def test_a_malformed_cpu_list_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="cpus"):
        parse_cpus(text)


def test_all_is_the_process_affinity_written_out() -> None:
    mine = sorted(os.sched_getaffinity(0))
    assert parse_cpus("all") == mine
    listed = ReplicaSettings(cpus="all").with_cores_listed()
    assert listed.cpus == ",".join(map(str, mine)) and listed.rank_cores(0) == mine
    assert ReplicaSettings(cpus="0").with_cores_listed().cpus == "0"


def test_each_rank_takes_an_equal_consecutive_share() -> None:
    settings = ReplicaSettings(cpus="0-3", tensor_parallel_size=2)
    assert [settings.rank_cores(rank) for rank in (0, 1)] == [[0, 1], [2, 3]]
    assert ReplicaSettings().rank_cores(0) is None
    with pytest.raises(ValidationError, match="do not split evenly over 2"):
        ReplicaSettings(cpus="0-2", tensor_parallel_size=2)


def _replica(*flags: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", "from router.cli import main; raise SystemExit(main())", "replica", *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def test_cores_outside_the_process_affinity_are_refused_before_loading() -> None:
    missing = max(os.sched_getaffinity(0)) + 1
    done = _replica(f"--cpus={missing}", "--model=/nonexistent")
    assert done.returncode == 2
    assert f"cpus {missing} are not available to this process" in done.stderr
    assert "cannot load" not in done.stderr  # refused before the model was looked at


def test_threads_that_disagree_with_the_owned_cores_are_refused() -> None:
    core = min(os.sched_getaffinity(0))
    done = _replica(f"--cpus={core}", "--threads=2", "--model=/nonexistent")
    assert done.returncode == 2
    assert "one thread per core (1 per rank)" in done.stderr
    done = _replica("--cpus=all", "--threads=999", "--model=/nonexistent")
    assert done.returncode == 2
    assert f"one thread per core ({len(os.sched_getaffinity(0))} per rank)" in done.stderr
