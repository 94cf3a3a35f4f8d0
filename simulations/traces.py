"""Real traces as workloads: Mooncake JSONL (with prefix structure) and Azure LLM inference CSV (without).

Mooncake (`timestamp` in ms, `input_length`, `output_length`, `hash_ids`): each hash id names one 512-token block
of the prompt, prefix-chained (equal ids at one position mean an identical prefix up to that block). The simulator
works in blocks of `block_size` tokens (16 by default, the engines' KV block), so trace block `H` at position `i`
becomes `512 / block_size` sub-blocks whose made-up token ids are `[H, j, 0, ...]` for sub-block `j`; their hashes
are chained from the previous sub-block's, so two prompts share sub-blocks exactly as far as they share trace
blocks, and the last, partial trace block of a prompt contributes only its full sub-blocks. Sub-block hashes are
memoised per (parent hash, trace block), since a trace block repeats wherever its prefix does.

Timestamps are whole milliseconds, so requests that arrived within the same millisecond share one; each gets a
seeded uniform offset within its bucket (`jitter_s`, default one bucket), then times are divided by `speed`.

Files are read lazily, on every `requests()` call, and `limit` stops the read: memory follows the requests in
flight, not the trace's length (a tiled trace of up to `TILE_CACHE_ROWS` rows is read once per call and kept).
That needs rows in timestamp order (both public traces are); `arrivals` holds back only the rows a later row's
jitter could still overtake, and a row earlier than its predecessor is an error.

Tiling (`tiles`): a longer input of the same shape, the trace replayed back to back. Copy k arrives k periods
later (a period is the trace's span plus its mean gap between arrivals) and its Mooncake hash ids are shifted by
k x (largest id + 1), so no block of one copy equals a block of another: each copy has the trace's own prefix
sharing, and none with the others. Azure prompts share nothing already (their token runs are named by row index,
which keeps counting across copies).

Azure (`TIMESTAMP`, `ContextTokens`, `GeneratedTokens`): arrivals and lengths only; every prompt is made of its
own tokens, so no two requests share a block (hit ratio 0). Useful for load shape (the code trace is bursty).
"""

from __future__ import annotations

import csv
import heapq
import itertools
import json
import random
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from pathlib import Path

from router.policy.hashing import chain_hashes, namespace_seed
from simulations.workload import ChainState, Request, SegmentTokens, tokens_of

_pack_u32 = struct.Struct("<I").pack

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per `hash_ids` entry in Mooncake's traces."""

TILE_CACHE_ROWS = 50_000
"""Rows of a tiled trace kept in memory, so that its copies after the first are not parsed again (about 62 MB of
Mooncake rows at most: 1,250 bytes a row of the public trace, by tracemalloc); a longer trace is read from its file
for every copy."""

