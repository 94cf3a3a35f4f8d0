"""Grouped-query attention over a paged KV cache.

The cache of one layer is two tensors `k_cache, v_cache [num_slots, Hkv, D]`, slot = block * block_size + offset.
Each step first writes the new tokens' keys and values to their slots (`slot_mapping`), then attends over every
slot in the sequence's block table, so tokens whose blocks came from the prefix cache are read, never recomputed.
Both copy whole rows along the slot dimension: writes with `index_copy_` (a step's new slots are distinct), reads
with `index_select`, which on the CPU is several times faster than advanced indexing.

Everything about a step's shape that every layer shares (the slots each sequence reads, the additive masks) is built
once per step by `AttentionBatch.build`, so a layer only projects, writes its cache, gathers and attends. The query,
key and value projections are one matmul (`qkv_proj`, rows q | k | v, loaded from Hugging Face's three weights and,
where the architecture has them, biases), and queries and keys go through the per-head norm (Qwen3-MoE) and RoPE
together.

Sequences with few new tokens (a decode step's one, a speculative verification's k + 1: at most
`MAX_BATCHED_QUERIES`) run as padded batches, one per run of sequences with the same count, each query masked to the
context before it. Longer prefill chunks run per sequence: a chunk with nothing cached before it attends causally
over its own fresh keys (no gather, no mask); a chunk after cached tokens gathers the whole context and attends with
a mask offset by the cached length. All call `scaled_dot_product_attention`, which picks a fused kernel on CPU and GPU.

T = new tokens in the step, B = sequences, Hq / Hkv = query / key-value heads, D = head dim, L = context slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from replica.model.config import ModelConfig
from replica.model.layers import RMSNorm, apply_rope, rms_norm

KVCache = tuple[torch.Tensor, torch.Tensor]


MAX_BATCHED_QUERIES = 16
"""Sequences with at most this many new tokens in a step attend in padded batches: decode steps and speculative
verification (k + 1 tokens) batch their sequences; longer prefill chunks run one sequence at a time."""


@dataclass(frozen=True)
class PrefillSeq:
    """One sequence's prefill chunk, attended on its own."""

    start: int
    """First row of its new tokens in the step's [T, ...] tensors."""
    num_new: int
    slots: torch.Tensor | None
    """[L] int64 cache slots of its whole context (cached + new); None when nothing was cached before the chunk,
    so the chunk attends over its own fresh keys."""
    mask: torch.Tensor | None
    """[n, L] additive mask (0 or -inf) in the attention dtype: query j at position L - n + j sees keys 0..L-n+j."""


@dataclass(frozen=True)
class BatchedQueries:
    """G sequences with q new tokens each, in consecutive rows, attending over their whole context as one padded
    batch: decode (q = 1) and speculative verification (q = k + 1)."""

    start: int
    """First row of the group's G * q rows in the step's [T, ...] tensors."""
    num_seqs: int
    num_queries: int
    slots: torch.Tensor
    """[G, L] int64 slots of each sequence's context, padded with slots of the tables' padding block."""
    mask: torch.Tensor
    """[G, 1, q, L] additive mask: query j of a sequence with context c sits at position c - q + j and sees the
    keys up to it; padding is hidden."""

    @classmethod
    def build(
        cls,
        *,
        start: int,
        num_queries: int,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
        dtype: torch.dtype,
    ) -> BatchedQueries:
        """block_tables [G, max_blocks] int64 (padded); context_lens [G] int64 on the same device: cached + new
        tokens. Both may live on the device: nothing here reads them on the host."""
        device = block_tables.device
        slots = (block_tables.unsqueeze(-1) * block_size + torch.arange(block_size, device=device)).flatten(1)
        keys = torch.arange(slots.shape[1], device=device)  # [L]
        positions = context_lens.unsqueeze(-1) - num_queries + torch.arange(num_queries, device=device)  # [G, q]
        hidden = keys > positions.unsqueeze(-1)  # [G, q, L]
        mask = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, -torch.inf)
        return cls(start, block_tables.shape[0], num_queries, slots, mask.unsqueeze(1))


