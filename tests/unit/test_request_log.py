"""The request log (router/service/request_log.py) with real sinks: a file, and a pipe nobody reads."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest

from router.service.request_log import RequestLog


@pytest.fixture
def blocked_pipe() -> Iterator[BinaryIO]:
    """The write end of a pipe whose read end is never read: writes block once its buffer (64 KiB) is full."""
    read_fd, write_fd = os.pipe()
    sink = os.fdopen(write_fd, "wb")
    yield sink
    os.close(read_fd)  # the blocked writer gets EPIPE and ends
    with contextlib.suppress(OSError):
        sink.close()


def wait_until(predicate: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        time.sleep(0.01)


def test_every_line_arrives_in_order(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    with path.open("ab") as sink:
        request_log = RequestLog(sink, max_pending_lines=100_000, flush_interval_s=0.05)
        request_log.start()
        for i in range(20_000):
            request_log.record({"event": "request", "n": i, "path": "/v1/completions"})
            if i == 10_000:
                wait_until(lambda: request_log.num_written > 0)  # some batches written while more are queued
        request_log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["n"] for line in lines] == list(range(20_000))
    assert request_log.num_dropped == 0 and request_log.num_written == 20_000
    assert all(line["ts"] > 0 for line in lines)


def test_a_blocked_sink_neither_blocks_nor_grows(blocked_pipe: BinaryIO) -> None:
    dropped = []
    request_log = RequestLog(
        blocked_pipe,
        max_pending_lines=1000,
        flush_interval_s=0.01,
        close_timeout_s=0.2,
        on_drop=lambda: dropped.append(1),
    )
    request_log.start()
    line = {"event": "request", "path": "/v1/chat/completions", "pad": "x" * 200}
    started = time.perf_counter()
    for _ in range(50_000):  # some 11 MB of lines, far beyond the pipe's buffer
        request_log.record(dict(line))
    elapsed_s = time.perf_counter() - started
    assert elapsed_s < 2.0  # record never waited on the sink (about a microsecond each)
    assert len(request_log._pending) <= 1000
    assert request_log.num_dropped > 40_000 and len(dropped) == request_log.num_dropped
    started = time.perf_counter()
    request_log.close()  # the sink never drains: close gives up after its timeout
    assert time.perf_counter() - started < 1.0


def test_a_failing_sink_turns_the_log_off(tmp_path: Path) -> None:
    sink = (tmp_path / "log").open("ab")
    request_log = RequestLog(sink, max_pending_lines=10, flush_interval_s=0.01)
    request_log.start()
    sink.close()
    request_log.record({"n": 1})
    wait_until(lambda: request_log._thread is not None and not request_log._thread.is_alive())
    for i in range(100):
        request_log.record({"n": i})
    assert request_log.num_dropped == 90  # bounded even with no writer
    request_log.close()
