"""SGLang router's `cache_aware` policy, as a baseline (sgl-router `policies/cache_aware.rs`).

With load = requests in flight from the router (the counter SGLang's router keeps per worker):

1. Imbalance switch. If max_load - min_load > balance_abs_threshold AND max_load > balance_rel_threshold *
   min_load (both strict), the request goes to the least-loaded replica: branch IMBALANCE.
2. Otherwise, with match_rate = matched prompt tokens / prompt tokens of the best-matching replica: if
   match_rate > cache_threshold (strict), the request goes to that replica: branch CACHE_HIT.
3. Otherwise it goes to the least-loaded replica: branch CACHE_MISS.

Differences from the source, all forced by Shoal's shared inputs:
- SGLang matches characters of the request text in a per-router approximate radix tree; here the match is the
  `PrefixIndex` match in blocks (`RouteRequest.matched_blocks`), exact or approximate as the router runs.
- In step 3 SGLang picks the worker with the smallest tree (the fewest cached characters, i.e. the most free
  cache). The policy does not see tree sizes, so it takes the least-loaded replica, ties going to the least
  recently chosen (the replica that has received the least new prefix data lately) and then the smallest id.
  The same tie break applies in step 1, where SGLang takes the first minimum in worker order, and among equally
  long matches in step 2, after the lower load.
- SGLang computes min and max load over all its workers; here over the eligible replicas passed in.

Parameters (`SGLangCacheAwareConfig` below), defaults from sglang-router's CLI: cache_threshold 0.3,
balance_abs_threshold 64, balance_rel_threshold 1.5.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from router.policy.decisions import decision
from router.policy.types import Branch, Decision, PolicyConfigModel, ReplicaState, RouteRequest


class SGLangCacheAwareConfig(PolicyConfigModel):
    """SGLang router's `cache_aware` policy (see `sglang_cache_aware`). Defaults are sglang-router's CLI."""

    kind: Literal["sglang_cache_aware"] = "sglang_cache_aware"

    cache_threshold: float = Field(default=0.3, ge=0.0, le=1.0)
    """Prefix match ratio (matched / prompt tokens) above which the best-matching replica is chosen.
    `--cache-threshold`, default 0.3."""

    balance_abs_threshold: int = Field(default=64, ge=0)
    """Requests: the load is imbalanced only if max - min load exceeds this. `--balance-abs-threshold`, 64."""

    balance_rel_threshold: float = Field(default=1.5, ge=0.0)
    """Ratio: the load is imbalanced only if max load exceeds this times min load. `--balance-rel-threshold`,
    1.5."""


def _least_loaded(replicas: Sequence[ReplicaState]) -> ReplicaState:
    return min(replicas, key=lambda r: (r.in_flight, r.last_selected, r.id))


class SGLangCacheAware:
    """Cache affinity while the load is balanced, shortest queue when it is not."""

    name = "sglang_cache_aware"

    def __init__(self, config: SGLangCacheAwareConfig) -> None:
        self.config = config

    def is_imbalanced(self, replicas: Sequence[ReplicaState]) -> bool:
        """SGLang's switch: both the absolute and the relative load gap exceed their thresholds."""
        max_load = max(r.in_flight for r in replicas)
        min_load = min(r.in_flight for r in replicas)
        return (
            max_load - min_load > self.config.balance_abs_threshold
            and max_load > min_load * self.config.balance_rel_threshold
        )

    def select(self, request: RouteRequest, replicas: Sequence[ReplicaState], *, now: float) -> Decision:
        if len(replicas) == 1:
            return decision(request, replicas[0].id, Branch.ONLY_REPLICA)
        if self.is_imbalanced(replicas):
            return decision(request, _least_loaded(replicas).id, Branch.IMBALANCE)

        best = min(replicas, key=lambda r: (-request.cached_tokens(r.id), r.in_flight, r.last_selected, r.id))
        match_rate = request.cached_tokens(best.id) / request.prompt_tokens if request.prompt_tokens > 0 else 0.0
        if match_rate > self.config.cache_threshold:
            return decision(request, best.id, Branch.CACHE_HIT)
        return decision(request, _least_loaded(replicas).id, Branch.CACHE_MISS)
