"""Grouped-query attention over a paged KV cache.

The cache of one layer is two tensors `k_cache, v_cache [num_slots, Hkv, D]`, slot = block * block_size + offset.
Each step first writes the new tokens' keys and values to their slots (`slot_mapping`), then attends over every
slot in the sequence's block table, so tokens whose blocks came from the prefix cache are read, never recomputed.

Decode steps (one query per sequence) run as one padded batch; steps with prefill chunks run per sequence with a
causal mask offset by the tokens already in the cache. Both call `scaled_dot_product_attention`, which picks a
fused kernel on CPU and GPU.

T = new tokens in the step, B = sequences, Hq / Hkv = query / key-value heads, D = head dim, L = context slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from replica.model.config import ModelConfig
from replica.model.layers import RMSNorm, apply_rope


@dataclass
class AttentionBatch:
    """Where a step's tokens go in the cache and what each sequence attends over."""

    slot_mapping: torch.Tensor
    """[T] int64 cache slot of each new token."""
    query_lens: list[int]
    """New tokens of each sequence, in the order they appear in the step."""
    context_lens: torch.Tensor
    """[B] int64 tokens in the cache for each sequence after this step (cached + new)."""
    block_tables: torch.Tensor
    """[B, max_blocks] int64 block ids, padded with 0 (padding is masked by `context_lens`)."""
    block_size: int
    is_decode: bool
    """Every sequence has exactly one new token."""


KVCache = tuple[torch.Tensor, torch.Tensor]


def _gather_slots(block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, max_blocks * block_size] slot ids."""
    offsets = torch.arange(block_size, device=block_tables.device)
    return (block_tables.unsqueeze(-1) * block_size + offsets).flatten(1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        hidden = config.hidden_size
        kw = {"bias": False, "dtype": dtype, "device": device}
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, **kw)  # type: ignore[arg-type]
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, **kw)  # type: ignore[arg-type]
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, **kw)  # type: ignore[arg-type]
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, **kw)  # type: ignore[arg-type]
        self.q_norm = (
            RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device) if config.qk_norm else None
        )
        self.k_norm = (
            RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device) if config.qk_norm else None
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        """x [T, H], cos/sin [T, D/2] -> [T, H]."""
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = kv_cache
        k_cache[batch.slot_mapping] = k.to(k_cache.dtype)
        v_cache[batch.slot_mapping] = v.to(v_cache.dtype)
        out = self._decode(q, k_cache, v_cache, batch) if batch.is_decode else self._prefill(q, k_cache, v_cache, batch)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))  # type: ignore[no-any-return]

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        slots = _gather_slots(batch.block_tables, batch.block_size)  # [B, L]
        k = k_cache[slots].transpose(1, 2)  # [B, Hkv, L, D]
        v = v_cache[slots].transpose(1, 2)
        positions = torch.arange(slots.shape[1], device=q.device)
        mask = (positions < batch.context_lens.unsqueeze(-1))[:, None, None, :]  # [B, 1, 1, L]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2).to(k.dtype),  # [B, Hq, 1, D]
            k,
            v,
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out.squeeze(2).to(q.dtype)  # [B, Hq, D]

    def _prefill(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        outs = []
        start = 0
        slots_all = _gather_slots(batch.block_tables, batch.block_size)
        context_lens = batch.context_lens.tolist()
        for i, num_new in enumerate(batch.query_lens):
            context = context_lens[i]
            slots = slots_all[i, :context]
            k = k_cache[slots].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            v = v_cache[slots].transpose(0, 1).unsqueeze(0)
            qi = q[start : start + num_new].transpose(0, 1).unsqueeze(0).to(k.dtype)  # [1, Hq, n, D]
            start += num_new
            gqa = self.num_heads != self.num_kv_heads
            if num_new == context:  # nothing cached before: plain causal attention, the fused kernel's best case
                out = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa)
            else:
                # Query j sits at position context - num_new + j and sees keys up to and including itself.
                query_pos = torch.arange(context - num_new, context, device=q.device).unsqueeze(-1)
                mask = torch.arange(context, device=q.device).unsqueeze(0) <= query_pos  # [n, L]
                out = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
            outs.append(out.squeeze(0).transpose(0, 1))  # [n, Hq, D]
        return torch.cat(outs).to(q.dtype)


def dense_causal_attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Training path without a cache: x [B, S, H], cos/sin [S, D/2] -> [B, S, H]."""
    batch, seq, _ = x.shape
    q = attn.q_proj(x).view(batch, seq, attn.num_heads, attn.head_dim)
    k = attn.k_proj(x).view(batch, seq, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(x).view(batch, seq, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None and attn.k_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # cos/sin [S, D/2] broadcast over B
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, Hq, S, D], [B, Hkv, S, D]
    v = v.transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=attn.scale, enable_gqa=attn.num_heads != attn.num_kv_heads
    )
    return attn.o_proj(out.transpose(1, 2).reshape(batch, seq, attn.num_heads * attn.head_dim))  # type: ignore[no-any-return]