SUB_HASH_MEMO_ENTRIES = 1 << 14
"""Trace blocks whose sub-block hashes a workload keeps (some 1.5 KB each at 16-token blocks): a trace block
repeats wherever its prefix does, mostly within minutes, and the memo must not grow with the trace."""


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One request of a trace file, before time scaling and hashing."""

    timestamp_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class TraceBlockTokens:
    """Made-up token ids of a Mooncake prompt: sub-block `j` of trace block `H` is `[H, j, 0, ...]`."""

    hash_ids: tuple[int, ...]
    block_size: int

    def block_tokens(self, index: int) -> list[int]:
        per_trace_block = MOONCAKE_BLOCK_TOKENS // self.block_size
        trace_block, sub = divmod(index, per_trace_block)
        return [self.hash_ids[trace_block], sub] + [0] * (self.block_size - 2)


def iter_mooncake(path: str | Path) -> Iterator[TraceRow]:
    """The rows of a Mooncake JSONL trace, in file order, read as they are consumed."""
    with Path(path).open() as f:
        for line in f:
            if not line.strip():
                continue
            obj = json.loads(line)
            yield TraceRow(
                timestamp_s=obj["timestamp"] / 1000.0,
                input_tokens=int(obj["input_length"]),
                output_tokens=int(obj["output_length"]),
                hash_ids=tuple(obj["hash_ids"]),
            )


def read_mooncake(path: str | Path) -> list[TraceRow]:
    """The rows of a Mooncake JSONL trace, in file order."""
    return list(iter_mooncake(path))


def iter_azure(path: str | Path) -> Iterator[TraceRow]:
    """The rows of an Azure LLM inference CSV (TIMESTAMP, ContextTokens, GeneratedTokens) in file order, times from
    the first row, read as they are consumed."""
    start: datetime | None = None
    with Path(path).open(newline="") as f:
        for record in csv.DictReader(f):
            stamp = _parse_azure_time(record["TIMESTAMP"])
            if start is None:
                start = stamp
            yield TraceRow(
                timestamp_s=(stamp - start).total_seconds(),
                input_tokens=int(record["ContextTokens"]),
                output_tokens=int(record["GeneratedTokens"]),
            )


def read_azure(path: str | Path) -> list[TraceRow]:
    """The rows of an Azure LLM inference CSV, times from the first row, sorted by time."""
    rows = list(iter_azure(path))
    rows.sort(key=lambda r: r.timestamp_s)
    return rows


def _parse_azure_time(text: str) -> datetime:
    # Seven fractional digits ("18:17:03.9799600"); datetime takes at most six.
    head, _, frac = text.strip().partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}")


def prefix_hit_ceiling(rows: list[TraceRow]) -> float:
    """Fraction of prompt tokens that hit an unbounded cache shared by all requests, in trace blocks: the figure
    the trace's README states (0.651 for the Mooncake synthetic trace)."""
    seen: set[int] = set()
    hit = total = 0
    for row in rows:
        k = 0
        while k < len(row.hash_ids) and row.hash_ids[k] in seen:
            k += 1
        hit += min(k * MOONCAKE_BLOCK_TOKENS, row.input_tokens)
        total += row.input_tokens
        seen.update(row.hash_ids)
    return hit / total if total else 0.0


def arrivals(
    rows: Iterable[TraceRow], *, speed: float, jitter_s: float, seed: int
) -> Iterator[tuple[float, int, TraceRow]]:
    """(arrival in seconds, row index, row) in (arrival, index) order: each timestamp plus a seeded uniform offset in
    [0, jitter_s), all divided by `speed`; the offsets are drawn in row order.

    Rows must come in timestamp order. A row is held until the next row's timestamp reaches its arrival: no later
    row can arrive before that, so the order is a full sort's while only rows within `jitter_s` of the newest wait.
    """
    if speed <= 0:
        raise ValueError(f"speed must be positive, got {speed}")
    rng = random.Random(seed)
    pending: list[tuple[float, int, TraceRow]] = []
    latest_s = float("-inf")
    for i, row in enumerate(rows):
        if row.timestamp_s < latest_s:
            raise ValueError(
                f"trace row {i} at {row.timestamp_s} s comes after one at {latest_s} s: rows must be in time order"
            )
        latest_s = row.timestamp_s
        earliest_s = latest_s / speed  # no row from here on arrives before this
        while pending and pending[0][0] <= earliest_s:
            yield heapq.heappop(pending)
        heapq.heappush(pending, ((latest_s + rng.random() * jitter_s) / speed, i, row))
    while pending:
        yield heapq.heappop(pending)


@dataclass(frozen=True, slots=True)
class TraceShape:
    """What tiling needs to know of a trace, from one pass over it."""

    num_rows: int
    first_s: float
    last_s: float
    num_hash_ids: int
    """Largest hash id + 1 (0 without hash ids): the shift between copies' ids."""

    @property
    def period_s(self) -> float:
        """Seconds from one copy's start to the next: the trace's span plus its mean gap between arrivals (1 s for a
        trace of one row)."""
        span_s = self.last_s - self.first_s
        return span_s * self.num_rows / (self.num_rows - 1) if self.num_rows > 1 else 1.0


def trace_shape(rows: Iterable[TraceRow]) -> TraceShape:
    """The shape of rows in time order, in one pass."""
    num_rows = num_hash_ids = 0
    first_s = last_s = 0.0
    for row in rows:
        if not num_rows:
            first_s = row.timestamp_s
        num_rows += 1
        last_s = row.timestamp_s
        if row.hash_ids:
            num_hash_ids = max(num_hash_ids, max(row.hash_ids) + 1)
    return TraceShape(num_rows, first_s, last_s, num_hash_ids)


