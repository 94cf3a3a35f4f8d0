"""Speculative decoding in the engine: the same greedy tokens and the same prefix-cache blocks as plain decoding,
drafts drawn with their positions' keys, the same seeded text with speculation on or off and whatever else runs,
and one host transfer per step.

Drafters: the target drafting for itself (every greedy draft accepted), a perturbed copy of the target (some drafts
accepted, some rejected), and random dense and block drafters (almost every draft rejected). Prompts are batched and
chunked under a small token budget and small blocks, so verification shares steps with prefill and other decodes.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest
import torch

from replica.drafters.block import BlockDrafter, BlockDrafterConfig, BlockDrafterModel
from replica.drafters.dense import DenseDrafterConfig, DenseDrafterModel, ModelDrafter
from replica.engine.drafting import Drafter
from replica.engine.engine import EngineConfig, LLMEngine
from replica.engine.sampling import SamplingParams
from replica.model import host
from replica.model.model import MoEForCausalLM
from replica.quant.experts import quantize_model_experts
from router.policy.kv_events import BlockStored
from tests.unit.replica_engine.conftest import TINY, Run, drive, greedy

CONFIG = EngineConfig(num_blocks=200, block_size=4, max_num_batched_tokens=24, max_num_seqs=8)
_rng = random.Random(3)
PROMPTS = [[_rng.randrange(128) for _ in range(n)] for n in (5, 31, 2, 13, 9, 17)]


def model_drafter(model: MoEForCausalLM, k: int, config: EngineConfig = CONFIG) -> ModelDrafter:
    c = model.config
    return ModelDrafter(
        model,
        vocab_size=c.vocab_size,
        num_layers=c.num_hidden_layers,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        num_blocks=config.num_blocks,
        block_size=config.block_size,
        num_speculative_tokens=k,
        dtype=model.dtype,
        device=model.device,
    )


def perturbed(model: MoEForCausalLM, scale: float, seed: int = 0) -> MoEForCausalLM:
    """A copy of the target with noise on its weights: it agrees with the target on some tokens, not all."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    return other


def random_dense(k: int, config: EngineConfig = CONFIG) -> ModelDrafter:
    torch.manual_seed(1)
    d = DenseDrafterModel(DenseDrafterConfig(vocab_size=128, hidden_size=32, head_dim=8, intermediate_size=32))
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return ModelDrafter.of(
        d.eval(), num_blocks=config.num_blocks, block_size=config.block_size, num_speculative_tokens=k
    )


def random_block(model: MoEForCausalLM, k: int, config: EngineConfig = CONFIG) -> BlockDrafter:
    torch.manual_seed(2)
    cfg = BlockDrafterConfig(
        vocab_size=128, hidden_size=64, feature_layers=(0, 1), block_size=k, head_dim=16, intermediate_size=64
    )
    d = BlockDrafterModel(cfg, model)
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return BlockDrafter(d.eval(), num_blocks=config.num_blocks, block_size=config.block_size, num_speculative_tokens=k)


def run(
    model: MoEForCausalLM,
    params: SamplingParams,
    *,
    drafter: Drafter | None = None,
    k: int = 0,
    config: EngineConfig = CONFIG,
    prompts: list[list[int]] = PROMPTS,
    **changes: Any,
) -> tuple[Run, list[int]]:
    engine = LLMEngine(model, replace(config, num_speculative_tokens=k, **changes), drafter=drafter)
    ids = [engine.add_request(p, params) for p in prompts]
    return drive(engine), ids


def drafters(model: MoEForCausalLM, k: int) -> dict[str, Drafter]:
    return {
        "self": model_drafter(model, k),
        "perturbed": model_drafter(perturbed(model, 0.05), k),
        "random-dense": random_dense(k),
        "random-block": random_block(model, k),
    }


def accepted_fraction(r: Run) -> float:
    drafted = sum(s.speculation.num_draft_tokens for s in r.steps)
    return sum(s.speculation.num_accepted_tokens for s in r.steps) / max(drafted, 1)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_output_and_cached_blocks_equal_plain_decoding(model: MoEForCausalLM, k: int) -> None:
    plain, plain_ids = run(model, greedy(24))
    plain_stored = stored_hashes(plain)
    fractions = {}
    for name, drafter in drafters(model, k).items():
        spec, ids = run(model, greedy(24), drafter=drafter, k=k, adaptive_speculation=False)
        for a, b in zip(plain_ids, ids, strict=True):
            assert spec.tokens[b] == plain.tokens[a], f"{name}: prompt of {len(PROMPTS[plain_ids.index(a)])} tokens"
        # The router sees the same blocks: rejected drafts never reach the prefix cache or a KV event.
        assert stored_hashes(spec) == plain_stored, name
        fractions[name] = accepted_fraction(spec)
        assert sum(s.speculation.num_drafts for s in spec.steps) > 0, name
    assert fractions["self"] == 1.0
    assert 0.05 < fractions["perturbed"] < 0.95, fractions  # both paths of the acceptance test ran
    assert fractions["random-dense"] < 0.2 and fractions["random-block"] < 0.2


