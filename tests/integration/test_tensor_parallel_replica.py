"""`shoal replica --tensor-parallel-size 2` as a user starts it: the server on rank 0 answers through the official
client as a single-rank replica does, with the demo's block drafter too (rank 0 drafts and decides, rank 1 runs what
it decided), Ctrl-C (SIGTERM) stops both ranks cleanly, and a rank killed in the middle of a streamed generation ends
the replica within a deadline with a nonzero exit code and an error that names it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.integration.conftest import metric_value
from tests.integration.ports import free_ports
from tests.integration.test_seeded_replica import held_out_prompts
from tests.replica_checkpoint import build_tiny_checkpoint

START_DEADLINE_S = 120.0
EXIT_DEADLINE_S = 30.0
"""A lost rank must end rank 0 well within this (its graceful shutdown, or the hard exit after 10 s)."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-tp"))


class Replica:
    def __init__(
        self, checkpoint: Path | str, logs: Path, *, tensor_parallel_size: int, options: tuple[str, ...] = ()
    ) -> None:
        self.port = free_ports(1)
        self.stdout_path, self.stderr_path = logs / "stdout", logs / "stderr"
        command = [
            sys.executable,
            "-c",
            "from router.cli import main; raise SystemExit(main())",
            "replica",
            f"--model={checkpoint}",
            f"--port={self.port}",
            f"--tensor-parallel-size={tensor_parallel_size}",
            *(() if any(o.startswith("--cpus=") for o in options) else ("--threads=1",)),
            "--served-model-name=shoal-demo",
            "--num-blocks=256",
            *(options or ("--drafter=none",)),
        ]
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            self.process = subprocess.Popen(command, stdout=out, stderr=err, env=env)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0)

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"the replica exited at start:\n{self.stderr}"
            if '"event": "ready"' in self.stdout_path.read_text():
                return
            time.sleep(0.2)
        raise AssertionError(f"not ready after {START_DEADLINE_S:g} s:\n{self.stderr}")

    def rank_pid(self, rank: int) -> int:
        match = re.search(rf"tensor-parallel rank {rank} started, pid (\d+)", self.stderr)
        assert match, self.stderr
        return int(match.group(1))

    def wait_exit(self) -> int:
        try:
            return self.process.wait(timeout=EXIT_DEADLINE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"the replica did not exit within {EXIT_DEADLINE_S:g} s:\n{self.stderr}") from None


@pytest.fixture
def start(checkpoint: Path, tmp_path: Path) -> Iterator[type[Replica]]:
    started: list[Replica] = []

    def make(tensor_parallel_size: int, model: Path | str = checkpoint, options: tuple[str, ...] = ()) -> Replica:
        logs = tmp_path / f"replica{len(started)}"
        logs.mkdir()
        replica = Replica(model, logs, tensor_parallel_size=tensor_parallel_size, options=options)
        started.append(replica)
        return replica

    yield make  # type: ignore[misc]
    for replica in started:
        if replica.process.poll() is None:
            replica.process.kill()
            replica.process.wait()


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


def _complete(replica: Replica) -> list[str]:
    prompts = ["Hello there, how", "The warehouse keeps", "Tell me about the", "One two three"]
    return [
        replica.client.completions.create(model="shoal-demo", prompt=p, max_tokens=12, temperature=0).choices[0].text
        for p in prompts
    ]


def test_two_ranks_serve_like_one_and_stop_together(start) -> None:  # type: ignore[no-untyped-def]
    single = start(1)
    single.wait_ready()
    expected = _complete(single)
    single.process.send_signal(signal.SIGTERM)
    assert single.wait_exit() == 0

    sharded = start(2)
    sharded.wait_ready()
    assert _complete(sharded) == expected
    rank1 = sharded.rank_pid(1)
    sharded.process.send_signal(signal.SIGTERM)
    assert sharded.wait_exit() == 0, sharded.stderr
    assert "tensor-parallel rank 1 stopped after" in sharded.stderr
    assert not _is_alive(rank1)


