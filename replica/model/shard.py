"""Tensor-parallel sharding of a loaded model, Megatron-style, in place.

N = ranks, r = this rank; Hq / Hkv = query / key-value heads, D = head dim, H = hidden size, I = one routed
expert's hidden size, Is = the shared expert's, E = routed experts.

- Attention: `qkv_proj` is column-parallel by heads (rank r keeps query heads r*Hq/N.. and key-value heads
  r*Hkv/N.., so each query head keeps the key-value head of its group), `o_proj` row-parallel over the same heads;
  each rank's paged KV cache holds its Hkv/N heads only.
- Attention biases: the q/k/v bias split with its rows; the output projection's bias kept by rank 0 alone, so that
  the sum over ranks adds it once.
- Shared expert: `gate_up_proj` column-parallel (gate rows and up rows split alike), `down_proj` row-parallel; its
  sigmoid gate (Qwen2-MoE) replicated: one factor per token, the same on every rank, scales each rank's partial sum.
- Routed experts: every expert's intermediate dimension I is split (gate and up rows, down columns): each rank
  holds a slice of every expert, so routing needs no exchange of tokens and the load stays even whatever the router
  picks. NVFP4 experts are sharded after quantization: rows of gate_up keep their own block scales, and down's
  blocks of 16 run along I, so I/N must be a multiple of 16, and every slice keeps the expert's global scale: the
  dequantized values are exactly those of the unsharded model.
- Replicated: the embedding and LM head (small vocabularies: the demo's is 2048; rank 0 alone computes logits), the
  norms, and the router gate, which sees the same input on every rank (the residual stream after an all-reduce).

Each decoder layer then sums its ranks' partial outputs twice, after attention and after the MoE block (routed and
shared experts' partials added first, one all-reduce) over `MoEForCausalLM.tp_group`.
"""

from __future__ import annotations

import torch

from replica.model.attention import Attention
from replica.model.config import ModelConfig
from replica.model.model import MoEForCausalLM, ReduceGroup
from replica.model.moe import Experts, SharedExpert

NVFP4_BLOCK = 16
"""Values per NVFP4 block scale (`replica.quant.nvfp4`), along each weight's input dimension."""


class ShardError(ValueError):
    """A model that cannot be split over the requested number of ranks."""


