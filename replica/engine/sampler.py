"""Next-token sampling: greedy rows in one argmax, the rest one row at a time with temperature, top-k, top-p.

A request with a seed draws from its own generator, so its output does not depend on what else is in the batch.
"""

from __future__ import annotations

import torch

from replica.engine.sampling import SamplingParams


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] -> logits with everything outside the top-k and the top-p nucleus set to -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens strictly before it already reach top_p (the first token always stays).
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits [N, V] FP32 -> one token id per row."""
    out = [0] * len(params)
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    if greedy:
        ids = logits[greedy].argmax(-1).tolist()
        for i, token in zip(greedy, ids, strict=True):
            out[i] = token
    for i, p in enumerate(params):
        if p.is_greedy:
            continue
        row = _filter_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(-1)
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out
