"""PrefixIndex: matching, lifetimes, capacity, KV events, and the properties the router relies on."""

from __future__ import annotations

import gc
import itertools
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from router.policy.hashing import hash_tokens, namespace_seed
from router.policy.kv_events import AllCleared, BlockRemoved, BlockStored
from router.policy.prefix_index import PrefixIndex, PrefixIndexConfig

SEED = namespace_seed("test-model")
BLOCK = 4  # tokens per block in the event tests


def chain(*labels: int) -> list[int]:
    """Chained synthetic hashes: hash i names labels[:i + 1], as real block hashes name their prefix."""
    return [hash(("blk", *labels[: i + 1])) for i in range(len(labels))]


def make_index(*replicas: str, **config: Any) -> PrefixIndex:
    index = PrefixIndex(PrefixIndexConfig(**config))
    for r in replicas:
        index.add_replica(r)
    return index


def tokens(*block_labels: int) -> list[int]:
    return [label * 100 + i for label in block_labels for i in range(BLOCK)]


def stored(engine_hashes: list[int], parent: int | None, token_ids: list[int]) -> BlockStored:
    return BlockStored(tuple(engine_hashes), parent, tuple(token_ids), BLOCK)


# Matching -----------------------------------------------------------------------------------------------------


def test_match_counts_leading_blocks_per_replica() -> None:
    index = make_index("a", "b", "c")
    index.record("a", chain(1, 2, 3, 4), now=0.0)
    index.record("b", chain(1, 2, 7), now=0.0)
    assert index.match(chain(1, 2, 3, 4, 5), now=1.0) == {"a": 4, "b": 2}
    assert index.match(chain(1, 2, 7, 8), now=1.0) == {"a": 2, "b": 3}
    assert index.match(chain(1, 2, 3), now=1.0) == {"a": 3, "b": 2}
    assert index.match(chain(9, 2, 3), now=1.0) == {}
    assert index.match([], now=1.0) == {}


def test_partial_prefix_stops_at_the_first_block_a_replica_lacks() -> None:
    index = make_index("a")
    index.record("a", chain(1, 2), now=0.0)
    index.record("a", chain(1, 2, 3, 4, 5, 6), now=0.0)
    assert index.match(chain(1, 2, 3, 9, 9, 9), now=0.0) == {"a": 3}


def test_many_replicas_each_get_their_own_depth() -> None:
    index = make_index(*[f"r{i}" for i in range(70)])  # more replicas than a 64-bit mask
    for i in range(70):
        index.record(f"r{i}", chain(*range(i + 1)), now=0.0)
    assert index.match(chain(*range(70)), now=0.0) == {f"r{i}": i + 1 for i in range(70)}
    assert index.match(chain(*range(30), 999), now=0.0) == {f"r{i}": min(i + 1, 30) for i in range(70)}


# Lifetimes ----------------------------------------------------------------------------------------------------


def test_predicted_entries_count_only_while_younger_than_predicted_ttl() -> None:
    index = make_index("a", predicted_ttl_s=2.0, ttl_s=600.0)
    index.record("a", chain(1, 2, 3), now=10.0, predicted=True)
    assert index.match(chain(1, 2, 3), now=11.9) == {"a": 3}
    assert index.match(chain(1, 2, 3), now=12.0) == {}
    assert index.stats().num_entries == 3  # not swept yet, still not counted
    assert index.expire(12.0) == 3
    assert index.stats().num_entries == 0


def test_approximate_entries_expire_after_ttl_unless_touched() -> None:
    index = make_index("a", "b", ttl_s=100.0)
    index.record("a", chain(1, 2, 3), now=0.0)
    index.record("b", chain(1, 2, 3), now=0.0)
    index.record("b", chain(1, 2), now=50.0)  # b touches two blocks: they live until 150
    assert index.match(chain(1, 2, 3), now=99.0) == {"a": 3, "b": 3}
    assert index.match(chain(1, 2, 3), now=100.0) == {"b": 2}
    assert index.expire(100.0) == 4
    assert index.match(chain(1, 2, 3), now=100.0) == {"b": 2}
    assert index.match(chain(1, 2, 3), now=150.0) == {}
    assert index.expire(150.0) == 2
    assert index.stats().num_blocks == 0


