"""BlockManager on its own: allocation, reference counts, the LRU of free cached blocks, and the KV events.

Hashes are checked against `router.policy.hashing.hash_tokens`, the function the router matches prompts with, and
events are replayed the way a subscriber would (parents must be known before their children).
"""

from __future__ import annotations

import pytest

from replica.engine.block_manager import BlockManager
from replica.engine.sampling import SamplingParams
from replica.engine.sequence import Sequence
from router.policy.hashing import hash_tokens, namespace_seed
from router.policy.kv_events import AllCleared, BlockRemoved, BlockStored, KVEvent

SEED = namespace_seed("tiny-moe")
BS = 4
_ids = iter(range(1_000_000))


def seq(tokens: list[int]) -> Sequence:
    return Sequence(next(_ids), list(tokens), SamplingParams(), arrival_s=0.0)


def compute(bm: BlockManager, s: Sequence, num_tokens: int | None = None) -> None:
    """What the engine does after a step: mark tokens computed, register the full blocks."""
    s.num_computed_tokens = s.num_tokens if num_tokens is None else num_tokens
    bm.register_computed(s)


def replay(events: list[KVEvent], known: set[int] | None = None) -> set[int]:
    """Apply events as a subscriber does; a `stored` whose parent is unknown is an error."""
    hashes = set() if known is None else known
    for event in events:
        if isinstance(event, AllCleared):
            hashes.clear()
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= hashes, "removed a block never stored"
            hashes.difference_update(event.block_hashes)
        else:
            assert event.parent_hash is None or event.parent_hash in hashes, "stored before its parent"
            assert len(event.token_ids) == len(event.block_hashes) * event.block_size
            hashes.update(event.block_hashes)
    return hashes


def stored_hashes(events: list[KVEvent]) -> list[int]:
    return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]


def removed_hashes(events: list[KVEvent]) -> list[int]:
    return [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]


def test_allocation_counts_and_append() -> None:
    bm = BlockManager(8, BS, SEED)
    a = seq(list(range(9)))  # 3 blocks, the last with one token
    assert bm.allocate(a)
    assert len(a.block_table) == 3 and len(set(a.block_table)) == 3
    assert bm.num_free_blocks == 5
    assert [bm.ref_counts[b] for b in a.block_table] == [1, 1, 1]
    assert a.num_computed_tokens == 0 and a.num_cached_tokens == 0
    compute(bm, a)
    # Tokens 9..11 fit the third block; the 13th token (index 12) needs a fourth.
    for _ in range(3):
        a.token_ids.append(1)
        bm.append_slot(a)
        assert len(a.block_table) == 3
        a.num_computed_tokens += 1
    a.token_ids.append(1)
    bm.append_slot(a)
    assert len(a.block_table) == 4 and bm.num_free_blocks == 4
    bm.free(a)
    assert bm.num_free_blocks == 8 and not any(bm.ref_counts) and a.block_table == []


def test_shared_prefix_reference_counts_and_cached_tokens() -> None:
    bm = BlockManager(16, BS, SEED)
    a = seq(list(range(10)))
    assert bm.allocate(a)
    compute(bm, a)  # blocks 0 and 1 are full and registered
    b = seq([*range(8), 50, 51, 52])  # shares two full blocks
    assert bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert [bm.ref_counts[x] for x in b.block_table] == [2, 2, 1]
    # A prompt that is exactly the cached blocks still leaves its last token to compute: one block less is a hit.
    c = seq(list(range(8)))
    assert bm.allocate(c)
    assert c.num_cached_tokens == 4 and c.block_table[0] == a.block_table[0] and c.block_table[1] != a.block_table[1]
    assert bm.ref_counts[a.block_table[0]] == 3
    for s in (a, b, c):
        bm.free(s)
    assert not any(bm.ref_counts) and bm.num_free_blocks == 16
    assert bm.prefix_hit_tokens == 12 and bm.prefix_queried_tokens == 10 + 11 + 8


def test_prefix_caching_disabled_never_hits_or_announces() -> None:
    bm = BlockManager(16, BS, SEED, enable_prefix_caching=False)
    a = seq(list(range(10)))
    assert bm.allocate(a)
    compute(bm, a)
    b = seq(list(range(10)))
    assert bm.allocate(b)
    assert b.num_cached_tokens == 0 and set(a.block_table).isdisjoint(b.block_table)
    assert bm.drain_events() == [] and bm.hash_to_block == {}


