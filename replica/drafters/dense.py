"""The dense drafter: a small causal transformer on the target's tokenizer, with a paged KV cache of its own.

`DenseDrafterModel` is a decoder of a few layers (the target's attention, a dense SwiGLU instead of experts) with
its own embeddings and LM head. `ModelDrafter` runs any causal LM with the target's forward signature as a drafter
(this one, or the target itself, whose drafts are then always accepted: a test of the machinery):
- `ingest` runs it over every token the target ran in the step, at the same positions and slots, so its cache
  covers the same positions as the target's, prefix-cached blocks included;
- `propose` drafts k tokens autoregressively: a forward pass over each sequence's anchor, then over each draft, k
  passes of one token per sequence, batched. Positions and slots are computed on the device from the anchors'
  positions (they depend on this step's acceptance), so proposing needs no host transfer.
The cost is k + 1 drafter passes per step, which is why the block drafter (`replica.drafters.block`), one pass for k
tokens, is the faster one.

H = hidden size, T = tokens, S = sequences, k = drafts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
from torch import nn

from replica.engine.drafting import Proposal, ProposeRequest, masked_scores, slots_at
from replica.engine.runner import StepInputs, allocate_kv_caches
from replica.engine.sampler import draw
from replica.model.attention import Attention, AttentionBatch, BatchedQueries, KVCache, dense_causal_attention
from replica.model.config import ModelConfig
from replica.model.layers import RMSNorm, RotaryEmbedding
from replica.model.moe import SharedExpert


@dataclass(frozen=True)
class DenseDrafterConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int = 1
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    """Width of each layer's SwiGLU."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096

    def attention_config(self) -> ModelConfig:
        """The fields `Attention` reads, in the target's config type (its expert fields are unused here)."""
        return ModelConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            moe_intermediate_size=self.intermediate_size,
            num_experts=1,
            num_experts_per_tok=1,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class DenseLayer(nn.Module):
    def __init__(self, config: DenseDrafterConfig, *, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, dtype=dtype, device=device)
        self.self_attn = Attention(config.attention_config(), dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype=dtype, device=device)
        self.mlp = SharedExpert(h, config.intermediate_size, dtype=dtype, device=device)


class DenseDrafterModel(nn.Module):
    def __init__(
        self,
        config: DenseDrafterConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DenseLayer(config, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta, device=device)

    @property
    def decoder_layers(self) -> list[DenseLayer]:
        return list(self.layers)  # type: ignore[arg-type]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], batch: AttentionBatch
    ) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, H] over the paged cache (the target's signature)."""
        cos, sin = self.rotary(positions)
        h = self.embed_tokens(input_ids)
        for layer, cache in zip(self.decoder_layers, kv_caches, strict=True):
            h = h + layer.self_attn(layer.input_layernorm(h), cos, sin, cache, batch)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # type: ignore[no-any-return]

    def forward_train(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, S] -> logits [B, S, V], causal, no cache: the same function as `forward` over a cache."""
        cos, sin = self.rotary(torch.arange(input_ids.shape[1], device=input_ids.device))
        h = self.embed_tokens(input_ids)
        for layer in self.decoder_layers:
            h = h + dense_causal_attention(layer.self_attn, layer.input_layernorm(h), cos, sin)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.compute_logits(self.norm(h))


class CausalLM(Protocol):
    """What `ModelDrafter` needs of a model: the target's forward signature over a paged cache."""

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], batch: AttentionBatch
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class ModelDrafter:
    """A causal LM drafting autoregressively on a paged cache of its own (see the module docstring)."""

    feature_layers: tuple[int, ...] = ()

    def __init__(
        self,
        model: CausalLM,
        *,
        vocab_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        num_speculative_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.lookahead_tokens = num_speculative_tokens
        """It writes the anchor's and k - 1 drafts' keys: k positions from the anchor."""
        self.kv_caches = allocate_kv_caches(
            num_layers, num_blocks * block_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )
        self._dtype = dtype

    @classmethod
    def of(
        cls, model: DenseDrafterModel, *, num_blocks: int, block_size: int, num_speculative_tokens: int
    ) -> ModelDrafter:
        c = model.config
        weight = model.embed_tokens.weight
        return cls(
            model,
            vocab_size=c.vocab_size,
            num_layers=c.num_hidden_layers,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            num_speculative_tokens=num_speculative_tokens,
            dtype=weight.dtype,
            device=weight.device,
        )

    @torch.inference_mode()
    def ingest(self, inputs: StepInputs, features: torch.Tensor | None) -> None:
        self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attention)

    @torch.inference_mode()
    def propose(self, request: ProposeRequest) -> Proposal:
        tokens, positions = request.anchor_tokens, request.anchor_positions
        drafts = []
        for j in range(request.num_drafts):
            batch = AttentionBatch(
                slot_mapping=slots_at(request.block_tables, positions, self.block_size),
                parts=(
                    BatchedQueries.build(
                        start=0,
                        num_queries=1,
                        block_tables=request.block_tables,
                        context_lens=positions + 1,
                        block_size=self.block_size,
                        dtype=self._dtype,
                    ),
                ),
            )
            hidden = self.model(tokens, positions, self.kv_caches, batch)
            scores = masked_scores(request, j, tokens, self.model.compute_logits(hidden))
            tokens = draw(scores, request.sampling, request.keys[:, j])
            drafts.append(tokens)
            positions = positions + 1
        return Proposal(torch.stack(drafts, dim=1))