def stored_hashes(r: Run) -> list[int]:
    return sorted(h for step in r.steps for e in step.events if isinstance(e, BlockStored) for h in e.block_hashes)


def test_a_perfect_drafter_emits_k_plus_one_tokens_per_step(model: MoEForCausalLM) -> None:
    k = 4
    spec, _ = run(
        model, greedy(20), drafter=model_drafter(model, k), k=k, prompts=[PROMPTS[1]], adaptive_speculation=False
    )
    per_step = [len(outs[0].new_token_ids) for outs in ([o for o in s.outputs] for s in spec.steps) if outs]
    # The first token comes from the prefill; then k + 1 per step until max_tokens cuts the last one.
    assert per_step[1:-1] == [k + 1] * (len(per_step) - 2)
    assert sum(per_step) == 20


def test_nvfp4_experts_speculate_to_the_same_greedy_tokens(model: MoEForCausalLM) -> None:
    quantized = copy.deepcopy(model)
    quantize_model_experts(quantized, mode="w4a16")
    plain, a = run(quantized, greedy(16))
    spec, b = run(quantized, greedy(16), drafter=model_drafter(perturbed(model, 0.05), 3), k=3)
    assert [spec.tokens[i] for i in b] == [plain.tokens[i] for i in a]
    assert 0 < accepted_fraction(spec) < 1


def test_sampled_drafts_are_drawn_with_the_keys_of_their_positions(model: MoEForCausalLM) -> None:
    """Drafting for itself at temperature 1, q equals p: every draft is the target's token at its position unless
    the keys are misaligned (a draft drawn with another position's key differs most of the time)."""
    params = SamplingParams(max_tokens=24, temperature=1.0, top_k=40, seed=11, ignore_eos=True)
    spec, _ = run(model, params, drafter=model_drafter(model, 4), k=4, adaptive_speculation=False)
    assert accepted_fraction(spec) > 0.99


def test_seeded_sampling_with_speculation_is_reproducible(model: MoEForCausalLM) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    first, ids = run(model, params, drafter=model_drafter(perturbed(model, 0.05), 3), k=3, adaptive_speculation=False)
    again, ids2 = run(model, params, drafter=model_drafter(perturbed(model, 0.05), 3), k=3, adaptive_speculation=False)
    assert [first.tokens[i] for i in ids] == [again.tokens[i] for i in ids2]
    other, ids3 = run(
        model,
        replace(params, seed=99),
        drafter=model_drafter(perturbed(model, 0.05), 3),
        k=3,
        adaptive_speculation=False,
    )
    assert [other.tokens[i] for i in ids3] != [first.tokens[i] for i in ids]


SEEDED = replace(CONFIG, max_num_seqs=48, num_blocks=400)


def seeded_texts(
    model: MoEForCausalLM, seeds: list[int], *, alone: bool, drafter: Drafter | None = None, **changes: Any
) -> dict[int, list[int]]:
    """{seed: tokens} of one seeded request per seed at T=0.8: each in an engine of its own (`alone`), or all of
    them in one engine amid 16 unseeded requests (arriving first, so the seeded ones share steps with them)."""
    params = SamplingParams(max_tokens=16, temperature=0.8, ignore_eos=True)
    config = replace(SEEDED, **changes)
    prompt = PROMPTS[3]
    out = {}
    if alone:
        for seed in seeds:
            engine = LLMEngine(model, config, drafter=drafter)
            i = engine.add_request(prompt, replace(params, seed=seed))
            out[seed] = drive(engine).tokens[i]
        return out
    engine = LLMEngine(model, config, drafter=drafter)
    for j in range(16):
        engine.add_request(PROMPTS[j % len(PROMPTS)], params)
    ids = {seed: engine.add_request(prompt, replace(params, seed=seed)) for seed in seeds}
    r = drive(engine)
    return {seed: r.tokens[i] for seed, i in ids.items()}


def test_a_seed_gives_one_text_with_speculation_on_or_off_alone_or_amid_others(model: MoEForCausalLM) -> None:
    seeds = list(range(100, 120))
    k = 3
    perturbed_drafter = model_drafter(perturbed(model, 0.05), k, SEEDED)
    variants = {
        "plain alone": seeded_texts(model, seeds, alone=True),
        "plain amid": seeded_texts(model, seeds, alone=False),
        "k=3 alone": seeded_texts(model, seeds, alone=True, drafter=perturbed_drafter, num_speculative_tokens=k),
        "k=3 amid": seeded_texts(model, seeds, alone=False, drafter=perturbed_drafter, num_speculative_tokens=k),
        "block k=5 adaptive amid": seeded_texts(
            model, seeds, alone=False, drafter=random_block(model, 5, SEEDED), num_speculative_tokens=5
        ),
    }
    reference = variants["plain alone"]
    assert len({tuple(t) for t in reference.values()}) == len(seeds)  # the seeds draw different texts
    for name, texts in variants.items():
        assert texts == reference, name


