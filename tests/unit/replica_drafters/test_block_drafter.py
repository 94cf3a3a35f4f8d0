"""The block drafter drafts in the engine exactly what its training forward computes, drawn with its positions' keys."""

from __future__ import annotations

import torch

from replica.drafters.block import BlockDrafter, BlockDrafterConfig, BlockDrafterModel
from replica.engine.engine import EngineConfig, LLMEngine
from replica.engine.sampler import noise_keys, sample
from replica.engine.sampling import SamplingParams
from replica.model.model import MoEForCausalLM


def random_block_drafter(model: MoEForCausalLM, k: int) -> BlockDrafterModel:
    cfg = BlockDrafterConfig(
        vocab_size=128, hidden_size=64, feature_layers=(0, 1), block_size=k, head_dim=16, intermediate_size=64
    )
    drafter = BlockDrafterModel(cfg, model)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return drafter.eval()


def test_engine_drafts_equal_the_training_forward(model: MoEForCausalLM) -> None:
    k = 4
    drafter = random_block_drafter(model, k)
    config = EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16, num_speculative_tokens=k)
    engine = LLMEngine(
        model, config, drafter=BlockDrafter(drafter, num_blocks=64, block_size=4, num_speculative_tokens=k)
    )
    prompt = [7, 3, 99, 12, 5, 64, 2, 31, 8, 40, 11, 13, 90, 17, 6, 1, 77, 23, 4]  # two prefill chunks
    engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.9, seed=3, ignore_eos=True))
    first = []
    while not first:
        first = [t for o in engine.step().outputs for t in o.new_token_ids]
    (seq,) = engine.scheduler.running
    drafts = seq.draft_token_ids
    assert len(drafts) >= 1

    # The training path: the target over the whole sequence without a cache, the block at the first output token.
    ids = torch.tensor([prompt + first])
    with torch.no_grad():
        _, _, features = model.forward_train_with_features(ids, drafter.config.feature_layers)
        assert features is not None
        anchor = len(prompt)
        positions = torch.arange(anchor)
        cos, sin = drafter.rotary(positions)
        context = drafter.context(features[0, :anchor])
        kv = [layer.context_kv(context, cos, sin) for layer in drafter.block_layers]
        kv = [(k_.unsqueeze(0), v_.unsqueeze(0)) for k_, v_ in kv]
        mask = torch.zeros(1, 1, 1, anchor)
        hidden, unary = drafter.block_forward(ids[0, anchor:], torch.tensor([anchor]), kv, mask)
        previous = torch.tensor([[first[0], *drafts[:-1]]])
        scores = (
            drafter.path.scores(unary[:, : len(drafts)], drafter.path.proj(hidden[:, : len(drafts)]), previous)[0] / 0.9
        )
        # Draft j decides position len(prompt) + 1 + j (the first output token is the anchor), with seed 3.
        positions = torch.arange(len(drafts)).unsqueeze(0) + len(prompt) + 1
        keys = noise_keys(torch.tensor([3]), positions)[0]
        assert sample(scores.softmax(-1), keys).tolist() == drafts
