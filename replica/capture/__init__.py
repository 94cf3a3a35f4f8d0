"""Capture of served requests: their raw prompt and output token ids, for training a speculative drafter.

Opt-in (`shoal replica --capture-dir DIR`). The server builds one `CaptureRecord` per finished or aborted request
(`CaptureSource.record`, which drops text unless `capture_text="full"`) and hands it to `CaptureWriter.record`, which
never blocks the serving path: a writer thread appends JSON lines to numbered, size-capped files and counts what it
had to drop. `iter_captures` reads them back in order. Nothing here imports torch.
"""

from replica.capture.fingerprint import fingerprint_model, fingerprint_tokenizer
from replica.capture.reader import ReadCounts, iter_captures
from replica.capture.record import CaptureRecord, CaptureSource, decode_record, encode_record
from replica.capture.writer import DROP_REASONS, CaptureStats, CaptureWriter

__all__ = [
    "DROP_REASONS",
    "CaptureRecord",
    "CaptureSource",
    "CaptureStats",
    "CaptureWriter",
    "ReadCounts",
    "decode_record",
    "encode_record",
    "fingerprint_model",
    "fingerprint_tokenizer",
    "iter_captures",
]
