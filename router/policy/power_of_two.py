"""Power of two choices: sample two distinct replicas at random and send the request to the less loaded one.

Mitzenmacher, "The Power of Two Choices in Randomized Load Balancing" (IEEE TPDS, 2001): two random probes
bring the maximum load down exponentially compared with one, at a fraction of the cost of polling every
server, and they tolerate stale load figures better than a global minimum does. As in SGLang router's
`power_of_two`: two distinct workers, the one with the lower load wins, the first sampled on a tie. Load is
`ReplicaState.queue_depth`.

No parameters besides the seed (`PowerOfTwoConfig` below); the generator is a `random.Random(seed)` owned by
the policy. Cache-blind; the branch is POWER_OF_TWO (ONLY_REPLICA for a single replica).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal

from router.policy.decisions import decision
from router.policy.types import Branch, Decision, PolicyConfigModel, ReplicaState, RouteRequest


class PowerOfTwoConfig(PolicyConfigModel):
    """The better of two random choices (see `power_of_two`)."""

    kind: Literal["power_of_two"] = "power_of_two"


class PowerOfTwo:
    """The less loaded of two distinct random replicas."""

    name = "power_of_two"

    def __init__(self, config: PowerOfTwoConfig, *, seed: int = 0) -> None:
        self.config = config
        self._rng = random.Random(seed)

    def select(self, request: RouteRequest, replicas: Sequence[ReplicaState], *, now: float) -> Decision:
        if len(replicas) == 1:
            return decision(request, replicas[0].id, Branch.ONLY_REPLICA)
        first, second = self._rng.sample(replicas, 2)
        chosen = first if first.queue_depth <= second.queue_depth else second
        return decision(request, chosen.id, Branch.POWER_OF_TWO)
