"""Round robin: each request goes to the next replica in id order.

The cursor is the id of the last replica chosen, not an index, so the rotation survives changes to the replica
set: the next request goes to the smallest id greater than the cursor (wrapping to the smallest id), a new
replica takes its turn in id order, and a removed one is simply no longer there. Over any run of requests
against a fixed set, every replica's count differs from the others' by at most one.

No parameters (`RoundRobinConfig` below). Cache- and load-blind; the branch is ROUND_ROBIN (ONLY_REPLICA for
a single replica). Source: the classic baseline. SGLang router's `round_robin` keeps an index modulo the worker
count, which jumps when a worker joins or leaves; the id cursor keeps the rotation instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from router.policy.decisions import decision
from router.policy.types import Branch, Decision, PolicyConfigModel, ReplicaState, RouteRequest


class RoundRobinConfig(PolicyConfigModel):
    """Cycle through replicas in id order (see `round_robin`)."""

    kind: Literal["round_robin"] = "round_robin"


def next_after(ids: Sequence[str], cursor: str | None) -> str:
    """The smallest id greater than `cursor`, wrapping around to the smallest id (`ids` need not be sorted)."""
    if cursor is not None:
        later = [i for i in ids if i > cursor]
        if later:
            return min(later)
    return min(ids)


class RoundRobin:
    """Cycle through the replicas in id order."""

    name = "round_robin"

    def __init__(self, config: RoundRobinConfig) -> None:
        self.config = config
        self._cursor: str | None = None

    def select(self, request: RouteRequest, replicas: Sequence[ReplicaState], *, now: float) -> Decision:
        chosen = next_after([r.id for r in replicas], self._cursor)
        self._cursor = chosen
        branch = Branch.ONLY_REPLICA if len(replicas) == 1 else Branch.ROUND_ROBIN
        return decision(request, chosen, branch)
