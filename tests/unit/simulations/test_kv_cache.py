"""The block cache: prefix match, references, leaf-first LRU eviction, sharing of blocks computed twice."""

from __future__ import annotations

from simulations.kv_cache import KVCache


def test_a_committed_prefix_is_matched_and_survives_release_until_evicted() -> None:
    cache = KVCache(10)
    prompt = [11, 12, 13, 14]
    assert cache.allocate(4)
    stored: list[int] = []
    cache.commit(prompt, 0, 4, stored)
    assert stored == [0, 1, 2, 3]
    assert cache.num_used == 4
    cache.release(prompt, 4, 0)
    assert cache.num_used == 0 and cache.num_available == 10
    assert cache.match(prompt, 4) == 4
    assert cache.match([11, 12, 99, 14], 4) == 2
    assert cache.match(prompt, 3) == 3  # bounded by the caller (at least one token is always computed)


def test_eviction_takes_the_least_recently_released_and_a_prefix_leaf_first() -> None:
    cache = KVCache(6, is_tracking_removed=True)
    a, b = [1, 2, 3], [7, 8, 9]
    for prompt in (a, b):
        assert cache.allocate(3)
        cache.commit(prompt, 0, 3)
    cache.release(a, 3, 0)  # released first: evicted first, its tail (3) before its head (1)
    cache.release(b, 3, 0)
    assert cache.allocate(2)
    assert cache.take_removed() == [3, 2]
    assert cache.match(a, 3) == 1
    assert cache.match(b, 3) == 3
    assert cache.allocate(4)
    assert cache.take_removed() == [1, 9, 8, 7]
    assert not cache.allocate(1)  # every block is held now: nothing is taken


def test_acquired_blocks_are_not_evictable_and_count_as_used() -> None:
    cache = KVCache(4)
    prompt = [1, 2, 3, 4]
    cache.allocate(4)
    cache.commit(prompt, 0, 4)
    cache.release(prompt, 4, 0)
    assert cache.num_evictable_in(prompt, 4) == 4
    cache.acquire(prompt, 2)  # a second request hits the first two blocks
    assert cache.num_used == 2
    assert cache.num_evictable_in(prompt, 4) == 2
    assert cache.allocate(2)
    assert not cache.allocate(1)
    assert cache.match(prompt, 4) == 2


def test_a_block_computed_twice_is_shared_and_the_copy_freed() -> None:
    cache = KVCache(8)
    prompt = [5, 6]
    cache.allocate(2)
    cache.allocate(2)  # two sequences computing the same prompt at once
    first: list[int] = []
    second: list[int] = []
    cache.commit(prompt, 0, 2, first)
    cache.commit(prompt, 0, 2, second)
    assert first == [0, 1] and second == []
    assert cache.refs == {5: 2, 6: 2}
    assert cache.num_free == 6  # the second copy went back
    cache.release(prompt, 2, 0)
    cache.release(prompt, 2, 0)
    assert cache.num_available == 8


def test_without_prefix_caching_nothing_matches() -> None:
    cache = KVCache(8, is_caching=False)
    assert cache.match([1, 2, 3], 3) == 0