def test_predicted_record_never_shortens_an_approximate_entry() -> None:
    index = make_index("a", ttl_s=100.0, predicted_ttl_s=2.0)
    index.record("a", chain(1, 2), now=0.0)
    index.record("a", chain(1, 2, 3), now=1.0, predicted=True)
    assert index.match(chain(1, 2, 3), now=2.9) == {"a": 3}
    assert index.match(chain(1, 2, 3), now=3.0) == {"a": 2}
    assert index.match(chain(1, 2, 3), now=99.0) == {"a": 2}


# Capacity -----------------------------------------------------------------------------------------------------


def test_eviction_takes_least_recently_used_leaves_first() -> None:
    index = make_index("a", capacity_blocks=8, evict_fraction=0.05)  # evicts down to 7
    index.record("a", chain(1, 1, 1, 1), now=0.0)
    index.record("a", chain(2, 2, 2, 2), now=1.0)
    index.record("a", chain(1, 1), now=2.0)  # the first prompt's first two blocks are now the most recent
    index.record("a", chain(3, 3), now=3.0)  # 10 blocks: the three least recently used leaves go
    assert index.match(chain(1, 1, 1, 1), now=3.0) == {"a": 2}
    assert index.match(chain(2, 2, 2, 2), now=3.0) == {"a": 3}
    assert index.match(chain(3, 3), now=3.0) == {"a": 2}
    stats = index.stats()
    assert stats.blocks_per_replica == {"a": 7}
    assert stats.evictions == 3


def test_a_prompt_longer_than_capacity_keeps_its_leading_blocks() -> None:
    index = make_index("a", capacity_blocks=5, evict_fraction=0.2)
    index.record("a", chain(*range(12)), now=0.0)
    assert index.match(chain(*range(12)), now=0.0) == {"a": 4}
    assert index.stats().num_blocks == 4


def test_capacity_is_per_replica_and_can_change() -> None:
    index = make_index("a", capacity_blocks=100)
    index.add_replica("small", capacity_blocks=3)
    index.record("a", chain(*range(10)), now=0.0)
    index.record("small", chain(*range(10)), now=0.0)
    assert index.match(chain(*range(10)), now=0.0) == {"a": 10, "small": 2}
    index.add_replica("a", capacity_blocks=6)  # shrinking evicts at once, leaves first
    assert index.match(chain(*range(10)), now=0.0) == {"a": 5, "small": 2}
    with pytest.raises(ValueError):
        index.add_replica("b", capacity_blocks=0)


def test_remove_replica_drops_its_entries_only() -> None:
    index = make_index("a", "b")
    index.record("a", chain(1, 2, 3), now=0.0)
    index.record("b", chain(1, 2), now=0.0)
    index.remove_replica("a")
    index.remove_replica("a")  # idempotent
    assert index.replicas == ("b",)
    assert index.match(chain(1, 2, 3), now=0.0) == {"b": 2}
    stats = index.stats()
    assert (stats.num_blocks, stats.num_entries, stats.blocks_per_replica) == (2, 2, {"b": 2})
    with pytest.raises(KeyError):
        index.record("a", chain(1), now=0.0)
    index.add_replica("c")  # takes the freed slot, and none of a's entries with it
    assert index.match(chain(1, 2, 3), now=0.0) == {"b": 2}


# KV events ----------------------------------------------------------------------------------------------------


def test_stored_indexes_the_routers_own_hashes_not_the_engines() -> None:
    index = make_index("a")
    token_ids = tokens(1, 2, 3)
    assert index.apply("a", stored([1, 2, 3], None, token_ids), seed=SEED, now=0.0)
    router_hashes = hash_tokens(token_ids, SEED, BLOCK)
    assert index.match(router_hashes, now=0.0) == {"a": 3}
    assert index.match([1, 2, 3], now=0.0) == {}
    assert index.match(hash_tokens(tokens(1, 2, 9), SEED, BLOCK), now=0.0) == {"a": 2}
    assert index.match(router_hashes, now=1e9) == {"a": 3}  # exact entries never expire
    assert index.stats().events_applied == 1


def test_stored_chains_from_the_router_hash_of_its_parent() -> None:
    index = make_index("a")
    index.apply("a", stored([11, 12], None, tokens(1, 2)), seed=SEED, now=0.0)
    index.apply("a", stored([13, 14], 12, tokens(3, 4)), seed=SEED, now=0.0)
    assert index.match(hash_tokens(tokens(1, 2, 3, 4), SEED, BLOCK), now=0.0) == {"a": 4}


