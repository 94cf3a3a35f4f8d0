"""NVIDIA Dynamo's KV router, as a baseline (Dynamo `kv_router` DefaultWorkerSelector).

Every replica gets a cost in KV blocks, lower is better:

    request_blocks = prompt_tokens / tokens_per_block
    prefill_blocks = max(request_blocks - overlap_blocks, 0)      # blocks this replica would have to compute
    cost           = overlap_score_weight * prefill_blocks + active_blocks

`overlap_blocks` is the replica's prefix match (`RouteRequest.matched_blocks`). `active_blocks` stands for
Dynamo's decode blocks, the KV blocks held by the requests active on the worker, which Dynamo's router tracks
per sequence. Shoal's router knows counts, not sequences, so it estimates them:
- kv_usage * kv_capacity_blocks when the replica's KV usage was scraped and its capacity is known: the blocks
  really held, by every router's requests;
- else (waiting_prompt_tokens + streaming * streaming_seq_tokens) / tokens_per_block: the prefill backlog's
  uncached tokens plus a round figure per streaming request.
Dynamo also adds the new request's own blocks to every worker's decode blocks; that shifts all costs alike and
changes neither the argmin nor the (shift-invariant) softmax, so it is left out.

Choice: with temperature 0, the smallest cost, exact ties broken at random (as Dynamo does). With temperature
T > 0, Dynamo's softmax sampling: costs are scaled by 1 / (max - min), negated and divided by T, so
P(r) is proportional to exp(-(cost(r) - min) / ((max - min) * T)); uniform when all costs are equal. Random
draws come from the policy's own `random.Random(seed)`.

Branch: ONLY_REPLICA, else CACHE_HIT / SPILL / CACHE_MISS (`decisions.cache_branch`).

Parameters (`DynamoKVConfig` below), defaults from Dynamo's frontend: overlap_score_weight 1.0
(`--kv-overlap-score-weight`), temperature 0.0 (`--router-temperature`); streaming_seq_tokens 1024 (Shoal's
estimate, see above).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from router.policy.decisions import cache_branch, decision
from router.policy.types import Branch, Decision, PolicyConfigModel, ReplicaState, RouteRequest


class DynamoKVConfig(PolicyConfigModel):
    """NVIDIA Dynamo's KV router cost (see `dynamo_kv`). Defaults are Dynamo's frontend defaults."""

    kind: Literal["dynamo_kv"] = "dynamo_kv"

    overlap_score_weight: float = Field(default=1.0, ge=0.0)
    """Weight of the prefill blocks against the active (decode) blocks, `--kv-overlap-score-weight`, default
    1.0. 0 ignores the prefix cache (pure load balancing)."""

    temperature: float = Field(default=0.0, ge=0.0)
    """Softmax sampling temperature over normalised costs, `--router-temperature`, default 0 (argmin)."""

    streaming_seq_tokens: int = Field(default=1024, ge=0)
    """Tokens of KV one streaming request is assumed to hold when a replica's KV usage or capacity is unknown.
    Dynamo tracks each active sequence's blocks itself; Shoal's router knows only counts, so it charges a round
    figure for a chat turn's prompt plus output."""


class DynamoKV:
    """Minimise prefill blocks (weighted) plus active blocks; optionally sample by softmax."""

    name = "dynamo_kv"

    def __init__(self, config: DynamoKVConfig, *, seed: int = 0) -> None:
        self.config = config
        self._rng = random.Random(seed)

    def active_blocks(self, request: RouteRequest, replica: ReplicaState) -> float:
        """KV blocks held by the requests active on `replica` (see the module docstring for the estimate)."""
        if replica.kv_usage is not None and replica.kv_capacity_blocks is not None:
            return replica.kv_usage * replica.kv_capacity_blocks
        tokens = replica.waiting_prompt_tokens + replica.streaming * self.config.streaming_seq_tokens
        return tokens / request.tokens_per_block

    def cost(self, request: RouteRequest, replica: ReplicaState) -> float:
        """Dynamo's logit for `replica`, in blocks (lower is better)."""
        request_blocks = request.prompt_tokens / request.tokens_per_block
        prefill_blocks = max(request_blocks - request.matched_blocks.get(replica.id, 0), 0.0)
        return self.config.overlap_score_weight * prefill_blocks + self.active_blocks(request, replica)

    def _sample(self, costs: list[tuple[float, ReplicaState]]) -> ReplicaState:
        low = min(c for c, _ in costs)
        high = max(c for c, _ in costs)
        temperature = self.config.temperature
        if temperature == 0.0:
            return self._rng.choice([r for c, r in costs if c == low])
        if high == low:
            return self._rng.choice([r for _, r in costs])
        weights = [math.exp(-(c - low) / ((high - low) * temperature)) for c, _ in costs]
        return self._rng.choices([r for _, r in costs], weights=weights)[0]

    def select(self, request: RouteRequest, replicas: Sequence[ReplicaState], *, now: float) -> Decision:
        if len(replicas) == 1:
            return decision(request, replicas[0].id, Branch.ONLY_REPLICA)
        chosen = self._sample([(self.cost(request, r), r) for r in replicas])
        return decision(request, chosen.id, cache_branch(request, replicas, chosen.id))