@dataclass(frozen=True)
class AttentionBatch:
    """Where a step's tokens go in the cache and what each sequence attends over, shared by every layer."""

    slot_mapping: torch.Tensor
    """[T] int64 cache slot of each new token."""
    parts: tuple[BatchedQueries | PrefillSeq, ...]
    """The step's sequences in row order: padded batches of few-token sequences, and prefill chunks."""

    @classmethod
    def build(
        cls,
        *,
        slot_mapping: torch.Tensor,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: torch.Tensor,
        block_size: int,
        dtype: torch.dtype,
    ) -> AttentionBatch:
        """block_tables [B, max_blocks] int64 (padded with 0); context_lens: cached + new tokens per sequence.

        Consecutive sequences with the same number of new tokens, at most `MAX_BATCHED_QUERIES`, form one
        `BatchedQueries` (the runner orders a step's sequences so that they are consecutive)."""
        device = block_tables.device
        offsets = torch.arange(block_size, device=device)
        parts: list[BatchedQueries | PrefillSeq] = []
        start = 0
        i = 0
        while i < len(query_lens):
            num_new, context = query_lens[i], context_lens[i]
            if num_new <= MAX_BATCHED_QUERIES:
                end = i + 1
                while end < len(query_lens) and query_lens[end] == num_new:
                    end += 1
                parts.append(
                    BatchedQueries.build(
                        start=start,
                        num_queries=num_new,
                        block_tables=block_tables[i:end],
                        context_lens=torch.tensor(context_lens[i:end], device=device),
                        block_size=block_size,
                        dtype=dtype,
                    )
                )
                start += (end - i) * num_new
                i = end
                continue
            if num_new == context:
                parts.append(PrefillSeq(start, num_new, None, None))
            else:
                num_blocks = -(-context // block_size)
                slots = (block_tables[i, :num_blocks, None] * block_size + offsets).flatten()[:context]
                # Query j sits at position L - n + j: keys after it (column - row > L - n) are hidden. One fill and
                # one triangle, 2-3x cheaper than comparing positions and masked_fill_ on a long context.
                mask = torch.full((num_new, context), -torch.inf, dtype=dtype, device=device)
                parts.append(PrefillSeq(start, num_new, slots, mask.triu_(context - num_new + 1)))  # [n, L]
            start += num_new
            i += 1
        return cls(slot_mapping, tuple(parts))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.eps = config.rms_norm_eps
        hidden = config.hidden_size
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(hidden, qkv_rows, bias=config.qkv_bias, dtype=dtype, device=device)
        self.o_proj = nn.Linear(
            self.num_heads * self.head_dim, hidden, bias=config.o_proj_bias, dtype=dtype, device=device
        )
        self.q_norm = RMSNorm(self.head_dim, self.eps, dtype=dtype, device=device) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, self.eps, dtype=dtype, device=device) if config.qk_norm else None

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., H] -> (q | k normed and rotated [..., Hq + Hkv, D], v [..., Hkv, D]); cos/sin broadcast to them."""
        qkv = self.qkv_proj(x).unflatten(-1, (self.num_heads + 2 * self.num_kv_heads, self.head_dim))
        qk, v = qkv[..., : self.num_heads + self.num_kv_heads, :], qkv[..., self.num_heads + self.num_kv_heads :, :]
        if self.q_norm is not None and self.k_norm is not None:
            q_weight, k_weight = self.q_norm.weight, self.k_norm.weight
            weight = torch.cat((q_weight.expand(self.num_heads, -1), k_weight.expand(self.num_kv_heads, -1)))
            qk = rms_norm(qk, weight, self.eps)  # per head, weight [Hq + Hkv, D]: q_norm's rows, then k_norm's
        return apply_rope(qk, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        """x [T, H], cos/sin [T, 1, D] (`RotaryEmbedding`) -> [T, H]."""
        num_tokens = x.shape[0]
        qk, v = self.project(x, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]  # [T, Hq, D], [T, Hkv, D]
        k_cache, v_cache = kv_cache
        k_cache.index_copy_(0, batch.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, batch.slot_mapping, v.to(v_cache.dtype))
        outs = [
            self.attend_batched(q, k_cache, v_cache, part)
            if isinstance(part, BatchedQueries)
            else self._prefill(q, k, v, k_cache, v_cache, part)
            for part in batch.parts
        ]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))  # type: ignore[no-any-return]

    def attend_batched(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, part: BatchedQueries
    ) -> torch.Tensor:
        """The group's queries (rows of q [T, Hq, D]) over their gathered contexts -> [G * q, Hq, D]."""
        g, n = part.num_seqs, part.num_queries
        rows = q[part.start : part.start + g * n].view(g, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = gather_slots(k_cache, part.slots).transpose(1, 2)  # [G, Hkv, L, D]
        v = gather_slots(v_cache, part.slots).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            rows.to(k.dtype),  # [G, Hq, q, D]
            k,
            v,
            attn_mask=part.mask,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out.transpose(1, 2).reshape(g * n, self.num_heads, self.head_dim).to(q.dtype)

    def _prefill(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seq: PrefillSeq,
    ) -> torch.Tensor:
        gqa = self.num_heads != self.num_kv_heads
        rows = slice(seq.start, seq.start + seq.num_new)
        qi = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if seq.slots is None:  # nothing cached before: plain causal attention, the fused kernel's best case
            # In the cache's dtype, as if read back from it: the same numbers as a chunk after cached tokens.
            k = k_new[rows].transpose(0, 1).unsqueeze(0).to(k_cache.dtype)  # [1, Hkv, n, D]
            v = v_new[rows].transpose(0, 1).unsqueeze(0).to(v_cache.dtype)
            out = F.scaled_dot_product_attention(qi.to(k.dtype), k, v, is_causal=True, scale=self.scale, enable_gqa=gqa)
        else:
            k = k_cache.index_select(0, seq.slots).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            v = v_cache.index_select(0, seq.slots).transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(
                qi.to(k.dtype), k, v, attn_mask=seq.mask, scale=self.scale, enable_gqa=gqa
            )
        return out.squeeze(0).transpose(0, 1).to(q.dtype)  # [n, Hq, D]


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [num_slots, Hkv, D], slots [B, L] -> [B, L, Hkv, D]: `cache[slots]`."""
    return cache.index_select(0, slots.flatten()).view(*slots.shape, *cache.shape[1:])


def dense_causal_attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Training path without a cache: x [B, S, H], cos/sin [S, 1, D] -> [B, S, H]."""
    batch, seq, _ = x.shape
    qk, v = attn.project(x, cos, sin)  # [B, S, Hq + Hkv, D], [B, S, Hkv, D]
    qk = qk.transpose(1, 2)
    q, k = qk[:, : attn.num_heads], qk[:, attn.num_heads :]  # [B, Hq, S, D], [B, Hkv, S, D]
    out = F.scaled_dot_product_attention(
        q, k, v.transpose(1, 2), is_causal=True, scale=attn.scale, enable_gqa=attn.num_heads != attn.num_kv_heads
    )
    return attn.o_proj(out.transpose(1, 2).reshape(batch, seq, attn.num_heads * attn.head_dim))  # type: ignore[no-any-return]
