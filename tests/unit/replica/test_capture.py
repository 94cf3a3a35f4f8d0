"""Capture files on a real file system: exact round trips, rotation and the size cap, numbering after old files,
truncated and invalid lines, no text unless asked, a full disk (/dev/full) and a stalled one (a FIFO nobody reads).

State the writer thread reaches is awaited by polling with a deadline, never by a bare sleep."""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import logging
import os
import termios
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from replica.capture import (
    CaptureRecord,
    CaptureSource,
    CaptureWriter,
    ReadCounts,
    encode_record,
    fingerprint_model,
    fingerprint_tokenizer,
    iter_captures,
)
from replica.capture.fingerprint import EDGE_DIGEST_BYTES, FULL_DIGEST_MAX_BYTES
from replica.engine.sampling import SamplingParams

MiB = 1024**2


def make_record(i: int = 0, **overrides: object) -> CaptureRecord:
    values: dict[str, object] = {
        "request_id": f"cmpl-{i:03d}",  # fixed width: every line of make_record is as long
        "endpoint": "completions",
        "model": "shoal-demo",
        "model_hash": "m" * 64,
        "tokenizer_hash": "t" * 64,
        "prompt_token_ids": [0, 1, 2**31 - 1, 151_643, 100 + i],
        "output_token_ids": [7, 0, 151_645],
        "params": {"temperature": 0.0, "max_tokens": 3, "seed": None, "stop_token_ids": [2]},
        "constrained": None,
        "finish_reason": "length",
        "num_cached_tokens": 16,
        "arrival_unix_s": 1_700_000_000.123456,
        "ttft_s": 0.0125,
        "e2e_s": 0.5,
    }
    values.update(overrides)
    return CaptureRecord(**values)  # type: ignore[arg-type]


def writer_for(directory: Path, **overrides: int) -> CaptureWriter:
    sizes = {"file_max_bytes": MiB, "total_max_bytes": 8 * MiB, "queue_max_records": 64, **overrides}
    return CaptureWriter(directory, **sizes)


def wait_for(predicate: Callable[[], bool], *, timeout_s: float = 5.0, what: str = "condition") -> None:
    deadline_s = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline_s:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.005)


def test_records_round_trip_exactly_with_ids_as_json_integers(tmp_path: Path) -> None:
    records = [
        make_record(0),
        make_record(1, endpoint="chat", ttft_s=None, finish_reason="abort", output_token_ids=[]),
        make_record(2, prompt_text="こんにちは\n", output_text="", constrained="json_schema"),
    ]
    writer = writer_for(tmp_path)
    writer.start()
    for rec in records:
        writer.record(rec)
    assert writer.close(timeout_s=5)

    assert list(iter_captures(tmp_path)) == records
    (path,) = tmp_path.iterdir()
    assert path.name == "capture-00000001.jsonl"
    lines = path.read_bytes().splitlines()
    assert lines[0].startswith(b'{"v":1,')
    assert b'"prompt_token_ids":[0,1,2147483647,151643,100]' in lines[0]
    assert b"prompt_text" not in lines[0] and b"output_text" not in lines[0]  # absent, not null
    stats = writer.stats()
    assert stats.num_records_written == 3
    assert stats.num_bytes_written == path.stat().st_size
    assert stats.num_dropped == {"queue_full": 0, "write_error": 0, "closed": 0}


def test_rotates_at_file_max_bytes_and_deletes_the_oldest_files_beyond_the_total(tmp_path: Path) -> None:
    line_bytes = len(encode_record(make_record(0)))
    (tmp_path / "capture-00000001.jsonl").write_bytes(encode_record(make_record(999)) * 3)  # an earlier run's
    writer = writer_for(tmp_path, file_max_bytes=3 * line_bytes, total_max_bytes=10 * line_bytes)
    writer.start()
    for i in range(20):
        writer.record(make_record(i))
    assert writer.close(timeout_s=5)

    # 3 records a file: files 2..7 rotated full, file 8 holds records 18 and 19. Before each file is opened, only
    # what leaves room for a full one stays (10 - 3 lines: two full files).
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["capture-00000006.jsonl", "capture-00000007.jsonl", "capture-00000008.jsonl"]
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= 10 * line_bytes
    assert [r.request_id for r in iter_captures(tmp_path)] == [f"cmpl-{i:03d}" for i in range(12, 20)]
    stats = writer.stats()
    assert stats.num_files_rotated == 6
    assert stats.num_records_written == 20


def test_a_new_writer_continues_after_the_highest_existing_file(tmp_path: Path) -> None:
    old = tmp_path / "capture-00000007.jsonl"
    old.write_bytes(encode_record(make_record(0)))
    (tmp_path / "capture-00000003.jsonl").write_bytes(encode_record(make_record(1)))
    (tmp_path / "notes.txt").write_text("not a capture file")
    before = old.read_bytes()

    writer = writer_for(tmp_path)
    writer.start()
    writer.record(make_record(2))
    assert writer.close(timeout_s=5)

    assert old.read_bytes() == before
    assert (tmp_path / "capture-00000008.jsonl").read_bytes() == encode_record(make_record(2))
    assert [r.request_id for r in iter_captures(tmp_path)] == ["cmpl-001", "cmpl-000", "cmpl-002"]


