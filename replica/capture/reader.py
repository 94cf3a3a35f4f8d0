"""`iter_captures(directory)`: every record of a capture directory, in the order it was written.

Files are read in sequence order, lines in file order. The last line of a file may be cut short (a writer killed
mid-line, a disk that filled up): it is counted as truncated, not as an error. Any other line that is not a
version-1 record is skipped, counted, and reported in one warning per file. Only regular files are read, so a
FIFO or a dangling link left where a capture file would be cannot hang or stop the reader; a directory a replica is
still writing to can be read too (a file its size cap deletes meanwhile is skipped).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from replica.capture.record import CaptureRecord, capture_files, decode_record

log = logging.getLogger(__name__)


@dataclass
class ReadCounts:
    """What `iter_captures` has read so far; pass one in to learn what it skipped."""

    num_files: int = 0
    num_records: int = 0
    num_truncated_lines: int = 0
    """Last lines of a file without their newline that are not a record."""
    num_invalid_lines: int = 0
    """Complete lines that are not a version-1 record."""


def iter_captures(directory: Path, *, counts: ReadCounts | None = None) -> Iterator[CaptureRecord]:
    counts = counts if counts is not None else ReadCounts()
    for _, path in capture_files(directory):
        if not path.is_file():
            continue
        try:
            f = path.open("rb")
        except FileNotFoundError:
            continue  # deleted by a live writer's size cap since the listing
        counts.num_files += 1
        num_invalid, first_error = 0, ""
        with f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    record = decode_record(line)
                except ValueError as exc:
                    if not line.endswith(b"\n"):
                        counts.num_truncated_lines += 1
                        log.debug("capture: %s ends in a truncated line", path)
                        continue
                    first_error = first_error or str(exc)
                    num_invalid += 1
                    continue
                counts.num_records += 1
                yield record
        if num_invalid:
            counts.num_invalid_lines += num_invalid
            log.warning(
                "capture: skipped %d lines of %s that are not capture records; the first: %s",
                num_invalid,
                path,
                first_error,
            )
