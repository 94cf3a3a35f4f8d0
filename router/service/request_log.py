"""The per-request log: one JSON line per request, formatted and written off the event loop, in batches.

`record` (on the event loop) appends the request's fields, unformatted, to a bounded deque and returns: a few
hundred nanoseconds. A writer thread wakes every `flush_interval_s`, or as soon as a batch's worth waits, formats
what is queued (orjson) and writes it in one call. A slow or blocked sink (a full disk, a pipe nobody reads) blocks
only that thread; once `max_pending_lines` wait, new lines are dropped and counted (`num_dropped`, and the
`shoal_router_request_log_dropped_total` counter), never blocking a request or growing without bound. `close`
flushes what is queued and stops the thread, waiting at most `close_timeout_s` for a sink that does not drain.
Lines leave in the order `record` was called: one deque, one writer.

The sink is an unbuffered file of the log's own (`open_sink`: a file, or a duplicate of standard error), so a
writer blocked in it holds no lock that the router's other logging needs. Writes go out in pieces of at most
`_PIPE_BUF` bytes cut at line ends, so on a pipe shared with other log lines no line is torn.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import orjson

log = logging.getLogger("shoal.router")

_BATCH_LINES = 512
"""Lines queued at which the writer is woken before its interval is up."""
_NEWLINE = orjson.OPT_APPEND_NEWLINE
_PIPE_BUF = 4096
"""Bytes Linux writes to a pipe atomically (POSIX PIPE_BUF)."""


def open_sink(path: Path | None) -> BinaryIO:
    """An unbuffered sink: the file at `path` (appended to), or a duplicate of standard error."""
    if path is None:
        return os.fdopen(os.dup(2), "wb", buffering=0)
    return path.open("ab", buffering=0)


class RequestLog:
    def __init__(
        self,
        sink: BinaryIO,
        *,
        max_pending_lines: int,
        flush_interval_s: float,
        close_timeout_s: float = 2.0,
        on_drop: Callable[[], object] = lambda: None,
        worker: str | None = None,
    ) -> None:
        self.sink = sink
        self.max_pending_lines = max_pending_lines
        self.flush_interval_s = flush_interval_s
        self.close_timeout_s = close_timeout_s
        self.on_drop = on_drop
        """Called (on the event loop) for each line dropped because the writer is behind."""
        self.worker = worker
        """Added to every line as "worker" (a `--workers` process's label); None: not added."""
        self.num_dropped = 0
        self.num_written = 0
        self._pending: collections.deque[dict[str, Any]] = collections.deque()
        self._wake = threading.Event()
        self._is_stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="shoal-request-log", daemon=True)
        self._thread.start()

    def record(self, fields: dict[str, Any]) -> None:
        """Queue one line (its fields; "ts", the wall-clock time, and "worker" are added). Never blocks."""
        pending = self._pending
        if len(pending) >= self.max_pending_lines:
            self.num_dropped += 1
            self.on_drop()
            return
        fields["ts"] = time.time()
        if self.worker is not None:
            fields["worker"] = self.worker
        pending.append(fields)  # deque.append and popleft are atomic: no lock between the loop and the writer
        if len(pending) == _BATCH_LINES:
            self._wake.set()

    def close(self) -> None:
        """Write what is queued, stop the writer (waiting at most `close_timeout_s`) and close the sink. A writer
        still blocked in the sink keeps it: closing a file under a write could hand its descriptor to another."""
        self._is_stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.close_timeout_s)
            if self._thread.is_alive():
                log.warning("request log: the sink did not drain within %.1f s at shutdown", self.close_timeout_s)
        if self._thread is None or not self._thread.is_alive():
            self.sink.close()
        if self.num_dropped:
            log.warning("request log: %d lines dropped because the log's sink was too slow", self.num_dropped)

    def _run(self) -> None:
        pending = self._pending
        while True:
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            is_stopping = self._is_stopping
            lines = []
            while pending:
                fields = pending.popleft()
                try:
                    lines.append(orjson.dumps(fields, option=_NEWLINE))
                except TypeError:  # a value orjson cannot encode (a lone surrogate): keep the line, lose the value
                    lines.append(orjson.dumps({key: repr(value) for key, value in fields.items()}, option=_NEWLINE))
            if lines:
                try:
                    self._write(lines)
                except (OSError, ValueError) as exc:  # ValueError: the sink was closed
                    log.warning("request log: writing failed, the log is off from now: %s", exc)
                    return
                self.num_written += len(lines)
            if is_stopping and not pending:
                return

    def _write(self, lines: list[bytes]) -> None:
        piece: list[bytes] = []
        size = 0
        for line in lines:
            if piece and size + len(line) > _PIPE_BUF:
                self._write_all(b"".join(piece))
                piece, size = [], 0
            piece.append(line)
            size += len(line)
        if piece:
            self._write_all(b"".join(piece))

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = self.sink.write(view)
            view = view[written or 0 :]