def test_register_computed_chains_hashes_like_the_router() -> None:
    bm = BlockManager(16, BS, SEED)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
    expected = hash_tokens(tokens, SEED, BS)
    assert len(expected) == 3
    a = seq(tokens)
    assert bm.allocate(a)
    compute(bm, a, 3)
    assert bm.drain_events() == []  # no full block yet
    compute(bm, a, 5)
    assert bm.drain_events() == [BlockStored((expected[0],), None, tuple(tokens[:4]), BS)]
    compute(bm, a, 13)  # two more blocks at once: one event, chained from the first block
    assert bm.drain_events() == [BlockStored((expected[1], expected[2]), expected[0], tuple(tokens[4:12]), BS)]
    assert {h: b for h, b in bm.hash_to_block.items()} == dict(zip(expected, a.block_table, strict=False))
    # A second sequence finds the chain the router would compute for it.
    b = seq([*tokens[:12], 0])
    assert bm.allocate(b)
    assert b.block_table[:3] == a.block_table[:3] and b.last_block_hash == expected[2]
    # Its next block chains from the hit, again as the router's function says.
    b.token_ids += [1, 2, 3, 4]
    bm.append_slot(b)
    compute(bm, b, 16)
    (event,) = bm.drain_events()
    assert event == BlockStored((hash_tokens(b.token_ids, SEED, BS)[3],), expected[2], tuple(b.token_ids[12:16]), BS)


def test_concurrent_duplicates_are_announced_once() -> None:
    bm = BlockManager(16, BS, SEED)
    tokens = list(range(20, 33))  # 3 full blocks + 1 token
    a, b = seq(tokens), seq(tokens)
    assert bm.allocate(a) and bm.allocate(b)  # neither finds the other's blocks: nothing is computed yet
    assert set(a.block_table).isdisjoint(b.block_table)
    compute(bm, a, 5)  # a registers block 0
    compute(bm, b, 13)  # b registers blocks 0..2; block 0 is a duplicate
    compute(bm, a, 13)  # a's blocks 1 and 2 are now duplicates of b's
    events = bm.drain_events()
    expected = hash_tokens(tokens, SEED, BS)
    assert sorted(stored_hashes(events)) == sorted(expected), "each block hash is announced exactly once"
    assert replay(events) == set(expected)
    # The cache names one block per hash; freeing everything announces each removal once, on eviction.
    bm.free(a)
    bm.free(b)
    assert set(bm.hash_to_block) == set(expected)
    assert bm.num_free_blocks == 16
    filler = seq([1] * 63)  # 16 blocks: evicts everything cached
    assert bm.allocate(filler)
    assert sorted(removed_hashes(bm.drain_events())) == sorted(expected)
    assert bm.hash_to_block == {}


def test_lru_evicts_least_recently_freed_and_tail_before_head() -> None:
    bm = BlockManager(6, BS, SEED)
    a = seq(list(range(13)))  # blocks a0 a1 a2 registered, a3 holds the 13th token
    b = seq(list(range(50, 55)))  # b0 registered, b1 partial
    assert bm.allocate(a) and bm.allocate(b)
    assert bm.num_free_blocks == 0
    compute(bm, a)
    compute(bm, b)
    ha = hash_tokens(a.token_ids, SEED, BS)
    hb = hash_tokens(b.token_ids, SEED, BS)
    bm.drain_events()
    bm.free(a)  # LRU: a2, a1, a0 (tail first); a3 is unhashed and goes to the plain free list
    bm.free(b)  # LRU: a2, a1, a0, b0
    assert bm.num_free_blocks == 6
    # Unhashed blocks are taken before any cached block is evicted.
    c = seq([9] * 5)
    assert bm.allocate(c)
    assert bm.drain_events() == [] and len(bm.hash_to_block) == 4
    # Each further block evicts the least recently freed cached block: a's tail first, b's block last.
    order: list[int] = []
    for _ in range(4):
        d = seq([7] * 3)
        assert bm.allocate(d)
        order += removed_hashes(bm.drain_events())
    assert bm.num_free_blocks == 0 and bm.hash_to_block == {}
    assert order == [ha[2], ha[1], ha[0], hb[0]]


