"""A step's tokens, decided on the device and brought to the host in one transfer.

After the target's forward pass every sampled sequence gets the outcome of its drafts and the token after them
(`rejection.verify`; without drafts that is plain sampling), then, for the sequences that speculate in the next
step, the drafter's proposal following that token. Emitted tokens, their counts and the new drafts reach the host
in a single `.tolist()`: one device-to-host synchronisation per step for the whole batch, whatever its size and k,
so the same code keeps a GPU busy (tests/unit/replica_engine/test_speculative_engine.py counts them). The
proposal's probabilities stay on the device for the next step's acceptance test. Constrained sequences are masked
here and draft after the transfer, once their grammars have consumed this step's tokens (`replica.engine.constrain`).

Each sequence draws its uniforms from its own generator (a seeded request's, or the engine's), as many as it uses:
one per draft it verifies, one for the token after them, one per draft it will propose. So a seeded request's
output depends on its own drafts and not on the batch's largest k.

S = sampled sequences, k = most drafts verified by any, k' = most drafts proposed for any, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replica.engine.constrain import apply_allowed
from replica.engine.drafting import Drafter, ProposeRequest
from replica.engine.rejection import verify
from replica.engine.runner import RunnerOutput
from replica.engine.sampler import SamplingTensors, probabilities
from replica.engine.sequence import Sequence


@dataclass(frozen=True)
class Decided:
    tokens: list[int]
    """Emitted tokens: the accepted drafts, then the residual or bonus token (before any stop condition)."""
    next_drafts: list[int]
    next_draft_probs: torch.Tensor | None
    """[len(next_drafts), V] on the device."""
    draft_uniforms: torch.Tensor | None = None
    """A constrained sequence that drafts next: the uniforms of its drafts, for `constrain.propose_constrained`
    once its tokens are consumed by its grammar (its drafts are not proposed here)."""


def _uniforms(
    generators: list[torch.Generator], num_drafts: list[int], num_next: list[int], k: int, k_next: int
) -> torch.Tensor:
    """[S, k + 1 + k'] float64: columns [0, k) verify drafts, column k draws the next token, [k + 1, ...) draft."""
    out = torch.zeros(len(generators), k + 1 + k_next, dtype=torch.float64)
    for row, (gen, d, n) in enumerate(zip(generators, num_drafts, num_next, strict=True)):
        draws = torch.rand(d + 1 + n, generator=gen, dtype=torch.float64)
        out[row, :d] = draws[:d]
        out[row, k] = draws[d]
        out[row, k + 1 : k + 1 + n] = draws[d + 1 :]
    return out


def decide(
    seqs: list[Sequence],
    num_drafts: list[int],
    num_next: list[int],
    out: RunnerOutput,
    generators: list[torch.Generator],
    drafter: Drafter | None,
    allowed: torch.Tensor | None = None,
) -> list[Decided]:
    """seqs: the step's sampled sequences (`out.sampled` order), each verifying `num_drafts[i]` drafts and to
    propose `num_next[i]` (0: none; needs a drafter). `allowed` [R, V] bool: grammar masks of the sampled rows
    (`constrain.target_allowed`), applied to the logits before anything is drawn or verified; constrained
    sequences get their drafts' uniforms back instead of drafts."""
    assert out.logits is not None
    device = out.logits.device
    num_seqs, vocab = len(seqs), out.logits.shape[-1]
    k, k_next = max(num_drafts), max(num_next)
    uniforms = _uniforms(generators, num_drafts, num_next, k, k_next).to(device)
    sampling = SamplingTensors.build([s.params for s in seqs], device)
    probs = probabilities(apply_allowed(out.logits, allowed), sampling.repeat(out.num_rows))  # [R, V]
    # Each sequence's rows, padded to k + 1 by repeating its last one (verify never reads past a row's drafts).
    index: list[int] = []
    first = 0
    for rows in out.num_rows:
        index.extend(first + min(j, rows - 1) for j in range(k + 1))
        first += rows
    target = probs[torch.tensor(index, device=device)].view(num_seqs, k + 1, vocab)
    draft_probs = torch.zeros(num_seqs, k, vocab, device=device)
    for row, (seq, d) in enumerate(zip(seqs, num_drafts, strict=True)):
        if d:
            assert seq.draft_probs is not None and seq.draft_probs.shape[0] == d
            draft_probs[row, :d] = seq.draft_probs
    draft_tokens = torch.tensor(
        [s.draft_token_ids[:d] + [0] * (k - d) for s, d in zip(seqs, num_drafts, strict=True)],
        dtype=torch.long,
        device=device,
    ).view(num_seqs, k)
    tokens, num_emitted = verify(
        target,
        draft_probs,
        draft_tokens,
        torch.tensor(num_drafts, dtype=torch.long, device=device),
        uniforms[:, :k],
        uniforms[:, k],
    )
    parts = [tokens.flatten(), num_emitted]
    proposing = [row for row, n in enumerate(num_next) if n and seqs[row].grammar is None]
    probs_next = None
    if proposing:
        assert drafter is not None
        picked = torch.tensor(proposing, dtype=torch.long, device=device)
        last = tokens.gather(1, (num_emitted - 1).unsqueeze(-1)).squeeze(-1)  # [S] the token drafts follow
        tables = [seqs[row].block_table for row in proposing]
        width = max(len(t) for t in tables)
        proposal = drafter.propose(
            ProposeRequest(
                num_tokens=k_next,
                anchor_tokens=last[picked],
                anchor_positions=torch.tensor(out.first_positions, device=device)[picked] + num_emitted[picked],
                block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device),
                sampling=sampling.select(picked),
                uniforms=uniforms[picked, k + 1 :],
            )
        )
        parts.append(proposal.tokens.flatten())
        probs_next = proposal.probs
    host = torch.cat(parts).tolist()  # the step's one device-to-host transfer
    split = num_seqs * (k + 1)
    flat_tokens, emitted, drafted = host[:split], host[split : split + num_seqs], host[split + num_seqs :]
    decided = []
    proposal_row = {row: i for i, row in enumerate(proposing)}
    for row in range(num_seqs):
        n = emitted[row]
        i = proposal_row.get(row)
        nexts = [] if i is None else drafted[i * k_next : i * k_next + num_next[row]]
        decided.append(
            Decided(
                tokens=flat_tokens[row * (k + 1) : row * (k + 1) + n],
                next_drafts=nexts,
                next_draft_probs=None if i is None or probs_next is None else probs_next[i, : num_next[row]],
                draft_uniforms=(
                    uniforms[row, k + 1 : k + 1 + num_next[row]]
                    if num_next[row] and seqs[row].grammar is not None
                    else None
                ),
            )
        )
    return decided
