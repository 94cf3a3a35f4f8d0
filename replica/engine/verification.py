"""Speculative verification: which drafted tokens a step keeps, and the token that follows them.

A sequence arrives with K drafted tokens d_1..d_K and the target's distributions p_1..p_{K+1} at the K+1 verified
positions (`replica.engine.sampler.probabilities`, so temperature, top-k, top-p, penalties and grammar masks are
already in p; row j given the drafts before it). Every position t has its own key (`sampler.noise_keys`: the
sequence's seed and t), and the token decoding without speculation would emit there is y_t = `sample(p_t, key_t)`.
Verification computes y_1..y_{K+1} on all rows at once and

    keeps d_j while d_j = y_j, then emits y at the first position where they differ (or y_{K+1} after K matches)

so, by induction over the positions, the emitted tokens are exactly those of decoding one token at a time with the
same keys: each accepted draft is the token plain decoding emits there, so the next row's context is plain
decoding's too. Speculation changes neither the law of the output (each y_t follows p_t exactly) nor, for a seeded
request, its text. A drafter that draws d_j with the same key from its own q (`Drafter.propose`) is coupled to the
target: both are exponential races over the same Exp(1) draws, so d_j = y_j with probability at least
(1 - TV) / (1 + TV), TV the total variation between p_j and q_j ("drafter-invariant speculative decoding",
Daliri et al. 2024), against 1 - TV for rejection sampling, which cannot reproduce plain decoding's text. With p
one-hot (greedy) y_j is the argmax: greedy output equals plain greedy decoding, and no draw is made at all.

Sequences with fewer drafts than the batch's K pad the rest; a padded position never matches.

Everything is batched tensor ops with no host transfer; the caller moves the result to the host once per step.
S = sequences, K = most drafts of any sequence, V = vocabulary.
"""

from __future__ import annotations

import torch

from replica.engine.sampler import sample


def verify(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    keys: torch.Tensor | None,
    drawing: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (tokens [S, K+1], num_emitted [S]): each row emits `tokens[:num_emitted]`, its accepted drafts then the
    target's token at the first mismatch (or after the last draft).

    target_probs [S, K+1, V]; draft_tokens [S, K] int64; num_drafts [S] int64 in 0..K (rows with fewer pad the rest,
    whatever the padding holds); keys [S, K+1] int64, the keys of the K+1 positions, or None when every row is
    greedy (one-hot); drawing [S] bool: the rows that draw, the others greedy (None: all draw)."""
    num_seqs, num_positions, vocab = target_probs.shape
    k = num_positions - 1
    flat_keys = None if keys is None else keys.reshape(-1)
    rows = None if drawing is None else drawing.repeat_interleave(num_positions).nonzero().squeeze(-1)
    tokens = sample(target_probs.reshape(-1, vocab), flat_keys, rows).view(num_seqs, num_positions)
    if k == 0:
        return tokens, torch.ones(num_seqs, dtype=torch.long, device=target_probs.device)
    has_draft = torch.arange(k, device=num_drafts.device) < num_drafts.unsqueeze(-1)  # [S, K]
    matched = (draft_tokens == tokens[:, :k]) & has_draft
    num_accepted = matched.to(torch.long).cumprod(-1).sum(-1)  # [S] leading drafts equal to the target's tokens
    return tokens, num_accepted + 1
