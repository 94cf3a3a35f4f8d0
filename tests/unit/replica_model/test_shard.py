"""Sharded models summed over in-process ranks equal the whole model: a decoder forward of N shards, each in its
own thread, whose layers sum partial outputs through a barrier (the same addition on every rank, as an all-reduce),
against the unsharded model's, with BF16-layout and NVFP4 experts; and shapes that do not divide are refused."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from replica.engine.runner import allocate_kv_caches
from replica.model.attention import AttentionBatch
from replica.model.config import ModelConfig
from replica.model.loader import init_weights
from replica.model.model import MoEForCausalLM
from replica.model.shard import ShardError, check_shardable, shard_model
from replica.quant.experts import NVFP4Experts, quantize_model_experts

CONFIG = ModelConfig(
    vocab_size=96,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    shared_expert_intermediate_size=64,
    max_position_embeddings=256,
)


class ThreadGroup:
    """N ranks as threads of this process: every rank's tensor is summed in rank order behind a barrier."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._slots: list[torch.Tensor | None] = [None] * world_size
        self._barrier = threading.Barrier(world_size, timeout=30)

    def rank_view(self, rank: int) -> _Rank:
        return _Rank(self, rank)


class _Rank:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.world_size = group, rank, group.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        g = self.group
        g._slots[self.rank] = x.clone()
        g._barrier.wait()
        total = g._slots[0]
        assert total is not None
        for other in g._slots[1:]:
            assert other is not None
            total = total + other
        g._barrier.wait()
        return x.copy_(total)


def _model(*, nvfp4: bool = False, serving_layout: bool = True) -> MoEForCausalLM:
    model = MoEForCausalLM(CONFIG)
    init_weights(model, seed=3, std=0.2)
    if serving_layout:
        model.use_serving_layout()
    if nvfp4:
        quantize_model_experts(model)
    return model.eval()


def _forward(model: MoEForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """A prefill of one sequence on a fresh paged cache of the model's (possibly sharded) kv heads."""
    attn = model.decoder_layers[0].self_attn
    caches = allocate_kv_caches(
        CONFIG.num_hidden_layers, 64, attn.num_kv_heads, CONFIG.head_dim, dtype=model.dtype, device=model.device
    )
    n = input_ids.shape[0]
    batch = AttentionBatch.build(
        slot_mapping=torch.arange(n),
        query_lens=[n],
        context_lens=[n],
        block_tables=torch.arange(4).view(1, 4),
        block_size=16,
        dtype=model.dtype,
    )
    with torch.inference_mode():
        hidden = model(input_ids, torch.arange(n), caches, batch)
        return model.compute_logits(hidden)


def _sharded_logits(whole: MoEForCausalLM, world_size: int, input_ids: torch.Tensor) -> list[torch.Tensor]:
    group = ThreadGroup(world_size)
    shards = []
    for rank in range(world_size):
        shard = copy.deepcopy(whole)
        shard_model(shard, group.rank_view(rank))
        shards.append(shard)
    results: list[torch.Tensor | None] = [None] * world_size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = _forward(shards[rank], input_ids)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            group._barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return [r for r in results if r is not None]


@pytest.mark.parametrize(
    ("nvfp4", "world_size"), [(False, 2), (True, 2), (False, 4)], ids=["fp32-tp2", "nvfp4-tp2", "fp32-tp4"]
)
def test_shards_sum_to_the_whole_model(nvfp4: bool, world_size: int) -> None:
    torch.set_num_threads(1)
    whole = _model(nvfp4=nvfp4)
    input_ids = torch.randint(0, CONFIG.vocab_size, (23,), generator=torch.Generator().manual_seed(0))
    expected = _forward(whole, input_ids)
    per_rank = _sharded_logits(whole, world_size, input_ids)
    assert len(per_rank) == world_size
    for logits in per_rank[1:]:
        assert torch.equal(logits, per_rank[0]), "ranks that sum the same partials must hold the same bits"
    # Only the order of the partial sums differs from the whole model's matmuls: FP32 rounding, far below a margin.
    torch.testing.assert_close(per_rank[0], expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(per_rank[0].argmax(-1), expected.argmax(-1))


def test_shards_hold_their_slice_only() -> None:
    whole = _model(nvfp4=True)
    shard = copy.deepcopy(whole)
    shard_model(shard, ThreadGroup(2).rank_view(1))
    attn = shard.decoder_layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (4, 2)
    assert attn.qkv_proj.weight.shape == ((4 + 2 * 2) * 8, 64)
    assert attn.o_proj.weight.shape == (64, 4 * 8)
    experts = shard.decoder_layers[0].mlp.experts
    assert isinstance(experts, NVFP4Experts) and experts.intermediate_size == 16
    assert experts.down_packed.shape == (8, 64, 8) and experts.down_scales.shape == (8, 64, 1)
    # Rank 1's up rows are the whole expert's up rows 16..31 (second half of each of gate and up).
    full = whole.decoder_layers[0].mlp.experts
    assert isinstance(full, NVFP4Experts)
    assert torch.equal(experts.gate_up_packed[:, 16:], full.gate_up_packed[:, 48:])
    with pytest.raises(ShardError, match="already sharded"):
        shard_model(shard, ThreadGroup(2).rank_view(1))


def test_shapes_that_do_not_divide_are_refused() -> None:
    with pytest.raises(ShardError, match="num_attention_heads=8, num_key_value_heads=4, moe_intermediate_size=32"):
        check_shardable(CONFIG, 3)
    with pytest.raises(ShardError, match="multiple of the 16-value block"):
        check_shardable(CONFIG, 4, is_nvfp4=True)
    check_shardable(CONFIG, 2, is_nvfp4=True)
    with pytest.raises(ShardError, match="num_key_value_heads=1"):
        check_shardable(CONFIG.replace(num_key_value_heads=1), 2)