def test_stored_with_an_unknown_parent_is_skipped_and_counted() -> None:
    index = make_index("a")
    assert not index.apply("a", stored([13, 14], 12, tokens(3, 4)), seed=SEED, now=0.0)
    assert not index.apply("a", BlockStored((1, 2), None, tuple(tokens(1)), BLOCK), seed=SEED, now=0.0)
    stats = index.stats()
    assert (stats.num_blocks, stats.events_applied, stats.events_skipped) == (0, 0, 2)


def test_removed_maps_engine_hashes_back_to_router_hashes() -> None:
    index = make_index("a", "b")
    index.apply("a", stored([1, 2, 3], None, tokens(1, 2, 3)), seed=SEED, now=0.0)
    index.apply("b", stored([7, 8, 9], None, tokens(1, 2, 3)), seed=SEED, now=0.0)
    router_hashes = hash_tokens(tokens(1, 2, 3), SEED, BLOCK)
    index.apply("a", BlockRemoved((2,)), seed=SEED, now=0.0)  # an inner block: a's match stops before it
    assert index.match(router_hashes, now=0.0) == {"a": 1, "b": 3}
    index.apply("a", BlockRemoved((3, 999)), seed=SEED, now=0.0)  # unknown engine hashes are ignored
    assert index.stats().blocks_per_replica == {"a": 1, "b": 3}
    index.apply("b", AllCleared(), seed=SEED, now=0.0)
    assert index.match(router_hashes, now=0.0) == {"a": 1}
    assert index.stats().num_blocks == 1


def test_removed_block_stored_again_rejoins_the_chain() -> None:
    index = make_index("a")
    index.apply("a", stored([1, 2, 3], None, tokens(1, 2, 3)), seed=SEED, now=0.0)
    index.apply("a", BlockRemoved((2,)), seed=SEED, now=0.0)
    index.apply("a", stored([2], 1, tokens(2)), seed=SEED, now=0.0)
    assert index.match(hash_tokens(tokens(1, 2, 3), SEED, BLOCK), now=0.0) == {"a": 3}


def test_a_block_named_by_two_engine_hashes_leaves_with_the_last() -> None:
    index = make_index("a")
    index.apply("a", stored([1], None, tokens(1)), seed=SEED, now=0.0)
    index.apply("a", stored([2], None, tokens(1)), seed=SEED, now=0.0)  # same tokens, another engine hash
    hashes = hash_tokens(tokens(1), SEED, BLOCK)
    index.apply("a", BlockRemoved((1,)), seed=SEED, now=0.0)
    assert index.match(hashes, now=0.0) == {"a": 1}
    index.apply("a", BlockRemoved((2,)), seed=SEED, now=0.0)
    assert index.match(hashes, now=0.0) == {}


def test_stored_makes_a_predicted_entry_real() -> None:
    index = make_index("a", predicted_ttl_s=2.0, capacity_blocks=10)
    router_hashes = hash_tokens(tokens(1, 2, 3), SEED, BLOCK)
    index.record("a", router_hashes, now=0.0, predicted=True)
    index.apply("a", stored([5, 6], None, tokens(1, 2)), seed=SEED, now=0.5)
    assert index.match(router_hashes, now=1.0) == {"a": 3}
    assert index.match(router_hashes, now=5.0) == {"a": 2}
    assert index.expire(5.0) == 1


def test_predictions_expire_on_a_replica_whose_engine_removed_blocks() -> None:
    index = make_index("a", "b", predicted_ttl_s=2.0)
    router_hashes = hash_tokens(tokens(1, 2, 3, 4, 5), SEED, BLOCK)
    index.apply("a", stored([1, 2, 3], None, tokens(1, 2, 3)), seed=SEED, now=0.0)
    index.apply("a", BlockRemoved((3,)), seed=SEED, now=0.0)
    index.record("a", router_hashes, now=10.0, predicted=True)
    index.record("b", router_hashes[:4], now=10.0, predicted=True)
    assert index.match(router_hashes, now=11.0) == {"a": 5, "b": 4}
    assert index.match(router_hashes, now=12.0) == {"a": 2}


