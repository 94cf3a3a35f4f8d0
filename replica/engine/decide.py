"""A step's tokens, decided on the device and brought to the host in one transfer.

After the target's forward pass every sampled sequence gets the outcome of its drafts and the token after them
(`verification.verify`; without drafts that is plain sampling), then, for the sequences that speculate in the next
step, the drafter's proposal following that token. Emitted tokens, their counts and the new drafts reach the host
in a single `.tolist()`: one device-to-host synchronisation per step for the whole batch, whatever its size and its
drafts, so the same code keeps a GPU busy (tests/unit/replica_engine/test_speculative_engine.py counts them).
Constrained sequences are masked here and draft after the transfer, once their grammars have consumed this step's
tokens (`replica.engine.constrain`).

Every draw is keyed by the sequence's seed and the position it decides (`sampler.noise_keys`), the target's and the
drafter's alike, so a seeded request's output is a function of the request: the same whatever else is in the
batch, whatever k the policy picks, and with speculation on or off.

Penalties apply to the target's logits at every verified row, from that row's history: the committed output plus
the drafts before the row, so speculation changes nothing about which tokens a penalised greedy request emits. The
drafter proposes without penalties (a worse proposal, still exact: what it drafts never changes the output).

Log-probabilities, for the requests that ask, are the model's raw distribution at each emitted token's position
(`sampler.raw_logprobs`: before penalties, grammar masks and temperature, as vLLM reports by default). An accepted
draft's logprob is the target's at its verified row, so the values are those of decoding without speculation. The
chosen tokens' logprobs and a top-k of each row travel in the same single transfer as the tokens (everything cast
to float64 for it, exact for token ids).

S = sampled sequences, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replica.engine.constrain import apply_allowed
from replica.engine.drafting import Drafter, ProposeRequest
from replica.engine.runner import RunnerOutput
from replica.engine.sampler import (
    Penalties,
    SamplingTensors,
    TokenLogprob,
    apply_penalties,
    gather_logprobs,
    noise_keys,
    probabilities,
    raw_logprobs,
)
from replica.engine.sequence import Sequence
from replica.engine.verification import verify
from replica.model.host import decides_on_host


@dataclass(frozen=True)
class Decided:
    tokens: list[int]
    """Emitted tokens: the accepted drafts, then the target's token after them (before any stop condition)."""
    next_drafts: list[int]
    logprobs: list[TokenLogprob] | None = None
    """With `params.logprobs` set: one per emitted token."""
    num_constrained_next: int = 0
    """A constrained sequence that drafts next: how many drafts, for `constrain.propose_constrained` once its
    tokens are consumed by its grammar (its drafts are not proposed here)."""


