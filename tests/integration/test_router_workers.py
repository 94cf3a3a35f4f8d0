"""`shoal router --workers N` (router/service/workers.py): N processes on one port, sharing through a real Redis.

The router runs as a user runs it, a `shoal router` process, in front of fake replicas. Which worker served a
request comes from its request-log line (`worker`), and each worker's state from its `/metrics` (`worker` label),
scraped over new connections until every worker has answered. State is awaited by polling with deadlines.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.fakes import FakeReplica
from tests.integration.conftest import LONG_PREFIX_BYTES, MODEL, StartFakes, eventually, metric_value, unique_text
from tests.integration.ports import free_ports
from tests.integration.redis_server import RedisProcess

pytestmark = pytest.mark.integration

FAST_ENV = {
    "SHOAL_ROUTER_FLEET__HEARTBEAT_S": "0.1",
    "SHOAL_ROUTER_FLEET__READ_BLOCK_S": "0.1",
    "SHOAL_ROUTER_LIMITS__UNREADY_DELAY_S": "0",
    "SHOAL_ROUTER_LIMITS__SHUTDOWN_GRACE_S": "5",
}


class Workers:
    """A `shoal router --workers N` process and its stderr (logging and the request log)."""

    def __init__(self, process: asyncio.subprocess.Process, port: int, log_path: Path) -> None:
        self.process = process
        self.port = port
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{port}"

    def request_lines(self) -> list[dict[str, Any]]:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return [json.loads(line) for line in lines if line.startswith('{"event":"request"')]

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


async def start_workers(
    tmp_path: Path, fakes: Sequence[FakeReplica], num_workers: int, *extra: str, port: int | None = None
) -> Workers:
    port = port or free_ports(1)
    log_path = tmp_path / f"router-{port}.log"
    argv = [sys.executable, "-c", "import sys; from router.cli import main; sys.exit(main())", "router"]
    argv += ["--port", str(port), "--workers", str(num_workers), *extra]
    for fake in fakes:
        argv += ["--replica", fake.url]
    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            *argv, stdout=log, stderr=log, env={**os.environ, **FAST_ENV}, start_new_session=True
        )
    return Workers(process, port, log_path)


async def all_answer(workers: Workers, num_workers: int) -> bool:
    return len(await scrape_each_worker(workers.url, num_workers)) == num_workers


async def serving(tmp_path: Path, fakes: Sequence[FakeReplica], num_workers: int, launched: list[Workers]) -> Workers:
    """`start_workers`, then wait until every worker answers on the port."""
    workers = await start_workers(tmp_path, fakes, num_workers)
    launched.append(workers)

    async def ready() -> bool:
        return await all_answer(workers, num_workers)

    await eventually(ready, timeout_s=60.0, what=f"all {num_workers} workers serving")
    return workers


@pytest.fixture
async def launched() -> AsyncIterator[list[Workers]]:
    started: list[Workers] = []
    yield started
    for workers in started:
        if workers.process.returncode is None:
            os.killpg(workers.process.pid, signal.SIGKILL)
            await workers.process.wait()


async def scrape_each_worker(url: str, num_workers: int) -> dict[str, str]:
    """Each worker's /metrics text, by its `worker` label: scrapes over new connections until all have answered."""
    texts: dict[str, str] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        for _ in range(200):
            try:
                async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    text = await resp.text()
            except aiohttp.ClientError:
                continue
            for line in text.splitlines():
                if line.startswith("shoal_router_held_requests{"):
                    texts[line.split('worker="')[1].split('"')[0]] = text
                    break
            if len(texts) == num_workers:
                return texts
    return texts


async def every_worker(url: str, num_workers: int, name: str) -> dict[str, float]:
    """One metric's value in each worker; empty until every worker answered."""
    texts = await scrape_each_worker(url, num_workers)
    if len(texts) < num_workers:
        return {}
    return {worker: metric_value(text, name) or 0.0 for worker, text in texts.items()}


async def complete_on_new_connections(url: str, prompts: Sequence[str]) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        for prompt in prompts:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()


