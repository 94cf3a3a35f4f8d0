"""llm-d inference scheduler's default scoring, as a baseline (llm-d-inference-scheduler, default profile).

llm-d's endpoint picker runs filters, then scorers that each give every candidate a score in 0..1, then a
max-score picker over the weighted sum. The default profile's three scorers, as computed here:

- queue-scorer (weight 2): waiting-queue size q, min-max normalised across candidates,
  (q_max - q) / (q_max - q_min), and 1 for everyone when all are equal. q is the engine's waiting queue
  (`num_waiting`, what llm-d reads) when scraped, else the router's own prefill backlog count (`waiting`).
- kv-cache-utilization-scorer (weight 2): 1 - kv_usage. An engine that does not export KV usage (or has not
  been scraped yet, usually a fresh and empty one) scores 1.
- prefix-cache-scorer (weight 3): the matched fraction of the request's blocks, matched_blocks / len(hashes),
  0 for a request shorter than one block.

The replica with the largest weighted sum wins; ties are broken at random, from the policy's own
`random.Random(seed)`, as llm-d's max-score picker shuffles before picking.

Branch: ONLY_REPLICA, else CACHE_HIT / SPILL / CACHE_MISS (`decisions.cache_branch`).

Parameters (`LLMDWeightedConfig` below): queue_weight 2, kv_cache_weight 2, prefix_weight 3 (llm-d's
default scheduler profile).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from router.policy.decisions import cache_branch, decision
from router.policy.types import Branch, Decision, PolicyConfigModel, ReplicaState, RouteRequest


class LLMDWeightedConfig(PolicyConfigModel):
    """llm-d inference scheduler's default scorer weights (see `llmd_weighted`)."""

    kind: Literal["llmd_weighted"] = "llmd_weighted"

    queue_weight: float = Field(default=2.0, ge=0.0)
    """Weight of queue-scorer (waiting queue, min-max normalised). llm-d's default profile: 2."""

    kv_cache_weight: float = Field(default=2.0, ge=0.0)
    """Weight of kv-cache-utilization-scorer (1 - KV usage). llm-d's default profile: 2."""

    prefix_weight: float = Field(default=3.0, ge=0.0)
    """Weight of prefix-cache-scorer (matched fraction of the request's blocks). llm-d's default profile: 3."""


def _queue_size(replica: ReplicaState) -> int:
    return replica.num_waiting if replica.num_waiting is not None else replica.waiting


class LLMDWeighted:
    """Weighted sum of queue, KV-utilisation and prefix scores; the maximum wins."""

    name = "llmd_weighted"

    def __init__(self, config: LLMDWeightedConfig, *, seed: int = 0) -> None:
        self.config = config
        self._rng = random.Random(seed)

    def scores(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> list[float]:
        """The weighted score of each replica, in the order given."""
        cfg = self.config
        queues = [_queue_size(r) for r in replicas]
        q_min, q_max = min(queues), max(queues)
        num_blocks = request.total_blocks
        out: list[float] = []
        for replica, queue in zip(replicas, queues, strict=True):
            queue_score = 1.0 if q_max == q_min else (q_max - queue) / (q_max - q_min)
            kv_score = 1.0 - min(max(replica.kv_usage or 0.0, 0.0), 1.0)
            matched = request.matched_blocks.get(replica.id, 0)
            prefix_score = min(matched / num_blocks, 1.0) if num_blocks else 0.0
            out.append(
                cfg.queue_weight * queue_score + cfg.kv_cache_weight * kv_score + cfg.prefix_weight * prefix_score
            )
        return out

    def select(self, request: RouteRequest, replicas: Sequence[ReplicaState], *, now: float) -> Decision:
        if len(replicas) == 1:
            return decision(request, replicas[0].id, Branch.ONLY_REPLICA)
        scores = self.scores(request, replicas)
        best = max(scores)
        chosen = self._rng.choice([r for r, s in zip(replicas, scores, strict=True) if s == best])
        return decision(request, chosen.id, cache_branch(request, replicas, chosen.id))
