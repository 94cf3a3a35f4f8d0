"""Building a `Decision`: the cache figures of the chosen replica and, for cache-aware policies, the branch.

Every policy reports the predicted cached prefix of the replica it chose, so that the simulator and the metrics
can compare hit ratios across policies, including the cache-blind baselines. Cache-aware policies that do not
have a branch logic of their own (estimated_ttft, dynamo_kv, llmd_weighted) explain a choice the same way:

- CACHE_MISS: no eligible replica holds a single block of the prompt;
- CACHE_HIT: the chosen replica holds the longest prefix (ties included);
- SPILL: another replica held at least one block more, and load made this one the better choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from operator import attrgetter

from router.policy.types import Branch, Decision, ReplicaState, RouteRequest

_id_of = attrgetter("id")


def decision(request: RouteRequest, replica_id: str, branch: Branch, predicted_ttft_s: float | None = None) -> Decision:
    """A decision for `replica_id` carrying its predicted prefix match."""
    return Decision(
        replica=replica_id,
        branch=branch,
        matched_blocks=request.matched_blocks.get(replica_id, 0),
        predicted_cached_tokens=request.cached_tokens(replica_id),
        predicted_ttft_s=predicted_ttft_s,
    )


def cache_branch(request: RouteRequest, replicas: Sequence[ReplicaState], chosen_id: str) -> Branch:
    """CACHE_MISS, CACHE_HIT or SPILL for a choice among `replicas` (see the module docstring)."""
    matched = request.matched_blocks
    if not matched:
        return Branch.CACHE_MISS
    best_blocks = max(map(matched.get, map(_id_of, replicas), repeat(0)))
    return branch_for_blocks(best_blocks, matched.get(chosen_id, 0))


def branch_for_blocks(best_blocks: int, chosen_blocks: int) -> Branch:
    """`cache_branch` from the longest match among the replicas and the chosen replica's match, in blocks."""
    if best_blocks <= 0:
        return Branch.CACHE_MISS
    if chosen_blocks >= best_blocks:
        return Branch.CACHE_HIT
    return Branch.SPILL