def check_shardable(config: ModelConfig, world_size: int, *, is_nvfp4: bool = False) -> None:
    """Raise ShardError naming every dimension that does not divide by `world_size`."""
    if world_size < 1:
        raise ShardError(f"tensor_parallel_size must be at least 1, not {world_size}")
    problems = [
        f"{name}={value}"
        for name, value in (
            ("num_attention_heads", config.num_attention_heads),
            ("num_key_value_heads", config.num_key_value_heads),
            ("moe_intermediate_size", config.moe_intermediate_size),
            ("shared_expert_intermediate_size", config.shared_expert_intermediate_size),
        )
        if value % world_size
    ]
    if problems:
        raise ShardError(f"tensor_parallel_size={world_size} does not divide {', '.join(problems)}")
    if is_nvfp4 and (config.moe_intermediate_size // world_size) % NVFP4_BLOCK:
        raise ShardError(
            f"NVFP4 experts: moe_intermediate_size / tensor_parallel_size = "
            f"{config.moe_intermediate_size // world_size} is not a multiple of the {NVFP4_BLOCK}-value block"
        )


def _rows(weight: torch.Tensor, start: int, size: int, dim: int) -> torch.Tensor:
    return weight.narrow(dim, start, size)


def _split_halves(weight: torch.Tensor, rank: int, world_size: int, dim: int) -> torch.Tensor:
    """Rank r's slice of each half of a fused [gate | up] dimension, the two slices side by side."""
    half = weight.shape[dim] // 2
    size = half // world_size
    gate = _rows(weight, rank * size, size, dim)
    up = _rows(weight, half + rank * size, size, dim)
    return torch.cat((gate, up), dim=dim).contiguous()


def _slice(weight: torch.Tensor, rank: int, world_size: int, dim: int) -> torch.Tensor:
    size = weight.shape[dim] // world_size
    return _rows(weight, rank * size, size, dim).contiguous()


def _shard_attention(attn: Attention, rank: int, world_size: int) -> None:
    d = attn.head_dim
    hq, hkv = attn.num_heads, attn.num_kv_heads
    for param in (attn.qkv_proj.weight, attn.qkv_proj.bias):  # [(Hq + 2 Hkv) D, H] and [(Hq + 2 Hkv) D]: q | k | v
        if param is not None:
            q, k, v = torch.split(param.data, [hq * d, hkv * d, hkv * d])
            param.data = torch.cat(
                (_slice(q, rank, world_size, 0), _slice(k, rank, world_size, 0), _slice(v, rank, world_size, 0))
            )
    attn.qkv_proj.out_features = attn.qkv_proj.weight.shape[0]
    attn.o_proj.weight.data = _slice(attn.o_proj.weight.data, rank, world_size, 1)  # [H, Hq/N D]
    attn.o_proj.in_features = attn.o_proj.weight.shape[1]
    if rank != 0:  # the ranks' partial outputs are summed: the bias is added once, by rank 0
        attn.o_proj.register_parameter("bias", None)
    attn.num_heads, attn.num_kv_heads = hq // world_size, hkv // world_size


def _shard_shared_expert(shared: SharedExpert, rank: int, world_size: int) -> None:
    shared.gate_up_proj.weight.data = _split_halves(shared.gate_up_proj.weight.data, rank, world_size, 0)
    shared.gate_up_proj.out_features = shared.gate_up_proj.weight.shape[0]
    shared.down_proj.weight.data = _slice(shared.down_proj.weight.data, rank, world_size, 1)  # [H, Is/N]
    shared.down_proj.in_features = shared.down_proj.weight.shape[1]


def _shard_experts(experts: Experts, rank: int, world_size: int) -> None:
    from replica.quant.experts import NVFP4Experts

    if isinstance(experts, NVFP4Experts):
        # gate_up rows [E, 2I, *] (codes and scales alike); down columns: I/2 packed bytes, I/16 block scales.
        experts.gate_up_packed = _split_halves(experts.gate_up_packed, rank, world_size, 1)
        experts.gate_up_scales = _split_halves(experts.gate_up_scales, rank, world_size, 1)
        experts.down_packed = _slice(experts.down_packed, rank, world_size, 2)
        experts.down_scales = _slice(experts.down_scales, rank, world_size, 2)
    else:
        # The serving layout (memory transposed) is kept: slices are rebuilt row-major, then laid out again.
        was_serving = not experts.gate_up.is_contiguous()
        experts.gate_up.data = _split_halves(experts.gate_up.data, rank, world_size, 1)  # [E, 2I/N, H]
        experts.down.data = _slice(experts.down.data, rank, world_size, 2)  # [E, H, I/N]
        if was_serving:
            experts.use_serving_layout()
    experts.intermediate_size //= world_size


def shard_model(model: MoEForCausalLM, group: ReduceGroup) -> None:
    """Keep `group.rank`'s shard of every sharded weight of `model` (loaded, and quantized if it is to be) and make
    its layers sum their partial outputs over `group`."""
    from replica.quant.experts import NVFP4Experts

    rank, world_size = group.rank, group.world_size
    if model.tp_group is not None:
        raise ShardError("the model is already sharded")

    if not 0 <= rank < world_size:
        raise ShardError(f"rank {rank} is outside 0..{world_size - 1}")
    layers = model.decoder_layers
    is_nvfp4 = any(isinstance(layer.mlp.experts, NVFP4Experts) for layer in layers)
    check_shardable(model.config, world_size, is_nvfp4=is_nvfp4)
    with torch.no_grad():
        for layer in layers:
            _shard_attention(layer.self_attn, rank, world_size)
            _shard_experts(layer.mlp.experts, rank, world_size)
            if layer.mlp.shared_expert is not None:
                _shard_shared_expert(layer.mlp.shared_expert, rank, world_size)
    model.tp_group = group
