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

Speed. The router decides once per request over every replica, so `select` keeps, between decisions, each
replica's terms that do not depend on the request (`ttft_terms.FleetTerms`: backlog, decode and pressure
seconds, the cap test, the tie key), re-derived only for the replicas whose fields were written since
(`ReplicaState.stamp`). Per decision it ranks the replicas that match nothing by a line in the prompt's length,
computes the few that hold part of the prompt apart, and sums a cost in the documented order only where the
line's roundings could move it across the tie band's edge, and for the chosen replica's estimate. Decisions are
those of the plain reference in tests/unit/test_estimated_ttft_fast_path.py, to the last bit. A fleet of at most
`DIRECT_MAX_REPLICAS` is costed directly from the fields instead, in one pass: with a few replicas, nearly every
decision follows a write to one of them, and keeping terms costs more than it saves (`benchmarks/bench_routing.py
--replicas N --baseline REV` against a revision without this path: a third less `select` time at 2 replicas, some
15% less at 8).

Parameters (`config.EstimatedTTFTConfig`): decode_s_per_seq_step, prefill_tokens_per_step,
attention_s_per_token_pair, rate_noise_cv, fleet_cost_weight, kv_pressure_s, kv_pressure_threshold,
tie_epsilon_s, tie_rel_epsilon, max_queue_per_replica.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import compress
from typing import TYPE_CHECKING

from router.policy.decisions import branch_for_blocks, decision
from router.policy.ttft_terms import MIN_PREFILL_TOKENS_PER_S, FleetTerms, rate_pooling
from router.policy.types import Branch, Decision, ReplicaState, RouteRequest

if TYPE_CHECKING:
    from router.policy.config import EstimatedTTFTConfig

DIRECT_MAX_REPLICAS = 8
"""Fleets up to this size are costed directly from the replicas' fields (`_select_directly`); larger ones keep
their request-independent terms between decisions (`ttft_terms.FleetTerms`)."""


def own_prefill_s(cached: int, uncached: int, rate: float, attention_s_per_token_pair: float) -> float:
    """Seconds a replica spends on a prompt's `uncached` tokens after its `cached` ones, at `rate` tokens/s: the
    linear part and causal attention's (query, key) pairs (module docstring, own)."""
    return uncached / rate + attention_s_per_token_pair * uncached * (cached + uncached / 2)


