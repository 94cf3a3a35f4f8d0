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

import xxhash

DEFAULT_TOKEN_BLOCK_SIZE = 16
"""Tokens per block in token mode: vLLM's and SGLang's default KV block size (exact mode needs them equal)."""

DEFAULT_TEXT_BLOCK_SIZE = 64
"""Bytes per block in text mode: about 16 tokens of English text at ~4 bytes per token."""

_xxh3 = xxhash.xxh3_64_intdigest
_pack_u64 = struct.Struct("<Q").pack


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
    num_blocks = _num_blocks(len(data), block_size, max_blocks)
    if num_blocks == 0:
        return []
    out = [_xxh3(seed + data[:block_size])]
    append = out.append
    prev = out[0]
    for start in range(block_size, num_blocks * block_size, block_size):
        prev = _xxh3(_pack_u64(prev) + data[start : start + block_size])
        append(prev)
    return out


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (raises OverflowError for ids outside [0, 2**32))."""
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
    data = pack_tokens(token_ids[: num_blocks * block_size])
    width = 4 * block_size
    blocks = [data[i : i + width] for i in range(0, len(data), width)]
    return chain_hashes(blocks, seed, parent_hash)


class ChainMemo:
    """A bounded memo of block-hash chains, keyed by prefix checkpoints, so shared prefixes are hashed once.

    Traffic repeats prefixes: every turn of a conversation resends the whole conversation, and system prompts
    and tool definitions open many requests. Hashing costs the router one Python-level step per block, so a
    32 KiB prompt costs hundreds of microseconds. The memo cuts a prompt into chunks of `checkpoint_blocks`
    blocks and names each chunk by a coarse chain over chunks (one `xxh3_64` call per chunk, seeded like the
    fine chain, so it names the seed and the whole prefix up to the chunk's end). Since the fine hashes of a
    chunk depend on exactly that (the fine chain state before it, and its bytes), the memo maps the coarse name
    to the chunk's fine hashes. A cached chunk costs one hash call and one look-up instead of a step per block;
    the output is identical to `hash_text` / `hash_tokens` (tests hold them equal). A chunk is stored on its
    second sighting only, so prompts never seen again cost little more than hashing them directly.

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
        return self._chain(pack_tokens(token_ids[: num_blocks * block_size]), 4 * block_size, seed, num_blocks)

    def _chain(self, data: bytes, width: int, seed: bytes, num_blocks: int) -> list[int]:
        """Hashes of the first `num_blocks` blocks of `width` bytes of `data`."""
        if num_blocks == 0:
            return []
        per_chunk = self.checkpoint_blocks
        chunk_bytes = per_chunk * width
        out: list[int] = []
        prev: int | None = None  # the fine chain state: the last block hash so far
        coarse_head = seed
        chunks = self._chunks
        seen = self._seen
        append = out.append
        for start in range(0, (num_blocks // per_chunk) * chunk_bytes, chunk_bytes):
            end = start + chunk_bytes
            coarse = _xxh3(coarse_head + data[start:end])
            coarse_head = _pack_u64(coarse)
            key = (width, coarse)
            cached = chunks.get(key)
            if cached is not None:
                chunks.move_to_end(key)
                out.extend(cached)
                self.hits += 1
            else:
                # The fine chain over this chunk, as `hash_text` computes it.
                offset = len(out)
                block = start
                if prev is None:
                    prev = _xxh3(seed + data[block : block + width])
                    append(prev)
                    block += width
                while block < end:
                    prev = _xxh3(_pack_u64(prev) + data[block : block + width])
                    append(prev)
                    block += width
                self.misses += 1
                # Admission on second sight: a chunk is stored only when seen before, so one-off prompts cost a
                # cheap key, not a stored chunk.
                if key in seen:
                    del seen[key]
                    chunks[key] = array("Q", out[offset:])
                    if len(chunks) > self.max_entries:
                        chunks.popitem(last=False)
                elif self.max_entries:
                    seen[key] = None
                    if len(seen) > self.max_seen:
                        seen.popitem(last=False)
            prev = out[-1]
        done = len(out)
        if done < num_blocks:
            tail = data[done * width : num_blocks * width]
            out.extend(chain_hashes([tail[i : i + width] for i in range(0, len(tail), width)], seed, prev))
        return out
