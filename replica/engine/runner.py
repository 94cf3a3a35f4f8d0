"""Runs one scheduled step on the model: builds the flat token batch, the slot mapping and block tables, and
returns the logits of the rows to sample: a sequence whose committed tokens end in the step samples at its last
committed token and at each of its drafts (the LM head runs on those rows only).

Sequences with few new tokens (decodes, verifications) go first, ordered by their count, so that attention batches
each run of equal counts (`AttentionBatch.build`); prefill chunks follow in scheduling order. Step inputs (token
ids, positions, cache slots by runs of one block) are built as Python lists and become tensors once, so a step
spends only a few tensor ops before the model.

The KV cache is allocated here, once: per layer `k_cache, v_cache [num_blocks * block_size, Hkv, D]` (of this rank's
heads in a tensor-parallel group). `plan` turns a scheduled batch into host lists (`parallel.StepPlan`), which
rank 0 of a tensor-parallel group broadcasts before running; `execute` runs a plan, on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from replica.engine.parallel import StepPlan, TensorParallel
from replica.engine.scheduler import ScheduledBatch
from replica.model.attention import MAX_BATCHED_QUERIES, AttentionBatch, KVCache
from replica.model.model import MoEForCausalLM


@dataclass(frozen=True)
class StepInputs:
    """What the target ran in a step, in row order; a drafter that follows the target reads the same tensors."""

    input_ids: torch.Tensor
    """[T] int64."""
    positions: torch.Tensor
    """[T] int64."""
    attention: AttentionBatch


@dataclass(frozen=True)
class RunnerOutput:
    inputs: StepInputs
    sampled: list[int]
    """Indices into the batch's sequences of those with rows to sample, in row order."""
    num_rows: list[int]
    """Rows each of them samples: 1 + its drafts."""
    first_positions: list[int]
    """Position of each one's first sampled row: its last committed token."""
    logits: torch.Tensor | None
    """[R, V] FP32, R = sum(num_rows); None when nothing samples."""
    features: torch.Tensor | None
    """[T, F] outputs of the requested target layers, for a block drafter; None if none were requested."""
    prompt_spans: list[tuple[int, int, int]] = field(default_factory=list)
    """(batch index, first position, count): prompt positions whose logits `prompt_logits` holds, for sequences
    that want prompt logprobs (position p's logits give prompt token p + 1's logprob)."""
    prompt_logits: torch.Tensor | None = None
    """[sum of counts, V] FP32, in `prompt_spans` order; None when no sequence of the step wants them."""


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


def allocate_kv_caches(
    num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, *, dtype: torch.dtype, device: torch.device
) -> list[KVCache]:
    """Per layer `k_cache, v_cache [num_slots, Hkv, D]`, zeroed."""
    shape = (num_slots, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]