def test_an_engine_block_of_several_router_blocks_is_indexed_as_them_and_leaves_with_them() -> None:
    index = make_index("a", "b")
    engine_block = 2 * BLOCK  # vLLM's 128-token CPU blocks against the router's 16, scaled down
    two = BlockStored((1, 2), None, tuple(tokens(1, 2, 3, 4)), engine_block)
    assert index.apply("a", two, seed=SEED, now=0.0, block_size=BLOCK)
    index.apply("b", stored([7, 8, 9], None, tokens(1, 2, 3)), seed=SEED, now=0.0)
    router_hashes = hash_tokens(tokens(1, 2, 3, 4, 5, 6), SEED, BLOCK)
    assert index.match(router_hashes, now=0.0) == {"a": 4, "b": 3}
    child = BlockStored((3,), 2, tuple(tokens(5, 6)), engine_block)  # chained from the last router block of 2
    assert index.apply("a", child, seed=SEED, now=0.0, block_size=BLOCK)
    assert index.match(router_hashes, now=0.0) == {"a": 6, "b": 3}
    index.apply("a", BlockRemoved((2,)), seed=SEED, now=0.0)  # both router blocks of engine block 2 leave
    assert index.match(router_hashes, now=0.0) == {"a": 2, "b": 3}
    assert index.stats().blocks_per_replica == {"a": 4, "b": 3}
    index.apply("a", AllCleared(), seed=SEED, now=0.0)
    assert index.stats().blocks_per_replica == {"a": 0, "b": 3}
    odd = BlockStored((4,), None, tuple(tokens(1)[:3]), 3)  # not a multiple of the router's block: skipped
    assert not index.apply("a", odd, seed=SEED, now=0.0, block_size=BLOCK)


def test_demote_turns_exact_entries_into_approximate_ones_and_keeps_their_parents() -> None:
    index = make_index("a", "b", ttl_s=100.0)
    index.apply("a", stored([1, 2], None, tokens(1, 2)), seed=SEED, now=0.0)
    index.apply("b", stored([5], None, tokens(1)), seed=SEED, now=0.0)
    router_hashes = hash_tokens(tokens(1, 2, 3), SEED, BLOCK)
    assert index.demote("a", now=10.0) == 2
    assert index.match(router_hashes, now=109.0) == {"a": 2, "b": 1}
    assert index.match(router_hashes, now=111.0) == {"b": 1}  # the TTL retires what the engine may have dropped
    index.apply("a", BlockRemoved((2,)), seed=SEED, now=20.0)  # a demoted block is no longer the engine's word
    assert index.match(router_hashes, now=21.0) == {"a": 2, "b": 1}
    assert index.apply("a", stored([3], 2, tokens(3)), seed=SEED, now=30.0)  # the parent is still known
    assert index.match(router_hashes, now=31.0) == {"a": 3, "b": 1}
    assert index.match(router_hashes, now=200.0) == {"b": 1}  # block 3 is exact, its demoted parents expired
    assert index.expire(200.0) == 2
    assert index.stats().blocks_per_replica["a"] == 1


def test_a_record_never_downgrades_an_exact_entry() -> None:
    index = make_index("a", ttl_s=10.0, capacity_blocks=1)
    router_hashes = hash_tokens(tokens(1, 2, 3), SEED, BLOCK)
    index.apply("a", stored([5, 6, 7], None, tokens(1, 2, 3)), seed=SEED, now=0.0)
    index.record("a", router_hashes, now=0.0)  # all exact: nothing to guess, nothing to evict
    assert index.match(router_hashes, now=1000.0) == {"a": 3}
    assert index.stats().evictions == 0


def test_config_is_frozen_and_strict() -> None:
    config = PrefixIndexConfig()
    with pytest.raises(ValidationError):
        config.ttl_s = 1.0  # type: ignore[misc]
    with pytest.raises(ValidationError):
        PrefixIndexConfig(ttl=1.0)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        PrefixIndexConfig(evict_fraction=1.0)
    assert PrefixIndexConfig.model_fields["ttl_s"].description


# Garbage collection -------------------------------------------------------------------------------------------


def busy_index() -> PrefixIndex:
    """An index through every kind of entry, shared blocks, events, sweeps and enough churn to rebuild its dicts."""
    index = make_index("a", "b", "c", capacity_blocks=300, ttl_s=5.0, predicted_ttl_s=1.0)
    for i in range(400):
        index.record("abc"[i % 3], chain(i % 4, 1, 2, i, 3), now=i * 0.1, predicted=i % 7 == 0)
        index.match(chain(i % 4, 1, 2, i - 3, 3), now=i * 0.1)
    index.apply("a", stored([1, 2, 3], None, tokens(1, 2, 3)), seed=SEED, now=40.0)
    index.apply("b", stored([4, 5], None, tokens(1, 2)), seed=SEED, now=40.0)
    index.apply("b", stored([6], None, tokens(1)), seed=SEED, now=40.0)  # a second engine hash for a block
    index.record("c", hash_tokens(tokens(1, 2, 3, 4), SEED, BLOCK), now=40.0)
    index.apply("a", BlockRemoved((2,)), seed=SEED, now=40.0)
    index.expire(42.0)
    return index


