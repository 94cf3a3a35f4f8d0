"""Prefix caching through the engine: a request sharing a prefix with an earlier one reads the earlier request's
blocks, reports them as cached tokens, and computes exactly what a cold engine computes.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
import torch

from replica.engine.engine import EngineConfig, LLMEngine
from replica.engine.sampling import SamplingParams
from replica.model.model import MoEForCausalLM
from router.policy.hashing import hash_tokens, namespace_seed
from router.policy.kv_events import BlockStored
from tests.unit.replica_engine.conftest import Run, drive, greedy

BS = 4
SEED = namespace_seed("tiny-moe")
_rng = random.Random(7)
FIRST = [_rng.randrange(128) for _ in range(30)]


def engine(model: MoEForCausalLM, **changes: Any) -> LLMEngine:
    config = EngineConfig(num_blocks=64, block_size=BS, max_num_batched_tokens=64, max_num_seqs=8, hash_seed=SEED)
    return LLMEngine(model, replace(config, **changes))


def run_one(e: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[int, Run]:
    seq_id = e.add_request(prompt, params)
    return seq_id, drive(e)


def assert_same_as_cold(model: MoEForCausalLM, warm: Run, seq_id: int, prompt: list[int], max_tokens: int) -> None:
    cold_id, cold = run_one(engine(model), prompt, greedy(max_tokens))
    assert cold.finals[cold_id].num_cached_tokens == 0
    assert warm.tokens[seq_id] == cold.tokens[cold_id]
    torch.testing.assert_close(torch.stack(warm.logits[seq_id]), torch.stack(cold.logits[cold_id]), atol=1e-5, rtol=0)


def test_shared_prefix_is_cached_and_computes_like_a_cold_run(model: MoEForCausalLM) -> None:
    e = engine(model)
    first_id, first = run_one(e, FIRST, greedy(4))
    assert first.finals[first_id].num_cached_tokens == 0
    # The events announce the first request's computed blocks under the router's hashes: its prompt and all but
    # the last output token (which is sampled, never computed).
    computed = FIRST + first.tokens[first_id][:-1]
    stored = [h for step in first.steps for ev in step.events if isinstance(ev, BlockStored) for h in ev.block_hashes]
    assert stored == hash_tokens(computed, SEED, BS)

    second = FIRST[:22] + [_rng.randrange(128) for _ in range(10)]  # shares 5 full blocks (22 // 4)
    second_id, warm = run_one(e, second, greedy(6))
    assert {o.num_cached_tokens for o in warm.outputs[second_id]} == {20}
    # The second request's step computed only its uncached tokens.
    assert warm.steps[0].num_batched_tokens == len(second) - 20
    assert_same_as_cold(model, warm, second_id, second, 6)


def test_repeated_prompt_recomputes_its_last_token(model: MoEForCausalLM) -> None:
    prompt = FIRST[:28]  # exactly 7 blocks, all cached after the first run
    e = engine(model)
    run_one(e, prompt, greedy(1))
    again_id, again = run_one(e, prompt, greedy(5))
    assert again.finals[again_id].num_cached_tokens == 24  # (28 - 1) // 4 blocks: one token is left to compute
    assert again.steps[0].num_batched_tokens == 4
    assert_same_as_cold(model, again, again_id, prompt, 5)


def test_next_turn_hits_blocks_of_generated_tokens(model: MoEForCausalLM) -> None:
    e = engine(model)
    first_id, first = run_one(e, FIRST, greedy(7))
    computed = len(FIRST) + 7 - 1
    follow_up = FIRST + first.tokens[first_id] + [1, 2, 3]
    next_id, warm = run_one(e, follow_up, greedy(4))
    assert warm.finals[next_id].num_cached_tokens == computed // BS * BS == 36
    assert_same_as_cold(model, warm, next_id, follow_up, 4)


def test_concurrent_requests_share_blocks_computed_while_they_run(model: MoEForCausalLM) -> None:
    """A request admitted while another's prefill is under way hits the chunks already computed."""
    e = engine(model, max_num_batched_tokens=8)
    first_id = e.add_request(FIRST, greedy(3))
    second = [*FIRST[:24], 5, 6, 7]
    # The first prompt's 30 tokens take steps of 8, 8, 8 and 6; the second is admitted in the budget left in the
    # fourth step, when the first has computed 24 tokens.
    second_id = e.add_request(second, greedy(3))
    run = drive(e)
    assert run.finals[first_id].num_cached_tokens == 0
    assert run.finals[second_id].num_cached_tokens == 24

    def first_step(seq_id: int) -> int:
        return next(i for i, step in enumerate(run.steps) if any(o.seq_id == seq_id for o in step.outputs))

    assert first_step(first_id) == 3 and first_step(second_id) == 4
    assert_same_as_cold(model, run, second_id, second, 3)


def test_prefix_caching_disabled(model: MoEForCausalLM) -> None:
    e = engine(model, enable_prefix_caching=False)
    first_id, first = run_one(e, FIRST, greedy(4))
    second_id, second = run_one(e, FIRST, greedy(4))
    assert first.finals[first_id].num_cached_tokens == second.finals[second_id].num_cached_tokens == 0
    assert second.steps[0].num_batched_tokens == len(FIRST)
    assert all(step.events == [] for step in first.steps + second.steps)
    assert first.tokens[first_id] == second.tokens[second_id]


def test_a_warm_up_leaves_no_cached_block_and_no_event(model: MoEForCausalLM) -> None:
    e = engine(model)
    e.warm_up()
    assert not e.has_work and not e.block_manager.hash_to_block and not e.block_manager.drain_events()
    # The first request after it finds nothing cached, announces its blocks as a cold engine's first would, and
    # computes what a cold engine computes.
    seq_id, run = run_one(e, FIRST, greedy(4))
    assert run.finals[seq_id].num_cached_tokens == 0
    stored = [h for step in run.steps for ev in step.events if isinstance(ev, BlockStored) for h in ev.block_hashes]
    assert stored == hash_tokens(FIRST + run.tokens[seq_id][:-1], SEED, BS)
    assert_same_as_cold(model, run, seq_id, FIRST, 4)
    # Only an idle engine warms up.
    e.add_request(FIRST, greedy(1))
    with pytest.raises(RuntimeError, match="idle engine"):
        e.warm_up()
