"""The block-hash contract (DESIGN.md §1): pinned values the replica and the simulator rely on."""

from __future__ import annotations

import struct

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from router.policy.hashing import ChainMemo, chain_hashes, hash_text, hash_tokens, namespace_seed, pack_tokens
from router.policy.prefix_index import PrefixIndex, PrefixIndexConfig
from router.policy.routing_text import chat_routing_key

SEED = namespace_seed("shoal-demo")


def test_pinned_text_hashes() -> None:
    assert hash_text(b"a" * 130, SEED) == [9423797586876040807, 2689915107622268764]


def test_pinned_token_hashes() -> None:
    assert hash_tokens(list(range(40)), SEED) == [8069749931875024725, 7765077088569949177]


def test_first_block_is_xxh3_of_seed_and_little_endian_uint32_tokens() -> None:
    expected = xxhash.xxh3_64_intdigest(b"shoal-demo" + struct.pack("<16I", *range(16)))
    assert hash_tokens(list(range(16)), SEED)[0] == expected
    assert pack_tokens([1, 2**32 - 1]) == b"\x01\x00\x00\x00\xff\xff\xff\xff"


def test_chaining_from_a_parent_continues_the_chain() -> None:
    whole = hash_tokens(list(range(48)), SEED)
    assert hash_tokens(list(range(16, 48)), SEED, parent_hash=whole[0]) == whole[1:]


@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=6), st.integers(min_value=1, max_value=5))
def test_blocks_with_a_shared_tail_hash_as_their_tokens(ids: list[int], tail_tokens: int) -> None:
    """The simulator's made-up Mooncake blocks (an id, then a fixed tail) hashed without building them whole."""
    tail = [7, 0, 3, 9, 1][:tail_tokens]  # each block: one id, then these tokens
    tokens = [t for i in ids for t in [i, *tail]]
    expected = hash_tokens(tokens, b"model", 1 + tail_tokens)
    assert chain_hashes([pack_tokens([i]) for i in ids], b"model", tail=pack_tokens(tail)) == expected


def test_only_full_blocks_are_hashed() -> None:
    assert hash_text(b"x" * 63, SEED) == []
    assert len(hash_text(b"x" * 191, SEED)) == 2
    assert len(hash_tokens(list(range(31)), SEED)) == 1


def test_seed_namespaces_models_and_adapters() -> None:
    text = b"y" * 64
    assert hash_text(text, namespace_seed("a")) != hash_text(text, namespace_seed("b"))
    assert hash_text(text, namespace_seed("a", "lora")) != hash_text(text, namespace_seed("a"))
    assert namespace_seed("a", "bc") != namespace_seed("ab", "c")


def test_max_blocks_bounds_the_work() -> None:
    assert hash_text(b"z" * 640, SEED, max_blocks=3) == hash_text(b"z" * 640, SEED)[:3]


def test_bad_block_size_and_token_ids_are_rejected() -> None:
    with pytest.raises(ValueError):
        hash_text(b"abc", SEED, block_size=0)
    with pytest.raises(OverflowError):
        hash_tokens([2**32] * 16, SEED)


_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": st.text(max_size=200)}
)


@given(st.lists(_message, min_size=1, max_size=6), _message)
def test_a_conversation_extended_by_one_turn_keeps_every_hash(
    messages: list[dict[str, str]], turn: dict[str, str]
) -> None:
    short = chat_routing_key({"messages": messages}).text
    longer = chat_routing_key({"messages": [*messages, turn]}).text
    assert short is not None and longer is not None
    assert longer.startswith(short)
    short_hashes = hash_text(short, SEED, block_size=16)
    assert hash_text(longer, SEED, block_size=16)[: len(short_hashes)] == short_hashes


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.lists(st.integers(0, 2**32 - 1), max_size=64))
def test_token_prompts_extended_keep_their_hashes(prefix: list[int], suffix: list[int]) -> None:
    short = hash_tokens(prefix, SEED, block_size=8)
    assert hash_tokens(prefix + suffix, SEED, block_size=8)[: len(short)] == short


@given(
    st.binary(max_size=3000),
    st.lists(st.binary(max_size=1500), min_size=1, max_size=4),
    st.sampled_from([8, 16, 64]),
    st.sampled_from([1, 3, 8]),
    st.none() | st.integers(0, 100),
)
def test_the_chain_memo_gives_exactly_the_direct_hashes(
    prefix: bytes, suffixes: list[bytes], block_size: int, checkpoint_blocks: int, max_blocks: int | None
) -> None:
    memo = ChainMemo(checkpoint_blocks=checkpoint_blocks, max_entries=16)
    for seed in (SEED, namespace_seed("other-model")):
        for suffix in suffixes:  # shared prefixes: later calls hit the memo
            data = prefix + suffix
            expected = hash_text(data, seed, block_size, max_blocks=max_blocks)
            assert memo.hash_text(data, seed, block_size, max_blocks=max_blocks) == expected
    assert len(memo) <= 16


