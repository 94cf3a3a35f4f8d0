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

from collections.abc import Sequence
from typing import TYPE_CHECKING

from router.policy.decisions import cache_branch, decision
from router.policy.types import Branch, Decision, ReplicaState, RouteRequest

if TYPE_CHECKING:
    from router.policy.config import EstimatedTTFTConfig

_MIN_PREFILL_TOKENS_PER_S = 1.0
"""Floor on a replica's prefill rate, so a corrupt rate cannot divide by zero."""


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
        # Two passes with locals: this runs per request over every replica (the router's hot path). It computes
        # exactly `costs_s` (tests hold the two equal).
        cfg = self.config
        n = len(replicas)
        rate_sum = rate_sq_sum = 0.0
        for r in replicas:
            rate = r.prefill_tokens_per_s
            if rate < _MIN_PREFILL_TOKENS_PER_S:
                rate = _MIN_PREFILL_TOKENS_PER_S
            rate_sum += rate
            rate_sq_sum += rate * rate
        rate_mean = rate_sum / n
        rate_var = rate_sq_sum / n - rate_mean * rate_mean
        noise = (cfg.rate_noise_cv * rate_mean) ** 2
        # var <= noise covers a homogeneous fleet, where float cancellation can leave a tiny var of either sign.
        shrink = 1.0 - noise / rate_var if rate_var > noise else 0.0
        cap = cfg.max_queue_per_replica
        step_s = cfg.decode_s_per_seq_step
        inv_step_tokens = 1.0 / cfg.prefill_tokens_per_step
        attn = cfg.attention_s_per_token_pair
        threshold = cfg.kv_pressure_threshold
        pressure_scale = cfg.kv_pressure_s / ((1.0 - threshold) ** 2)
        prompt_tokens = request.prompt_tokens
        # Cached tokens only for the few replicas that match at all; the rest compute the whole prompt.
        cached_by_id = {rid: request.cached_tokens(rid) for rid in request.matched_blocks}
        cached_get = cached_by_id.get
        ttfts: list[float] = []
        owns: list[float] = []
        under_cap: list[bool] = []
        for r in replicas:
            running = r.num_running or 0
            rate = r.prefill_tokens_per_s
            if rate < _MIN_PREFILL_TOKENS_PER_S:
                rate = _MIN_PREFILL_TOKENS_PER_S
            rate = rate_mean + shrink * (rate - rate_mean)
            cached = cached_get(r.id, 0)
            uncached = prompt_tokens - cached
            own = uncached / rate + attn * uncached * (cached + uncached / 2)
            backlog = r.waiting_prompt_tokens
            streaming = r.streaming
            decoding = streaming if streaming > running else running
            estimate = backlog / rate + own + step_s * decoding * (1.0 + (backlog + uncached) * inv_step_tokens)
            if r.waiting > 0:
                estimate += attn * backlog * backlog / (2 * r.waiting)
            kv = r.kv_usage
            if kv is not None and kv > threshold:
                excess = (kv if kv < 1.0 else 1.0) - threshold
                estimate += pressure_scale * excess * excess
            ttfts.append(estimate)
            owns.append(own)
            engine_depth = running + (r.num_waiting or 0)
            under_cap.append((r.in_flight if r.in_flight > engine_depth else engine_depth) < cap)
        weight = cfg.fleet_cost_weight
        floor_s = min(owns)
        costs = [t + weight * (o - floor_s) for t, o in zip(ttfts, owns, strict=True)]
        is_under_cap = any(under_cap)
        candidates: Sequence[int] = (
            [i for i, ok in enumerate(under_cap) if ok] if is_under_cap and not all(under_cap) else range(n)
        )
        best_s = min(costs[i] for i in candidates)
        tied_below_s = best_s + cfg.tie_epsilon_s + cfg.tie_rel_epsilon * best_s
        tied = [i for i in candidates if costs[i] <= tied_below_s]
        if len(tied) == 1:
            best = tied[0]
        else:
            best = min(tied, key=lambda i: (replicas[i].in_flight, replicas[i].last_selected, replicas[i].id))
        chosen = replicas[best]
        branch = cache_branch(request, replicas, chosen.id) if is_under_cap else Branch.OVERLOADED
        return decision(request, chosen.id, branch, ttfts[best])