def test_owned_cpus_split_over_the_ranks(start) -> None:  # type: ignore[no-untyped-def]
    """`--cpus all` with two ranks: each rank runs on its own half of the process's cores alone (rank 0 writes the
    list out before it pins itself), and the ranks answer as one rank with as many threads does."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or len(cores) % 2:
        pytest.skip("needs an even number of cores")
    first, second = cores[: len(cores) // 2], cores[len(cores) // 2 :]
    single = start(1, options=("--drafter=none", f"--cpus={','.join(map(str, first))}"))
    single.wait_ready()
    assert os.sched_getaffinity(single.process.pid) == set(first)
    expected = _complete(single)
    single.process.send_signal(signal.SIGTERM)
    assert single.wait_exit() == 0

    sharded = start(2, options=("--drafter=none", "--cpus=all"))
    sharded.wait_ready()
    assert os.sched_getaffinity(sharded.process.pid) == set(first)
    assert os.sched_getaffinity(sharded.rank_pid(1)) == set(second)
    assert _complete(sharded) == expected
    sharded.process.send_signal(signal.SIGTERM)
    assert sharded.wait_exit() == 0, sharded.stderr


def _demo_answers(replica: Replica, prompts: list[str], **params: float) -> list[str]:
    return [
        replica.client.completions.create(model="shoal-demo", prompt=p, max_tokens=32, **params).choices[0].text
        for p in prompts
    ]


def _metric(replica: Replica, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{replica.port}/metrics", timeout=10) as response:
        return metric_value(response.read().decode(), name) or 0.0


def test_two_ranks_with_the_block_drafter_give_one_ranks_text(start) -> None:  # type: ignore[no-untyped-def]
    """The demo with its block drafter on two ranks: greedy text equal to one rank without speculation on 50
    held-out chats, and seeded sampling (T=0.8) equal to one rank with speculation."""
    prompts = held_out_prompts(50)
    seeded = prompts[:20]
    single = start(1, "demo", ("--num-speculative-tokens=0",))
    single.wait_ready()
    greedy = _demo_answers(single, prompts, temperature=0)
    single.process.send_signal(signal.SIGTERM)
    assert single.wait_exit() == 0
    single_spec = start(1, "demo", ("--drafter=auto",))
    single_spec.wait_ready()
    sampled = [_demo_answers(single_spec, [p], temperature=0.8, seed=i)[0] for i, p in enumerate(seeded)]
    single_spec.process.send_signal(signal.SIGTERM)
    assert single_spec.wait_exit() == 0

    sharded = start(2, "demo", ("--drafter=auto",))
    sharded.wait_ready()
    assert _demo_answers(sharded, prompts, temperature=0) == greedy
    assert [_demo_answers(sharded, [p], temperature=0.8, seed=i)[0] for i, p in enumerate(seeded)] == sampled
    drafted = _metric(sharded, "vllm:spec_decode_num_draft_tokens_total")
    accepted = _metric(sharded, "vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted < drafted  # the drafter ran on rank 0, and rank 0 kept some drafts and refused others
    sharded.process.send_signal(signal.SIGTERM)
    assert sharded.wait_exit() == 0, sharded.stderr


def test_a_rank_that_dies_mid_generation_ends_the_replica_with_an_error(start) -> None:  # type: ignore[no-untyped-def]
    replica = start(2)
    replica.wait_ready()
    rank1 = replica.rank_pid(1)
    stream = replica.client.completions.create(
        model="shoal-demo",
        prompt="A long story about",
        max_tokens=3000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)  # generation is under way
    ended = threading.Event()

    def drain() -> None:
        try:
            for _ in chunks:
                pass
        except (openai.APIError, OSError):
            pass  # the replica went away mid-stream: the router would fail over
        ended.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    os.kill(rank1, signal.SIGKILL)
    code = replica.wait_exit()
    assert code != 0
    lost = r"tensor-parallel rank 1 \(pid \d+\) exited with code -9; the replica cannot serve without it"
    assert re.search(lost, replica.stderr), replica.stderr
    assert ended.wait(EXIT_DEADLINE_S), "the client's stream never ended"
