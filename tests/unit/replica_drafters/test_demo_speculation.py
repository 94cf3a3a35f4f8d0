"""On the demo model and its packaged drafter: greedy output with speculation equals greedy output without it,
token for token, on 200 demo chat requests, with the experts in the model's dtype and in NVFP4; and the drafter
drafts well enough that the comparison means something (most of its drafts are accepted)."""

from __future__ import annotations

import copy

import pytest

from replica.demo.build import ensure_demo_model
from replica.demo.corpus import chat_requests
from replica.drafters.checkpoint import DrafterModel, default_num_speculative_tokens, drafter_runtime, load_drafter
from replica.engine.engine import EngineConfig, LLMEngine
from replica.engine.sampling import SamplingParams
from replica.model.loader import load_model
from replica.model.model import MoEForCausalLM
from replica.quant.experts import quantize_model_experts
from replica.tokenizer import Tokenizer

NUM_PROMPTS = 200
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def demo() -> tuple[MoEForCausalLM, Tokenizer, DrafterModel, list[list[int]]]:
    path = ensure_demo_model()
    model = load_model(path)
    tokenizer = Tokenizer.from_file(path / "tokenizer.json")
    drafter = load_drafter(path / "drafter", model)
    bodies = chat_requests(NUM_PROMPTS, seed=515)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(b["messages"], tools=b.get("tools"))) for b in bodies]
    return model, tokenizer, drafter, prompts


def generate(
    model: MoEForCausalLM, tokenizer: Tokenizer, prompts: list[list[int]], drafter: DrafterModel | None
) -> tuple[list[list[int]], tuple[int, float]]:
    """Greedy outputs in prompt order, and (verifications, mean acceptance length)."""
    num_blocks = 16 * ((max(len(p) for p in prompts) + MAX_TOKENS) // 16 + 3)
    k = default_num_speculative_tokens(drafter) if drafter is not None else 0
    config = EngineConfig(num_blocks=num_blocks, max_num_seqs=16, max_num_batched_tokens=2048, num_speculative_tokens=k)
    runtime = (
        drafter_runtime(drafter, num_blocks=num_blocks, block_size=16, num_speculative_tokens=k) if drafter else None
    )
    engine = LLMEngine(model, config, eos_token_ids=tokenizer.eos_token_ids, drafter=runtime)
    ids = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)) for p in prompts]
    out: dict[int, list[int]] = {i: [] for i in ids}
    drafts = accepted = 0
    while engine.has_work:
        result = engine.step()
        for o in result.outputs:
            out[o.seq_id].extend(o.new_token_ids)
        drafts += result.speculation.num_drafts
        accepted += result.speculation.num_accepted_tokens
    return [out[i] for i in ids], (drafts, 1 + accepted / max(drafts, 1))


@pytest.mark.parametrize("experts", ["model dtype", "nvfp4"])
def test_speculative_greedy_equals_plain_greedy_on_the_demo_model(
    demo: tuple[MoEForCausalLM, Tokenizer, DrafterModel, list[list[int]]], experts: str
) -> None:
    model, tokenizer, drafter, prompts = demo
    if experts == "nvfp4":
        model = copy.deepcopy(model)
        quantize_model_experts(model, mode="w4a16")
    plain, _ = generate(model, tokenizer, prompts, None)
    spec, (verifications, acceptance_length) = generate(model, tokenizer, prompts, drafter)
    differing = [i for i, (a, b) in enumerate(zip(plain, spec, strict=True)) if a != b]
    assert not differing, f"{len(differing)} of {NUM_PROMPTS} outputs differ, e.g. prompt {differing[0]}"
    assert sum(len(o) for o in plain) > NUM_PROMPTS * 20
    assert verifications > 500 and acceptance_length > 3.0, (verifications, acceptance_length)
