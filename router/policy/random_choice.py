"""Random: each request goes to a uniformly random replica.

The generator is a `random.Random(seed)` owned by the policy object, so a simulation with the same seed and
the same inputs makes the same choices. (The module is not called `random`, which would shadow the standard
library; the policy's name is still "random".)

No parameters besides the seed (`RandomConfig` below). Cache- and load-blind; the branch is RANDOM
(ONLY_REPLICA for a single replica). Source: the baseline of SGLang router's and vLLM router's `random`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal

from router.policy.decisions import decision
from router.policy.types import Branch, Decision, PolicyConfigModel, ReplicaState, RouteRequest


class RandomConfig(PolicyConfigModel):
    """A uniformly random replica, from the policy's seeded generator (see `random_choice`)."""

    kind: Literal["random"] = "random"


class RandomChoice:
    """A uniformly random replica from a seeded generator."""

    name = "random"

    def __init__(self, config: RandomConfig, *, seed: int = 0) -> None:
        self.config = config
        self._rng = random.Random(seed)

    def select(self, request: RouteRequest, replicas: Sequence[ReplicaState], *, now: float) -> Decision:
        if len(replicas) == 1:
            return decision(request, replicas[0].id, Branch.ONLY_REPLICA)
        return decision(request, self._rng.choice(replicas).id, Branch.RANDOM)
