"""Grammar masks in a step: the target's at every verified position, and the drafter's while it drafts.

Target (`verification_bitmasks`, on the host once the forward pass is issued, so that they overlap where the pass
runs asynchronously, as on CUDA): a constrained sequence that samples at its last committed token and at d drafts
needs the mask after its committed tokens and after each prefix of its drafts; llguidance advances its matcher
through the drafts and rolls it back, so the step's masks cost one batched call (`benchmarks/bench_constrained.py`
reports its time as grammar overhead). Drafts drawn by the walk below come
with those masks already: the walk computed them on the way, so their sequences skip that call. The masks go to
the device as bitmasks and are applied to the logits before the sampler's softmax, so temperature, top-k and top-p
act on the allowed tokens and every verified token is drawn from the masked distribution.

Drafter (`propose_constrained`, after the step's one transfer for the decision): the mask of draft position j
depends on the anchor (the token just emitted) and on drafts 1..j-1, so the walk consumes each drawn draft on the
host and computes the next mask before the drafter draws the next position. Each draft is drawn from the drafter's
scores with the mask applied, with the key of its position. This costs one small transfer per drafted position (k
tokens of the constrained rows), on top of the decision's, only in steps where constrained sequences draft. At the
end the matcher rolls back every draft it consumed: between steps it holds the committed tokens only.

Forced drafts: where the grammar leaves only one way on after a row's last draft (a key, the punctuation around
it: llguidance's `compute_ff_tokens`, in the tokenizer's own split), those tokens follow the drafter's as further
drafts, up to a cap per row. They cost the drafter nothing and one verified position each, and are kept whenever
the drafts before them are: the target's masked distribution there is that token alone. The drafter's own k
positions are masked as before, so a forced run inside them is drawn under its one-token masks.

A position whose mask allows nothing (a draft that ended the grammar, or a grammar that dead-ends) is given an
all-true mask so that no softmax runs over nothing: past a grammar's end no draft is proposed, and a token emitted
at a dead end is refused by the matcher on the host, which ends that sequence with an error (`FinishReason.ERROR`).

S = sequences, R = sampled rows (1 + drafts per sequence), W = bitmask words, V = vocabulary, k = drafts.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from replica.engine.drafting import Drafter, ProposeRequest
from replica.engine.sampler import SamplingTensors, noise_keys
from replica.engine.sequence import Sequence
from replica.grammar.matcher import GrammarCompiler, GrammarMatcher, allowed


def verification_bitmasks(
    compiler: GrammarCompiler, seqs: Seq[Sequence], num_drafts: Seq[int]
) -> dict[int, torch.Tensor]:
    """{seq_id: bitmask [1 + d, W]} for the constrained ones of `seqs` (each verifying `num_drafts[i]` drafts):
    the mask after its committed tokens, then after each draft. The matchers end where they started."""
    rows: list[tuple[GrammarMatcher, int, list[int]]] = []
    spans: list[tuple[int, int, int]] = []
    first = 0
    for seq, d in zip(seqs, num_drafts, strict=True):
        if seq.grammar is None:
            continue
        rows.append((seq.grammar, first, seq.draft_token_ids[:d]))
        spans.append((seq.seq_id, first, d + 1))
        first += d + 1
    if not rows:
        return {}
    bitmask = compiler.fill_masks(rows, first)
    return {seq_id: bitmask[start : start + n] for seq_id, start, n in spans}


def target_allowed(
    seqs: Seq[Sequence], num_rows: Seq[int], bitmasks: dict[int, torch.Tensor], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """Allowed tokens [R, V] bool for a step's sampled rows (`seqs` in row order, `num_rows[i]` rows each), or None
    when none is constrained. Unconstrained rows and rows that allow nothing allow everything."""
    if not any(s.seq_id in bitmasks for s in seqs):
        return None
    num_words = (vocab_size + 31) // 32
    parts = [
        bitmasks[s.seq_id][:n] if s.seq_id in bitmasks else torch.full((n, num_words), -1, dtype=torch.int32)
        for s, n in zip(seqs, num_rows, strict=True)
    ]
    mask = allowed(torch.cat(parts).to(device, non_blocking=True), vocab_size)
    return mask | ~mask.any(-1, keepdim=True)


def apply_allowed(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """logits [N, V] with the tokens `mask` [N, V] refuses at -inf (a copy; the input is left as it is)."""
    return logits if mask is None else logits.masked_fill(~mask, -torch.inf)


class DraftWalk:
    """`ProposeRequest.allowed` for constrained sequences: each call consumes the drafts drawn at the previous
    position and returns the next position's masks; `end` reads the forced tokens and the masks the next step
    verifies with, and `finish` rolls the matchers back."""

    def __init__(self, compiler: GrammarCompiler, matchers: list[GrammarMatcher], device: torch.device) -> None:
        self.compiler = compiler
        self.matchers = matchers
        self.device = device
        self.num_consumed = [0] * len(matchers)
        self.num_valid = [0] * len(matchers)
        """Leading drafts of each row drawn under a mask that allowed something: the drafts it may propose."""
        self.bitmasks: list[list[torch.Tensor]] = [[] for _ in matchers]
        """Each row's bitmask [W] at every position it drew while valid: the mask after each prefix of its drafts."""
        self._is_active = [not m.is_stopped for m in matchers]

    def __call__(self, position: int, previous: torch.Tensor) -> torch.Tensor:
        if position > 0:
            drawn = previous.tolist()  # one small transfer per drafted position (module docstring)
            for row, matcher in enumerate(self.matchers):
                if self._is_active[row]:
                    if matcher.consume(drawn[row]):
                        self.num_consumed[row] += 1
                    else:
                        self._is_active[row] = False
        rows = [(m, row, ()) for row, m in enumerate(self.matchers) if self._is_active[row] and not m.is_stopped]
        bitmask = self.compiler.fill_masks(rows, len(self.matchers))
        has_any = (bitmask != 0).any(-1).tolist()  # on the host: the bitmask is a CPU tensor
        for row, is_allowed in enumerate(has_any):
            if self._is_active[row] and is_allowed:
                self.num_valid[row] += 1
                self.bitmasks[row].append(bitmask[row])
            else:
                self._is_active[row] = False
        mask = allowed(bitmask.to(self.device, non_blocking=True), self.compiler.vocab_size)
        return mask | ~mask.any(-1, keepdim=True)

    def end(self, drafts: list[list[int]], max_forced: Seq[int]) -> list[tuple[list[int], torch.Tensor]]:
        """Per row: (the tokens the grammar forces after its `drafts`, at most `max_forced[row]`; the bitmasks
        [1 + d, W] after the committed tokens and after each of the d drafts, forced ones included), as
        `verification_bitmasks` would compute them next step. `drafts`: each row's leading valid drafts. The
        matchers are moved to the end of those drafts (`finish` rolls them back)."""
        forced: list[list[int]] = []
        for row, (matcher, row_drafts, limit) in enumerate(zip(self.matchers, drafts, max_forced, strict=True)):
            count = len(row_drafts)
            assert count <= self.num_valid[row], "drafts past the walk's valid positions"
            if self.num_consumed[row] > count:
                matcher.rollback(self.num_consumed[row] - count)
            for token in row_drafts[self.num_consumed[row] :]:
                if not matcher.consume(token):
                    raise RuntimeError(f"the grammar refused a draft drawn under its mask: {matcher.error}")
            self.num_consumed[row] = count
            is_open = limit > 0 and not matcher.is_stopped
            forced.append(list(matcher.llmatcher.compute_ff_tokens()[:limit]) if is_open else [])
        rows, first = [], 0
        for matcher, extra in zip(self.matchers, forced, strict=True):
            rows.append((matcher, first, extra))
            first += 1 + len(extra)
        tail = self.compiler.fill_masks(rows, first)  # after the drafter's drafts, then after each forced one
        out = []
        for row, (extra, (_, start, _)) in enumerate(zip(forced, rows, strict=True)):
            own = self.bitmasks[row][: len(drafts[row])]  # the walk's: after each prefix of the drafts
            out.append((extra, torch.cat([*(m.unsqueeze(0) for m in own), tail[start : start + 1 + len(extra)]])))
        return out

    def finish(self) -> None:
        for matcher, n in zip(self.matchers, self.num_consumed, strict=True):
            matcher.rollback(n)


