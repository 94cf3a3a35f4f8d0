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


def hash_text(
    data: bytes,
    seed: bytes,
    block_size: int = DEFAULT_TEXT_BLOCK_SIZE,
    max_blocks: int | None = None,
) -> list[int]:
    """Block hashes of routing text (its UTF-8 bytes); at most `max_blocks` when given."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_blocks = len(data) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
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
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    if num_blocks == 0:
        return []
    data = pack_tokens(token_ids[: num_blocks * block_size])
    width = 4 * block_size
    blocks = [data[i : i + width] for i in range(0, len(data), width)]
    return chain_hashes(blocks, seed, parent_hash)
