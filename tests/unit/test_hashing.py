"""The block-hash contract (DESIGN.md §1): pinned values the replica and the simulator rely on."""

from __future__ import annotations

import struct

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from router.policy.hashing import hash_text, hash_tokens, namespace_seed, pack_tokens
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
