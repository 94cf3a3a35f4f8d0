"""Shoal's default policy: send each request where its estimated time to first token is smallest.

Every term is in seconds, so replicas of different speeds, caches and loads compare on one scale:

    uncached(r) = prompt_tokens - cached_tokens(r)            # predicted prefix match, from the PrefixIndex
    prefill(r)  = (r.waiting_prompt_tokens + uncached(r)) / r.prefill_tokens_per_s
    decode(r)   = decode_step_s_per_seq * max(r.streaming, r.num_running or 0)
    pressure(r) = kv_pressure_s * x**2,   x = max(0, kv_usage - kv_pressure_threshold) / (1 - kv_pressure_threshold)
    ttft(r)     = prefill(r) + decode(r) + pressure(r)

- prefill: engines prefill first come, first served, so the request waits for the uncached tokens of the
  requests ahead of it (the router's prefill backlog) and then computes its own uncached tokens, all at the
  replica's learned rate (`prefill_rate`). This is where a cache hit and a slow or busy replica both show.
- decode: a chunked-prefill engine runs one token of every decoding sequence in each step beside the prefill
  chunks, so every decoding sequence lengthens the steps the prefill runs in. The router's own streaming count
  is exact; the engine's running count also sees other routers' requests; the larger is used.
- pressure: above the threshold the KV cache is close to full and a new request waits for blocks (or causes a
  preemption); the term grows quadratically to `kv_pressure_s` at a full cache. It is 0 when the engine does
  not export KV usage.

Choice. A replica whose queue depth is at or past `max_queue_per_replica` is skipped while another is under
the cap; when every replica is at it, the smallest estimate over all wins and the branch is OVERLOADED. Every
candidate within `tie_epsilon_s + tie_rel_epsilon * best` of the best estimate is tied, and the tie goes to
fewer requests in flight, then the least recently chosen (`last_selected`, which the driver sets to `now`),
then the smallest id. Idle replicas therefore take cache misses in turn instead of the first one taking all,
while a real difference (a cache hit, a backlog, a faster replica) still decides.

Branch: ONLY_REPLICA for a single replica, OVERLOADED as above, else CACHE_HIT / SPILL / CACHE_MISS as in
`decisions.cache_branch`. The decision carries the chosen replica's estimate as `predicted_ttft_s`.

Parameters (`config.EstimatedTTFTConfig`): decode_step_s_per_seq, kv_pressure_s, kv_pressure_threshold,
tie_epsilon_s, tie_rel_epsilon, max_queue_per_replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from router.policy.decisions import cache_branch, decision
from router.policy.types import Branch, Decision, ReplicaState, RouteRequest

if TYPE_CHECKING:
    from router.policy.config import EstimatedTTFTConfig

_MIN_PREFILL_TOKENS_PER_S = 1.0
"""Floor on a replica's prefill rate, so a corrupt rate cannot divide by zero."""


class EstimatedTTFT:
    """Minimise the estimated time to first token; break near-ties towards idle, least recently used replicas."""

    name = "estimated_ttft"

    def __init__(self, config: EstimatedTTFTConfig) -> None:
        self.config = config

    def estimate_s(self, request: RouteRequest, replica: ReplicaState) -> float:
        """Predicted time to first token of `request` on `replica`, in seconds."""
        cfg = self.config
        uncached_tokens = request.prompt_tokens - request.cached_tokens(replica.id)
        rate = max(replica.prefill_tokens_per_s, _MIN_PREFILL_TOKENS_PER_S)
        prefill_s = (replica.waiting_prompt_tokens + uncached_tokens) / rate
        decode_s = cfg.decode_step_s_per_seq * max(replica.streaming, replica.num_running or 0)
        pressure_s = 0.0
        if replica.kv_usage is not None and replica.kv_usage > cfg.kv_pressure_threshold:
            excess = (min(replica.kv_usage, 1.0) - cfg.kv_pressure_threshold) / (1.0 - cfg.kv_pressure_threshold)
            pressure_s = cfg.kv_pressure_s * excess * excess
        return prefill_s + decode_s + pressure_s

    def select(self, request: RouteRequest, replicas: Sequence[ReplicaState], *, now: float) -> Decision:
        if len(replicas) == 1:
            only = replicas[0]
            return decision(request, only.id, Branch.ONLY_REPLICA, self.estimate_s(request, only))
        # One pass with locals: this runs per request over every replica (the router's hot path). It computes
        # exactly `estimate_s` (tests hold the two equal).
        cfg = self.config
        cap = cfg.max_queue_per_replica
        step_s = cfg.decode_step_s_per_seq
        threshold = cfg.kv_pressure_threshold
        pressure_scale = cfg.kv_pressure_s / ((1.0 - threshold) ** 2)
        prompt_tokens = request.prompt_tokens
        # Cached tokens only for the few replicas that match at all; the rest compute the whole prompt.
        cached_by_id = {rid: request.cached_tokens(rid) for rid in request.matched_blocks}
        cached_get = cached_by_id.get
        estimates: list[float] = []
        add = estimates.append
        under_cap: list[bool] = []
        add_under_cap = under_cap.append
        for r in replicas:
            running = r.num_running or 0
            rate = r.prefill_tokens_per_s
            if rate < _MIN_PREFILL_TOKENS_PER_S:
                rate = _MIN_PREFILL_TOKENS_PER_S
            streaming = r.streaming
            estimate = (r.waiting_prompt_tokens + prompt_tokens - cached_get(r.id, 0)) / rate + step_s * (
                streaming if streaming > running else running
            )
            kv = r.kv_usage
            if kv is not None and kv > threshold:
                excess = (kv if kv < 1.0 else 1.0) - threshold
                estimate += pressure_scale * excess * excess
            add(estimate)
            engine_depth = running + (r.num_waiting or 0)
            add_under_cap((r.in_flight if r.in_flight > engine_depth else engine_depth) < cap)
        is_under_cap = any(under_cap)
        candidates: Sequence[int]
        if is_under_cap and not all(under_cap):
            candidates = [i for i, ok in enumerate(under_cap) if ok]
        else:
            candidates = range(len(replicas))
        best_s = min(estimates[i] for i in candidates)
        tied_below_s = best_s + cfg.tie_epsilon_s + cfg.tie_rel_epsilon * best_s
        tied = [i for i in candidates if estimates[i] <= tied_below_s]
        if len(tied) == 1:
            best = tied[0]
        else:
            best = min(tied, key=lambda i: (replicas[i].in_flight, replicas[i].last_selected, replicas[i].id))
        chosen, chosen_s = replicas[best], estimates[best]
        branch = cache_branch(request, replicas, chosen.id) if is_under_cap else Branch.OVERLOADED
        return decision(request, chosen.id, branch, chosen_s)
