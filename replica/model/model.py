"""The decoder: embeddings, N x (RMSNorm, attention, RMSNorm, MoE), final norm, LM head.

Module names follow Hugging Face's Qwen3-MoE and Qwen2-MoE (`model.layers.{i}.self_attn.o_proj`, `mlp.gate`,
`mlp.shared_expert_gate`, ...) so checkpoint keys map one to one, except Mixtral's names, which
`replica.model.loader` renames, and weights that run as one matmul, which it joins on load and splits on save:
routed experts stacked per layer (`mlp.experts.gate_up [E, 2I, H]`), the attention's `self_attn.qkv_proj` (from
`q_proj`, `k_proj`, `v_proj`) and the shared expert's `gate_up_proj` (from `gate_proj`, `up_proj`).

Serving runs on flattened tokens of many sequences ([T, H]) against the paged cache; `forward_train` runs padded
batches ([B, S]) without a cache for `shoal replica build-demo`.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from replica.model.attention import Attention, AttentionBatch, KVCache, dense_causal_attention
from replica.model.config import ModelConfig
from replica.model.layers import RMSNorm, RotaryEmbedding
from replica.model.moe import MoEBlock


class ReduceGroup(Protocol):
    """The ranks a sharded model sums its partial outputs over (`replica.engine.parallel.TensorParallel`)."""

    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks in place (every rank gets the same bits) and return it."""
        ...


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, *, layer: int, dtype: torch.dtype, device: torch.device | str | None
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = Attention(config, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.mlp = MoEBlock(config, layer=layer, dtype=dtype, device=device)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, layer=i, dtype=dtype, device=device) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)


class MoEForCausalLM(nn.Module):
    def __init__(
        self, config: ModelConfig, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, dtype=dtype, device=device)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device)
        # RoPE tables are computed, never loaded: on a meta-built model `init_rope` fills them in on the real device.
        self.rotary: RotaryEmbedding | None = None
        self.tp_group: ReduceGroup | None = None
        """Set by `replica.model.shard.shard_model`: the ranks whose partial outputs of attention and of the MoE
        block each layer sums; None when the model is whole."""
        if device is None or torch.device(device).type != "meta":
            self.init_rope(device)

    def init_rope(self, device: torch.device | str | None) -> None:
        c = self.config
        self.rotary = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, device=device)

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return list(self.model.layers)  # type: ignore[arg-type]

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def use_serving_layout(self) -> None:
        """Every layer's routed experts in their serving layout (`Experts.use_serving_layout`)."""
        for layer in self.decoder_layers:
            layer.mlp.experts.use_serving_layout()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        batch: AttentionBatch,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, H] (the caller picks rows for `compute_logits`)."""
        return self.forward_with_features(input_ids, positions, kv_caches, batch, ())[0]

    def forward_with_features(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        batch: AttentionBatch,
        feature_layers: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (final hidden states [T, H], the outputs of `feature_layers` side by side [T, len * H], or None when
        none are asked for): what a block drafter conditions on."""
        assert self.rotary is not None, "init_rope() was not called after building on the meta device"
        cos, sin = self.rotary(positions)
        h = self.model.embed_tokens(input_ids)  # [T, H]
        features = []
        reduce = None if self.tp_group is None else self.tp_group.all_reduce
        for i, (layer, kv_cache) in enumerate(zip(self.decoder_layers, kv_caches, strict=True)):
            attended = layer.self_attn(layer.input_layernorm(h), cos, sin, kv_cache, batch)
            h = h + (attended if reduce is None else reduce(attended))
            mixed = layer.mlp(layer.post_attention_layernorm(h))
            h = h + (mixed if reduce is None else reduce(mixed))
            if i in feature_layers:
                features.append(h)
        return self.model.norm(h), (torch.cat(features, dim=-1) if features else None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, V] in FP32."""
        return self.lm_head(hidden).float()  # type: ignore[no-any-return]

    def forward_train(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, S] -> (logits [B, S, V], load-balancing loss), no cache, causal.

        The balancing loss is Switch Transformer's E * sum_e(fraction of tokens to e * mean router prob of e),
        averaged over layers; it keeps every expert in use, which calibration later requires.
        """
        logits, aux, _ = self.forward_train_with_features(input_ids, ())
        return logits, aux

    def forward_train_with_features(
        self, input_ids: torch.Tensor, feature_layers: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`forward_train`, plus the outputs of `feature_layers` side by side [B, S, len * H] (None if none)."""
        assert self.rotary is not None
        batch, seq = input_ids.shape
        cos, sin = self.rotary(torch.arange(seq, device=input_ids.device))
        h = self.model.embed_tokens(input_ids)  # [B, S, H]
        aux = torch.zeros((), device=input_ids.device)
        features = []
        for i, layer in enumerate(self.decoder_layers):
            h = h + dense_causal_attention(layer.self_attn, layer.input_layernorm(h), cos, sin)
            flat = layer.post_attention_layernorm(h).reshape(batch * seq, -1)  # [T, H]
            mlp: MoEBlock = layer.mlp
            out, topk_ids, logits = mlp.forward_with_routing(flat)
            h = h + out.view(batch, seq, -1)
            num_experts = logits.shape[-1]
            fraction = torch.bincount(topk_ids.flatten(), minlength=num_experts).float() / topk_ids.numel()
            aux = aux + num_experts * (fraction * logits.softmax(-1).mean(0)).sum()
            if i in feature_layers:
                features.append(h)
        logits_out = self.lm_head(self.model.norm(h)).float()
        return logits_out, aux / len(self.model.layers), (torch.cat(features, dim=-1) if features else None)
