"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Each step has a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`). Running sequences go
first, oldest first: a decoding sequence takes one token, a sequence still prefilling takes the next chunk of its
prompt that fits the budget (chunked prefill, so a long prompt never stalls everyone's decode). Then waiting
sequences are admitted in arrival order while their blocks fit, prefix-cached blocks included, so a hit costs
neither blocks nor budget.

When a decoding sequence needs a new block and none is free, the most recently admitted running sequence is
preempted: its blocks are freed (their cached prefix usually survives in the LRU) and it goes back to the front of
the waiting queue, to be recomputed. No admission happens in a step that preempted.

Speculation: a decoding sequence with drafts takes 1 + d tokens (its last token and the d drafts to verify), the
drafts cut to the budget and dropped rather than preempting anyone for their blocks. A sequence that samples in the
step also gets blocks for the drafter's look-ahead (the positions a dense drafter writes while it proposes); when
they do not fit it simply gets no drafts (`Sequence.has_draft_room`).
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
    """Tokens each sequence runs in the step, drafts included."""
    num_draft_tokens: list[int] = field(default_factory=list)
    """Of those, drafts to verify (the last ones)."""
    preempted: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, num_tokens: int, num_drafts: int = 0) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_tokens)
        self.num_draft_tokens.append(num_drafts)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        lookahead_tokens: int = 0,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        self.block_manager = block_manager
        self.lookahead_tokens = lookahead_tokens
        """Positions past a sampling sequence's last token that the drafter writes while proposing."""
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
        seq.clear_drafts()
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _make_draft_room(self, seq: Sequence, end: int) -> None:
        """Blocks for the drafter's look-ahead after position `end` (the furthest a step can bring the sequence's
        last token), if they fit."""
        bm = self.block_manager
        seq.has_draft_room = bm.can_hold(seq, end + self.lookahead_tokens)
        if seq.has_draft_room:
            bm.hold(seq, end + self.lookahead_tokens)

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
                if seq.num_computed_tokens + n == seq.num_tokens:
                    self._make_draft_room(seq, seq.num_tokens)
                batch.add(seq, n)
                budget -= n
                continue
            while not bm.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            num_drafts = min(len(seq.draft_token_ids), budget - 1)
            if num_drafts and not bm.can_hold(seq, seq.num_tokens + num_drafts):
                num_drafts = 0  # drop the drafts rather than preempt anyone for their blocks
            if num_drafts < len(seq.draft_token_ids):
                seq.draft_token_ids = seq.draft_token_ids[:num_drafts]
            bm.hold(seq, seq.num_tokens + num_drafts)
            self._make_draft_room(seq, seq.num_tokens + num_drafts)
            batch.add(seq, 1 + num_drafts, num_drafts)
            budget -= 1 + num_drafts
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
            if seq.num_computed_tokens + n == seq.num_tokens:
                self._make_draft_room(seq, seq.num_tokens)
            batch.add(seq, n)
            budget -= n
        return batch
