"""Speculative acceptance: which drafted tokens a step keeps, and the token that follows them.

A sequence arrives with K drafted tokens d_1..d_K, each drawn from the drafter's proposal q_j (the exact
distribution it was sampled from, one-hot for a greedy drafter), and the target's distributions p_1..p_{K+1} at
the K+1 verified positions (`replica.engine.sampler.probabilities`, so temperature, top-k and top-p are already in
p). Speculative sampling (Leviathan et al. 2023; Chen et al. 2023):

    accept d_j while u_j * q_j(d_j) < p_j(d_j)             (probability min(1, p_j(d_j) / q_j(d_j)))
    at the first rejection j, emit a token from norm(max(p_j - q_j, 0))
    if all K are accepted, emit a bonus token from p_{K+1}

so the emitted tokens are distributed exactly as tokens sampled one at a time from p. With p one-hot (greedy)
this is "accept while the draft equals the argmax, then emit the argmax": greedy output equals plain greedy
decoding. Sequences with fewer drafts than the batch's K pad with q = 0: a padded position is always rejected and
its residual is p itself, which is the bonus token, so one formula serves every row.

Everything is batched tensor ops with no host transfer; the caller moves the result to the host once per step.
S = sequences, K = most drafts of any sequence, V = vocabulary.
"""

from __future__ import annotations

import torch

from replica.engine.sampler import sample


def verify(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    accept_uniforms: torch.Tensor,
    final_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (tokens [S, K+1], num_emitted [S]): each row emits `tokens[:num_emitted]`, its accepted drafts then one
    token from the residual or the bonus distribution.

    target_probs [S, K+1, V]; draft_probs [S, K, V]; draft_tokens [S, K] int64; num_drafts [S] int64 in 0..K (rows
    with fewer pad the rest, whatever the padding holds); accept_uniforms [S, K] and final_uniforms [S] in [0, 1).
    """
    num_seqs, num_positions, vocab = target_probs.shape
    k = num_positions - 1
    if k == 0:
        return sample(target_probs[:, 0], final_uniforms).unsqueeze(-1), torch.ones(
            num_seqs, dtype=torch.long, device=target_probs.device
        )
    has_draft = torch.arange(k, device=num_drafts.device) < num_drafts.unsqueeze(-1)  # [S, K]
    q = draft_probs * has_draft.unsqueeze(-1)  # padded positions: q = 0
    drafts = draft_tokens.unsqueeze(-1)
    p_of_draft = target_probs[:, :k].gather(-1, drafts).squeeze(-1)  # [S, K]
    q_of_draft = q.gather(-1, drafts).squeeze(-1)
    accepted = (accept_uniforms.to(q.dtype) * q_of_draft < p_of_draft) & has_draft
    num_accepted = accepted.to(torch.long).cumprod(-1).sum(-1)  # [S] leading accepted drafts
    # The next token's distribution, at position num_accepted: residual after a rejection, p after the last draft.
    at = num_accepted.view(num_seqs, 1, 1).expand(num_seqs, 1, vocab)
    p_at = target_probs.gather(1, at).squeeze(1)  # [S, V]
    q_at = torch.cat((q, q.new_zeros(num_seqs, 1, vocab)), dim=1).gather(1, at).squeeze(1)
    residual = (p_at - q_at).clamp_min(0)
    # p == q leaves no residual mass; a rejection then has probability 0, and rounding that rejects anyway draws
    # from p (the residual's limit), never from nothing.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)
    final = sample(residual, final_uniforms)  # [S]
    tokens = torch.cat((draft_tokens, draft_tokens.new_zeros(num_seqs, 1)), dim=1)
    tokens = tokens.scatter(1, num_accepted.unsqueeze(-1), final.unsqueeze(-1))
    return tokens, num_accepted + 1