def test_the_index_keeps_its_blocks_in_containers_the_gc_does_not_track() -> None:
    """A full collection visits every tracked container: the index's per-block dicts must not be among them."""
    index = busy_index()
    replicas = index._replicas.values()
    assert all(rep.guesses for rep in replicas) and any(index._bounds)  # every kind of entry is there
    assert any(rep.engine_blocks for rep in replicas) and any(rep.extra_engine_refs for rep in replicas)
    containers = [*index._holders, *index._bounds]
    for rep in replicas:
        containers += [rep.guesses, rep.engine_blocks, rep.extra_engine_refs]
    assert [c for c in containers if gc.is_tracked(c)] == []


def test_the_gc_tracks_no_more_objects_for_more_blocks() -> None:
    """So a full collection costs the same however many blocks the router indexes."""
    index = make_index("a", "b", "c")
    index.record("a", chain(1, 2, 3), now=0.0)
    gc.collect()
    num_tracked = len(gc.get_objects())
    for i in range(300):
        index.record("abc"[i % 3], chain(i % 5, i, *range(30)), now=i * 0.1, predicted=i % 7 == 0)
    index.apply("a", stored([1, 2, 3], None, tokens(1, 2, 3)), seed=SEED, now=30.0)
    assert index.stats().num_blocks > 9000
    gc.collect()
    assert len(gc.get_objects()) - num_tracked < 10


# Properties ---------------------------------------------------------------------------------------------------

REPLICAS = ("a", "b", "c")
paths = st.lists(st.integers(0, 2), min_size=1, max_size=7)


@dataclass
class Record:
    replica: str
    hashes: list[int]
    now: float
    predicted: bool


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def best_live_prefix(records: list[Record], replica: str, hashes: list[int], now: float, ttl: dict[bool, float]) -> int:
    live = (r for r in records if r.replica == replica and now < r.now + ttl[r.predicted])
    return max((common_prefix(hashes, r.hashes) for r in live), default=0)