def test_reader_tolerates_a_truncated_last_line_and_skips_invalid_lines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = [encode_record(make_record(i)) for i in range(3)]
    invalid = [
        b"not json\n",
        b"[1, 2]\n",
        encode_record(make_record(9)).replace(b'"v":1', b'"v":2'),
        encode_record(make_record(9)).replace(b"[0,1,", b"[0.0,1,"),  # a float is not a token id
        encode_record(make_record(9)).replace(b'"model":"shoal-demo",', b""),
    ]
    (tmp_path / "capture-00000001.jsonl").write_bytes(good[0] + b"".join(invalid) + good[1])
    (tmp_path / "capture-00000002.jsonl").write_bytes(good[2] + good[2][: len(good[2]) // 2])
    counts = ReadCounts()
    with caplog.at_level(logging.WARNING):
        records = list(iter_captures(tmp_path, counts=counts))
    assert [r.request_id for r in records] == ["cmpl-000", "cmpl-001", "cmpl-002"]
    assert counts == ReadCounts(num_files=2, num_records=3, num_truncated_lines=1, num_invalid_lines=5)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "skipped 5 lines" in warnings[0], warnings


def _request_record(source: CaptureSource) -> CaptureRecord:
    return source.record(
        request_id="chatcmpl-1",
        endpoint="chat",
        prompt_token_ids=[11, 12, 13],
        output_token_ids=[14, 15],
        params=SamplingParams(max_tokens=2, stop=("Marmalade", "quokka")),
        finish_reason="stop",
        num_cached_tokens=0,
        arrival_unix_s=1.0,
        ttft_s=0.1,
        e2e_s=0.2,
        prompt_text="<|im_start|>user\nWhere is the Zanzibar invoice?<|im_end|>\n",
        output_text="The Zanzibar invoice left on Tuesday",
    )


@pytest.mark.parametrize("keep_text", [False, True])
def test_text_reaches_the_files_only_with_capture_text_full(tmp_path: Path, keep_text: bool) -> None:
    source = CaptureSource(model="shoal-demo", model_hash="m", tokenizer_hash="t", keep_text=keep_text)
    writer = writer_for(tmp_path)
    writer.start()
    writer.record(_request_record(source))
    assert writer.close(timeout_s=5)

    data = b"".join(p.read_bytes() for p in tmp_path.iterdir())
    words = [b"Zanzibar", b"invoice", b"Tuesday", b"Marmalade", b"quokka", b"user"]
    assert [w for w in words if w in data] == (words if keep_text else [])
    (rec,) = iter_captures(tmp_path)
    assert rec.params["num_stop_strings"] == 2
    assert rec.params.get("stop") == (["Marmalade", "quokka"] if keep_text else None)
    assert (rec.prompt_text is not None, rec.output_text is not None) == (keep_text, keep_text)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_drops_and_counts_logs_once_and_recovers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    writer = writer_for(tmp_path)
    writer.start()
    full = tmp_path / "capture-00000001.jsonl"
    full.symlink_to("/dev/full")  # every write fails with ENOSPC
    with caplog.at_level(logging.WARNING, logger="replica.capture.writer"):
        for i in range(5):
            writer.record(make_record(i))
        wait_for(lambda: writer.stats().num_dropped["write_error"] == 5, what="5 failed writes")
        assert writer.stats().num_records_written == 0
        outages = [r.getMessage() for r in caplog.records if "cannot write" in r.getMessage()]
        assert len(outages) == 1 and "No space left" in outages[0], outages

        full.unlink()  # the disk has room again
        for i in range(5, 8):
            writer.record(make_record(i))
        wait_for(lambda: writer.stats().num_records_written == 3, what="writes to work again")
        assert writer.close(timeout_s=5)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("cannot write" in m for m in messages) == 1
    recoveries = [m for m in messages if "works again after" in m]
    assert len(recoveries) == 1 and "5 records were dropped" in recoveries[0], recoveries
    assert [r.request_id for r in iter_captures(tmp_path)] == ["cmpl-005", "cmpl-006", "cmpl-007"]
    assert writer.stats().num_dropped == {"queue_full": 0, "write_error": 5, "closed": 0}


@pytest.mark.skipif(not hasattr(fcntl, "F_SETPIPE_SZ"), reason="needs Linux pipes")
def test_a_stalled_disk_never_blocks_record_and_drops_beyond_the_queue(tmp_path: Path) -> None:
    queue_max_records = 4
    writer = writer_for(tmp_path, queue_max_records=queue_max_records)
    writer.start()
    fifo = tmp_path / "capture-00000001.jsonl"
    os.mkfifo(fifo)
    read_fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader that does not read: the disk is stuck
    drained = bytearray()
    try:
        pipe_bytes = fcntl.fcntl(read_fd, fcntl.F_SETPIPE_SZ, 4096)
        big = make_record(0, prompt_token_ids=list(range(100_000, 100_000 + pipe_bytes // 4)))
        assert len(encode_record(big)) > pipe_bytes  # one record cannot fit: its write blocks
        writer.record(big)

        def pipe_is_full() -> bool:
            return int.from_bytes(fcntl.ioctl(read_fd, termios.FIONREAD, b"\0" * 4), "little") == pipe_bytes

        wait_for(pipe_is_full, what="the writer thread to block in its write")

        durations_s = []
        for i in range(1, 201):
            start_s = time.perf_counter()
            writer.record(replace(big, request_id=f"cmpl-{i:03d}"))
            durations_s.append(time.perf_counter() - start_s)
        assert max(durations_s) < 0.01, max(durations_s)
        assert writer.stats().num_dropped["queue_full"] == 200 - queue_max_records
        assert not writer.close(timeout_s=0.05)  # still stuck: close gives up instead of hanging

        os.set_blocking(read_fd, True)

        def drain() -> None:
            while chunk := os.read(read_fd, 1 << 16):  # until the writer closes its end
                drained.extend(chunk)

        reader = threading.Thread(target=drain)
        reader.start()
        assert writer.close(timeout_s=10)
        reader.join(timeout=10)
        assert not reader.is_alive()
    finally:
        os.close(read_fd)
    expected = [encode_record(replace(big, request_id=f"cmpl-{i:03d}")) for i in range(1 + queue_max_records)]
    assert bytes(drained) == b"".join(expected)  # the one in the pipe, then the queue, in order
    stats = writer.stats()
    assert stats.num_records_written == 1 + queue_max_records
    assert stats.num_dropped == {"queue_full": 200 - queue_max_records, "write_error": 0, "closed": 0}
    writer.record(big)
    assert writer.stats().num_dropped["closed"] == 1
    assert list(iter_captures(tmp_path)) == []  # the reader skips the FIFO rather than hang on it
    fifo.unlink()


def test_fingerprints_cover_config_names_sizes_and_contents(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    (tmp_path / "model-00001.safetensors").write_bytes(b"a" * 1000)
    (tmp_path / "model-00002.safetensors").write_bytes(b"b" * 1000)
    (tmp_path / "tokenizer.json").write_text('{"model": {}}')
    base = fingerprint_model(tmp_path)
    assert len(base) == 64 and base == fingerprint_model(tmp_path)
    assert fingerprint_tokenizer(tmp_path / "tokenizer.json") == hashlib.sha256(b'{"model": {}}').hexdigest()

    def changed(edit: Callable[[], None]) -> bool:
        edit()
        return fingerprint_model(tmp_path) != base

    assert changed(lambda: (tmp_path / "model-00002.safetensors").write_bytes(b"b" * 999 + b"c"))
    (tmp_path / "model-00002.safetensors").write_bytes(b"b" * 1000)
    assert fingerprint_model(tmp_path) == base
    assert changed(lambda: (tmp_path / "config.json").write_text('{"hidden_size": 65}'))
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    assert changed(lambda: (tmp_path / "model-00002.safetensors").rename(tmp_path / "model-00003.safetensors"))


def test_a_large_weight_file_is_fingerprinted_by_its_ends(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    weights = tmp_path / "model.safetensors"
    with weights.open("wb") as f:
        f.truncate(FULL_DIGEST_MAX_BYTES + 1)  # sparse: no disk is used
    base = fingerprint_model(tmp_path)

    def poke(offset: int) -> str:
        with weights.open("r+b") as f:
            f.seek(offset)
            f.write(b"\1")
        return fingerprint_model(tmp_path)

    middle = poke(FULL_DIGEST_MAX_BYTES // 2)
    assert middle == base  # not read: startup does not hash hundreds of GB
    head = poke(EDGE_DIGEST_BYTES - 1)
    assert head != middle
    assert poke(FULL_DIGEST_MAX_BYTES) != head  # the last byte


def test_writer_settings_are_checked() -> None:
    from replica.settings import ReplicaSettings

    with pytest.raises(ValueError, match="file_max_bytes"):
        CaptureWriter(Path("unused"), file_max_bytes=2, total_max_bytes=1, queue_max_records=1)
    with pytest.raises(ValueError, match="capture_file_max_bytes"):
        ReplicaSettings(capture_file_max_bytes=2, capture_total_max_bytes=1)


def test_cli_flags_set_the_capture_settings(tmp_path: Path) -> None:
    from replica.cli import _settings_from_args, add_replica_command

    parser = argparse.ArgumentParser()
    add_replica_command(parser.add_subparsers())
    args = parser.parse_args(["replica", "--capture-dir", str(tmp_path), "--capture-text", "full"])
    settings = _settings_from_args(args)
    assert (settings.capture_dir, settings.capture_text) == (tmp_path, "full")
    default = _settings_from_args(parser.parse_args(["replica"]))
    assert (default.capture_dir, default.capture_text) == (None, "none")
