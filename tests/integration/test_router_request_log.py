"""The request log of a running router: on a FIFO nobody reads, requests are neither slowed nor failed, and the
lines that could not be written are counted; on a file, one line per request, in order."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

from tests.integration.conftest import StartFakes, StartRouter, metric_value

pytestmark = pytest.mark.integration


async def test_a_fifo_nobody_reads_does_not_slow_or_fail_requests(
    start_fakes: StartFakes, start_router: StartRouter, tmp_path: Path
) -> None:
    fifo = tmp_path / "requests.fifo"
    os.mkfifo(fifo)
    reader_fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # held open, never read: the router's writes fill it
    try:
        router = await start_router(
            await start_fakes(1),
            log_requests=True,
            request_log={"path": fifo, "max_pending_lines": 50, "flush_interval_s": 0.01},
        )
        prompt = "x" * 2000  # lines stay short; what fills the pipe is their number
        started = time.perf_counter()
        for batch in range(12):
            replies = await asyncio.gather(*(router.complete(f"{batch} {prompt}", max_tokens=1) for _ in range(50)))
            assert all(reply.status == 200 for reply in replies)
        elapsed_s = time.perf_counter() - started
        assert elapsed_s < 30.0
        dropped = metric_value(await router.metrics(), "shoal_router_request_log_dropped_total")
        assert dropped is not None and dropped > 0  # 600 lines of some 300 bytes each outgrow a 64 KiB pipe
        started = time.perf_counter()
        await router.cleanup()  # the writer is stuck in write(): shutdown still ends, within its close timeout
        assert time.perf_counter() - started < 10.0
    finally:
        os.close(reader_fd)


async def test_lines_arrive_in_order(start_fakes: StartFakes, start_router: StartRouter, tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    router = await start_router(
        await start_fakes(1), log_requests=True, request_log={"path": path, "flush_interval_s": 0.02}
    )
    for i in range(40):
        assert (await router.complete(f"request {i}", max_tokens=1, user=str(i))).status == 200
    await router.cleanup()  # flushes
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 40 and all(line["status"] == 200 for line in lines)
    assert [line["ts"] for line in lines] == sorted(line["ts"] for line in lines)
