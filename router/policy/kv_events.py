"""KV-cache events (replica -> router), DESIGN.md contract 2.

An engine publishes `stored` when full blocks enter its prefix cache, `removed` when it evicts them, and
`cleared` when it drops the whole cache. The router does not trust engine hashes to equal its own (vLLM's do
not): it recomputes its hashes from a `stored` event's token ids, chained from the router hash of the event's
parent block, and keeps the engine hash only to map a later `removed` back to its own hash.

The JSON wire form (`to_dict`/`from_dict`) is what Shoal's replica streams; vLLM's event class names
(`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) are accepted as `type` too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    """Engine hashes of the stored blocks, in prefix order."""
    parent_hash: int | None
    """Engine hash of the block before the first stored one; None when the first block starts the prompt."""
    token_ids: tuple[int, ...]
    """Token ids of all stored blocks, `block_size` per block."""
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllCleared

_TYPES = {
    "stored": "stored",
    "BlockStored": "stored",
    "removed": "removed",
    "BlockRemoved": "removed",
    "cleared": "cleared",
    "AllBlocksCleared": "cleared",
}


class KVEventError(ValueError):
    """A malformed event; the consumer logs and skips it."""


def to_dict(event: KVEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {
            "type": "stored",
            "block_hashes": list(event.block_hashes),
            "parent_hash": event.parent_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
        }
    if isinstance(event, BlockRemoved):
        return {"type": "removed", "block_hashes": list(event.block_hashes)}
    return {"type": "cleared"}


def _ints(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise KVEventError(f"'{name}' must be an array of integers")
    return tuple(value)


def from_dict(data: Mapping[str, Any]) -> KVEvent:
    kind = _TYPES.get(data.get("type", ""))
    if kind == "cleared":
        return AllCleared()
    if kind == "removed":
        return BlockRemoved(_ints(data.get("block_hashes"), "block_hashes"))
    if kind == "stored":
        hashes = _ints(data.get("block_hashes"), "block_hashes")
        tokens = _ints(data.get("token_ids"), "token_ids")
        block_size = data.get("block_size")
        parent = data.get("parent_hash")
        if type(block_size) is not int or block_size <= 0:
            raise KVEventError("'block_size' must be a positive integer")
        if parent is not None and type(parent) is not int:
            raise KVEventError("'parent_hash' must be an integer or null")
        if len(tokens) != len(hashes) * block_size:
            raise KVEventError(f"'token_ids' holds {len(tokens)} tokens, expected {len(hashes)} blocks x {block_size}")
        return BlockStored(hashes, parent, tokens, block_size)
    raise KVEventError(f"unknown event type {data.get('type')!r}")
