"""Synthetic workloads: seeded, Zipf-popular system prompts, conversations and agent tool loops that extend their
previous request."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from pydantic import ValidationError

from simulations.synthetic import (
    AgenticConfig,
    AgenticWorkload,
    SessionsConfig,
    SessionsWorkload,
    SharedPrefixConfig,
    SharedPrefixWorkload,
)
from simulations.workload import Request


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


def agentic_config(**overrides: object) -> AgenticConfig:
    data: dict[str, object] = {
        "num_episodes": 60,
        "episode_rate_per_s": 2.0,
        "num_agent_kinds": 4,
        "system_prompt_tokens": (400, 800),
        "task_tokens": (30, 90),
        "num_steps": (2, 6),
        "output_tokens": (10, 40),
        "tool_result_tokens": (50, 300),
        "tool_latency_s": (0.5, 2.0),
        "estimated_ttft_s": 0.2,
        "estimated_tpot_s": 0.01,
        "seed": 5,
    }
    return AgenticConfig.model_validate({**data, **overrides})


def test_agentic_steps_extend_the_previous_step_and_stay_within_their_ranges() -> None:
    config = agentic_config()
    requests = list(AgenticWorkload(config).requests())
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    episodes: dict[str, list[Request]] = {}
    for r in requests:
        assert r.session is not None and r.cache_hashes is not None
        episodes.setdefault(r.session, []).append(r)
    assert len(episodes) == 60
    step_counts = Counter(len(steps) for steps in episodes.values())
    assert set(step_counts) <= set(range(2, 7)) and len(step_counts) >= 3
    heads: dict[int, list[int]] = {}
    for steps in episodes.values():
        first = steps[0]
        system_blocks = 400 // 16
        heads.setdefault(first.hashes[0], list(first.hashes[:system_blocks]))
        assert list(first.hashes[:system_blocks]) == heads[first.hashes[0]]  # the kind's system prompt
        assert 400 + 30 <= first.prompt_tokens <= 800 + 90
        for previous, step in itertools.pairwise(steps):
            assert previous.cache_hashes is not None
            # The whole previous step, its tool call included, then the tool's result.
            assert list(step.hashes[: len(previous.cache_hashes)]) == list(previous.cache_hashes)
            assert len(step.hashes) > len(previous.cache_hashes)
            tool_result = step.prompt_tokens - previous.prompt_tokens - previous.output_tokens
            assert 50 <= tool_result <= 300
            gap = step.arrival_s - previous.arrival_s
            response_s = 0.2 + previous.output_tokens * 0.01
            assert response_s + 0.5 <= gap <= response_s + 2.0
        for step in steps:
            assert 10 <= step.output_tokens <= 40
            assert step.cache_hashes is not None
            assert list(step.cache_hashes[: len(step.hashes)]) == list(step.hashes)
            assert len(step.cache_hashes) == (step.prompt_tokens + step.output_tokens) // 16
    assert 1 < len(heads) <= 4
    # Zipf over kinds: the most popular kind opens more episodes than the least.
    kinds = Counter(steps[0].hashes[0] for steps in episodes.values()).most_common()
    assert kinds[0][1] > kinds[-1][1]


def test_agentic_episodes_are_seeded() -> None:
    def stream(config: AgenticConfig) -> list[tuple[float, int, int, list[int]]]:
        return [
            (r.arrival_s, r.prompt_tokens, r.output_tokens, list(r.hashes)) for r in AgenticWorkload(config).requests()
        ]

    first = stream(agentic_config())
    assert first == stream(agentic_config())
    assert first != stream(agentic_config(seed=6))


def test_agentic_ranges_are_checked() -> None:
    with pytest.raises(ValidationError, match="num_steps"):
        agentic_config(num_steps=(0, 3))
    with pytest.raises(ValidationError, match="min <= max"):
        agentic_config(tool_latency_s=(3.0, 1.0))