async def route_prefixes(workers: Workers, num_workers: int, *, shared: bool) -> list[list[dict[str, Any]]]:
    """For a few prefixes: one request, then (with sharing, once every worker applied the fleet's later batches)
    eight follow-ups on new connections. The request-log lines of each prefix's requests, first one first."""
    for i in range(3):
        prefix = unique_text(LONG_PREFIX_BYTES, f"doc{i}")
        await complete_on_new_connections(workers.url, [prefix + " first question"])
        if shared:
            # Batches reach each worker in stream order: two more applied batches from the other worker mean the
            # one holding this decision (published within a flush interval of it) has been applied.
            before = await every_worker(workers.url, num_workers, "shoal_router_fleet_batches_applied_total")

            async def applied_two_more(before: dict[str, float] = before) -> bool:
                now = await every_worker(workers.url, num_workers, "shoal_router_fleet_batches_applied_total")
                return bool(now) and all(now[w] >= before[w] + 2 for w in before)

            await eventually(applied_two_more, timeout_s=10.0, what="every worker applied the fleet's batches")
        await complete_on_new_connections(workers.url, [prefix + f" follow-up {j}" for j in range(8)])

    async def all_logged() -> bool:
        return len(workers.request_lines()) >= 27

    await eventually(all_logged, timeout_s=10.0, what="27 request-log lines")
    # Each worker writes its lines in batches: the file interleaves them, the time each request ended does not.
    lines = [line for line in workers.request_lines() if line["path"] == "/v1/completions"]
    lines.sort(key=lambda line: float(line["ts"]))
    return [lines[9 * i : 9 * i + 9] for i in range(3)]


async def test_workers_share_one_port_and_one_view_through_redis(
    tmp_path: Path, start_fakes: StartFakes, redis_process: RedisProcess, launched: list[Workers]
) -> None:
    fakes = await start_fakes(2)
    workers = await start_workers(tmp_path, fakes, 2, "--redis-url", redis_process.url)
    launched.append(workers)

    async def peers_seen() -> bool:
        peers = await every_worker(workers.url, 2, "shoal_router_fleet_peers")
        return peers == {"0": 1.0, "1": 1.0}

    await eventually(peers_seen, timeout_s=60.0, what="both workers serving, each seeing the other as a peer")
    groups = await route_prefixes(workers, 2, shared=True)
    served_by_the_other = 0
    for first, *follow_ups in groups:
        for line in follow_ups:
            assert (line["branch"], line["replica"]) == ("cache_hit", first["replica"]), line
            served_by_the_other += line["worker"] != first["worker"]
    assert served_by_the_other > 0  # a prefix one worker routed was a hit at the other


async def test_without_redis_each_worker_sees_only_its_own_requests(
    tmp_path: Path, start_fakes: StartFakes, launched: list[Workers]
) -> None:
    workers = await serving(tmp_path, await start_fakes(2), 2, launched)
    assert "each sees only the requests it serves" in workers.log_text()
    groups = await route_prefixes(workers, 2, shared=False)
    misses_at_the_other = [
        line
        for first, *follow_ups in groups
        for line in follow_ups
        if line["worker"] != first["worker"] and line["branch"] != "cache_hit"
    ]
    assert misses_at_the_other  # the other worker had not seen the prefix


async def test_a_dead_worker_is_started_again_and_sigterm_stops_them_all(
    tmp_path: Path, start_fakes: StartFakes, launched: list[Workers]
) -> None:
    workers = await serving(tmp_path, await start_fakes(1), 2, launched)
    first_children = children_of(workers.process.pid)
    assert len(first_children) == 2, first_children
    os.kill(first_children[0], signal.SIGKILL)

    async def replaced() -> bool:
        children = children_of(workers.process.pid)
        return len(children) == 2 and first_children[0] not in children and await all_answer(workers, 2)

    await eventually(replaced, timeout_s=60.0, interval_s=0.1, what="the killed worker started again")
    assert "exited (status 137); starting it again" in workers.log_text()
    children = children_of(workers.process.pid)
    workers.process.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(workers.process.wait(), timeout=30.0) == 0, workers.log_text()[-3000:]
    assert not set(children) & set(children_of(workers.process.pid)) and not _alive(children)


async def test_a_worker_that_cannot_listen_stops_the_group_with_an_error(
    tmp_path: Path, start_fakes: StartFakes, launched: list[Workers]
) -> None:
    fakes = await start_fakes(1)
    with socket.socket() as taken:  # bound without SO_REUSEPORT: no worker can share it
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        workers = await start_workers(tmp_path, fakes, 2, port=port)
        launched.append(workers)
        status = await asyncio.wait_for(workers.process.wait(), timeout=60.0)
    assert status != 0
    assert "before it listened: stopping" in workers.log_text()


def children_of(pid: int) -> list[int]:
    """The live worker processes of `pid` (not multiprocessing's resource tracker), from /proc."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid and fields[0] != "Z" and b"spawn_main" in _cmdline(entry):
            children.append(int(entry))
    return sorted(children)


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pids: Sequence[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive
