"""Paged KV blocks with prefix caching on the shared block hash.

The cache is `num_blocks` blocks of `block_size` tokens. A sequence's block table lists its blocks in order. A full
block whose keys and values have been computed is entered into the prefix cache under the hash of DESIGN.md
contract 1 (`router.policy.hashing`, token mode, chained from the previous block), which is also the hash the
router computes, so KV events name blocks the router can match without a tokenizer of its own.

Blocks have reference counts. At zero a hashed block stays in the cache, in an LRU of free cached blocks that can
be revived by a later prefix hit; an unhashed block goes straight back to the free list. A new block is taken from
the free list first, then by evicting the least recently freed cached block (which emits `removed`). A sequence
frees its blocks last-to-first, so a prefix outlives its extensions.

Events (`stored`, `removed`, `cleared`) queue here and the engine drains them once per step.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from replica.engine.sequence import Sequence
from router.policy.hashing import hash_tokens
from router.policy.kv_events import AllCleared, BlockRemoved, BlockStored, KVEvent


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, hash_seed: bytes, *, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        # For snapshots (a new KV-event subscriber learns the whole cache): each cached block's tokens, parent hash
        # and depth in its chain, so parents can be announced before children.
        self._block_tokens: list[tuple[int, ...]] = [()] * num_blocks
        self._block_parents: list[int | None] = [None] * num_blocks
        self._block_depths = [0] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self._free_uncached: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU: first item is evicted first
        self._events: list[KVEvent] = []
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    # ---- accounting -------------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take (free cached blocks count: they are evictable)."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running sequences (vLLM's kv_cache_usage_perc)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def drain_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    # ---- allocation -------------------------------------------------------------------------------------------

    def _prefix_hits(self, seq: Sequence) -> tuple[list[int], int | None]:
        """Cached blocks of the sequence's leading full blocks up to the first miss, and the last hit's hash.

        At least one token is always left to compute: the step that computes it yields the next token's logits.
        A sequence that still needs its prompt's logits (prompt logprobs) takes no hit.
        """
        if not self.enable_prefix_caching or seq.num_prompt_logprobs_missing:
            return [], None
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        last_hash = None
        for h in hash_tokens(seq.token_ids, self.hash_seed, self.block_size, max_blocks=max_blocks):
            block = self.hash_to_block.get(h)
            if block is None:
                break
            hits.append(block)
            last_hash = h
        return hits, last_hash

    def allocate(self, seq: Sequence) -> bool:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks; False if they don't fit."""
        assert not seq.block_table, f"sequence {seq.seq_id} already holds blocks"
        hits, last_hash = self._prefix_hits(seq)
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)
        new_needed = self.blocks_needed(seq.num_tokens) - len(hits)
        if revived + new_needed > self.num_free_blocks:
            return False
        for block in hits:
            if self.ref_counts[block] == 0:
                del self._free_cached[block]
            self.ref_counts[block] += 1
        seq.block_table = list(hits)
        for _ in range(new_needed):
            seq.block_table.append(self._take_free_block())
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)
        seq.last_block_hash = last_hash
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
            self.prefix_queried_tokens += seq.num_tokens
            self.prefix_hit_tokens += seq.num_computed_tokens
        return True

    def can_hold(self, seq: Sequence, num_positions: int) -> bool:
        """Whether the sequence's block table can grow to cover positions 0..num_positions-1."""
        return self.blocks_needed(num_positions) - len(seq.block_table) <= self.num_free_blocks

    def hold(self, seq: Sequence, num_positions: int) -> None:
        """Grow the block table to cover positions 0..num_positions-1 (`can_hold` must be true). Positions past the
        sequence's tokens hold draft tokens under verification or a drafter's look-ahead: their slots are written
        and overwritten, but only computed full blocks of committed tokens are ever registered."""
        for _ in range(self.blocks_needed(num_positions) - len(seq.block_table)):
            seq.block_table.append(self._take_free_block())

    def can_append(self, seq: Sequence) -> bool:
        """Whether the sequence's next token fits (it needs a new block only when its last one is full)."""
        return self.can_hold(seq, seq.num_tokens)

    def append_slot(self, seq: Sequence) -> None:
        """Make room for `seq.token_ids[-1]`, the token about to be computed."""
        self.hold(seq, seq.num_tokens)

    def _take_free_block(self) -> int:
        if self._free_uncached:
            block = self._free_uncached.popleft()
        else:
            block, _ = self._free_cached.popitem(last=False)
            self._forget(block)
        self.ref_counts[block] = 1
        return block

    def _forget(self, block: int) -> None:
        h = self.block_hashes[block]
        if h is not None:
            self.block_hashes[block] = None
            if self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]
                self._events.append(BlockRemoved(block_hashes=(h,)))

    def free(self, seq: Sequence) -> None:
        """Release a finished, aborted or preempted sequence's blocks, last block first."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                if self.block_hashes[block] is not None:
                    self._free_cached[block] = None
                else:
                    self._free_uncached.append(block)
        seq.block_table = []
        seq.num_registered_blocks = 0
        seq.last_block_hash = None

    # ---- prefix cache -----------------------------------------------------------------------------------------

    def register_computed(self, seq: Sequence) -> None:
        """Enter the sequence's newly computed full blocks into the prefix cache and queue one `stored` event."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        first = seq.num_registered_blocks
        if num_full <= first:
            return
        bs = self.block_size
        parent = seq.last_block_hash
        tokens = seq.token_ids[first * bs : num_full * bs]
        hashes = hash_tokens(tokens, self.hash_seed, bs, parent_hash=parent)
        stored: list[int] = []
        for i, h in enumerate(hashes):
            block = seq.block_table[first + i]
            existing = self.hash_to_block.get(h)
            if existing is not None and existing != block:
                # Another sequence computed the same block first: share its copy and free this one, so the chain
                # stays whole (a private copy would outlive its cached parent, unreachable and unannounced).
                if self.ref_counts[existing] == 0:
                    del self._free_cached[existing]
                self.ref_counts[existing] += 1
                seq.block_table[first + i] = existing
                self.ref_counts[block] -= 1
                if self.ref_counts[block] == 0:
                    self._free_uncached.append(block)
                continue
            self.block_hashes[block] = h
            self.hash_to_block[h] = block
            self._block_tokens[block] = tuple(tokens[i * bs : (i + 1) * bs])
            self._block_parents[block] = hashes[i - 1] if i else parent
            self._block_depths[block] = first + i
            stored.append(h)
        seq.num_registered_blocks = num_full
        seq.last_block_hash = hashes[-1]
        if stored and len(stored) == len(hashes):
            self._events.append(BlockStored(tuple(stored), parent, tuple(tokens), bs))
        elif stored:
            # Announce only the newly stored blocks, each with its own parent, to keep events self-describing.
            for i, h in enumerate(hashes):
                if h in stored:
                    prev = hashes[i - 1] if i else parent
                    self._events.append(BlockStored((h,), prev, tuple(tokens[i * bs : (i + 1) * bs]), bs))

    def snapshot_events(self) -> list[KVEvent]:
        """`cleared`, then one `stored` per cached block, parents first: replayed, they rebuild the whole cache."""
        blocks = sorted(self.hash_to_block.values(), key=lambda b: self._block_depths[b])
        events: list[KVEvent] = [AllCleared()]
        for block in blocks:
            h = self.block_hashes[block]
            assert h is not None
            events.append(BlockStored((h,), self._block_parents[block], self._block_tokens[block], self.block_size))
        return events

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block not in use; False (and nothing done) while any block is held."""
        if any(self.ref_counts):
            return False
        for block in list(self._free_cached):
            self.block_hashes[block] = None
            self._free_uncached.append(block)
        self._free_cached.clear()
        self.hash_to_block.clear()
        self._events.append(AllCleared())
        return True
