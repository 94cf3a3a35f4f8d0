"""Tensor-parallel shards of the parameters Qwen2-MoE and Qwen3-MoE add to the plain decoder (q/k/v biases, the
output projection's bias, the shared expert's sigmoid gate) sum to the whole model, as `test_shard` checks for the
rest: the q/k/v bias is split with its rows, the output bias is added by rank 0 alone, the gate is replicated."""

from __future__ import annotations

import copy

import pytest
import torch

from replica.model.config import ModelConfig
from replica.model.loader import init_weights
from replica.model.model import MoEForCausalLM
from replica.model.shard import shard_model
from tests.unit.replica_model.test_shard import CONFIG, ThreadGroup, _forward, _sharded_logits

CONFIGS = {
    "qwen2_moe": CONFIG.replace(qk_norm=False, qkv_bias=True, shared_expert_gate=True),
    "qwen3_moe-bias": CONFIG.replace(shared_expert_intermediate_size=0, qkv_bias=True, o_proj_bias=True),
}


def _model(config: ModelConfig) -> MoEForCausalLM:
    model = MoEForCausalLM(config)
    init_weights(model, seed=4, std=0.2)  # biases and the gate drawn like the matrices, not left at zero
    model.use_serving_layout()
    return model.eval()


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("arch", CONFIGS)
def test_shards_with_biases_and_gate_sum_to_the_whole_model(arch: str, world_size: int) -> None:
    torch.set_num_threads(1)
    whole = _model(CONFIGS[arch])
    input_ids = torch.randint(0, CONFIG.vocab_size, (23,), generator=torch.Generator().manual_seed(0))
    expected = _forward(whole, input_ids)
    per_rank = _sharded_logits(whole, world_size, input_ids)
    for logits in per_rank[1:]:
        assert torch.equal(logits, per_rank[0])
    torch.testing.assert_close(per_rank[0], expected, rtol=1e-4, atol=1e-4)


def test_bias_slices_follow_their_heads_and_the_output_bias_stays_on_rank_0() -> None:
    whole = _model(CONFIGS["qwen3_moe-bias"])
    full = whole.decoder_layers[0].self_attn
    assert full.qkv_proj.bias is not None and full.o_proj.bias is not None
    q, k, v = torch.split(full.qkv_proj.bias, [8 * 8, 4 * 8, 4 * 8])
    group = ThreadGroup(2)
    for rank in (0, 1):
        shard = copy.deepcopy(whole)
        shard_model(shard, group.rank_view(rank))
        attn = shard.decoder_layers[0].self_attn
        assert attn.qkv_proj.bias is not None
        want = torch.cat(
            (q[rank * 32 : (rank + 1) * 32], k[rank * 16 : (rank + 1) * 16], v[rank * 16 : (rank + 1) * 16])
        )
        assert torch.equal(attn.qkv_proj.bias, want)
        assert (attn.o_proj.bias is not None) == (rank == 0)
