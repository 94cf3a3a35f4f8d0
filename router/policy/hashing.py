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
from collections.abc import Sequence
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


def chain_hashes(blocks: Sequence[bytes], seed: bytes, parent_hash: int | None = None) -> list[int]:
    """Hash already-cut blocks; the first chains from `parent_hash` when given, else from `seed`."""
    out: list[int] = []
    if not blocks:
        return out
    append = out.append
    head = seed if parent_hash is None else _pack_u64(parent_hash)
    prev = _xxh3(head + blocks[0])
    append(prev)
    for i in range(1, len(blocks)):
        prev = _xxh3(_pack_u64(prev) + blocks[i])
        append(prev)
    return out


def _extend_chain(out: list[int], data: bytes, start: int, num_blocks: int, width: int, prev: int) -> None:
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

    Not thread-safe; the router keeps one per process. Memory, with 64-block chunks: about 0.8 KiB per stored
    chunk, and about 180 bytes per chunk seen once (up to `4 * max_entries` of them).
    """

    def __init__(self, checkpoint_blocks: int = 64, max_entries: int = 16384) -> None:
        if checkpoint_blocks <= 0 or max_entries < 0:
            raise ValueError("checkpoint_blocks must be positive and max_entries not negative")
        self.checkpoint_blocks = checkpoint_blocks
        self.max_entries = max_entries
        self._chunks: OrderedDict[tuple[int, int], array[int]] = OrderedDict()
        self._seen: OrderedDict[tuple[int, int], None] = OrderedDict()
        """Chunks seen once and not stored yet; a second sighting stores them."""
        self.max_seen = 4 * max_entries
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._chunks)

    def hash_text(
        self, data: bytes, seed: bytes, block_size: int = DEFAULT_TEXT_BLOCK_SIZE, max_blocks: int | None = None
    ) -> list[int]:
        """Exactly `hash_text(data, seed, block_size, max_blocks)`."""
        return self._chain(data, block_size, seed, _num_blocks(len(data), block_size, max_blocks))

    def hash_tokens(
        self,
        token_ids: Sequence[int],
        seed: bytes,
        block_size: int = DEFAULT_TOKEN_BLOCK_SIZE,
        max_blocks: int | None = None,
    ) -> list[int]:
        """Exactly `hash_tokens(token_ids, seed, block_size, max_blocks=max_blocks)`."""
        num_blocks = _num_blocks(len(token_ids), block_size, max_blocks)
        if num_blocks == 0:
            return []
        return self._chain(pack_tokens(_head(token_ids, num_blocks * block_size)), 4 * block_size, seed, num_blocks)

    def _chain(self, data: bytes, width: int, seed: bytes, num_blocks: int) -> list[int]:
        """Hashes of the first `num_blocks` blocks of `width` bytes of `data`."""
        if num_blocks == 0:
            return []
        per_chunk = self.checkpoint_blocks
        chunk_bytes = per_chunk * width
        view = memoryview(data)
        out: list[int] = []
        missed: list[tuple[int, int]] = []  # keys of the chunks since the last hit, not hashed yet
        coarse = _xxh3(seed)
        chunks = self._chunks
        for start in range(0, (num_blocks // per_chunk) * chunk_bytes, chunk_bytes):
            coarse = _xxh3(view[start : start + chunk_bytes], seed=coarse)
            key = (width, coarse)
            if key not in chunks:
                missed.append(key)
                continue
            if missed:
                # Chunks that missed in a row are hashed in one pass (a call per chunk costs ~1 us), then
                # admitted in order, as if one by one; an admission may evict the chunk just found.
                self._hash_missed(out, data, width, seed, missed, len(missed) * per_chunk)
                missed = []
                if key not in chunks:
                    missed.append(key)
                    continue
            chunks.move_to_end(key)
            out.extend(chunks[key])
            self.hits += 1
        self._hash_missed(out, data, width, seed, missed, num_blocks - len(out))
        return out

    def _hash_missed(
        self, out: list[int], data: bytes, width: int, seed: bytes, missed: list[tuple[int, int]], num_blocks: int
    ) -> None:
        """Extend `out` by the next `num_blocks` block hashes (the `missed` chunks, then any partial chunk) and
        count and admit the `missed` chunks."""
        first = len(out)
        if num_blocks > 0:
            if first == 0:
                out.append(_xxh3(seed + data[:width]))
                _extend_chain(out, data, width, num_blocks - 1, width, out[0])
            else:
                _extend_chain(out, data, first * width, num_blocks, width, out[-1])
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
                chunks[key] = array("Q", out[offset : offset + per_chunk])
                if len(chunks) > self.max_entries:
                    chunks.popitem(last=False)
            elif self.max_entries:
                seen[key] = None
                if len(seen) > self.max_seen:
                    seen.popitem(last=False)