class EstimatedTTFT:
    """Minimise estimated TTFT plus fleet prefill cost; break near-ties towards idle, least recently used replicas."""

    name = "estimated_ttft"

    def __init__(self, config: EstimatedTTFTConfig) -> None:
        self.config = config
        self._terms = FleetTerms(config)

    def pooled_rates(self, replicas: Sequence[ReplicaState]) -> list[float]:
        """Each replica's learned prefill rate shrunk towards the fleet mean (tokens/s), see the module docstring."""
        rates = [max(r.prefill_tokens_per_s, MIN_PREFILL_TOKENS_PER_S) for r in replicas]
        mean, shrink = rate_pooling(rates, self.config.rate_noise_cv)
        return [mean + shrink * (x - mean) for x in rates]

    def own_prefill_s(self, request: RouteRequest, replica: ReplicaState, rate: float) -> float:
        """Seconds `replica` would spend on the request's own uncached tokens at `rate` tokens/s."""
        cached = request.cached_tokens(replica.id)
        return own_prefill_s(cached, request.prompt_tokens - cached, rate, self.config.attention_s_per_token_pair)

    def estimate_s(self, request: RouteRequest, replica: ReplicaState, rate: float | None = None) -> float:
        """Predicted time to first token of `request` on `replica`, in seconds, at `rate` tokens/s (default: the
        replica's learned rate; `select` passes the pooled one)."""
        cfg = self.config
        if rate is None:
            rate = max(replica.prefill_tokens_per_s, MIN_PREFILL_TOKENS_PER_S)
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
        """(ttft, cost) of each replica in seconds, term by term as documented (`select` takes some sums in another
        order, so its figures may differ from these in the last bits)."""
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
        if len(replicas) <= DIRECT_MAX_REPLICAS:
            return self._select_directly(request, replicas)
        # The router's hot path (module docstring, Speed).
        terms = self._terms
        terms.update(replicas)
        mean_rate, pooled = terms.pool_rates()
        prompt_tokens = request.prompt_tokens
        tokens_per_block = request.tokens_per_block
        attn = self.config.attention_s_per_token_pair
        matched = request.matched_blocks
        positions = terms.positions
        # (position, cached tokens, own prefill s) of each replica among `replicas` that matches
        hits: list[tuple[int, int, float]] = []
        best_blocks = 0  # the longest match among `replicas`, for the branch
        for rid, blocks in matched.items():
            i = positions.get(rid)
            if i is None:
                continue
            if blocks > best_blocks:
                best_blocks = blocks
            cached = int(blocks * tokens_per_block)  # request.cached_tokens
            if cached > prompt_tokens:
                cached = prompt_tokens
            rate = mean_rate if pooled is None else pooled[i]
            hits.append((i, cached, own_prefill_s(cached, prompt_tokens - cached, rate, attn)))
        chosen = None
        if pooled is None and not terms.num_irregular:
            chosen = self._choose_by_lines(prompt_tokens, hits, mean_rate)
        if chosen is None:
            chosen = self._choose_exactly(prompt_tokens, hits, mean_rate, pooled)
        best, ttft_s = chosen
        chosen_id = replicas[best].id
        is_overloaded = not terms.num_under_cap
        branch = Branch.OVERLOADED if is_overloaded else branch_for_blocks(best_blocks, matched.get(chosen_id, 0))
        return decision(request, chosen_id, branch, ttft_s)

    def _select_directly(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> Decision:
        """`select` for a few replicas: every term from the fields, in the documented order, in one pass after
        the rates' pooling. Below `DIRECT_MAX_REPLICAS` this costs less than keeping `FleetTerms` (whose every
        write re-derives a replica's terms anyway) and gives the same floats."""
        cfg = self.config
        rates = [max(r.prefill_tokens_per_s, MIN_PREFILL_TOKENS_PER_S) for r in replicas]
        mean, shrink = rate_pooling(rates, cfg.rate_noise_cv)
        prompt_tokens = request.prompt_tokens
        tokens_per_block = request.tokens_per_block
        matched = request.matched_blocks
        attn = cfg.attention_s_per_token_pair
        step_s = cfg.decode_s_per_seq_step
        inv_step_tokens = 1.0 / cfg.prefill_tokens_per_step
        threshold = cfg.kv_pressure_threshold
        pressure_scale = cfg.kv_pressure_s / ((1.0 - threshold) ** 2)
        cap = cfg.max_queue_per_replica
        owns: list[float] = []
        ttfts: list[float] = []
        cached_tokens: list[int] = []
        under_cap: list[int] = []
        best_blocks = 0
        for i, r in enumerate(replicas):
            rate = mean + shrink * (rates[i] - mean)
            blocks = matched.get(r.id, 0)
            if blocks > best_blocks:
                best_blocks = blocks
            cached = int(blocks * tokens_per_block)  # request.cached_tokens
            if cached > prompt_tokens:
                cached = prompt_tokens
            uncached = prompt_tokens - cached
            own = own_prefill_s(cached, uncached, rate, attn)
            backlog = r.waiting_prompt_tokens
            running = r.num_running or 0
            streaming = r.streaming
            decode_s = step_s * (streaming if streaming > running else running)
            ttft = backlog / rate + own + decode_s * (1.0 + (backlog + uncached) * inv_step_tokens)
            waiting = r.waiting
            if waiting > 0:
                ttft += attn * backlog * backlog / (2 * waiting)
            kv = r.kv_usage
            if kv is not None and kv > threshold:
                excess = (kv if kv < 1.0 else 1.0) - threshold
                ttft += pressure_scale * excess * excess
            owns.append(own)
            ttfts.append(ttft)
            cached_tokens.append(cached)
            in_flight = r.in_flight
            engine_depth = running + (r.num_waiting or 0)
            if (in_flight if in_flight > engine_depth else engine_depth) < cap:
                under_cap.append(i)
        floor_s = min(owns)
        weight = cfg.fleet_cost_weight
        costs = [ttft + weight * (own - floor_s) for ttft, own in zip(ttfts, owns, strict=True)]
        candidates = under_cap if under_cap else range(len(replicas))
        best_s = min([costs[i] for i in candidates])
        tied_below_s = best_s + cfg.tie_epsilon_s + cfg.tie_rel_epsilon * best_s
        tied = [i for i in candidates if costs[i] <= tied_below_s]
        if len(tied) == 1:
            best = tied[0]
        else:
            best = min(tied, key=lambda i: (replicas[i].in_flight, replicas[i].last_selected, replicas[i].id))
        chosen_id = replicas[best].id
        blocks = matched.get(chosen_id, 0)
        branch = branch_for_blocks(best_blocks, blocks) if under_cap else Branch.OVERLOADED
        return Decision(chosen_id, branch, blocks, cached_tokens[best], ttfts[best])

    def _choose_by_lines(
        self, prompt_tokens: int, hits: list[tuple[int, int, float]], rate: float
    ) -> tuple[int, float] | None:
        """(position, ttft) of the choice, ranking the replicas that match nothing by their line form (a few
        roundings off the exact cost, module docstring of `ttft_terms`); None when a replica's cost lies so near
        the edge of the tie band that those roundings could move it across, for `_choose_exactly` to decide.

        Every fleet rate is `rate` (pooled to the mean) and no term is negative, so every cost is a sum of
        non-negative terms and both forms are within ~20 float roundings (~5e-15) of its real value; a replica
        further than 1e-12 of the costs from the band's edge is in or out of it whichever form is used."""
        cfg = self.config
        terms = self._terms
        weight = cfg.fleet_cost_weight
        own_s = prompt_tokens / rate + cfg.attention_s_per_token_pair * prompt_tokens * (0 + prompt_tokens / 2)
        floor_s = own_s if len(hits) < len(terms.rows) else math.inf
        for _, _, own in hits:
            if own < floor_s:
                floor_s = own
        base_s = own_s + weight * (own_s - floor_s)  # the terms that a replica matching nothing adds to its line
        inv_rate = 1.0 / rate
        costs = [
            w * inv_rate + fixed_s + prompt_tokens * per_token_s
            for w, fixed_s, per_token_s in zip(
                terms.line_backlogs, terms.line_fixed_s, terms.line_per_token_s, strict=True
            )
        ]
        ttfts: dict[int, float] = {}
        for i, cached, own in hits:
            ttfts[i] = ttft_s = self._ttft_s(i, rate, own, prompt_tokens - cached)
            costs[i] = ttft_s + weight * (own - floor_s) - base_s
        n = len(costs)
        candidates: Sequence[int] = range(n)
        if 0 < terms.num_under_cap < n:
            candidates = list(compress(candidates, terms.is_under_cap))
            best_s = min([costs[i] for i in candidates]) + base_s
        else:
            best_s = min(costs) + base_s
        tied_below_s = best_s + cfg.tie_epsilon_s + cfg.tie_rel_epsilon * best_s
        band_s = 1e-12 * (1.0 + cfg.tie_rel_epsilon) * (abs(tied_below_s) + base_s)
        if not band_s < math.inf:
            return None
        above_s = tied_below_s - base_s + band_s
        tied = [i for i in candidates if costs[i] <= above_s]
        below_s = above_s - 2.0 * band_s
        for i in tied:
            if costs[i] > below_s:
                return None
        best = tied[0] if len(tied) == 1 else min(tied, key=terms.tie_keys.__getitem__)
        predicted_s = ttfts.get(best)
        if predicted_s is None:
            predicted_s = self._ttft_s(best, rate, own_s, prompt_tokens)
        return best, predicted_s

    def _choose_exactly(
        self, prompt_tokens: int, hits: list[tuple[int, int, float]], mean_rate: float, pooled: list[float] | None
    ) -> tuple[int, float]:
        """(position, ttft) of the choice, from every replica's exact cost."""
        cfg = self.config
        terms = self._terms
        inv_step_tokens = terms.inv_step_tokens
        weight = cfg.fleet_cost_weight
        # A replica that matches nothing computes the whole prompt: the attention term is the same for all of them.
        uncached_attn_s = cfg.attention_s_per_token_pair * prompt_tokens * (0 + prompt_tokens / 2)
        n = len(terms.rows)
        rates = [mean_rate] * n if pooled is None else pooled
        owns = [prompt_tokens / rate + uncached_attn_s for rate in rates]
        for i, _, own in hits:
            owns[i] = own
        floor_s = min(owns)
        costs = [
            w / rate
            + own
            + decode_s * (1.0 + (w + prompt_tokens) * inv_step_tokens)
            + attn_s
            + kv_s
            + weight * (own - floor_s)
            for (w, decode_s, attn_s, kv_s), rate, own in zip(terms.rows, rates, owns, strict=True)
        ]
        ttfts: dict[int, float] = {}
        for i, cached, own in hits:
            ttfts[i] = ttft_s = self._ttft_s(i, rates[i], own, prompt_tokens - cached)
            costs[i] = ttft_s + weight * (own - floor_s)
        if 0 < terms.num_under_cap < n:
            candidates = list(compress(range(n), terms.is_under_cap))
            best_s = min([costs[i] for i in candidates])
            tied_below_s = best_s + cfg.tie_epsilon_s + cfg.tie_rel_epsilon * best_s
            tied = [i for i in candidates if costs[i] <= tied_below_s]
        else:
            best_s = min(costs)
            tied_below_s = best_s + cfg.tie_epsilon_s + cfg.tie_rel_epsilon * best_s
            tied = [i for i, cost in enumerate(costs) if cost <= tied_below_s]
        best = tied[0] if len(tied) == 1 else min(tied, key=terms.tie_keys.__getitem__)
        predicted_s = ttfts.get(best)
        if predicted_s is None:
            rate = mean_rate if pooled is None else pooled[best]
            predicted_s = self._ttft_s(best, rate, prompt_tokens / rate + uncached_attn_s, prompt_tokens)
        return best, predicted_s

    def _ttft_s(self, i: int, rate: float, own_s: float, uncached: int) -> float:
        """The estimate of replica `i` of the last `select` at pooled `rate`, with its own prefill `own_s` (its
        cost less the fleet term), summed as `_choose_exactly` sums the others'."""
        w, decode_s, attn_s, kv_s = self._terms.rows[i]
        return w / rate + own_s + decode_s * (1.0 + (w + uncached) * self._terms.inv_step_tokens) + attn_s + kv_s