def tile_rows(read: Callable[[], Iterator[TraceRow]], shape: TraceShape, tiles: int | None) -> Iterator[TraceRow]:
    """`tiles` copies of the rows `read()` gives (None: without end), back to back (module docstring)."""
    if not shape.num_rows:
        return
    for k in itertools.count() if tiles is None else range(tiles):
        if not k:
            yield from read()
            continue
        shift_s, id_shift = k * shape.period_s, k * shape.num_hash_ids
        for row in read():
            yield TraceRow(
                timestamp_s=row.timestamp_s + shift_s,
                input_tokens=row.input_tokens,
                output_tokens=row.output_tokens,
                hash_ids=tuple([h + id_shift for h in row.hash_ids]),
            )


class _TraceFile:
    """The reading, tiling, counting and arrivals shared by the trace workloads."""

    def __init__(
        self, path: str | Path, *, speed: float, jitter_s: float, seed: int, limit: int | None, tiles: int | None
    ) -> None:
        if speed <= 0:
            raise ValueError(f"speed must be positive, got {speed}")
        if tiles is None and limit is None:
            raise ValueError("a trace tiled without end needs a limit")
        if tiles is not None and tiles < 1:
            raise ValueError(f"tiles must be at least 1, got {tiles}")
        self.path = Path(path)
        self.speed = speed
        self.jitter_s = jitter_s
        self.seed = seed
        self.limit = limit
        self.tiles = tiles
        self._shape: TraceShape | None = None

    def read(self) -> Iterator[TraceRow]:
        """The file's rows, in file order."""
        raise NotImplementedError

    @property
    def tiling(self) -> str:
        """How the trace is tiled, for the workload's name."""
        if self.tiles == 1:
            return ""
        return f" x{self.tiles}" if self.tiles is not None else f" tiled to {self.limit:,} requests"

    def count(self) -> int:
        """The file's rows (overridden where counting lines is cheaper than parsing them)."""
        return self.shape().num_rows

    def shape(self) -> TraceShape:
        if self._shape is None:
            self._shape = trace_shape(self.read())
        return self._shape

    def __len__(self) -> int:
        if self.tiles == 1:
            count = self.count()
        else:
            count = self.shape().num_rows * self.tiles if self.tiles is not None else self.limit or 0
        return count if self.limit is None else min(count, self.limit)

    def rows(self) -> Iterator[TraceRow]:
        """The rows replayed, tiled, in file order."""
        if self.tiles == 1:
            return itertools.islice(self.read(), self.limit)
        read: Callable[[], Iterator[TraceRow]] = self.read
        if self.shape().num_rows <= TILE_CACHE_ROWS:
            read = partial(iter, list(self.read()))  # parsed once; every copy replays the list
        return itertools.islice(tile_rows(read, self.shape(), self.tiles), self.limit)

    def copy_of(self, request: Request) -> int:
        """The copy of the trace a request is from (0 untiled): its row index divided by the trace's row count."""
        return 0 if self.tiles == 1 else request.id // self.shape().num_rows

    def copy_end_s(self, copy: int) -> float:
        """A time no request of the copy arrives after: its last row's, jittered the most (inf untiled)."""
        if self.tiles == 1:
            return float("inf")
        shape = self.shape()
        return (shape.last_s + copy * shape.period_s + self.jitter_s) / self.speed

    def arrivals(self) -> Iterator[tuple[float, int, TraceRow]]:
        return arrivals(self.rows(), speed=self.speed, jitter_s=self.jitter_s, seed=self.seed)