def test_prefix_hit_revives_a_free_cached_block_and_refreshes_it() -> None:
    bm = BlockManager(4, BS, SEED)
    a = seq(list(range(5)))
    b = seq(list(range(100, 105)))
    assert bm.allocate(a) and bm.allocate(b)
    compute(bm, a)
    compute(bm, b)
    a0 = a.block_table[0]
    bm.free(a)  # LRU: a0
    bm.free(b)  # LRU: a0, b0
    bm.drain_events()
    # A hit takes a0 off the LRU (it is in use again); freeing it makes it the most recent.
    again = seq(list(range(5)))
    assert bm.allocate(again)
    assert again.block_table[0] == a0 and again.num_cached_tokens == 4
    assert bm.ref_counts[a0] == 1
    bm.free(again)  # LRU: b0, a0
    filler = seq([1] * 12)  # 3 blocks: the 2 uncached ones, then evicts b0, not a0
    assert bm.allocate(filler)
    assert removed_hashes(bm.drain_events()) == hash_tokens(b.token_ids, SEED, BS)
    assert hash_tokens(a.token_ids, SEED, BS)[0] in bm.hash_to_block


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    bm = BlockManager(4, BS, SEED)
    a = seq(list(range(9)))
    assert bm.allocate(a)
    compute(bm, a)
    bm.free(a)  # two cached blocks (a0, a1) and two unhashed free blocks
    bm.drain_events()
    state = (list(bm.ref_counts), list(bm.block_hashes), dict(bm.hash_to_block), bm.num_free_blocks)
    stats = (bm.prefix_hit_tokens, bm.prefix_queried_tokens)
    # Hits a0 and a1 but needs 4 more blocks: 2 revived + 4 new > 4 free.
    big = seq([*range(8), *range(60, 73)])
    assert not bm.allocate(big)
    assert big.block_table == [] and big.num_computed_tokens == 0 and big.num_cached_tokens == 0
    assert (list(bm.ref_counts), list(bm.block_hashes), dict(bm.hash_to_block), bm.num_free_blocks) == state
    assert (bm.prefix_hit_tokens, bm.prefix_queried_tokens) == stats
    assert bm.drain_events() == []
    # The same request fits once it needs one block less.
    fits = seq([*range(8), *range(60, 68)])
    assert bm.allocate(fits) and fits.num_cached_tokens == 8 and bm.num_free_blocks == 0


def test_snapshot_replays_into_the_cached_hashes() -> None:
    bm = BlockManager(12, BS, SEED)
    live: set[int] = set()
    trunk = list(range(30, 38))
    seqs = [seq([*trunk, *range(i * 10, i * 10 + 6)]) for i in range(3)]  # a trunk of 2 blocks, 3 branches
    for s in seqs:
        assert bm.allocate(s)
        compute(bm, s)
        replay(bm.drain_events(), live)
    for s in seqs:
        bm.free(s)
    # LRU after the frees: branch 0, branch 1, branch 2, trunk 1, trunk 0. 9 blocks: the 7 unhashed, then the
    # first two branches are evicted.
    filler = seq([1] * 36)
    assert bm.allocate(filler)
    replay(bm.drain_events(), live)
    assert live == set(bm.hash_to_block) and len(live) == 3
    snapshot = bm.snapshot_events()
    assert isinstance(snapshot[0], AllCleared)
    assert replay(snapshot, {123}) == set(bm.hash_to_block)
    assert all(len(e.block_hashes) == 1 for e in snapshot[1:] if isinstance(e, BlockStored))
    # The stored hashes recompute from the snapshot's own tokens and parents, as a router does.
    for event in snapshot[1:]:
        assert isinstance(event, BlockStored)
        assert hash_tokens(event.token_ids, SEED, BS, parent_hash=event.parent_hash) == list(event.block_hashes)


def test_reset_prefix_cache_refuses_while_blocks_are_held() -> None:
    bm = BlockManager(8, BS, SEED)
    a = seq(list(range(9)))
    assert bm.allocate(a)
    compute(bm, a)
    bm.drain_events()
    assert not bm.reset_prefix_cache()
    assert len(bm.hash_to_block) == 2 and bm.drain_events() == []
    bm.free(a)
    assert bm.reset_prefix_cache()
    assert bm.drain_events() == [AllCleared()]
    assert bm.hash_to_block == {} and bm.num_free_blocks == 8
    b = seq(list(range(9)))
    assert bm.allocate(b) and b.num_cached_tokens == 0
    # The blocks dropped by the reset are plain free blocks now: reusing them announces no removal.
    filler = seq([1] * 20)
    assert bm.allocate(filler)
    assert bm.drain_events() == []


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0)])
def test_rejects_empty_cache(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        BlockManager(num_blocks, block_size, SEED)


def test_can_append_without_free_blocks_when_the_last_block_has_room() -> None:
    bm = BlockManager(2, BS, SEED)
    a = seq(list(range(7)))
    assert bm.allocate(a) and bm.num_free_blocks == 0
    compute(bm, a)
    a.token_ids.append(1)  # 8 tokens: the 8th goes to slot 3 of the second block
    bm.append_slot(a)
    assert len(a.block_table) == 2
    assert bm.can_append(a)


def test_snapshot_has_no_orphans_after_a_duplicate_parent_is_evicted() -> None:
    bm = BlockManager(6, BS, SEED)
    tokens = list(range(9))
    y, x = seq(tokens), seq(tokens)
    assert bm.allocate(y) and bm.allocate(x)
    compute(bm, y, 4)  # y stores block 0
    compute(bm, x)  # x's block 0 is a private duplicate; x stores block 1, whose parent is y's block 0
    bm.free(y)
    filler = seq([1] * 9)  # takes y's two unhashed blocks, then evicts y's block 0 while x still uses block 1
    assert bm.allocate(filler)
    # Every cached block must be reachable: a snapshot replays with every parent known.
    replay(bm.snapshot_events())
