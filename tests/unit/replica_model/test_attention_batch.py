"""`AttentionBatch.build`: the slots each sequence reads and the masks, against their definitions."""

from __future__ import annotations

import pytest
import torch

from replica.model.attention import AttentionBatch

BS = 4


def _build(query_lens: list[int], context_lens: list[int], dtype: torch.dtype = torch.float32) -> AttentionBatch:
    num_blocks = [-(-c // BS) for c in context_lens]
    tables = torch.zeros(len(context_lens), max(num_blocks), dtype=torch.long)
    first = 0
    for i, n in enumerate(num_blocks):
        tables[i, :n] = torch.arange(first + n - 1, first - 1, -1)  # blocks out of order, as a cache hands them out
        first += n
    slot_mapping = torch.zeros(sum(query_lens), dtype=torch.long)  # not read by build
    return AttentionBatch.build(
        slot_mapping=slot_mapping,
        query_lens=query_lens,
        context_lens=context_lens,
        block_tables=tables,
        block_size=BS,
        dtype=dtype,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_new", "context"), [(2, 9), (3, 9), (8, 9), (5, 16), (4, 17)])
def test_prefill_after_cached_tokens_sees_exactly_its_prefix(num_new: int, context: int, dtype: torch.dtype) -> None:
    (seq,) = _build([num_new], [context], dtype).prefill
    assert seq.mask is not None and seq.slots is not None
    assert seq.mask.shape == (num_new, context) and seq.mask.dtype == dtype
    for j in range(num_new):
        position = context - num_new + j
        for key in range(context):
            assert seq.mask[j, key].item() == (0.0 if key <= position else -torch.inf), (j, key)
    num_blocks = -(-context // BS)
    blocks = list(range(num_blocks - 1, -1, -1))
    assert seq.slots.tolist() == [blocks[t // BS] * BS + t % BS for t in range(context)]


def test_prefill_steps_mix_cold_and_cached_chunks() -> None:
    batch = _build([6, 2, 3], [6, 7, 3])
    assert not batch.is_decode
    assert [(s.start, s.num_new) for s in batch.prefill] == [(0, 6), (6, 2), (8, 3)]
    cold, cached, cold_again = batch.prefill
    assert cold.slots is None and cold.mask is None and cold_again.mask is None  # causal over their own keys
    assert cached.mask is not None and cached.mask.shape == (2, 7)


def test_decode_mask_hides_the_padding_of_shorter_sequences() -> None:
    batch = _build([1, 1], [3, 6])
    assert batch.is_decode and batch.decode_mask is not None and batch.decode_slots is not None
    mask = batch.decode_mask[:, 0, 0]  # [B, L]
    assert batch.decode_slots.shape == mask.shape == (2, 8)
    assert (mask[0, :3] == 0).all() and (mask[0, 3:] == -torch.inf).all()
    assert (mask[1, :6] == 0).all() and (mask[1, 6:] == -torch.inf).all()
