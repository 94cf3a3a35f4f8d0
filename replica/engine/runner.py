"""Runs one scheduled step on the model: builds the flat token batch, the slot mapping and block tables, and
returns the logits of the sequences whose last token was in the step (the LM head runs on those rows only).

Step inputs (token ids, positions, cache slots by runs of one block) are built as Python lists and become tensors
once, so a step spends only a few tensor ops before the model.

The KV cache is allocated here, once: per layer `k_cache, v_cache [num_blocks * block_size, Hkv, D]`.
"""

from __future__ import annotations

import torch

from replica.engine.scheduler import ScheduledBatch
from replica.model.attention import AttentionBatch, KVCache
from replica.model.model import MoEForCausalLM


def append_slots(slots: list[int], block_table: list[int], start: int, end: int, block_size: int) -> None:
    """Append the cache slots of positions start..end-1 (`block_table[p // block_size] * block_size + p % block_size`),
    one run per block they touch."""
    pos = start
    while pos < end:
        block = pos // block_size
        run_end = min((block + 1) * block_size, end)
        offset = (block_table[block] - block) * block_size
        slots.extend(range(pos + offset, run_end + offset))
        pos = run_end


class ModelRunner:
    def __init__(self, model: MoEForCausalLM, *, num_blocks: int, block_size: int, kv_dtype: torch.dtype | None = None):
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        c = model.config
        dtype = kv_dtype or model.dtype
        shape = (num_blocks * block_size, c.num_key_value_heads, c.head_dim)
        self.kv_caches: list[KVCache] = [
            (torch.zeros(shape, dtype=dtype, device=model.device), torch.zeros(shape, dtype=dtype, device=model.device))
            for _ in range(c.num_hidden_layers)
        ]

    @staticmethod
    def kv_bytes_per_block(model: MoEForCausalLM, block_size: int, dtype: torch.dtype | None = None) -> int:
        c = model.config
        itemsize = torch.empty((), dtype=dtype or model.dtype).element_size()
        return 2 * c.num_hidden_layers * block_size * c.num_key_value_heads * c.head_dim * itemsize

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[int], torch.Tensor | None]:
        """-> (indices into batch.seqs that completed their tokens and need sampling, their logits [N, V])."""
        bs = self.block_size
        device = self.model.device
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        last_rows: list[int] = []
        sample_idx: list[int] = []
        max_blocks = max(len(s.block_table) for s in batch.seqs)
        tables = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            append_slots(slots, seq.block_table, start, start + n, bs)
            context_lens.append(start + n)
            tables.append(seq.block_table + [0] * (max_blocks - len(seq.block_table)))
            if start + n == seq.num_tokens:
                sample_idx.append(i)
                last_rows.append(len(input_ids) - 1)
        block_tables = torch.tensor(tables, dtype=torch.long, device=device)  # [B, max_blocks]
        positions_t = torch.tensor(positions, dtype=torch.long, device=device)  # [T]
        attn = AttentionBatch.build(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),  # [T]
            query_lens=list(batch.num_new_tokens),
            context_lens=context_lens,
            block_tables=block_tables,
            block_size=bs,
            dtype=self.kv_caches[0][0].dtype,
        )
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long, device=device), positions_t, self.kv_caches, attn)
        if not sample_idx:
            return [], None
        first, last = last_rows[0], last_rows[-1]
        # Increasing rows; when they are one run (a decode step, a single sequence's chunk) a slice, not a gather.
        rows = hidden[first : last + 1] if last - first + 1 == len(last_rows) else hidden[last_rows]
        return sample_idx, self.model.compute_logits(rows)