record_ops = st.lists(
    st.tuples(st.sampled_from(REPLICAS), paths, st.floats(0.0, 4.0), st.booleans(), st.booleans()),
    min_size=1,
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(ops=record_ops, queries=st.lists(paths, min_size=1, max_size=5), capacity=st.integers(1, 12))
def test_records_match_exactly_the_longest_live_recorded_prefix(
    ops: list[tuple[str, list[int], float, bool, bool]], queries: list[list[int]], capacity: int
) -> None:
    """With room for everything, a replica's match is the longest prefix any live record gave it; with a small
    capacity it is never more, and a replica never holds more guesses than its capacity."""
    ttl = {False: 5.0, True: 1.0}
    roomy = make_index(*REPLICAS, ttl_s=ttl[False], predicted_ttl_s=ttl[True], capacity_blocks=10_000)
    tight = make_index(*REPLICAS, ttl_s=ttl[False], predicted_ttl_s=ttl[True], capacity_blocks=capacity)
    records: list[Record] = []
    now = 0.0
    for replica, path, dt, predicted, sweep in ops:
        now += dt
        if sweep:
            roomy.expire(now)
            tight.expire(now)
        records.append(Record(replica, chain(*path), now, predicted))
        roomy.record(replica, chain(*path), now=now, predicted=predicted)
        tight.record(replica, chain(*path), now=now, predicted=predicted)
        assert all(n <= capacity for n in tight.stats().blocks_per_replica.values())
        for query in [*queries, path]:
            hashes = chain(*query)
            want = {r: best_live_prefix(records, r, hashes, now, ttl) for r in REPLICAS}
            assert roomy.match(hashes, now=now) == {r: n for r, n in want.items() if n}
            assert all(tight.match(hashes, now=now).get(r, 0) <= n for r, n in want.items())


@dataclass
class EngineModel:
    """A replica's prefix cache as an engine keeps it: block prefixes (token tuples) under engine hashes."""

    blocks: dict[tuple[int, ...], int] = field(default_factory=dict)
    next_hash: itertools.count[int] = field(default_factory=lambda: itertools.count(1000))

    def store(self, token_ids: list[int]) -> list[BlockStored]:
        """Cache a prompt: one `stored` event per run of blocks it lacked, chained from the block before."""
        events: list[BlockStored] = []
        run: list[int] = []
        parent: int | None = None
        for end in range(BLOCK, len(token_ids) + 1, BLOCK):
            prefix = tuple(token_ids[:end])
            if prefix in self.blocks:
                if run:
                    events.append(stored(run, parent, token_ids[end - BLOCK * (len(run) + 1) : end - BLOCK]))
                    run = []
                parent = self.blocks[prefix]
                continue
            self.blocks[prefix] = next(self.next_hash)
            run.append(self.blocks[prefix])
        if run:
            end = len(token_ids) - len(token_ids) % BLOCK
            events.append(stored(run, parent, token_ids[end - BLOCK * len(run) : end]))
        return events

    def cached_blocks(self, token_ids: list[int]) -> int:
        ends = range(BLOCK, len(token_ids) + 1, BLOCK)
        return next((i for i, end in enumerate(ends) if tuple(token_ids[:end]) not in self.blocks), len(ends))


prompts = st.lists(st.integers(0, 2), min_size=1, max_size=6).map(lambda labels: tokens(*labels))
engine_ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.sampled_from(REPLICAS[:2]), prompts),
        st.tuples(st.just("remove"), st.sampled_from(REPLICAS[:2]), st.integers(0, 50)),
        st.tuples(st.just("clear"), st.sampled_from(REPLICAS[:2]), st.just(0)),
    ),
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(ops=engine_ops, queries=st.lists(prompts, min_size=1, max_size=4))
def test_exact_mode_tracks_what_each_engine_caches(
    ops: list[tuple[str, str, object]], queries: list[list[int]]
) -> None:
    """Fed an engine's events (inner blocks removed included), a replica's match is the number of leading
    blocks its engine would hit."""
    index = make_index(*REPLICAS[:2])
    engines = {r: EngineModel() for r in REPLICAS[:2]}
    for kind, replica, arg in ops:
        engine = engines[replica]
        if kind == "store":
            assert isinstance(arg, list)
            for event in engine.store(arg):
                assert index.apply(replica, event, seed=SEED, now=0.0)
        elif kind == "remove" and engine.blocks:
            assert isinstance(arg, int)
            victim = sorted(engine.blocks)[arg % len(engine.blocks)]
            index.apply(replica, BlockRemoved((engine.blocks.pop(victim),)), seed=SEED, now=0.0)
        elif kind == "clear":
            engine.blocks.clear()
            index.apply(replica, AllCleared(), seed=SEED, now=0.0)
        for query in [*queries, *(arg for k, _, arg in ops if k == "store")]:
            assert isinstance(query, list)
            want = {r: e.cached_blocks(query) for r, e in engines.items()}
            assert index.match(hash_tokens(query, SEED, BLOCK), now=0.0) == {r: n for r, n in want.items() if n}
    assert index.stats().num_entries == sum(len(e.blocks) for e in engines.values())


@settings(max_examples=100, deadline=None)
@given(
    labels=st.lists(st.integers(0, 3), min_size=1, max_size=6),
    num_stored=st.integers(1, 6),
    num_recorded=st.integers(1, 6),
    predicted=st.booleans(),
)
def test_stored_and_record_of_the_same_blocks_commute(
    labels: list[int], num_stored: int, num_recorded: int, predicted: bool
) -> None:
    """Applying a `stored` then recording the same prompt matches like recording first, at every later time."""
    token_ids = tokens(*labels)
    router_hashes = hash_tokens(token_ids, SEED, BLOCK)
    num_stored = min(num_stored, len(labels))
    event = stored(list(range(1, num_stored + 1)), None, token_ids[: num_stored * BLOCK])
    recorded = router_hashes[:num_recorded]
    stored_first = make_index("a", ttl_s=10.0, predicted_ttl_s=1.0)
    stored_first.apply("a", event, seed=SEED, now=0.0)
    stored_first.record("a", recorded, now=0.0, predicted=predicted)
    recorded_first = make_index("a", ttl_s=10.0, predicted_ttl_s=1.0)
    recorded_first.record("a", recorded, now=0.0, predicted=predicted)
    recorded_first.apply("a", event, seed=SEED, now=0.0)
    for now in (0.0, 0.5, 1.0, 9.0, 10.0, 100.0):
        for end in range(1, len(router_hashes) + 1):
            assert stored_first.match(router_hashes[:end], now=now) == recorded_first.match(
                router_hashes[:end], now=now
            )
        assert stored_first.expire(now) == recorded_first.expire(now)
        assert stored_first.stats() == recorded_first.stats()
    assert stored_first.match(router_hashes, now=100.0) == {"a": num_stored}
