"""`AttentionBatch.build`: the slots each sequence reads and the masks, against their definitions."""

from __future__ import annotations

import pytest
import torch

from replica.model.attention import AttentionBatch, BatchedQueries, PrefillSeq

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


def _prefill_parts(batch: AttentionBatch) -> list[PrefillSeq]:
    assert all(isinstance(p, PrefillSeq) for p in batch.parts)
    return [p for p in batch.parts if isinstance(p, PrefillSeq)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_new", "context"), [(17, 20), (20, 33), (30, 31), (17, 64)])
def test_prefill_after_cached_tokens_sees_exactly_its_prefix(num_new: int, context: int, dtype: torch.dtype) -> None:
    (seq,) = _prefill_parts(_build([num_new], [context], dtype))
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
    batch = _build([20, 18, 17], [20, 27, 17])
    assert [(s.start, s.num_new) for s in _prefill_parts(batch)] == [(0, 20), (20, 18), (38, 17)]
    cold, cached, cold_again = _prefill_parts(batch)
    assert cold.slots is None and cold.mask is None and cold_again.mask is None  # causal over their own keys
    assert cached.mask is not None and cached.mask.shape == (18, 27)


def test_decode_mask_hides_the_padding_of_shorter_sequences() -> None:
    (part,) = _build([1, 1], [3, 6]).parts
    assert isinstance(part, BatchedQueries) and part.num_seqs == 2 and part.num_queries == 1
    mask = part.mask[:, 0, 0]  # [B, L]
    assert part.slots.shape == mask.shape == (2, 8)
    assert (mask[0, :3] == 0).all() and (mask[0, 3:] == -torch.inf).all()
    assert (mask[1, :6] == 0).all() and (mask[1, 6:] == -torch.inf).all()


def test_runs_of_equal_few_token_sequences_batch_and_see_their_causal_prefix() -> None:
    """Verification of k drafts is k + 1 queries per sequence: one padded batch per run of equal counts, each
    query masked to the keys up to its own position; a long chunk between them stays on its own."""
    batch = _build([3, 3, 20, 1], [9, 5, 24, 7])
    three, chunk, one = batch.parts
    assert isinstance(three, BatchedQueries) and (three.start, three.num_seqs, three.num_queries) == (0, 2, 3)
    assert isinstance(chunk, PrefillSeq) and (chunk.start, chunk.num_new) == (6, 20)
    assert isinstance(one, BatchedQueries) and (one.start, one.num_seqs) == (26, 1)
    for g, context in enumerate([9, 5]):
        for j in range(3):
            visible = (three.mask[g, 0, j] == 0).nonzero().flatten().tolist()
            assert visible == list(range(context - 3 + j + 1)), (g, j)
