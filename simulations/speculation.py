"""How many draft tokens a speculative step accepts: a truncated geometric law fitted to the mean acceptance length.

Each draft is accepted with probability alpha, independently, until the first rejection, and at most k are, so the
accepted count A in 0..k has P(A >= j) = alpha^j. A sequence emits 1 + A tokens (the accepted drafts and the
target's bonus token), whose mean is

    tau = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)

which increases from 1 (alpha = 0) to k + 1 (alpha = 1). `acceptance_rate` inverts it by bisection, once per
configuration; `accepted_drafts` turns one uniform draw into A. Per-position acceptance falling with the position,
as real drafters show, would need more than tau to fit; the mean, which is what sets throughput, is kept exact.
"""

from __future__ import annotations


def mean_tokens_per_step(num_speculative_tokens: int, alpha: float) -> float:
    """tau for k = `num_speculative_tokens` drafts accepted with probability `alpha` each: sum of alpha^j, j = 0..k."""
    total, term = 0.0, 1.0
    for _ in range(num_speculative_tokens + 1):
        total += term
        term *= alpha
    return total


def acceptance_rate(num_speculative_tokens: int, mean_acceptance_length: float, *, tolerance: float = 1e-12) -> float:
    """alpha such that `mean_tokens_per_step(k, alpha)` = tau, by bisection on [0, 1] (tau is increasing in
    alpha there); tau = 1 gives 0 and tau = k + 1 gives 1."""
    k, tau = num_speculative_tokens, mean_acceptance_length
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be at least 1, got {k}")
    if not 1.0 <= tau <= k + 1:
        raise ValueError(f"mean acceptance length {tau} must lie in [1, k + 1] = [1, {k + 1}]")
    low, high = 0.0, 1.0
    while high - low > tolerance:
        middle = (low + high) / 2
        if mean_tokens_per_step(k, middle) < tau:
            low = middle
        else:
            high = middle
    return 0.0 if tau == 1.0 else 1.0 if tau == k + 1 else (low + high) / 2


def accepted_drafts(u: float, alpha: float, num_speculative_tokens: int) -> int:
    """A, the drafts accepted, from one uniform draw `u` in [0, 1): the largest j <= k with u < alpha^j, so that
    P(A >= j) = alpha^j."""
    accepted, threshold = 0, alpha
    while accepted < num_speculative_tokens and u < threshold:
        accepted += 1
        threshold *= alpha
    return accepted
