"""`CaptureWriter`: appends capture records to numbered JSONL files on one thread, off the serving path.

`record()` runs on the event loop and never blocks or raises: it puts the record into a bounded queue, or drops and
counts it when the queue is full (a slow or stuck disk costs records, never latency). One writer thread, started by
`start()` and stopped by `close(timeout_s)`, encodes records and writes each with `os.write` on an unbuffered file,
so every byte counted reached the OS. The current file is closed once it holds `file_max_bytes`; the next record
opens the next number. Before a file is opened, the oldest capture files are deleted until they and a full new file
fit in `total_max_bytes`, so the directory stays within it (give or take the one record that ends each file), old
files from earlier runs included.

A write error (ENOSPC, EIO, EFBIG, EACCES, ...) drops the record and closes the file; the next record opens it
again, or the next number if the failed file already holds bytes of ours, so a half-written line is only ever the
last line of a file. An outage is logged twice, when it starts and when writing works again, never per record.

One writer per directory: it continues after the highest number present when `start()` lists the directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from replica.capture.record import CaptureRecord, capture_file_name, capture_files, encode_record

log = logging.getLogger(__name__)

DROP_REASONS = ("queue_full", "write_error", "closed")
"""Why a record was not written: the queue was full, the write (or, a bug, the encoding) failed, or the writer was
not running (before `start()`, after `close()`)."""

_STOP = object()


@dataclass(frozen=True)
class CaptureStats:
    num_records_written: int
    num_bytes_written: int
    num_files_rotated: int
    num_dropped: dict[str, int]
    """Records dropped, by reason (every one of `DROP_REASONS`)."""


class CaptureWriter:
    """Writes records to `directory`; sizes in bytes; `clock` (seconds) times outages for the log."""

    def __init__(
        self,
        directory: Path,
        *,
        file_max_bytes: int,
        total_max_bytes: int,
        queue_max_records: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < file_max_bytes <= total_max_bytes:
            raise ValueError(f"need 0 < file_max_bytes <= total_max_bytes, got {file_max_bytes}, {total_max_bytes}")
        if queue_max_records < 1:
            raise ValueError(f"queue_max_records must be at least 1, got {queue_max_records}")
        self.directory = directory
        self.file_max_bytes = file_max_bytes
        self.total_max_bytes = total_max_bytes
        self._clock = clock
        self._queue: queue.Queue[object] = queue.Queue(queue_max_records)
        self._thread: threading.Thread | None = None
        self._is_closing = False
        self._is_stop_queued = False
        # Owned by the writer thread.
        self._seq = 0
        self._fd: int | None = None
        self._file_bytes = 0
        self._outage_since_s: float | None = None
        self._num_outage_dropped = 0
        # Each counter has one writing thread: the caller of record() for the first two, the writer thread after.
        self._num_queue_full = 0
        self._num_closed = 0
        self._num_write_errors = 0
        self._num_written = 0
        self._num_bytes = 0
        self._num_rotated = 0

    @property
    def path(self) -> Path:
        """The file the next record goes to."""
        return self.directory / capture_file_name(self._seq)

    def start(self) -> None:
        """Create the directory, pick the number after the highest present, and start the writer thread.

        Raises OSError if the directory cannot be made or listed: a wrong `--capture-dir` fails at startup.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        found = capture_files(self.directory)
        self._seq = found[-1][0] + 1 if found else 1
        # A daemon thread, so a writer stuck in a write (a hung disk) cannot keep the process alive past close().
        self._thread = threading.Thread(target=self._run, name="shoal-capture-writer", daemon=True)
        self._thread.start()

    def record(self, rec: CaptureRecord) -> None:
        """Queue `rec` for writing; drops it (counted) if the queue is full or the writer is not running."""
        if self._thread is None or self._is_closing:
            self._num_closed += 1
            return
        try:
            self._queue.put_nowait(rec)
        except queue.Full:
            self._num_queue_full += 1

    def close(self, timeout_s: float) -> bool:
        """Write what is queued, close the file and stop the thread; False if that took more than `timeout_s`.

        Records arriving after close() are dropped. Calling it again after False waits again.
        """
        self._is_closing = True
        if self._thread is None:
            return True
        deadline_s = time.monotonic() + timeout_s
        if not self._is_stop_queued:
            try:
                self._queue.put(_STOP, timeout=timeout_s)
                self._is_stop_queued = True
            except queue.Full:
                return False
        self._thread.join(max(0.0, deadline_s - time.monotonic()))
        return not self._thread.is_alive()

    def stats(self) -> CaptureStats:
        return CaptureStats(
            num_records_written=self._num_written,
            num_bytes_written=self._num_bytes,
            num_files_rotated=self._num_rotated,
            num_dropped={
                "queue_full": self._num_queue_full,
                "write_error": self._num_write_errors,
                "closed": self._num_closed,
            },
        )

    def _run(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            assert isinstance(item, CaptureRecord)
            try:
                self._write(encode_record(item))
            except OSError as exc:
                self._num_write_errors += 1
                self._on_write_error(exc)
            except Exception:  # a record that cannot be encoded is a bug; the thread must keep serving the rest
                self._num_write_errors += 1
                log.exception("capture: cannot encode a record; dropped")
        self._close_file()

    def _write(self, line: bytes) -> None:
        if self._fd is None:
            self._delete_oldest()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._file_bytes = 0
        view = memoryview(line)
        while view:
            n = os.write(self._fd, view)
            self._file_bytes += n
            view = view[n:]
        self._num_written += 1
        self._num_bytes += len(line)
        if self._outage_since_s is not None:
            log.warning(
                "capture: writing to %s works again after %.1f s; %d records were dropped",
                self.path,
                self._clock() - self._outage_since_s,
                self._num_outage_dropped,
            )
            self._outage_since_s = None
        if self._file_bytes >= self.file_max_bytes:
            self._close_file()
            self._seq += 1
            self._num_rotated += 1

    def _on_write_error(self, exc: OSError) -> None:
        if self._outage_since_s is None:
            log.warning("capture: cannot write %s (%s); dropping records until writing works again", self.path, exc)
            self._outage_since_s = self._clock()
            self._num_outage_dropped = 0
        self._num_outage_dropped += 1
        holds_bytes = self._fd is not None and self._file_bytes > 0
        self._close_file()
        if holds_bytes:
            self._seq += 1  # never append after a partial line

    def _close_file(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)

    def _delete_oldest(self) -> None:
        sizes: list[tuple[Path, int]] = []
        for _, path in capture_files(self.directory):
            with contextlib.suppress(OSError):
                sizes.append((path, path.stat().st_size))
        total_bytes = sum(size for _, size in sizes)
        for path, size in sizes:
            if total_bytes + self.file_max_bytes <= self.total_max_bytes:
                break
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("capture: cannot delete %s to stay under %d bytes: %s", path, self.total_max_bytes, exc)
                continue
            total_bytes -= size
