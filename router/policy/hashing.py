"""Chained block hashes: the one hash of the project (DESIGN.md, contract 1).

A prompt is cut into full blocks of units: token ids in token mode (packed as little-endian uint32), or the
UTF-8 bytes of the routing text in text mode. Each block's hash covers its whole prefix:

    h[0] = xxh3_64(seed + block[0])
    h[i] = xxh3_64(h[i-1].to_bytes(8, "little") + block[i])

so two prompts share hash i exactly when they share blocks 0..i, and a prefix match is a walk over the request's
hashes until the first miss. The seed namespaces the model (and LoRA adapter), so requests for different models
never share a hash. A trailing partial block is never hashed: engines cache only full blocks.

The replica's KV cache and the simulator call these functions too; `tests/unit/test_hashing.py` pins exact
values so that all three stay in agreement.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from struct import Struct

import xxhash

DEFAULT_TOKEN_BLOCK_SIZE = 16
"""Tokens per block in token mode: vLLM's and SGLang's default KV block size (exact mode needs them equal)."""

DEFAULT_TEXT_BLOCK_SIZE = 64
"""Bytes per block in text mode: about 16 tokens of English text at ~4 bytes per token."""

_xxh3 = xxhash.xxh3_64_intdigest
_pack_u64 = Struct("<Q").pack

_BLOCKS_PER_CUT = 64
"""Blocks cut from the data by one `struct.unpack_from` call (one compiled format per block width, kept in
`struct`'s own format cache)."""


def namespace_seed(model: str, adapter: str | None = None) -> bytes:
    """Seed bytes for a model and, optionally, a LoRA adapter served on it.

    The NUL separator keeps ("a", "bc") and ("ab", "c") apart.
    """
    if adapter:
        return f"{model}\x00{adapter}".encode()
    return model.encode()


def chain_hashes(blocks: Sequence[bytes], seed: bytes, parent_hash: int | None = None, tail: bytes = b"") -> list[int]:
    """Hash already-cut blocks, each followed by `tail` (blocks that differ only in their first bytes, as the
    simulator's made-up prompts, need not be built whole); the first chains from `parent_hash` when given, else
    from `seed`."""
    out: list[int] = []
    if not blocks:
        return out
    append = out.append
    head = seed if parent_hash is None else _pack_u64(parent_hash)
    prev = _xxh3(head + blocks[0] + tail)
    append(prev)
    for i in range(1, len(blocks)):
        prev = _xxh3(_pack_u64(prev) + blocks[i] + tail)
        append(prev)
    return out


def _extend_chain(out: list[int], data: bytes | bytearray, start: int, num_blocks: int, width: int, prev: int) -> None:
    """Append to `out` the hashes of `num_blocks` blocks of `width` bytes of `data` from byte `start`, chained
    from the block hash `prev`.

    The hot loop of the project: one `Struct.pack` of (prev, block) and one `xxh3_64` call per block, the blocks
    cut 64 at a time by one `unpack_from`, which is about twice as fast as slicing and concatenating per block.
    """
    pack = Struct(f"<Q{width}s").pack
    append = out.append
    end = start + num_blocks * width
    cut_bytes = _BLOCKS_PER_CUT * width
    for cut in range(start, end, cut_bytes):
        count = min(_BLOCKS_PER_CUT, (end - cut) // width)
        for block in struct.unpack_from(f"{width}s" * count, data, cut):
            prev = _xxh3(pack(prev, block))
            append(prev)


def _hash_blocks(data: bytes, width: int, num_blocks: int, seed: bytes, parent_hash: int | None) -> list[int]:
    """Hashes of the first `num_blocks` blocks of `width` bytes of `data`, from `parent_hash` or `seed`."""
    if num_blocks <= 0:
        return []
    head = seed if parent_hash is None else _pack_u64(parent_hash)
    out = [_xxh3(head + data[:width])]
    _extend_chain(out, data, width, num_blocks - 1, width, out[0])
    return out


def _num_blocks(num_units: int, block_size: int, max_blocks: int | None) -> int:
    """Full blocks of `block_size` units in `num_units`, at most `max_blocks`."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_blocks = num_units // block_size
    return num_blocks if max_blocks is None else min(num_blocks, max_blocks)


def hash_text(
    data: bytes,
    seed: bytes,
    block_size: int = DEFAULT_TEXT_BLOCK_SIZE,
    max_blocks: int | None = None,
) -> list[int]:
    """Block hashes of routing text (its UTF-8 bytes); at most `max_blocks` when given."""
    return _hash_blocks(data, block_size, _num_blocks(len(data), block_size, max_blocks), seed, None)


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (raises OverflowError for ids outside [0, 2**32))."""
    if isinstance(token_ids, list):
        packed = array("I")
        packed.fromlist(token_ids)  # twice as fast as array("I", token_ids) on a list
    else:
        packed = array("I", token_ids)
    if packed.itemsize != 4:  # pragma: no cover - every supported platform has a 4-byte "I"
        packed = array("L", token_ids)
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return packed.tobytes()


def hash_tokens(
    token_ids: Sequence[int],
    seed: bytes,
    block_size: int = DEFAULT_TOKEN_BLOCK_SIZE,
    parent_hash: int | None = None,
    max_blocks: int | None = None,
) -> list[int]:
    """Block hashes of token ids; chains from `parent_hash` (a KV event's parent) when given."""
    num_blocks = _num_blocks(len(token_ids), block_size, max_blocks)
    if num_blocks == 0:
        return []
    return _hash_blocks(
        pack_tokens(_head(token_ids, num_blocks * block_size)), 4 * block_size, num_blocks, seed, parent_hash
    )


def _head(token_ids: Sequence[int], num_tokens: int) -> Sequence[int]:
    """The first `num_tokens` ids, without a copy when that is all of them."""
    return token_ids if len(token_ids) == num_tokens else token_ids[:num_tokens]


class ChainMemo:
    """A bounded memo of block-hash chains, keyed by prefix checkpoints, so shared prefixes are hashed once.

    Traffic repeats prefixes: every turn of a conversation resends the whole conversation, and system prompts
    and tool definitions open many requests. Hashing costs the router one Python-level step per block, so a
    32 KiB prompt costs some 80-150 microseconds. The memo cuts a prompt into chunks of `checkpoint_blocks`
    blocks and names each chunk by a coarse chain over chunks: one `xxh3_64` call over the chunk's bytes, with
    the previous chunk's name (for the first chunk, the hash of the seed) as xxh3's integer seed, so a name
    stands for the seed and the whole prefix up to the chunk's end. Since the fine hashes of a chunk depend on
    exactly that (the fine chain state before it, and its bytes), the memo maps the coarse name to the chunk's
    fine hashes. A cached chunk costs one hash call and one look-up instead of a step per block; the output is
    identical to `hash_text` / `hash_tokens` (tests hold them equal). A chunk is stored on its second sighting
    only, so prompts never seen again cost little more than hashing them directly; chunks that miss in a row
    are hashed in one pass.

    Not thread-safe; the router keeps one per process. Memory, with 64-block chunks: about 2.9 KiB per stored
    chunk (47 MiB at the default 16,384), and about 180 bytes per chunk seen once (up to `4 * max_entries` of them).
    """

    def __init__(self, checkpoint_blocks: int = 64, max_entries: int = 16384) -> None:
        if checkpoint_blocks <= 0 or max_entries < 0:
            raise ValueError("checkpoint_blocks must be positive and max_entries not negative")
        self.checkpoint_blocks = checkpoint_blocks
        self.max_entries = max_entries
        self._chunks: OrderedDict[tuple[int, int], tuple[int, ...]] = OrderedDict()
        """Stored chunks' fine hashes, as tuples of the int objects themselves: a hit extends a prompt's hashes by
        reference, where an `array("Q")` (a quarter of the memory) made a new int object per block (the hash
        column of `benchmarks/bench_routing.py --baseline` measures the difference)."""
        self._seen: OrderedDict[tuple[int, int], None] = OrderedDict()
        """Chunks seen once and not stored yet; a second sighting stores them."""
        self.max_seen = 4 * max_entries
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._chunks)

    def chain_text(
        self, data: bytes, seed: bytes, block_size: int = DEFAULT_TEXT_BLOCK_SIZE, max_blocks: int | None = None
    ) -> PromptChain:
        """The block hashes of `hash_text(data, seed, block_size, max_blocks)`, computed on demand."""
        return PromptChain(self, data, None, block_size, seed, _num_blocks(len(data), block_size, max_blocks))

    def chain_tokens(
        self,
        token_ids: Sequence[int],
        seed: bytes,
        block_size: int = DEFAULT_TOKEN_BLOCK_SIZE,
        max_blocks: int | None = None,
        packed: bytes | None = None,
    ) -> PromptChain:
        """The block hashes of `hash_tokens(token_ids, seed, block_size, max_blocks=max_blocks)`, computed on
        demand; the ids are packed as far as the hashes need them, unless `packed` (`pack_tokens(token_ids)`)
        is given."""
        num_blocks = _num_blocks(len(token_ids), block_size, max_blocks)
        if packed is not None:
            return PromptChain(self, packed, None, 4 * block_size, seed, num_blocks)
        return PromptChain(self, b"", token_ids, 4 * block_size, seed, num_blocks)

    def hash_text(
        self, data: bytes, seed: bytes, block_size: int = DEFAULT_TEXT_BLOCK_SIZE, max_blocks: int | None = None
    ) -> list[int]:
        """Exactly `hash_text(data, seed, block_size, max_blocks)`."""
        return self.chain_text(data, seed, block_size, max_blocks).complete()

    def hash_tokens(
        self,
        token_ids: Sequence[int],
        seed: bytes,
        block_size: int = DEFAULT_TOKEN_BLOCK_SIZE,
        max_blocks: int | None = None,
    ) -> list[int]:
        """Exactly `hash_tokens(token_ids, seed, block_size, max_blocks=max_blocks)`."""
        return self.chain_tokens(token_ids, seed, block_size, max_blocks).complete()

    def _admit(self, missed: list[tuple[int, int]], hashes: list[int], first: int) -> None:
        """Count the `missed` chunks, whose fine hashes start at `hashes[first]`, and store those seen before."""
        chunks = self._chunks
        seen = self._seen
        per_chunk = self.checkpoint_blocks
        for i, key in enumerate(missed):
            self.misses += 1
            # Admission on second sight: a chunk is stored only when seen before, so one-off prompts cost a
            # cheap key, not a stored chunk.
            if key in seen:
                del seen[key]
                offset = first + i * per_chunk
                chunks[key] = tuple(hashes[offset : offset + per_chunk])
                if len(chunks) > self.max_entries:
                    chunks.popitem(last=False)
            elif self.max_entries:
                seen[key] = None
                if len(seen) > self.max_seen:
                    seen.popitem(last=False)


class PromptChain:
    """One prompt's block hashes through a `ChainMemo`, computed as far as they are asked for.

    A routing decision needs a prompt's hashes only up to the first block no replica holds: chained hashes
    cannot match past it. `prefix(is_indexed)` takes chunks from the memo while the index knows their last
    block, and hashes a chunk the memo lacks block by block until the first block the index does not know; a
    prompt's new tail is hashed after the request has gone to its replica (`complete()`, for the index's record)
    instead of before. `hashes` is one list that grows in place; once complete it equals `hash_text` /
    `hash_tokens` of the prompt.
    """

    __slots__ = (
        "_coarse",
        "_data",
        "_ids",
        "_memo",
        "_next_chunk",
        "_partial",
        "_seed",
        "_view",
        "_width",
        "hashes",
        "num_blocks",
    )

    def __init__(
        self, memo: ChainMemo, data: bytes, ids: Sequence[int] | None, width: int, seed: bytes, num_blocks: int
    ) -> None:
        self._memo = memo
        self._data: bytes | bytearray = data
        self._ids = ids
        """Token ids still to pack into `_data` as far as needed (token mode), else None."""
        self._view = memoryview(data)
        self._width = width
        self._seed = seed
        self._coarse = _xxh3(seed)
        self._next_chunk = 0
        self._partial: tuple[int, int] | None = None
        """The key of a chunk the memo lacks that `prefix` left part-hashed (its blocks end at `_next_chunk`)."""
        self.num_blocks = num_blocks
        """Blocks of the whole prompt, hashed or not."""
        self.hashes: list[int] = []

    @property
    def is_complete(self) -> bool:
        return len(self.hashes) == self.num_blocks

    def prefix(self, is_indexed: Callable[[int], bool]) -> list[int]:
        """`hashes`, computed at least up to the first block hash `is_indexed` rejects (the whole prompt when it
        rejects none). A match over them equals a match over all of the prompt's."""
        return self._run(is_indexed)

    def complete(self) -> list[int]:
        """`hashes`, all of them."""
        return self.hashes if self.is_complete else self._run(None)

    def _need(self, num_bytes: int) -> None:
        """Pack token ids until `_data` holds `num_bytes`, and no more: a decision may need only a few chunks."""
        have = len(self._data)
        if have >= num_bytes or self._ids is None:
            return
        packed = pack_tokens(self._ids[have // 4 : num_bytes // 4])
        self._view.release()  # a bytearray with an exported buffer cannot grow
        if isinstance(self._data, bytearray):
            self._data += packed
        else:
            self._data = bytearray(packed)
        self._view = memoryview(self._data)

    def _run(self, is_indexed: Callable[[int], bool] | None) -> list[int]:
        out = self.hashes
        memo = self._memo
        chunks = memo._chunks
        width = self._width
        per_chunk = memo.checkpoint_blocks
        chunk_bytes = per_chunk * width
        num_chunks = self.num_blocks // per_chunk
        if self._partial is not None:  # finish the chunk `prefix` stopped in
            key, self._partial = self._partial, None
            self._hash_missed(
                [key], self._next_chunk * per_chunk - len(out), first=self._next_chunk * per_chunk - per_chunk
            )
        missed: list[tuple[int, int]] = []  # keys of the chunks since the last hit, not hashed yet
        while self._next_chunk < num_chunks:
            start = self._next_chunk * chunk_bytes
            self._next_chunk += 1
            self._need(start + chunk_bytes)
            self._coarse = _xxh3(self._view[start : start + chunk_bytes], seed=self._coarse)
            key = (width, self._coarse)
            if key not in chunks:
                if is_indexed is None:
                    missed.append(key)  # chunks that miss in a row are hashed in one pass (~1 us a call saved)
                    continue
                if not self._hash_until_unindexed(self._next_chunk * per_chunk, is_indexed):
                    self._partial = key
                    return out
                self._memo._admit([key], out, len(out) - per_chunk)
                continue
            if missed:
                # Admitted in order, as if one by one; an admission may evict the chunk just found.
                self._hash_missed(missed, len(missed) * per_chunk)
                missed = []
            hit = chunks.get(key)
            if hit is None:
                missed.append(key)
                continue
            chunks.move_to_end(key)
            out.extend(hit)
            memo.hits += 1
            if is_indexed is not None and not is_indexed(out[-1]):
                return out
        self._hash_missed(missed, self.num_blocks - len(out))
        return out

    def _hash_until_unindexed(self, end: int, is_indexed: Callable[[int], bool]) -> bool:
        """Hash blocks up to block `end`, one at a time, stopping after the first that `is_indexed` rejects;
        True when all of them passed."""
        out = self.hashes
        width = self._width
        data = self._data
        i = len(out)
        # The first block often ends the walk (a prompt's new part starts in this chunk): it is cut alone.
        first = data[i * width : (i + 1) * width]
        out.append(_xxh3(self._seed + first if i == 0 else _pack_u64(out[-1]) + first))
        if not is_indexed(out[-1]):
            return False
        i += 1
        prev = out[-1]
        append = out.append
        pack = Struct(f"<Q{width}s").pack
        for block in struct.unpack_from(f"{width}s" * (end - i), data, i * width):
            prev = _xxh3(pack(prev, block))
            append(prev)
            if not is_indexed(prev):
                return False
        return True

    def _hash_missed(self, missed: list[tuple[int, int]], num_blocks: int, first: int | None = None) -> None:
        """Extend `hashes` by the next `num_blocks` block hashes (the `missed` chunks, then any partial chunk)
        and count and admit the `missed` chunks, the first of which starts at block `first` (default: at the
        first of the new hashes)."""
        out = self.hashes
        start = len(out)
        if first is None:
            first = start
        if num_blocks > 0:
            width = self._width
            self._need((start + num_blocks) * width)
            data = self._data
            if start == 0:
                out.append(_xxh3(self._seed + data[:width]))
                _extend_chain(out, data, width, num_blocks - 1, width, out[0])
            else:
                _extend_chain(out, data, start * width, num_blocks, width, out[-1])
        if missed:
            self._memo._admit(missed, out, first)