class MooncakeWorkload(_TraceFile):
    """A Mooncake JSONL trace, its 512-token blocks mapped to `block_size`-token sub-blocks."""

    def __init__(
        self,
        path: str | Path,
        *,
        block_size: int = 16,
        speed: float = 1.0,
        jitter_s: float = 0.001,
        seed: int = 0,
        model: str = "mooncake",
        limit: int | None = None,
        tiles: int | None = 1,
    ) -> None:
        """`tiles`: copies of the trace back to back (None: as many as `limit` takes)."""
        if block_size < 2 or MOONCAKE_BLOCK_TOKENS % block_size:
            raise ValueError(f"block_size must divide {MOONCAKE_BLOCK_TOKENS} and be at least 2, got {block_size}")
        super().__init__(path, speed=speed, jitter_s=jitter_s, seed=seed, limit=limit, tiles=tiles)
        self.name = f"mooncake:{Path(path).name}{self.tiling}"
        self.block_size = block_size
        self.seed_bytes = namespace_seed(model)
        self._num_lines: int | None = None
        self._sub_hashes: OrderedDict[tuple[int | None, int], list[int]] = OrderedDict()
        """(parent sub-block hash or None at position 0, trace block id) -> the trace block's sub-block hashes, the
        `SUB_HASH_MEMO_ENTRIES` most recently used."""
        self._sub_block_tails = [
            _pack_u32(j) + bytes(4 * (block_size - 2)) for j in range(MOONCAKE_BLOCK_TOKENS // block_size)
        ]
        """pack_tokens([j, 0, ...]): the bytes of sub-block j after its trace block's id."""

    def read(self) -> Iterator[TraceRow]:
        return iter_mooncake(self.path)

    def count(self) -> int:
        if self._num_lines is None:
            with self.path.open() as f:
                self._num_lines = sum(1 for line in f if line.strip())
        return self._num_lines

    def requests(self) -> Iterator[Request]:
        for arrival_s, i, row in self.arrivals():
            yield Request(
                id=i,
                arrival_s=arrival_s,
                prompt_tokens=row.input_tokens,
                output_tokens=max(1, row.output_tokens),
                hashes=self.hashes(row),
                tokens=TraceBlockTokens(row.hash_ids, self.block_size),
            )

    def hashes(self, row: TraceRow) -> list[int]:
        """Chained hashes of the row's full sub-blocks (`input_tokens // block_size` of them)."""
        per_trace_block = MOONCAKE_BLOCK_TOKENS // self.block_size
        num_blocks = row.input_tokens // self.block_size
        if per_trace_block == 1:  # a block per trace block: one chain, cheaper than the memo's bookkeeping
            heads = [_pack_u32(block) for block in row.hash_ids[:num_blocks]]
            return chain_hashes(heads, self.seed_bytes, tail=self._sub_block_tails[0])
        out: list[int] = []
        parent: int | None = None
        memo = self._sub_hashes
        for trace_block in row.hash_ids:
            if len(out) >= num_blocks:
                break
            key = (parent, trace_block)
            sub = memo.get(key)
            if sub is None:
                sub = memo[key] = self._hash_trace_block(trace_block, parent)
                if len(memo) > SUB_HASH_MEMO_ENTRIES:
                    memo.popitem(last=False)
            else:
                memo.move_to_end(key)
            take = min(per_trace_block, num_blocks - len(out))
            out.extend(sub[:take] if take < per_trace_block else sub)
            parent = out[-1]
        return out

    def _hash_trace_block(self, trace_block: int, parent: int | None) -> list[int]:
        # pack_tokens([trace_block, j, 0, ...]), built directly: this runs for every distinct trace block.
        head = _pack_u32(trace_block)
        return chain_hashes([head + tail for tail in self._sub_block_tails], self.seed_bytes, parent)


class AzureWorkload(_TraceFile):
    """An Azure LLM inference CSV: arrivals and lengths; every prompt is its own (no shared prefixes)."""

    def __init__(
        self,
        path: str | Path,
        *,
        block_size: int = 16,
        speed: float = 1.0,
        jitter_s: float = 0.0,
        seed: int = 0,
        model: str = "azure",
        limit: int | None = None,
        tiles: int | None = 1,
    ) -> None:
        """`tiles`: copies of the trace back to back (None: as many as `limit` takes)."""
        super().__init__(path, speed=speed, jitter_s=jitter_s, seed=seed, limit=limit, tiles=tiles)
        self.name = f"azure:{Path(path).name}{self.tiling}"
        self.block_size = block_size
        self.seed_bytes = namespace_seed(model)

    def read(self) -> Iterator[TraceRow]:
        return iter_azure(self.path)

    def requests(self) -> Iterator[Request]:
        for arrival_s, i, row in self.arrivals():
            segments = ((i, row.input_tokens),)  # segment id = row index: no two prompts share a token run
            tokens = SegmentTokens(segments, self.block_size)
            chain = ChainState(self.seed_bytes, self.block_size)
            chain.extend(tokens_of(segments, 0, row.input_tokens))
            yield Request(
                id=i,
                arrival_s=arrival_s,
                prompt_tokens=row.input_tokens,
                output_tokens=max(1, row.output_tokens),
                hashes=chain.hashes,
                tokens=tokens,
            )
