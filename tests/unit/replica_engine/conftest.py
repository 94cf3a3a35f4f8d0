"""Shared pieces of the engine tests: a tiny MoE model, and a driver that runs an engine to completion.

The driver checks the engine's block accounting after every step and that each request gets exactly one finished
output, and records every step's logits (a forward hook on the LM head, which the runner calls once per step on
the rows it samples, in the order the step's outputs come back).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from replica.engine.engine import LLMEngine, RequestOutput, StepResult
from replica.engine.sampling import SamplingParams
from replica.model.config import ModelConfig
from replica.model.loader import init_weights
from replica.model.model import MoEForCausalLM

TINY = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    shared_expert_intermediate_size=64,
    max_position_embeddings=512,
)


@pytest.fixture(scope="module", autouse=True)
def single_thread() -> Iterator[None]:
    """One intra-op thread: the tiny model's ops are too small to split, and on a busy machine the idle threads'
    spin-waits make each step several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> MoEForCausalLM:
    m = MoEForCausalLM(TINY)
    init_weights(m, seed=0, std=0.2)
    return m.eval()


def greedy(max_tokens: int, **changes: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **changes)


@dataclass
class Run:
    """What a driven engine produced, per request id."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    finals: dict[int, RequestOutput] = field(default_factory=dict)
    logits: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """Logits [V] of every sampled token, in order."""
    outputs: dict[int, list[RequestOutput]] = field(default_factory=dict)
    num_steps: int = 0
    steps: list[StepResult] = field(default_factory=list)


@contextmanager
def capture_logits(model: MoEForCausalLM) -> Iterator[list[torch.Tensor]]:
    """Each LM-head call's output [N, V], in call order."""
    calls: list[torch.Tensor] = []
    handle = model.lm_head.register_forward_hook(lambda _mod, _args, out: calls.append(out.detach().clone()))
    try:
        yield calls
    finally:
        handle.remove()


def drive(
    engine: LLMEngine,
    *,
    max_steps: int = 2000,
    between_steps: Callable[[LLMEngine, StepResult], None] | None = None,
    run: Run | None = None,
) -> Run:
    """Step `engine` until it has no work; returns (or extends) what every request produced."""
    run = run or Run()
    with capture_logits(engine.model) as calls:
        while engine.has_work:
            assert run.num_steps < max_steps, f"no progress after {max_steps} steps"
            num_calls = len(calls)
            result = engine.step()
            engine.check_invariants()
            run.num_steps += 1
            run.steps.append(result)
            sampled = [o for o in result.outputs if o.new_token_ids]
            if engine.drafter is None and sampled:  # one sampled row per output (with drafts, one per verified
                rows = calls[num_calls]  # position); the step's first LM-head call (prompt logprobs' comes after)
                assert len(sampled) == rows.shape[0]
                for out, row in zip(sampled, rows, strict=True):
                    run.logits.setdefault(out.seq_id, []).append(row)
            for out in result.outputs:
                assert out.seq_id not in run.finals, f"request {out.seq_id} produced output after finishing"
                run.outputs.setdefault(out.seq_id, []).append(out)
                run.tokens.setdefault(out.seq_id, []).extend(out.new_token_ids)
                if out.finished:
                    run.finals[out.seq_id] = out
            if between_steps is not None:
                between_steps(engine, result)
    return run


def dense_logits(model: MoEForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """Logits [S, V] of `model.forward_train` (no cache) over one sequence."""
    with torch.inference_mode():
        logits, _ = model.forward_train(torch.tensor([token_ids]))
    return logits[0]


def dense_greedy(model: MoEForCausalLM, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy decoding by re-running the whole sequence without a cache for every token."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(int(dense_logits(model, tokens)[-1].argmax()))
    return tokens[len(prompt) :]
