"""The block drafter: k tokens in one non-causal pass, conditioned on the target's own hidden states.

In the spirit of DFlash (block-diffusion drafting): the drafter reads the outputs of a few target layers (the
`feature_layers`, side by side) at every position the target computed, fused by one linear layer and a norm into a
context feature, from which each drafter layer projects keys and values into a paged cache of its own (`ingest`:
projections only, no attention, so following the target costs little). To draft, one pass runs a block of k + 1
positions, the anchor token (the last emitted one) followed by k mask positions, each attending to the whole cached
context and, without a causal mask, to the whole block. The pass leaves one hidden state per mask position; the
target's LM head turns each into unary scores over the vocabulary.

Sampling a coherent block. Drawing each position from its own unary distribution would give an incoherent block
at temperature > 0 (two likely continuations mixed token by token), because the mask positions do not see each
other's choices. A path head supplies that dependence cheaply: position j's scores are

    s_j(x) = u_j(x) + < A[x_{j-1}] * W h_j , B[x] >

a low-rank bilinear term between the previous drafted token (the anchor for j = 1) and the candidate, modulated by
position j's hidden state (DFlash2's candidate selector is of this kind). Drafting walks the block left to right:
q_j = the request's sampling transform of s_j (temperature, top-k, top-p), d_j ~ q_j, then j + 1. Each step is one
small matmul, not a transformer pass; d_j is drawn with the key of its position (`sampler.draw`), so it agrees
with the target's token there as often as q_j resembles p_j; greedy drafting takes the argmax path. Training
(`replica.drafters.train`) fits s_j, with the true previous token, to the target's distribution at each position.

The embeddings and the LM head are the target's, shared and not saved with the drafter. The pass always runs the
block size the drafter was trained with; fewer drafts use its first positions.

T = tokens, S = sequences, K = block size (drafts), Q = K + 1 block positions, L = context slots, H = hidden, F =
features (len(feature_layers) * target hidden), V = vocabulary, r = path rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from replica.engine.drafting import Proposal, ProposeRequest, masked_scores
from replica.engine.runner import StepInputs, allocate_kv_caches
from replica.engine.sampler import SamplingTensors, draw
from replica.model.attention import Attention, KVCache, gather_slots
from replica.model.config import ModelConfig
from replica.model.layers import RMSNorm, RotaryEmbedding
from replica.model.model import MoEForCausalLM
from replica.model.moe import SharedExpert


@dataclass(frozen=True)
class BlockDrafterConfig:
    vocab_size: int
    hidden_size: int
    """Equals the target's: the drafter uses the target's embeddings and LM head."""
    feature_layers: tuple[int, ...]
    """Target layers whose outputs condition the drafter."""
    block_size: int = 8
    """Mask positions of a drafting pass: the most drafts it proposes."""
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    path_rank: int = 64
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
        out = asdict(self)
        out["feature_layers"] = list(self.feature_layers)
        return out


class BlockLayer(nn.Module):
    def __init__(self, config: BlockDrafterConfig, *, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, dtype=dtype, device=device)
        self.self_attn = Attention(config.attention_config(), dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype=dtype, device=device)
        self.mlp = SharedExpert(h, config.intermediate_size, dtype=dtype, device=device)

    def context_kv(
        self, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused context features [..., H] -> keys (normed, rotated) and values [..., Hkv, D]."""
        qk, v = self.self_attn.project(context, cos, sin)
        return qk[..., self.self_attn.num_heads :, :], v

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_k: torch.Tensor,
        context_v: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """h [N, Q, H] (block positions; cos/sin [N, Q, 1, D]); context keys/values [N, L, Hkv, D]; `mask`
        [N, 1, Q, L + Q] additive over the context then the block (`block_mask`)."""
        attn = self.self_attn
        n, q_len, _ = h.shape
        qk, v = attn.project(self.input_layernorm(h), cos, sin)
        q, k = qk[:, :, : attn.num_heads], qk[:, :, attn.num_heads :]  # [N, Q, Hq, D], [N, Q, Hkv, D]
        keys = torch.cat((context_k, k.to(context_k.dtype)), dim=1).transpose(1, 2)  # [N, Hkv, L + Q, D]
        values = torch.cat((context_v, v.to(context_v.dtype)), dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2).to(keys.dtype),
            keys,
            values,
            attn_mask=mask,
            scale=attn.scale,
            enable_gqa=attn.num_heads != attn.num_kv_heads,
        )  # [N, Hq, Q, D]
        h = h + attn.o_proj(out.transpose(1, 2).reshape(n, q_len, -1).to(h.dtype))
        return h + self.mlp(self.post_attention_layernorm(h))  # type: ignore[no-any-return]