@given(st.lists(st.integers(0, 2**32 - 1), max_size=300), st.lists(st.integers(0, 2**32 - 1), max_size=100))
def test_the_chain_memo_in_token_mode(prefix: list[int], suffix: list[int]) -> None:
    memo = ChainMemo(checkpoint_blocks=2)
    for ids in (prefix, prefix + suffix, prefix):
        assert memo.hash_tokens(ids, SEED, block_size=4) == hash_tokens(ids, SEED, block_size=4)


def test_the_chain_memo_stores_chunks_seen_twice_and_stays_bounded() -> None:
    memo = ChainMemo(checkpoint_blocks=4, max_entries=2)
    system = b"s" * (64 * 8)  # two chunks of 4 blocks

    def prompt(turn: bytes) -> list[int]:
        return memo.hash_text(system + turn * 64 * 4, SEED)

    prompt(b"a")
    assert (memo.hits, memo.misses, len(memo)) == (0, 3, 0)  # seen once: nothing stored yet
    prompt(b"b")
    assert (memo.hits, memo.misses, len(memo)) == (0, 6, 2)  # the system prompt's chunks, seen twice, are stored
    prompt(b"c")
    assert (memo.hits, memo.misses) == (2, 7)  # and now come from the memo
    prompt(b"a")  # the "a" chunk is seen a second time: stored, and the oldest chunk goes
    assert (memo.hits, memo.misses, len(memo)) == (4, 8, 2)
    memo.hash_text(system, namespace_seed("another model"))
    assert memo.misses == 10  # another seed never shares a chunk


def test_a_prompt_chain_hashes_only_as_far_as_the_index_knows() -> None:
    memo = ChainMemo(checkpoint_blocks=4)
    data = bytes(range(256)) * 9  # 36 blocks of 64 bytes: 9 chunks of 4
    expected = hash_text(data, SEED)
    known = set(expected[:10])  # an index holding the first 10 blocks

    chain = memo.chain_text(data, SEED)
    prefix = chain.prefix(known.__contains__)
    assert prefix == expected[:11]  # up to the first block outside the index
    assert not chain.is_complete and chain.num_blocks == 36
    assert chain.complete() is prefix and prefix == expected  # one list, completed in place
    assert chain.is_complete and chain.complete() == expected

    # Token ids are packed only as far as the hashes need them, and give the same hashes as when packed first.
    ids = list(range(1000))
    tokens = hash_tokens(ids, SEED, block_size=4)
    lazy = memo.chain_tokens(ids, SEED, block_size=4)
    assert lazy.prefix(lambda _: False) == tokens[:1]
    assert len(lazy._data) < 4 * len(ids)
    assert lazy.complete() == tokens
    assert memo.chain_tokens(ids, SEED, block_size=4, packed=pack_tokens(ids)).complete() == tokens


@given(
    st.binary(min_size=0, max_size=64 * 40),
    st.integers(0, 40),
    st.sampled_from([1, 3, 8]),
    st.booleans(),
)
def test_a_match_over_the_chain_prefix_equals_a_match_over_all_hashes(
    data: bytes, indexed_blocks: int, checkpoint_blocks: int, is_seen_before: bool
) -> None:
    """What `RoutingCore.prepare` relies on: a decision on the prefix is the decision on the whole prompt."""
    index = PrefixIndex(PrefixIndexConfig(capacity_blocks=1000, ttl_s=100.0))
    index.add_replica("a")
    index.add_replica("b")
    full = hash_text(data, SEED)
    index.record("a", full[:indexed_blocks], now=0.0)
    index.record("b", full[: indexed_blocks // 2], now=0.0)
    memo = ChainMemo(checkpoint_blocks=checkpoint_blocks)
    if is_seen_before:  # chunks come from the memo
        memo.hash_text(data, SEED)
        memo.hash_text(data, SEED)
    chain = memo.chain_text(data, SEED)
    prefix = list(chain.prefix(index.holds))
    assert prefix == full[: len(prefix)]
    assert index.match(prefix, now=1.0) == index.match(full, now=1.0)
    assert chain.complete() == full