@contextmanager
def count_host_transfers() -> Iterator[list[str]]:
    """Every Python-level call that makes the host wait for a tensor's value, with the sampler and the MoE layer
    taking an accelerator's way (on a CPU they decide what to compute from values: `host.HOST_DECISIONS_ON_CPU`)."""
    calls: list[str] = []
    names = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero")
    originals = {name: getattr(torch.Tensor, name) for name in names}

    def wrap(name: str) -> Any:
        original = originals[name]

        def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return original(self, *args, **kwargs)

        return counted

    try:
        host.HOST_DECISIONS_ON_CPU = False
        for name in names:
            setattr(torch.Tensor, name, wrap(name))
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        host.HOST_DECISIONS_ON_CPU = True


@pytest.mark.parametrize("kind", ["block", "dense"])
def test_one_host_transfer_per_step(model: MoEForCausalLM, kind: str) -> None:
    k = 3
    drafter = random_block(model, k) if kind == "block" else model_drafter(perturbed(model, 0.05), k)
    engine = LLMEngine(model, replace(CONFIG, num_speculative_tokens=k), drafter=drafter)
    for p in PROMPTS:
        engine.add_request(p, SamplingParams(max_tokens=12, temperature=0.8, seed=len(p), ignore_eos=True))
    engine.add_request(PROMPTS[0], greedy(12))
    steps_with_drafts = 0
    while engine.has_work:
        with count_host_transfers() as calls:
            result = engine.step()
        sampled = any(o.new_token_ids for o in result.outputs)
        assert calls == (["tolist"] if sampled else []), calls
        steps_with_drafts += result.speculation.num_drafts > 0
    assert steps_with_drafts > 3


def test_drafts_are_cut_to_the_token_budget_and_dropped_when_blocks_run_out(model: MoEForCausalLM) -> None:
    k = 5
    tight = replace(CONFIG, max_num_batched_tokens=6, num_blocks=14)
    plain, a = run(model, greedy(12), config=tight, prompts=PROMPTS[:3])
    spec, b = run(model, greedy(12), drafter=model_drafter(model, k, tight), k=k, config=tight, prompts=PROMPTS[:3])
    assert [spec.tokens[i] for i in b] == [plain.tokens[i] for i in a]
    assert all(s.num_batched_tokens <= 6 for s in spec.steps)
    assert any(s.num_preempted for s in plain.steps + spec.steps) or any(
        0 < s.speculation.num_draft_tokens < k * s.speculation.num_drafts for s in spec.steps
    )


def test_engine_refuses_speculation_without_a_drafter(model: MoEForCausalLM) -> None:
    with pytest.raises(ValueError, match="needs a drafter"):
        LLMEngine(model, replace(CONFIG, num_speculative_tokens=2))
    wrong = MoEForCausalLM(replace(TINY, vocab_size=64))
    with pytest.raises(ValueError, match="vocabulary"):
        LLMEngine(model, replace(CONFIG, num_speculative_tokens=2), drafter=model_drafter(wrong, 2))


def test_sampled_tokens_follow_the_target_distribution_through_the_engine() -> None:
    """The end-to-end check of the plumbing (drafts, keys, positions, mismatches): on a 16-token vocabulary, the
    2nd and 3rd sampled tokens of 4,000 requests, drafted by a drafter that disagrees with the target often, have the
    target's exact marginals (computed from its logits over every prefix) within sampling noise."""
    small = MoEForCausalLM(replace(TINY, vocab_size=16))
    from replica.model.loader import init_weights

    init_weights(small, seed=4, std=0.3)
    small.eval()
    prompt = [3, 1, 4, 1, 5]
    config = replace(CONFIG, num_blocks=4000, max_num_seqs=256, max_num_batched_tokens=2048, num_speculative_tokens=2)
    drafter = model_drafter(perturbed(small, 0.5), 2, config)
    engine = LLMEngine(small, replace(config, adaptive_speculation=False), drafter=drafter)
    n = 4000
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for _ in range(n)]
    r = drive(engine, max_steps=200)
    counts = torch.zeros(2, 16)
    for i in ids:
        t = r.tokens[i]
        counts[0, t[1]] += 1
        counts[1, t[2]] += 1
    with torch.inference_mode():
        p1 = small.forward_train(torch.tensor([prompt]))[0][0, -1].softmax(-1)  # [16]
        second = torch.stack(
            [small.forward_train(torch.tensor([[*prompt, a]]))[0][0, -1].softmax(-1) for a in range(16)]
        )
        p2 = p1 @ second  # marginal of the 2nd token
        third = torch.zeros(16)
        for a in range(16):
            rows = small.forward_train(torch.tensor([[*prompt, a, b] for b in range(16)]))[0][:, -1].softmax(-1)
            third += p1[a] * (second[a] @ rows)
    assert accepted_fraction(r) < 0.8  # tokens after a mismatch carried part of the output
    for observed, expected in zip(counts / n, (p2, third), strict=True):
        assert 0.5 * (observed - expected).abs().sum() < 0.06