class PathHead(nn.Module):
    """s_j(x) = u_j(x) + < A[previous] * W h_j, B[x] > (module docstring)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, *, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.previous = nn.Embedding(vocab_size, rank, dtype=dtype, device=device)
        self.candidate = nn.Embedding(vocab_size, rank, dtype=dtype, device=device)
        self.proj = nn.Linear(hidden_size, rank, bias=False, dtype=dtype, device=device)

    def scores(self, unary: torch.Tensor, projected: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """unary [..., V], projected [..., r] (`proj` of the position's hidden state), previous [...] int64 ->
        [..., V] float32."""
        pair: torch.Tensor = (self.previous(previous) * projected) @ self.candidate.weight.t()
        return unary + pair.float()


class BlockDrafterModel(nn.Module):
    """The drafter's own weights; `target` lends its embeddings and LM head (kept out of this module's state)."""

    def __init__(
        self,
        config: BlockDrafterConfig,
        target: MoEForCausalLM,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if target.config.hidden_size != config.hidden_size or target.config.vocab_size != config.vocab_size:
            raise ValueError(
                f"a block drafter for hidden size {config.hidden_size} and vocabulary {config.vocab_size} does not "
                f"fit a target with {target.config.hidden_size} and {target.config.vocab_size}"
            )
        if max(config.feature_layers) >= target.config.num_hidden_layers:
            raise ValueError(
                f"feature layers {config.feature_layers} past the target's {target.config.num_hidden_layers}"
            )
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(len(config.feature_layers) * h, h, bias=False, dtype=dtype, device=device)
        self.feature_norm = RMSNorm(h, config.rms_norm_eps, dtype=dtype, device=device)
        self.mask_embedding = nn.Parameter(torch.zeros(h, dtype=dtype, device=device))
        self.layers = nn.ModuleList(
            BlockLayer(config, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(h, config.rms_norm_eps, dtype=dtype, device=device)
        self.path = PathHead(config.vocab_size, h, config.path_rank, dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta, device=device)
        self._target = (target,)  # a tuple: not a submodule, so the target's weights are neither trained nor saved

    @property
    def target(self) -> MoEForCausalLM:
        return self._target[0]

    @property
    def block_layers(self) -> list[BlockLayer]:
        return list(self.layers)  # type: ignore[arg-type]

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Target layer outputs [..., F] -> fused context features [..., H]."""
        return self.feature_norm(self.fc(features))  # type: ignore[no-any-return]

    def block_inputs(self, anchors: torch.Tensor) -> torch.Tensor:
        """anchors [N] -> block inputs [N, K + 1, H]: the anchor's embedding, then K mask embeddings."""
        anchor = self.target.model.embed_tokens(anchors).unsqueeze(1)  # [N, 1, H]
        masks = self.mask_embedding.to(anchor.dtype).expand(anchors.shape[0], self.config.block_size, -1)
        return torch.cat((anchor, masks), dim=1)

    def block_forward(
        self,
        anchors: torch.Tensor,
        positions: torch.Tensor,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]],
        context_mask: torch.Tensor,
        num_tokens: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting pass. anchors [N] at positions [N]; context_kv per layer ([N, L, Hkv, D] twice); mask
        broadcasting to [N, 1, Q, L] -> (hidden [N, k, H] at the first k = `num_tokens` (default K) mask positions,
        unary scores [N, k, V])."""
        block_positions = positions.unsqueeze(-1) + torch.arange(self.config.block_size + 1, device=positions.device)
        cos, sin = self.rotary(block_positions)  # [N, Q, 1, D]
        h = self.block_inputs(anchors)
        n, q_len = h.shape[:2]
        # Every block position sees the context the mask allows and the whole block.
        mask = torch.cat((context_mask.expand(n, 1, q_len, -1), context_mask.new_zeros(n, 1, q_len, q_len)), dim=-1)
        for layer, (k, v) in zip(self.block_layers, context_kv, strict=True):
            h = layer(h, cos, sin, k, v, mask)
        hidden = self.norm(h[:, 1 : 1 + (num_tokens or self.config.block_size)])  # [N, k, H]
        return hidden, self.target.compute_logits(hidden)

    def draft(
        self,
        hidden: torch.Tensor,
        unary: torch.Tensor,
        anchors: torch.Tensor,
        num_tokens: int,
        sampling: SamplingTensors,
        keys: torch.Tensor,
        request: ProposeRequest | None = None,
    ) -> torch.Tensor:
        """Walk the path head over the first `num_tokens` positions -> drafts [N, k], position j drawn with
        `keys[:, j]`; with a `request` that has grammar masks, each position is drawn under its mask."""
        previous = anchors
        projected = self.path.proj(hidden)  # [N, k, r]
        drafts = []
        for j in range(num_tokens):
            scores = self.path.scores(unary[:, j], projected[:, j], previous)
            if request is not None:
                scores = masked_scores(request, j, previous, scores)
            previous = draw(scores, sampling, keys[:, j])
            drafts.append(previous)
        return torch.stack(drafts, dim=1)


class BlockDrafter:
    """Runs a `BlockDrafterModel` in the engine: its context cache in the engine's block layout."""

    lookahead_tokens = 0
    """Proposing writes nothing to the cache: the block's own keys are never stored."""

    def __init__(
        self, model: BlockDrafterModel, *, num_blocks: int, block_size: int, num_speculative_tokens: int
    ) -> None:
        if num_speculative_tokens > model.config.block_size:
            raise ValueError(
                f"num_speculative_tokens={num_speculative_tokens} is more than this block drafter drafts "
                f"({model.config.block_size} per pass)"
            )
        c = model.config
        weight = model.fc.weight
        self.model = model
        self.vocab_size = c.vocab_size
        self.feature_layers = c.feature_layers
        self.block_size = block_size
        self.kv_caches: list[KVCache] = allocate_kv_caches(
            c.num_hidden_layers, num_blocks * block_size, c.num_key_value_heads, c.head_dim, dtype=weight.dtype,
            device=weight.device,
        )  # fmt: skip

    @torch.inference_mode()
    def ingest(self, inputs: StepInputs, features: torch.Tensor | None) -> None:
        """Context keys and values of every position the target ran. Positions of rejected drafts get keys too:
        they lie past what any later pass attends to, and the next step overwrites them."""
        assert features is not None, "the target did not return the feature layers"
        context = self.model.context(features.to(self.model.fc.weight.dtype))  # [T, H]
        cos, sin = self.model.rotary(inputs.positions)
        slots = inputs.attention.slot_mapping
        for layer, (k_cache, v_cache) in zip(self.model.block_layers, self.kv_caches, strict=True):
            k, v = layer.context_kv(context, cos, sin)
            k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
            v_cache.index_copy_(0, slots, v.to(v_cache.dtype))

    @torch.inference_mode()
    def propose(self, request: ProposeRequest) -> Proposal:
        bs = self.block_size
        tables = request.block_tables
        slots = (tables.unsqueeze(-1) * bs + torch.arange(bs, device=tables.device)).flatten(1)  # [S, L]
        # The context is every position before the anchor: the target has computed exactly those.
        visible = torch.arange(slots.shape[1], device=tables.device) < request.anchor_positions.unsqueeze(-1)
        mask = torch.zeros(visible.shape, dtype=self.kv_caches[0][0].dtype, device=tables.device)
        mask = mask.masked_fill_(~visible, -torch.inf)[:, None, None, :]  # [S, 1, 1, L]
        context_kv = [(gather_slots(k, slots), gather_slots(v, slots)) for k, v in self.kv_caches]
        hidden, unary = self.model.block_forward(
            request.anchor_tokens, request.anchor_positions, context_kv, mask, request.num_drafts
        )
        tokens = self.model.draft(
            hidden, unary, request.anchor_tokens, request.num_drafts, request.sampling, request.keys, request
        )
        return Proposal(tokens)