class ModelRunner:
    def __init__(self, model: MoEForCausalLM, *, num_blocks: int, block_size: int, kv_dtype: torch.dtype | None = None):
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        c = model.config
        group = model.tp_group
        self.tensor_parallel = group if isinstance(group, TensorParallel) and group.rank == 0 else None
        """Rank 0 of a tensor-parallel group: each step's plan is broadcast before it runs."""
        self.kv_caches = allocate_kv_caches(
            c.num_hidden_layers,
            num_blocks * block_size,
            model.decoder_layers[0].self_attn.num_kv_heads,  # this rank's heads when the model is sharded
            c.head_dim,
            dtype=kv_dtype or model.dtype,
            device=model.device,
        )

    def plan(
        self, batch: ScheduledBatch
    ) -> tuple[StepPlan, list[int], list[int], list[int], list[tuple[int, int, int]], list[int]]:
        """The step's inputs as host lists -> (plan, sampled, num_rows, first_positions, prompt_spans, and the
        prompt spans' rows in the flat batch) (see `RunnerOutput`)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        query_lens: list[int] = []
        sample_rows: list[int] = []
        sampled: list[int] = []
        num_rows: list[int] = []
        first_positions: list[int] = []
        order = sorted(
            range(len(batch.seqs)),
            key=lambda i: batch.num_new_tokens[i] if batch.num_new_tokens[i] <= MAX_BATCHED_QUERIES else 1 << 30,
        )
        max_blocks = max(len(s.block_table) for s in batch.seqs)
        tables = []
        prompt_spans: list[tuple[int, int, int]] = []
        prompt_rows: list[int] = []
        for i in order:
            seq, n, d = batch.seqs[i], batch.num_new_tokens[i], batch.num_draft_tokens[i]
            start = seq.num_computed_tokens
            if seq.num_prompt_logprobs_missing:
                # Positions 0..P-2 give prompt tokens 1..P-1 their logprobs; those known already (a recomputed
                # prompt after preemption) are skipped.
                first = max(start, len(seq.prompt_logprobs))
                count = min(start + n, seq.num_prompt_tokens - 1) - first
                if count > 0:
                    prompt_spans.append((i, first, count))
                    prompt_rows.extend(range(len(input_ids) + first - start, len(input_ids) + first - start + count))
            input_ids.extend(seq.token_ids[start : start + n - d])
            input_ids.extend(seq.draft_token_ids[:d])
            positions.extend(range(start, start + n))
            append_slots(slots, seq.block_table, start, start + n, bs)
            context_lens.append(start + n)
            query_lens.append(n)
            tables.append(seq.block_table + [0] * (max_blocks - len(seq.block_table)))
            if start + n - d == seq.num_tokens:
                sampled.append(i)
                num_rows.append(d + 1)
                first_positions.append(start + n - d - 1)
                sample_rows.extend(range(len(input_ids) - d - 1, len(input_ids)))
        plan = StepPlan(input_ids, positions, slots, query_lens, context_lens, tables, sample_rows)
        return plan, sampled, num_rows, first_positions, prompt_spans, prompt_rows

    @torch.inference_mode()
    def execute(
        self, plan: StepPlan, feature_layers: tuple[int, ...] = ()
    ) -> tuple[StepInputs, torch.Tensor, torch.Tensor | None]:
        """Run the model over a plan -> (its inputs as tensors, final hidden states [T, H], features or None).
        Every rank of a tensor-parallel group runs this on the same plan."""
        device = self.model.device
        inputs = StepInputs(
            input_ids=torch.tensor(plan.input_ids, dtype=torch.long, device=device),
            positions=torch.tensor(plan.positions, dtype=torch.long, device=device),
            attention=AttentionBatch.build(
                slot_mapping=torch.tensor(plan.slots, dtype=torch.long, device=device),  # [T]
                query_lens=plan.query_lens,
                context_lens=plan.context_lens,
                block_tables=torch.tensor(plan.block_tables, dtype=torch.long, device=device),  # [B, max_blocks]
                block_size=self.block_size,
                dtype=self.kv_caches[0][0].dtype,
            ),
        )
        hidden, features = self.model.forward_with_features(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.attention, feature_layers
        )
        return inputs, hidden, features

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, feature_layers: tuple[int, ...] = ()) -> RunnerOutput:
        plan, sampled, num_rows, first_positions, prompt_spans, prompt_rows = self.plan(batch)
        if self.tensor_parallel is not None:
            self.tensor_parallel.send_step(plan)  # the step's one message to the other ranks
        inputs, hidden, features = self.execute(plan, feature_layers)
        sample_rows = plan.sample_rows
        logits = None
        if sample_rows:
            first, last = sample_rows[0], sample_rows[-1]
            # Increasing rows; when they are one run (a decode step, a single sequence's chunk) a slice, not a gather.
            rows = hidden[first : last + 1] if last - first + 1 == len(sample_rows) else hidden[sample_rows]
            logits = self.model.compute_logits(rows)
        prompt_logits = self.model.compute_logits(hidden[prompt_rows]) if prompt_rows else None
        return RunnerOutput(inputs, sampled, num_rows, first_positions, logits, features, prompt_spans, prompt_logits)


def follow_steps(
    runner: ModelRunner,
    group: TensorParallel,
    on_step: Callable[[StepPlan, torch.Tensor], None] | None = None,
) -> int:
    """A rank other than 0: run every step rank 0 broadcasts until it says stop; -> the number of steps run.
    `on_step(plan, hidden [T, H])` sees each step's final hidden states (tests compute this rank's own logits)."""
    num_steps = 0
    while (plan := group.receive_step()) is not None:
        _, hidden, _ = runner.execute(plan)
        if on_step is not None:
            on_step(plan, hidden)
        num_steps += 1
    return num_steps
