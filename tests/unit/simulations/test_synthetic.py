"""Synthetic workloads: seeded, Zipf-popular system prompts, conversations that extend their previous turn."""

from __future__ import annotations

from collections import Counter

from simulations.synthetic import SessionsConfig, SessionsWorkload, SharedPrefixConfig, SharedPrefixWorkload


def test_shared_prefix_requests_share_their_system_prompt_and_popularity_is_zipf() -> None:
    config = SharedPrefixConfig(
        num_requests=400, num_system_prompts=8, zipf_s=1.0, system_prompt_tokens=(320, 320), user_tokens=(40, 40)
    )
    requests = list(SharedPrefixWorkload(config).requests())
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    heads = Counter(r.hashes[0] for r in requests)
    assert len(heads) == 8
    counts = sorted(heads.values(), reverse=True)
    assert counts[0] > 2 * counts[3]  # rank 1 about 4x rank 4 under Zipf(1)
    by_head: dict[int, tuple[int, list[int]]] = {}
    for r in requests:
        first_id, first = by_head.setdefault(r.hashes[0], (r.id, list(r.hashes)))
        assert list(r.hashes[:20]) == first[:20]  # 320 tokens = 20 shared blocks
        if r.id != first_id:
            assert r.hashes[20] != first[20]  # each user's own text
    again = list(SharedPrefixWorkload(config).requests())
    assert [r.hashes for r in again] == [r.hashes for r in requests]


def test_each_turn_extends_the_previous_turn_with_its_answer() -> None:
    config = SessionsConfig(num_sessions=30, mean_turns=4.0, think_time_s=5.0, seed=7)
    requests = list(SessionsWorkload(config).requests())
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    last: dict[str, list[int]] = {}
    turns = Counter(r.session for r in requests)
    assert len(turns) == 30 and max(turns.values()) > 1
    for r in requests:
        assert r.session is not None and r.cache_hashes is not None
        assert list(r.cache_hashes[: len(r.hashes)]) == list(r.hashes)
        previous = last.get(r.session)
        if previous is not None:
            assert list(r.hashes[: len(previous)]) == previous  # the whole previous turn, answer included
        last[r.session] = list(r.cache_hashes)
        tokens = r.tokens.block_tokens(len(r.hashes) - 1)
        assert len(tokens) == 16
