"""Trace loading: Mooncake's 512-token blocks become chained sub-blocks that keep the prefix structure; arrivals
are jittered with a seed and scaled, in a full sort's order though rows are read lazily; Mooncake and Azure rows
parse as the files say; a tiled trace repeats the trace's shape with fresh blocks."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from router.policy.hashing import hash_tokens
from simulations import traces
from simulations.floor import floor_ttfts
from simulations.traces import (
    MOONCAKE_BLOCK_TOKENS,
    AzureWorkload,
    MooncakeWorkload,
    TraceRow,
    arrivals,
    iter_mooncake,
    prefix_hit_ceiling,
    read_mooncake,
)
from simulations.workload import ListWorkload
from tests.data import AZURE_CODE, MOONCAKE

from .conftest import scenario


def write_trace(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_sub_blocks_keep_the_prefix_structure(tmp_path: Path) -> None:
    trace = write_trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 1200, "output_length": 5, "hash_ids": [1, 2, 3]},
            {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 4]},
            {"timestamp": 7, "input_length": 700, "output_length": 5, "hash_ids": [9, 2]},
        ],
    )
    workload = MooncakeWorkload(trace, block_size=16)
    a, b, c = (list(workload.hashes(row)) for row in read_mooncake(trace))
    per = MOONCAKE_BLOCK_TOKENS // 16
    assert (len(a), len(b), len(c)) == (1200 // 16, 1100 // 16, 700 // 16)
    assert a[: 2 * per] == b[: 2 * per]  # trace blocks 1, 2 shared
    assert a[2 * per] != b[2 * per]  # block 3 vs block 4
    assert not set(c) & set(a)  # block 2 after block 9 is another prefix: nothing shared


@pytest.mark.parametrize("block_size", [16, 128, 512])  # 512: a block per trace block, hashed without the memo
def test_hashes_are_the_routers_over_the_made_up_tokens(tmp_path: Path, block_size: int) -> None:
    trace = write_trace(
        tmp_path / "t.jsonl", [{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [5, 6, 7]}]
    )
    workload = MooncakeWorkload(trace, block_size=block_size)
    request = next(workload.requests())
    assert len(request.hashes) == 1100 // block_size
    tokens = [t for i in range(len(request.hashes)) for t in request.tokens.block_tokens(i)]
    assert list(request.hashes) == hash_tokens(tokens, workload.seed_bytes, block_size)


def jittered(rows: list[TraceRow], *, speed: float, seed: int, jitter_s: float = 0.001) -> list[tuple[float, int]]:
    return [(arrival_s, i) for arrival_s, i, _ in arrivals(rows, speed=speed, jitter_s=jitter_s, seed=seed)]


def test_jitter_is_seeded_stays_within_the_bucket_and_speed_scales() -> None:
    rows = [TraceRow(timestamp_s=t, input_tokens=10, output_tokens=1) for t in (0.0, 0.0, 0.001, 5.0)]
    first = jittered(rows, speed=1.0, seed=3)
    assert first == jittered(rows, speed=1.0, seed=3)
    assert first != jittered(rows, speed=1.0, seed=4)
    for arrival_s, i in first:
        assert rows[i].timestamp_s <= arrival_s < rows[i].timestamp_s + 0.001
    doubled = jittered(rows, speed=2.0, seed=3)
    assert [a for a, _ in doubled] == pytest.approx([a / 2 for a, _ in first])


@pytest.mark.parametrize("jitter_s", [0.001, 0.05])
def test_lazy_arrivals_come_in_a_full_sorts_order(jitter_s: float) -> None:
    # Many rows a bucket, and a jitter wider than the buckets: rows overtake each other across several buckets.
    stamps = sorted(random.Random(0).randrange(0, 40) / 1000 for _ in range(500))
    rows = [TraceRow(timestamp_s=t, input_tokens=10, output_tokens=1) for t in stamps]
    rng = random.Random(9)
    expected = sorted(((t + rng.random() * jitter_s) / 1.5, i) for i, t in enumerate(stamps))
    assert jittered(rows, speed=1.5, seed=9, jitter_s=jitter_s) == expected
    assert expected != sorted(expected, key=lambda pair: pair[1])  # the jitter did reorder rows


def test_arrivals_hold_only_the_rows_the_jitter_can_reorder() -> None:
    held: list[int] = []
    stream_read = 0

    def stream() -> Iterator[TraceRow]:
        nonlocal stream_read
        for i in range(1000):
            stream_read = i + 1
            yield TraceRow(timestamp_s=i * 0.01, input_tokens=10, output_tokens=1)

    for _, i, _ in arrivals(stream(), speed=1.0, jitter_s=0.001, seed=0):
        held.append(stream_read - i)  # rows read but not yet given out, this one included
    assert len(held) == 1000
    assert max(held) <= 2


def test_rows_out_of_time_order_are_refused() -> None:
    rows = [TraceRow(timestamp_s=t, input_tokens=10, output_tokens=1) for t in (0.0, 2.0, 1.0)]
    with pytest.raises(ValueError, match=r"row 2 at 1\.0 s"):
        jittered(rows, speed=1.0, seed=0)


def test_a_limit_stops_reading_the_file(tmp_path: Path) -> None:
    lines = MOONCAKE.read_text().splitlines()[:20]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(lines) + "\nnot json: a read past the limit fails here\n")
    workload = MooncakeWorkload(trace, limit=20)
    assert len(workload) == 20
    assert len(list(workload.requests())) == 20
    with pytest.raises(json.JSONDecodeError):
        list(MooncakeWorkload(trace).requests())


def test_workload_requests_are_the_same_on_every_call() -> None:
    workload = MooncakeWorkload(MOONCAKE, limit=100, seed=5)
    first = [(r.id, r.arrival_s, list(r.hashes)) for r in workload.requests()]
    assert first == [(r.id, r.arrival_s, list(r.hashes)) for r in workload.requests()]
    assert len(first) == len(workload) == 100
    assert [a for _, a, _ in first] == sorted(a for _, a, _ in first)
    assert sum(1 for _ in iter_mooncake(MOONCAKE)) == 400


def test_mooncake_rows_are_the_files_lines_in_seconds() -> None:
    rows = read_mooncake(MOONCAKE)
    lines = [json.loads(line) for line in MOONCAKE.read_text().splitlines()]
    assert len(rows) == len(lines) == 400
    for row, line in zip(rows, lines, strict=True):
        assert row.timestamp_s == line["timestamp"] / 1000
        assert (row.input_tokens, row.output_tokens) == (line["input_length"], line["output_length"])
        assert list(row.hash_ids) == line["hash_ids"]
    assert 0.05 < prefix_hit_ceiling(rows) < 0.06  # the slice's; the full trace's 0.651 is benchmarks/trace_facts.py's


def test_azure_rows_parse_and_prompts_share_nothing() -> None:
    workload = AzureWorkload(AZURE_CODE, limit=50)
    requests = list(workload.requests())
    assert len(requests) == 50
    assert requests[0].arrival_s == 0.0
    assert all(b.arrival_s >= a.arrival_s for a, b in itertools.pairwise(requests))
    assert requests[0].prompt_tokens == 4808 and requests[0].output_tokens == 10
    hashes = [h for r in requests for h in r.hashes]
    assert len(hashes) == len(set(hashes))


def test_tiles_repeat_the_traces_shape_with_fresh_blocks_a_period_later() -> None:
    base = MooncakeWorkload(MOONCAKE, limit=60, jitter_s=0.0)
    rows = read_mooncake(MOONCAKE)
    tiled = MooncakeWorkload(MOONCAKE, tiles=3, jitter_s=0.0)
    assert len(tiled) == 1200
    period_s = rows[-1].timestamp_s * 400 / 399  # span plus the mean gap; the trace starts at 0
    head = list(base.requests())
    requests = list(tiled.requests())
    for k in range(3):
        copy = [r for r in requests if k * 400 <= r.id < k * 400 + 60]
        assert [r.id - k * 400 for r in copy] == [r.id for r in head]
        assert [r.arrival_s for r in copy] == pytest.approx([r.arrival_s + k * period_s for r in head])
        assert [r.prompt_tokens for r in copy] == [r.prompt_tokens for r in head]
        if k:
            assert not {h for r in copy for h in r.hashes} & {h for r in head for h in r.hashes}
    # Each copy shares prefixes within itself exactly as the trace does, and with no other copy.
    engine, model, _ = scenario().fleet.resolve()
    once, hit_once = floor_ttfts(MooncakeWorkload(MOONCAKE, jitter_s=0.0), engine, model)
    thrice, hit_thrice = floor_ttfts(tiled, engine, model)
    assert hit_once > 0.05 and hit_thrice == hit_once
    assert list(thrice) == list(once) * 3


class CountingReads(MooncakeWorkload):
    """Counts the passes over the file."""

    num_reads = 0

    def read(self) -> Iterator[TraceRow]:
        self.num_reads += 1
        return super().read()


def test_a_short_tiled_trace_is_parsed_once_per_replay_and_a_long_one_once_per_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kept = CountingReads(MOONCAKE, tiles=3)
    replay = [(r.id, r.arrival_s, list(r.hashes)) for r in kept.requests()]
    assert len(replay) == 1200
    assert kept.num_reads == 2  # its shape, then the rows every copy replays
    monkeypatch.setattr(traces, "TILE_CACHE_ROWS", 399)  # the slice has 400 rows
    reread = CountingReads(MOONCAKE, tiles=3)
    assert [(r.id, r.arrival_s, list(r.hashes)) for r in reread.requests()] == replay
    assert reread.num_reads == 1 + 3


def test_tiling_to_a_request_count_cuts_the_last_copy() -> None:
    tiled = AzureWorkload(AZURE_CODE, tiles=None, limit=1234)
    requests = list(tiled.requests())
    assert len(tiled) == len(requests) == 1234
    assert requests[-1].id == 1233
    assert all(b.arrival_s >= a.arrival_s for a, b in itertools.pairwise(requests))
    hashes = [h for r in requests for h in r.hashes]
    assert len(hashes) == len(set(hashes))  # copies of an Azure trace share nothing either
    assert "tiled to 1,234 requests" in tiled.name
    with pytest.raises(ValueError, match="needs a limit"):
        MooncakeWorkload(MOONCAKE, tiles=None)


@pytest.mark.parametrize(("jitter_s", "speed"), [(0.001, 1.0), (40.0, 2.5)])
def test_the_floor_of_a_tiled_trace_forgets_each_finished_copy_and_finds_the_same_hits(
    jitter_s: float, speed: float
) -> None:
    tiled = MooncakeWorkload(MOONCAKE, tiles=None, limit=1000, jitter_s=jitter_s, speed=speed, seed=3)
    requests = list(tiled.requests())
    assert {tiled.copy_of(r) for r in requests} == {0, 1, 2}
    for r in requests:
        assert r.arrival_s <= tiled.copy_end_s(tiled.copy_of(r))
    if jitter_s > 1:  # copies overlap in time: the floor holds two copies' blocks at once
        assert any(tiled.copy_of(a) > tiled.copy_of(b) for a, b in itertools.pairwise(requests))
    engine, model, _ = scenario().fleet.resolve()
    by_copy = floor_ttfts(tiled, engine, model)
    one_cache = floor_ttfts(ListWorkload(requests, block_size=16, seed_bytes=tiled.seed_bytes), engine, model)
    assert list(by_copy[0]) == list(one_cache[0]) and by_copy[1] == one_cache[1] > 0.05
    assert MooncakeWorkload(MOONCAKE).copy_end_s(0) == float("inf")