def propose_constrained(
    drafter: Drafter,
    compiler: GrammarCompiler,
    seqs: list[Sequence],
    num_next_drafts: list[int],
    device: torch.device,
    max_forced: Seq[int] | None = None,
) -> list[tuple[list[int], torch.Tensor]]:
    """Drafts for constrained sequences after their tokens of this step are appended (and consumed by their
    matchers): `num_next_drafts[i]` at most for `seqs[i]`, fewer where the grammar ends, then up to `max_forced[i]`
    forced ones (module docstring). -> per sequence (drafts, the grammar's bitmasks [1 + len(drafts), W] on the
    host to verify them with)."""
    k = max(num_next_drafts)
    walk = DraftWalk(compiler, [s.grammar for s in seqs if s.grammar is not None], device)
    assert len(walk.matchers) == len(seqs), "every sequence here has a grammar"
    tables = [s.block_table for s in seqs]
    width = max(len(t) for t in tables)
    proposal = drafter.propose(
        ProposeRequest(
            num_drafts=k,
            anchor_tokens=torch.tensor([s.token_ids[-1] for s in seqs], dtype=torch.long, device=device),
            anchor_positions=torch.tensor([s.num_tokens - 1 for s in seqs], dtype=torch.long, device=device),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device),
            sampling=SamplingTensors.build([s.params for s in seqs], device),
            keys=noise_keys(
                torch.tensor([s.sample_seed for s in seqs], dtype=torch.long, device=device),
                torch.tensor([[s.num_tokens + j for j in range(k)] for s in seqs], dtype=torch.long, device=device),
            ),
            allowed=walk,
        )
    )
    tokens = proposal.tokens.tolist()  # the last position's drafts (and the rest again), in one transfer
    drafts = [tokens[row][: min(n, walk.num_valid[row])] for row, n in enumerate(num_next_drafts)]
    ends = walk.end(drafts, max_forced or [0] * len(seqs))
    walk.finish()
    return [(own + extra, bitmask) for own, (extra, bitmask) in zip(drafts, ends, strict=True)]