def decide(
    seqs: list[Sequence],
    num_drafts: list[int],
    num_next_drafts: list[int],
    out: RunnerOutput,
    drafter: Drafter | None,
    allowed: torch.Tensor | None = None,
) -> list[Decided]:
    """seqs: the step's sampled sequences (`out.sampled` order), each verifying `num_drafts[i]` drafts and to
    propose `num_next_drafts[i]` (0: none; needs a drafter). `allowed` [R, V] bool: grammar masks of the sampled rows
    (`constrain.target_allowed`), applied to the logits before anything is drawn or verified; constrained
    sequences propose later (`Decided.num_constrained_next`)."""
    assert out.logits is not None
    device = out.logits.device
    num_seqs, vocab = len(seqs), out.logits.shape[-1]
    max_drafts, max_next_drafts = max(num_drafts), max(num_next_drafts)
    sampling = SamplingTensors.build([s.params for s in seqs], device)
    penalties = row_penalties(seqs, out.num_rows, vocab, device)
    logits = apply_allowed(apply_penalties(out.logits, penalties), allowed)
    probs = probabilities(logits, sampling.repeat(out.num_rows))  # [R, V]
    # Each sequence's rows, padded to max_drafts + 1 by repeating its last one (verify never reads past a row's drafts).
    index: list[int] = []
    first = 0
    for rows in out.num_rows:
        index.extend(first + min(j, rows - 1) for j in range(max_drafts + 1))
        first += rows
    row_index = torch.tensor(index, device=device)
    target = probs[row_index].view(num_seqs, max_drafts + 1, vocab)
    draft_tokens = torch.tensor(
        [s.draft_token_ids[:d] + [0] * (max_drafts - d) for s, d in zip(seqs, num_drafts, strict=True)],
        dtype=torch.long,
        device=device,
    ).view(num_seqs, max_drafts)
    seeds = torch.tensor([s.sample_seed for s in seqs], dtype=torch.long, device=device)
    decided_at = torch.tensor([s.num_tokens for s in seqs], dtype=torch.long, device=device)  # row 0's position
    keys = drawing = None
    if not sampling.is_all_greedy:
        keys = noise_keys(seeds, decided_at.unsqueeze(-1) + torch.arange(max_drafts + 1, device=device))
        drawing = sampling.temperature != 0 if decides_on_host(logits) else None
    num_drafts_t = torch.tensor(num_drafts, dtype=torch.long, device=device)
    tokens, num_emitted = verify(target, draft_tokens, num_drafts_t, keys, drawing)
    parts = [tokens.flatten(), num_emitted]
    proposing = [row for row, n in enumerate(num_next_drafts) if n and seqs[row].grammar is None]
    if proposing:
        assert drafter is not None
        picked = torch.tensor(proposing, dtype=torch.long, device=device)
        last = tokens.gather(1, (num_emitted - 1).unsqueeze(-1)).squeeze(-1)  # [S] the token drafts follow
        tables = [seqs[row].block_table for row in proposing]
        width = max(len(t) for t in tables)
        proposal = drafter.propose(
            ProposeRequest(
                num_drafts=max_next_drafts,
                anchor_tokens=last[picked],
                anchor_positions=torch.tensor(out.first_positions, device=device)[picked] + num_emitted[picked],
                block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device),
                sampling=sampling.select(picked),
                keys=noise_keys(
                    seeds[picked],
                    (decided_at + num_emitted)[picked].unsqueeze(-1) + torch.arange(max_next_drafts, device=device),
                ),
            )
        )
        parts.append(proposal.tokens.flatten())
    wanted = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
    num_top = max(wanted, default=0)
    if wanted:
        lp = raw_logprobs(out.logits)[row_index].view(num_seqs, max_drafts + 1, vocab)
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
    split = num_seqs * (max_drafts + 1)
    flat_tokens, emitted, drafted = (
        ints[:split],
        ints[split : split + num_seqs],
        ints[split + num_seqs : num_ints if wanted else None],
    )
    num_cells = num_seqs * (max_drafts + 1)
    chosen_lp = floats[:num_cells]
    top_lp = floats[num_cells : num_cells + num_cells * num_top]
    top_tok = floats[num_cells + num_cells * num_top :]
    decided = []
    proposal_row = {row: i for i, row in enumerate(proposing)}
    for row in range(num_seqs):
        n = emitted[row]
        i = proposal_row.get(row)
        nexts = [] if i is None else drafted[i * max_next_drafts : i * max_next_drafts + num_next_drafts[row]]
        logprobs = None
        asked = seqs[row].params.logprobs
        if asked is not None:
            logprobs = []
            for j in range(n):
                cell = row * (max_drafts + 1) + j
                first_top = cell * num_top
                top = [(int(top_tok[first_top + t]), top_lp[first_top + t]) for t in range(asked)]
                logprobs.append(TokenLogprob(chosen_lp[cell], top))
        decided.append(
            Decided(
                tokens=flat_tokens[row * (max_drafts + 1) : row * (max_drafts + 1) + n],
                logprobs=logprobs,
                next_drafts=nexts,
                num_constrained_next=num_next_drafts[row] if seqs[row].grammar is not None else 0,
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
