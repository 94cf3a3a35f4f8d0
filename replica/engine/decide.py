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

Penalties apply to the target's logits at every verified row, from that row's history: the committed output plus
the drafts before the row, so speculation changes nothing about which tokens a penalised greedy request emits. The
drafter proposes without penalties (a worse proposal, still exact: acceptance only needs the q it drew from).

Log-probabilities, for the requests that ask, are the model's raw distribution at each emitted token's position
(`sampler.raw_logprobs`: before penalties, grammar masks and temperature, as vLLM reports by default). An accepted
draft's logprob is the target's at its verified row, so the values are those of decoding without speculation. The
chosen tokens' logprobs and a top-k of each row travel in the same single transfer as the tokens (everything cast
to float64 for it, exact for token ids).

S = sampled sequences, k = most drafts verified by any, k' = most drafts proposed for any, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replica.engine.constrain import apply_allowed
from replica.engine.drafting import Drafter, ProposeRequest
from replica.engine.rejection import verify
from replica.engine.runner import RunnerOutput
from replica.engine.sampler import (
    Penalties,
    SamplingTensors,
    apply_penalties,
    gather_logprobs,
    probabilities,
    raw_logprobs,
)
from replica.engine.sequence import Sequence


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the model, and the most likely tokens at its position."""

    logprob: float
    top: list[tuple[int, float]]
    """(token id, logprob), most likely first; as many as the request asked for."""


@dataclass(frozen=True)
class Decided:
    tokens: list[int]
    """Emitted tokens: the accepted drafts, then the residual or bonus token (before any stop condition)."""
    next_drafts: list[int]
    next_draft_probs: torch.Tensor | None
    """[len(next_drafts), V] on the device."""
    logprobs: list[TokenLogprob] | None = None
    """With `params.logprobs` set: one per emitted token."""
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
    penalties = row_penalties(seqs, out.num_rows, vocab, device)
    logits = apply_allowed(apply_penalties(out.logits, penalties), allowed)
    probs = probabilities(logits, sampling.repeat(out.num_rows))  # [R, V]
    # Each sequence's rows, padded to k + 1 by repeating its last one (verify never reads past a row's drafts).
    index: list[int] = []
    first = 0
    for rows in out.num_rows:
        index.extend(first + min(j, rows - 1) for j in range(k + 1))
        first += rows
    row_index = torch.tensor(index, device=device)
    target = probs[row_index].view(num_seqs, k + 1, vocab)
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
    wanted = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
    num_top = max(wanted, default=0)
    if wanted:
        lp = raw_logprobs(out.logits)[row_index].view(num_seqs, k + 1, vocab)
        chosen, top_values, top_ids = gather_logprobs(lp, tokens, num_top)
        num_ints = sum(p.numel() for p in parts)
        host = torch.cat(
            [p.double() for p in parts]
            + [chosen.flatten().double(), top_values.flatten().double(), top_ids.flatten().double()]
        ).tolist()  # the step's one device-to-host transfer
        ints = [int(x) for x in host[:num_ints]]
        floats = host[num_ints:]
    else:
        ints = torch.cat(parts).tolist()  # the step's one device-to-host transfer
        floats = []
    split = num_seqs * (k + 1)
    flat_tokens, emitted, drafted = (
        ints[:split],
        ints[split : split + num_seqs],
        ints[split + num_seqs : num_ints if wanted else None],
    )
    num_cells = num_seqs * (k + 1)
    chosen_lp = floats[:num_cells]
    top_lp = floats[num_cells : num_cells + num_cells * num_top]
    top_tok = floats[num_cells + num_cells * num_top :]
    decided = []
    proposal_row = {row: i for i, row in enumerate(proposing)}
    for row in range(num_seqs):
        n = emitted[row]
        i = proposal_row.get(row)
        nexts = [] if i is None else drafted[i * k_next : i * k_next + num_next[row]]
        logprobs = None
        asked = seqs[row].params.logprobs
        if asked is not None:
            logprobs = []
            for j in range(n):
                cell = row * (k + 1) + j
                first_top = cell * num_top
                top = [(int(top_tok[first_top + t]), top_lp[first_top + t]) for t in range(asked)]
                logprobs.append(TokenLogprob(chosen_lp[cell], top))
        decided.append(
            Decided(
                tokens=flat_tokens[row * (k + 1) : row * (k + 1) + n],
                logprobs=logprobs,
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


def row_penalties(seqs: list[Sequence], num_rows: list[int], vocab: int, device: torch.device) -> Penalties | None:
    """Per-row penalty inputs, or None when no sequence of the step is penalised. Row j of a sequence verifies
    its j-th draft: its history is the committed output and the drafts before it."""
    if not any(s.params.has_penalties for s in seqs):
        return None
    params, prompts, outputs = [], [], []
    for seq, rows in zip(seqs, num_rows, strict=True):
        output = seq.output_token_ids if seq.params.has_penalties else []
        for j in range(rows):
            params.append(seq.params)
            prompts.append(seq.prompt_token_ids)
            outputs.append(output + seq.draft_token_ids[:j] if seq.params.has_penalties else [])
    return Penalties.build(params, prompts, outputs, vocab, device)
