"""The paged engine computes what the model computes without a cache.

Several prompts run together (so decode steps are batched and prefill chunks share steps), with a token budget
smaller than the longest prompt (so it is prefilled in chunks), for block sizes 1, 4 and 16. Every sampled
token's logits must match `forward_train` over the same tokens, and greedy tokens must equal greedy decoding
that re-runs the whole sequence for each token.
"""

from __future__ import annotations

import random

import pytest
import torch

from replica.engine.engine import EngineConfig, LLMEngine
from replica.engine.sequence import FinishReason
from replica.model.model import MoEForCausalLM
from tests.unit.replica_engine.conftest import dense_greedy, dense_logits, drive, greedy

MAX_TOKENS = 8
BUDGET = 8
"""Tokens per step: less than the 23-token prompt, which therefore takes several prefill chunks."""

_rng = random.Random(0)
PROMPTS = [[_rng.randrange(128) for _ in range(n)] for n in (5, 23, 2, 13)]


@pytest.fixture(scope="module")
def dense_reference(model: MoEForCausalLM) -> list[list[int]]:
    return [dense_greedy(model, prompt, MAX_TOKENS) for prompt in PROMPTS]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_batched_chunked_greedy_equals_dense(
    model: MoEForCausalLM, dense_reference: list[list[int]], block_size: int
) -> None:
    engine = LLMEngine(
        model,
        EngineConfig(
            num_blocks=256 // block_size + 8, block_size=block_size, max_num_batched_tokens=BUDGET, max_num_seqs=8
        ),
    )
    ids = [engine.add_request(prompt, greedy(MAX_TOKENS)) for prompt in PROMPTS]
    run = drive(engine)

    for seq_id, prompt, expected in zip(ids, PROMPTS, dense_reference, strict=True):
        assert run.tokens[seq_id] == expected, f"prompt of {len(prompt)} tokens"
        assert run.finals[seq_id].finish_reason is FinishReason.LENGTH
        # Logits of every sampled token against the dense forward over prompt + output (the last output is sampled
        # from the logits at the position before it).
        dense = dense_logits(model, prompt + expected[:-1])[len(prompt) - 1 :]
        paged = torch.stack(run.logits[seq_id])
        torch.testing.assert_close(paged, dense, atol=1e-4, rtol=1e-4)

    # The run exercised what it claims to: a prompt longer than the budget spread over several steps, and decode
    # steps with several sequences in one batch.
    long_id = ids[1]
    first_token_step = next(i for i, step in enumerate(run.steps) if any(o.seq_id == long_id for o in step.outputs))
    assert first_token_step >= -(-len(PROMPTS[1]) // BUDGET) - 1
    assert any(step.num_batched_tokens == len(step.outputs) >= 3 for step in run.steps), "no batched decode step"
    assert all(step.num_batched_tokens <= BUDGET for step in run.steps)


def test_prompt_filling_exact_blocks_and_single_token_prompt(model: MoEForCausalLM) -> None:
    """Block-boundary cases: a prompt of exactly two blocks (its first output opens a third) and a 1-token prompt."""
    prompts = [list(range(40, 48)), [7]]
    engine = LLMEngine(model, EngineConfig(num_blocks=16, block_size=4, max_num_batched_tokens=64, max_num_seqs=4))
    ids = [engine.add_request(p, greedy(6)) for p in prompts]
    run = drive(engine)
    for seq_id, prompt in zip(ids, prompts, strict=True):
        assert run.tokens[seq_id] == dense_greedy(model, prompt, 6)
