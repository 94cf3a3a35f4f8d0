"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Each step has a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`). Running sequences go
first, oldest first: a decoding sequence takes one token, a sequence still prefilling takes the next chunk of its
prompt that fits the budget (chunked prefill, so a long prompt never stalls everyone's decode). Then waiting
sequences are admitted in arrival order while their blocks fit, prefix-cached blocks included, so a hit costs
neither blocks nor budget.

When a decoding sequence needs a new block and none is free, the most recently admitted running sequence is
preempted: its blocks are freed (their cached prefix usually survives in the LRU) and it goes back to the front of
the waiting queue, to be recomputed. No admission happens in a step that preempted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from replica.engine.block_manager import BlockManager
from replica.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.num_new_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Remove a sequence (finished or aborted) from whichever queue holds it and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if seq.is_prefilling:
                n = min(seq.num_uncomputed_tokens, budget)
            else:
                while not bm.can_append(seq):
                    victim = self.running[-1]
                    self._preempt(victim)
                    batch.preempted.append(victim)
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    continue
                bm.append_slot(seq)
                n = 1
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        if batch.preempted:
            return batch
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not bm.allocate(seq):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch
