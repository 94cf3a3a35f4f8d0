"""Shoal's default policy: send each request where its estimated time to first token, plus the prefill time its
placement costs the rest of the fleet, is smallest.

Every term is in seconds, so replicas of different speeds, caches and loads compare on one scale. For request
with `P` prompt tokens and replica r, with `W` = r.waiting_prompt_tokens (the router's prefill backlog, `k` =
r.waiting requests) and `c(r)` = cached_tokens(r) (predicted prefix match, from the PrefixIndex):

    u(r)        = P - c(r)                                      # tokens r would compute
    rate(r)     = mean + lam * (learned(r) - mean),  lam = max(0, 1 - (rate_noise_cv * mean)**2 / var)
    own(r)      = u / rate + attn * u * (c + u / 2)             # the prompt's own prefill on r
    prefill(r)  = W / rate + attn * W**2 / (2 * k) + own(r)
    decode(r)   = decode_s_per_seq_step * max(r.streaming, r.num_running or 0) * (1 + (W + u) / prefill_tokens_per_step)
    pressure(r) = kv_pressure_s * x**2,   x = max(0, kv_usage - kv_pressure_threshold) / (1 - kv_pressure_threshold)
    ttft(r)     = prefill(r) + decode(r) + pressure(r)
    fleet(r)    = fleet_cost_weight * (own(r) - min_r' own(r'))
    cost(r)     = ttft(r) + fleet(r)

- prefill: engines prefill first come, first served, so the request waits for the backlog ahead of it and then
  computes its own uncached tokens. The linear part runs at the replica's learned rate (`prefill_rate`); causal
  attention adds `attn` seconds per (query, key) pair, which makes a 64k-token prefill ~1.5x its linear time: a
  prompt with prefix c computes u * (c + u / 2) pairs, and the backlog's k prompts at least W**2 / (2k) (equal
  sizes minimise the sum of squares; their cached prefixes are unknown and left out, so it is a lower bound).
- rate: the learned rates of identical replicas scatter by ~20% (the simulator's Mooncake runs: 5.4k-9.8k
  tokens/s around 7.8k), as much as the backlog differences the policy must resolve. Each rate is shrunk towards
  the fleet mean (James-Stein): by all of its deviation when the fleet's spread is no larger than
  `rate_noise_cv`, by little when the replicas really differ (a 5k and a 20k replica keep 83% of it).
- decode: a chunked-prefill engine runs one token of every decoding sequence in each step beside the prefill
  chunks, and the request waits for about 1 + (W + u) / prefill_tokens_per_step steps. The router's own
  streaming count is exact; the engine's running count also sees other routers' requests; the larger is used.
- pressure: above the threshold the KV cache is close to full and a new request waits for blocks (or causes a
  preemption); the term grows quadratically to `kv_pressure_s` at a full cache. It is 0 when the engine does
  not export KV usage.
- fleet: TTFT alone is a greedy, per-request view. Recomputing a prefix that another replica holds spends fleet
  capacity, and every request that queues behind that work pays for it: in a queue at utilisation rho, work x
  delays the requests after it by about x * rho / (1 - rho) in total. So a placement is charged its prefill time
  beyond the cheapest placement's (0 on the replica with the longest match when rates are equal), times the
  weight. Without it, near saturation 656 of 3,993 Mooncake requests left the replica holding their prefix and the
  hit ratio fell to 0.49 (0.61 with it), which the saturated fleet paid in queueing (see simulations/README.md).

Choice. A replica whose queue depth is at or past `max_queue_per_replica` is skipped while another is under
the cap; when every replica is at it, the smallest cost over all wins and the branch is OVERLOADED. Every
candidate within `tie_epsilon_s + tie_rel_epsilon * best` of the best cost is tied, and the tie goes to fewer
requests in flight, then the least recently chosen (`last_selected`, which the driver sets to `now`), then the
smallest id. Idle replicas therefore take cache misses in turn instead of the first one taking all, while a real
difference (a cache hit, a backlog, a faster replica) still decides.

Branch: ONLY_REPLICA for a single replica, OVERLOADED as above, else CACHE_HIT / SPILL / CACHE_MISS as in
`decisions.cache_branch`. The decision carries the chosen replica's `ttft(r)` as `predicted_ttft_s` (the fleet
term is a cost, not a latency).

Parameters (`config.EstimatedTTFTConfig`): decode_s_per_seq_step, prefill_tokens_per_step,
attention_s_per_token_pair, rate_noise_cv, fleet_cost_weight, kv_pressure_s, kv_pressure_threshold,
tie_epsilon_s, tie_rel_epsilon, max_queue_per_replica.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import repeat
from operator import attrgetter
from typing import TYPE_CHECKING

from router.policy.decisions import branch_for_blocks, decision
from router.policy.types import Branch, Decision, ReplicaState, RouteRequest

if TYPE_CHECKING:
    from router.policy.config import EstimatedTTFTConfig

_MIN_PREFILL_TOKENS_PER_S = 1.0
"""Floor on a replica's prefill rate, so a corrupt rate cannot divide by zero."""

_rate_of = attrgetter("prefill_tokens_per_s")


class EstimatedTTFT:
    """Minimise estimated TTFT plus fleet prefill cost; break near-ties towards idle, least recently used replicas."""

    name = "estimated_ttft"

    def __init__(self, config: EstimatedTTFTConfig) -> None:
        self.config = config

    def pooled_rates(self, replicas: Sequence[ReplicaState]) -> list[float]:
        """Each replica's learned prefill rate shrunk towards the fleet mean (tokens/s), see the module docstring."""
        rates = [max(r.prefill_tokens_per_s, _MIN_PREFILL_TOKENS_PER_S) for r in replicas]
        mean = sum(rates) / len(rates)
        var = sum((x - mean) ** 2 for x in rates) / len(rates)
        noise = (self.config.rate_noise_cv * mean) ** 2
        lam = max(0.0, 1.0 - noise / var) if var > 0.0 else 0.0
        return [mean + lam * (x - mean) for x in rates]

    def own_prefill_s(self, request: RouteRequest, replica: ReplicaState, rate: float) -> float:
        """Seconds `replica` would spend on the request's own uncached tokens at `rate` tokens/s."""
        cached = request.cached_tokens(replica.id)
        uncached = request.prompt_tokens - cached
        return uncached / rate + self.config.attention_s_per_token_pair * uncached * (cached + uncached / 2)

    def estimate_s(self, request: RouteRequest, replica: ReplicaState, rate: float | None = None) -> float:
        """Predicted time to first token of `request` on `replica`, in seconds, at `rate` tokens/s (default: the
        replica's learned rate; `select` passes the pooled one)."""
        cfg = self.config
        if rate is None:
            rate = max(replica.prefill_tokens_per_s, _MIN_PREFILL_TOKENS_PER_S)
        backlog = replica.waiting_prompt_tokens
        prefill_s = backlog / rate + self.own_prefill_s(request, replica, rate)
        if replica.waiting > 0:
            prefill_s += cfg.attention_s_per_token_pair * backlog * backlog / (2 * replica.waiting)
        uncached = request.prompt_tokens - request.cached_tokens(replica.id)
        steps = 1.0 + (backlog + uncached) / cfg.prefill_tokens_per_step
        decode_s = cfg.decode_s_per_seq_step * max(replica.streaming, replica.num_running or 0) * steps
        pressure_s = 0.0
        if replica.kv_usage is not None and replica.kv_usage > cfg.kv_pressure_threshold:
            excess = (min(replica.kv_usage, 1.0) - cfg.kv_pressure_threshold) / (1.0 - cfg.kv_pressure_threshold)
            pressure_s = cfg.kv_pressure_s * excess * excess
        return prefill_s + decode_s + pressure_s

    def costs_s(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> list[tuple[float, float]]:
        """(ttft, cost) of each replica in seconds, term by term as documented (the reference `select` matches)."""
        rates = self.pooled_rates(replicas)
        own = [self.own_prefill_s(request, r, rate) for r, rate in zip(replicas, rates, strict=True)]
        floor_s = min(own)
        weight = self.config.fleet_cost_weight
        ttfts = [self.estimate_s(request, r, rate) for r, rate in zip(replicas, rates, strict=True)]
        return [(t, t + weight * (o - floor_s)) for t, o in zip(ttfts, own, strict=True)]

    def select(self, request: RouteRequest, replicas: Sequence[ReplicaState], *, now: float) -> Decision:
        if len(replicas) == 1:
            only = replicas[0]
            return decision(request, only.id, Branch.ONLY_REPLICA, self.estimate_s(request, only))
        # The router's hot path, once per request over every replica: three tight passes over locals that compute
        # exactly `costs_s` (tests hold the two equal, bit for bit), with the terms summed in the same order.
        cfg = self.config
        n = len(replicas)
        rates = [_MIN_PREFILL_TOKENS_PER_S if x < _MIN_PREFILL_TOKENS_PER_S else x for x in map(_rate_of, replicas)]
        rate_sum = rate_sq_sum = 0.0
        for rate in rates:
            rate_sum += rate
            rate_sq_sum += rate * rate
        rate_mean = rate_sum / n
        rate_var = rate_sq_sum / n - rate_mean * rate_mean
        noise = (cfg.rate_noise_cv * rate_mean) ** 2
        # var <= noise covers a homogeneous fleet, where float cancellation can leave a tiny var of either sign.
        shrink = 1.0 - noise / rate_var if rate_var > noise else 0.0
        # A fleet within `rate_noise_cv` pools every rate to the mean: exactly, while the rates are finite.
        pooled = (
            repeat(rate_mean)
            if shrink == 0.0 and rate_sq_sum < math.inf
            else ([rate_mean + shrink * (x - rate_mean) for x in rates])
        )
        cap = cfg.max_queue_per_replica
        step_s = cfg.decode_s_per_seq_step
        inv_step_tokens = 1.0 / cfg.prefill_tokens_per_step
        attn = cfg.attention_s_per_token_pair
        threshold = cfg.kv_pressure_threshold
        pressure_scale = cfg.kv_pressure_s / ((1.0 - threshold) ** 2)
        prompt_tokens = request.prompt_tokens
        # Cached tokens only for the few replicas that match at all; the rest compute the whole prompt, whose
        # attention term is the same for all of them.
        matched = request.matched_blocks
        cached_by_id = {rid: request.cached_tokens(rid) for rid in matched}
        cached_get = cached_by_id.get
        uncached_attn_s = attn * prompt_tokens * (0 + prompt_tokens / 2)
        best_blocks = 0  # the longest match among `replicas`, for the branch
        ttfts: list[float] = []
        owns: list[float] = []
        ttfts_append = ttfts.append
        owns_append = owns.append
        num_under_cap = 0
        for r, rate in zip(replicas, pooled, strict=False):  # `pooled` may be an endless repeat
            rid = r.id
            cached = cached_get(rid)
            if cached is None:
                uncached = prompt_tokens
                own = prompt_tokens / rate + uncached_attn_s
            else:
                uncached = prompt_tokens - cached
                own = uncached / rate + attn * uncached * (cached + uncached / 2)
                blocks = matched[rid]
                if blocks > best_blocks:
                    best_blocks = blocks
            backlog = r.waiting_prompt_tokens
            running = r.num_running or 0
            streaming = r.streaming
            decoding = streaming if streaming > running else running
            estimate = backlog / rate + own + step_s * decoding * (1.0 + (backlog + uncached) * inv_step_tokens)
            waiting = r.waiting
            if waiting > 0:
                estimate += attn * backlog * backlog / (2 * waiting)
            kv = r.kv_usage
            if kv is not None and kv > threshold:
                excess = (kv if kv < 1.0 else 1.0) - threshold
                estimate += pressure_scale * excess * excess
            ttfts_append(estimate)
            owns_append(own)
            engine_depth = running + (r.num_waiting or 0)
            in_flight = r.in_flight
            if (in_flight if in_flight > engine_depth else engine_depth) < cap:
                num_under_cap += 1
        weight = cfg.fleet_cost_weight
        floor_s = min(owns)
        costs = [t + weight * (o - floor_s) for t, o in zip(ttfts, owns, strict=True)]
        if 0 < num_under_cap < n:
            candidates = [i for i, r in enumerate(replicas) if r.queue_depth < cap]
            best_s = min([costs[i] for i in candidates])
            tied_below_s = best_s + cfg.tie_epsilon_s + cfg.tie_rel_epsilon * best_s
            tied = [i for i in candidates if costs[i] <= tied_below_s]
        else:
            best_s = min(costs)
            tied_below_s = best_s + cfg.tie_epsilon_s + cfg.tie_rel_epsilon * best_s
            tied = [i for i, cost in enumerate(costs) if cost <= tied_below_s]
        if len(tied) == 1:
            best = tied[0]
        else:
            best = min(tied, key=lambda i: (replicas[i].in_flight, replicas[i].last_selected, replicas[i].id))
        chosen = replicas[best]
        branch = branch_for_blocks(best_blocks, matched.get(chosen.id, 0)) if num_under_cap else Branch.OVERLOADED
        return decision(request, chosen.id, branch, ttfts[best])
