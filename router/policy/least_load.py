"""Least load ("join the shortest queue"): each request goes to the replica with the smallest queue depth.

Queue depth is `ReplicaState.queue_depth`: the router's own in-flight count plus the sequences the engine
counted beyond the router's own at its last scrape, so the policy sees other routers' load once a scrape has.
Ties (common when the fleet is idle) go round robin: to the first tied id after the last replica chosen, in id
order, so an idle fleet is not funnelled to its smallest id.

No parameters (`LeastLoadConfig` below). Cache-blind; the branch is LEAST_LOAD (ONLY_REPLICA for a single
replica). Source: join-the-shortest-queue, the textbook load-only baseline.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from router.policy.decisions import decision
from router.policy.round_robin import next_after
from router.policy.types import Branch, Decision, PolicyConfigModel, ReplicaState, RouteRequest


class LeastLoadConfig(PolicyConfigModel):
    """Join the shortest queue (see `least_load`)."""

    kind: Literal["least_load"] = "least_load"


class LeastLoad:
    """The smallest queue depth; ties in round-robin order."""

    name = "least_load"

    def __init__(self, config: LeastLoadConfig) -> None:
        self.config = config
        self._cursor: str | None = None

    def select(self, request: RouteRequest, replicas: Sequence[ReplicaState], *, now: float) -> Decision:
        least = min(r.queue_depth for r in replicas)
        chosen = next_after([r.id for r in replicas if r.queue_depth == least], self._cursor)
        self._cursor = chosen
        branch = Branch.ONLY_REPLICA if len(replicas) == 1 else Branch.LEAST_LOAD
        return decision(request, chosen, branch)
