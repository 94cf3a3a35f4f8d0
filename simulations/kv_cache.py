"""A simulated replica's KV cache: a fixed number of blocks with block-level LRU prefix caching (vLLM V1-like).

Blocks are counted, not stored. A block is in one of three states:
  - free: holds nothing (`num_free`);
  - cached: holds a full prompt block named by its chained hash (`router.policy.hashing`), with a reference count
    of the running sequences using it (`refs`); at count 0 it is evictable and sits in `evictable`, oldest first;
  - private: held by one sequence and not shareable (a partial last block, output tokens, or a duplicate computed
    while another sequence cached the same hash). The owning sequence counts these.

Sequences hold their cached blocks as a prefix of their prompt's hashes (`hashes[:n]`), so a sequence's cache
state is two integers. `match` walks a prompt's hashes while they are cached; `acquire` takes references on the
matched prefix; `commit` turns a sequence's freshly computed private blocks into cached ones (or shares an equal
block another sequence cached first, freeing the private copy); `release` drops references, appending blocks
that reach 0 to the evictable list leaf first, so that eviction, which takes from the front, removes a prefix's
tail before its head (vLLM frees a request's blocks in reverse order for the same reason). `allocate` takes free
blocks and then evicts the least recently released cached ones. With `is_caching` off, nothing is ever cached.

Evictions are collected in `removed` (when tracking) and commits report the blocks they cached, for exact-mode KV
events.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from itertools import compress, islice, repeat, takewhile
from operator import add, sub
from typing import Any

# The per-block loops below run as chains of C-level iterators (map, compress, dict.update): a prompt has
# hundreds of blocks, and a Python-level loop over them was the simulator's largest cost after the router's index.
_is_zero = (0).__eq__
_is_one = (1).__eq__


def _consume(iterator: Iterable[Any]) -> None:
    deque(iterator, maxlen=0)


class KVCache:
    """Block accounting and the prefix cache of one replica."""

    __slots__ = (
        "evictable",
        "is_caching",
        "is_tracking_removed",
        "num_blocks",
        "num_deleted",
        "num_evicted",
        "num_free",
        "refs",
        "removed",
    )

    def __init__(self, num_blocks: int, *, is_caching: bool = True, is_tracking_removed: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.num_free = num_blocks
        self.is_caching = is_caching
        self.refs: dict[int, int] = {}
        """Cached block hash -> running sequences using it (0: evictable)."""
        self.evictable: dict[int, None] = {}
        """Cached blocks at reference count 0, least recently released first (a dict keeps insertion order)."""
        self.num_deleted = 0
        """Deletions from `evictable` since it was last rebuilt. A dict leaves a hole per deleted entry, which
        iteration from the front (eviction) walks over; rebuilding once they outnumber the live entries keeps
        eviction amortised O(1)."""
        self.is_tracking_removed = is_tracking_removed
        self.removed: list[int] = []
        """Hashes evicted since the owner last took this list (exact mode's `removed` events), when tracking."""
        self.num_evicted = 0

    @property
    def num_available(self) -> int:
        """Blocks a new allocation can get: free ones plus evictable cached ones."""
        return self.num_free + len(self.evictable)

    @property
    def num_used(self) -> int:
        """Blocks held by running sequences (what vLLM reports as KV cache usage)."""
        return self.num_blocks - self.num_free - len(self.evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running sequences, 0..1 (vllm:kv_cache_usage_perc)."""
        return self.num_used / self.num_blocks

    def match(self, hashes: Sequence[int], max_blocks: int) -> int:
        """Leading blocks of `hashes` (at most `max_blocks`) that are cached."""
        if not self.is_caching or max_blocks <= 0:
            return 0
        return len(list(takewhile(self.refs.__contains__, islice(hashes, max_blocks))))

    def num_evictable_in(self, hashes: Sequence[int], num_blocks: int) -> int:
        """Of the first `num_blocks` of `hashes`, all cached, those at reference count 0."""
        return sum(map(_is_zero, map(self.refs.__getitem__, islice(hashes, num_blocks))))

    def acquire(self, hashes: Sequence[int], num_blocks: int) -> None:
        """Take a reference on the first `num_blocks` of `hashes`, all cached (just matched)."""
        blocks = list(islice(hashes, num_blocks))
        counts = list(map(self.refs.__getitem__, blocks))
        self.refs.update(zip(blocks, map(add, counts, repeat(1)), strict=True))
        self._forget_evictable(list(compress(blocks, map(_is_zero, counts))))

    def allocate(self, num_blocks: int) -> bool:
        """Take `num_blocks` blocks, evicting cached ones as needed; False (and nothing taken) when too few."""
        if num_blocks <= self.num_free:
            self.num_free -= num_blocks
            return True
        short = num_blocks - self.num_free
        evictable = self.evictable
        if short > len(evictable):
            return False
        victims = list(islice(evictable, short))  # the least recently released
        self._forget_evictable(victims)
        _consume(map(self.refs.__delitem__, victims))
        if self.is_tracking_removed:
            self.removed.extend(victims)
        self.num_evicted += short
        self.num_free = 0
        return True

    def commit(self, hashes: Sequence[int], start: int, stop: int, stored: list[int] | None = None) -> None:
        """A sequence computed prompt blocks `start..stop-1` into private blocks: cache them.

        Each block either enters the cache (its private block becomes the cached one; its index goes to `stored`
        when given) or, when another sequence cached the same hash first, is shared and its private copy freed.
        """
        refs = self.refs
        blocks = hashes[start:stop]
        if refs.keys().isdisjoint(blocks):  # the usual case: all new
            refs.update(zip(blocks, repeat(1)))
            if stored is not None:
                stored.extend(range(start, stop))
            return
        counts = list(map(refs.get, blocks))
        shared: list[int] = []
        for i, h, count in zip(range(start, stop), blocks, counts, strict=True):
            if count is None:
                refs[h] = 1
                if stored is not None:
                    stored.append(i)
            else:
                if count == 0:
                    shared.append(h)
                refs[h] = count + 1
                self.num_free += 1
        self._forget_evictable(shared)

    def release(self, hashes: Sequence[int], num_cached: int, num_private: int) -> None:
        """A sequence lets go of its cached prefix `hashes[:num_cached]` and its `num_private` private blocks."""
        self.num_free += num_private
        if not num_cached:
            return
        blocks = hashes[num_cached - 1 :: -1]  # leaf first: the tail of a prefix is evicted before its head
        counts = list(map(self.refs.__getitem__, blocks))
        self.refs.update(zip(blocks, map(sub, counts, repeat(1)), strict=True))
        self.evictable.update(dict.fromkeys(compress(blocks, map(_is_one, counts))))

    def _forget_evictable(self, hashes: list[int]) -> None:
        """Take blocks off the evictable list (acquired again, or evicted)."""
        if not hashes:
            return
        evictable = self.evictable
        _consume(map(evictable.__delitem__, hashes))
        self.num_deleted += len(hashes)
        if self.num_deleted > len(evictable) + 1024:
            self.evictable = dict(evictable)
            self.num_deleted = 0

    def take_removed(self) -> list[int]:
        """Hashes evicted since the last call."""
        removed = self.removed
        self.removed = []
        return removed
