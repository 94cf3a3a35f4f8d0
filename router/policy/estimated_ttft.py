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
replica's terms that do not depend on the request (backlog, decode and pressure seconds, the cap test, the tie
key), re-derived only for the replicas whose fields were written since (`ReplicaState.stamp`, a new object on
every write); per decision it adds the request's terms in one expression per replica, and computes the few
replicas that hold part of the prompt apart. Sums are taken in the same order as the plain reference in
tests/unit/test_estimated_ttft_fast_path.py, which holds costs, ties and estimates equal to the last bit.

Parameters (`config.EstimatedTTFTConfig`): decode_s_per_seq_step, prefill_tokens_per_step,
attention_s_per_token_pair, rate_noise_cv, fleet_cost_weight, kv_pressure_s, kv_pressure_threshold,
tie_epsilon_s, tie_rel_epsilon, max_queue_per_replica.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from functools import reduce
from itertools import compress, count
from operator import add, is_not, mul
from typing import TYPE_CHECKING

from router.policy.decisions import branch_for_blocks, decision
from router.policy.types import Branch, Decision, ReplicaState, RouteRequest

if TYPE_CHECKING:
    from router.policy.config import EstimatedTTFTConfig

_MIN_PREFILL_TOKENS_PER_S = 1.0
"""Floor on a replica's prefill rate, so a corrupt rate cannot divide by zero."""

_IDLE_ROW = (0, 0.0, 0.0, 0.0)
_NO_TIE_KEY = (0, -math.inf, "")


class EstimatedTTFT:
    """Minimise estimated TTFT plus fleet prefill cost; break near-ties towards idle, least recently used replicas."""

    name = "estimated_ttft"

    def __init__(self, config: EstimatedTTFTConfig) -> None:
        self.config = config
        self._inv_step_tokens = 1.0 / config.prefill_tokens_per_step
        # What `select` derived from the replicas of its last decision, by position in `replicas`:
        self._stamps: list[object] = []
        """Each replica's `ReplicaState.stamp` when its terms were derived."""
        self._rows: list[tuple[int, float, float, float]] = []
        """(prefill backlog tokens, decode seconds per engine step, the backlog's attention s, KV pressure s)."""
        self._rates: list[float] = []
        """Learned prefill rates (tokens/s), floored."""
        self._pooled: tuple[float, list[float] | None] | None = None
        """(fleet mean rate, pooled rate of each replica or None when all pool to the mean); None: to compute."""
        self._is_under_cap: list[bool] = []
        self._num_under_cap = 0
        self._tie_keys: list[tuple[int, float, str]] = []
        """(in flight, last selected, id): the near-tie order."""
        self._positions: dict[str, int] = {}
        """Position of each replica id."""

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
        # The router's hot path (module docstring, Speed).
        stamps = [r.stamp for r in replicas]
        if stamps != self._stamps:
            self._derive(replicas, stamps)
        cfg = self.config
        n = len(replicas)
        mean_rate, pooled = self._pooled if self._pooled is not None else self._pool_rates()
        prompt_tokens = request.prompt_tokens
        inv_step_tokens = self._inv_step_tokens
        attn = cfg.attention_s_per_token_pair
        weight = cfg.fleet_cost_weight
        rows = self._rows
        # A replica that matches nothing computes the whole prompt: the attention term is the same for all of them.
        uncached_attn_s = attn * prompt_tokens * (0 + prompt_tokens / 2)
        matched = request.matched_blocks
        positions = self._positions
        # (position, cached tokens, own prefill s) of the replicas among `replicas` that match
        hits: list[tuple[int, int, float]] = []
        best_blocks = 0  # the longest match among `replicas`, for the branch
        for rid, blocks in matched.items():
            i = positions.get(rid)
            if i is None:
                continue
            if blocks > best_blocks:
                best_blocks = blocks
            cached = request.cached_tokens(rid)
            uncached = prompt_tokens - cached
            rate = mean_rate if pooled is None else pooled[i]
            hits.append((i, cached, uncached / rate + attn * uncached * (cached + uncached / 2)))
        if pooled is None:
            own_s = prompt_tokens / mean_rate + uncached_attn_s
            floor_s = own_s if len(hits) < n else math.inf
            for _, _, own in hits:
                if own < floor_s:
                    floor_s = own
            fleet_s = weight * (own_s - floor_s)
            costs = [
                w / mean_rate + own_s + sd * (1.0 + (w + prompt_tokens) * inv_step_tokens) + q + p + fleet_s
                for w, sd, q, p in rows
            ]
        else:
            owns = [prompt_tokens / rate + uncached_attn_s for rate in pooled]
            for i, _, own in hits:
                owns[i] = own
            floor_s = min(owns)
            costs = [
                w / rate + own + sd * (1.0 + (w + prompt_tokens) * inv_step_tokens) + q + p + weight * (own - floor_s)
                for (w, sd, q, p), rate, own in zip(rows, pooled, owns, strict=True)
            ]
        ttfts: dict[int, float] = {}
        for i, cached, own in hits:
            ttft_s = self._ttft_s(i, mean_rate if pooled is None else pooled[i], own, prompt_tokens - cached)
            ttfts[i] = ttft_s
            costs[i] = ttft_s + weight * (own - floor_s)
        num_under_cap = self._num_under_cap
        if 0 < num_under_cap < n:
            candidates = list(compress(range(n), self._is_under_cap))
            best_s = min([costs[i] for i in candidates])
            tied_below_s = best_s + cfg.tie_epsilon_s + cfg.tie_rel_epsilon * best_s
            tied = [i for i in candidates if costs[i] <= tied_below_s]
        else:
            best_s = min(costs)
            tied_below_s = best_s + cfg.tie_epsilon_s + cfg.tie_rel_epsilon * best_s
            tied = [i for i, cost in enumerate(costs) if cost <= tied_below_s]
        best = tied[0] if len(tied) == 1 else min(tied, key=self._tie_keys.__getitem__)
        predicted_s = ttfts.get(best)
        if predicted_s is None:
            rate = mean_rate if pooled is None else pooled[best]
            predicted_s = self._ttft_s(best, rate, prompt_tokens / rate + uncached_attn_s, prompt_tokens)
        chosen = replicas[best].id
        branch = branch_for_blocks(best_blocks, matched.get(chosen, 0)) if num_under_cap else Branch.OVERLOADED
        return decision(request, chosen, branch, predicted_s)

    def _ttft_s(self, i: int, rate: float, own_s: float, uncached: int) -> float:
        """The estimate of replica `i` of the last `select` at pooled `rate`, with its own prefill `own_s` (its
        cost less the fleet term), summed as `select` sums it for the others."""
        w, sd, q, p = self._rows[i]
        return w / rate + own_s + sd * (1.0 + (w + uncached) * self._inv_step_tokens) + q + p

    def _derive(self, replicas: Sequence[ReplicaState], stamps: list[object]) -> None:
        """Re-derive the request-independent terms of the replicas whose stamp changed (all, when the list did)."""
        cfg = self.config
        n = len(replicas)
        if len(self._stamps) == n:
            changed: Iterable[int] = list(compress(count(), map(is_not, stamps, self._stamps)))
        else:
            changed = range(n)
            self._positions = {}
            self._rows = [_IDLE_ROW] * n
            self._rates = [0.0] * n
            self._is_under_cap = [False] * n
            self._tie_keys = [_NO_TIE_KEY] * n
        self._stamps = stamps
        rows, rates, is_under_cap, tie_keys = self._rows, self._rates, self._is_under_cap, self._tie_keys
        step_s = cfg.decode_s_per_seq_step
        attn = cfg.attention_s_per_token_pair
        threshold = cfg.kv_pressure_threshold
        pressure_scale = cfg.kv_pressure_s / ((1.0 - threshold) ** 2)
        cap = cfg.max_queue_per_replica
        for i in changed:
            r = replicas[i]
            backlog = r.waiting_prompt_tokens
            running = r.num_running or 0
            streaming = r.streaming
            waiting = r.waiting
            kv = r.kv_usage
            excess = ((kv if kv < 1.0 else 1.0) - threshold) if kv is not None and kv > threshold else 0.0
            # Adding a 0.0 term leaves a sum of non-negative terms unchanged, bit for bit.
            rows[i] = (
                backlog,
                step_s * (streaming if streaming > running else running),
                attn * backlog * backlog / (2 * waiting) if waiting > 0 else 0.0,
                pressure_scale * excess * excess,
            )
            rate = r.prefill_tokens_per_s
            rate = _MIN_PREFILL_TOKENS_PER_S if rate < _MIN_PREFILL_TOKENS_PER_S else rate
            if rate != rates[i]:
                rates[i] = rate
                self._pooled = None
            in_flight = r.in_flight
            engine_depth = running + (r.num_waiting or 0)
            is_under_cap[i] = (in_flight if in_flight > engine_depth else engine_depth) < cap
            if tie_keys[i][2] != r.id:
                self._positions = {}
            tie_keys[i] = (in_flight, r.last_selected, r.id)
        if not self._positions:
            self._positions = {r.id: i for i, r in enumerate(replicas)}
        self._num_under_cap = is_under_cap.count(True)

    def _pool_rates(self) -> tuple[float, list[float] | None]:
        """(fleet mean, pooled rate per replica or None when every one pools to the mean), as `pooled_rates`
        defines them, for the rates of the last `_derive`."""
        rates = self._rates
        n = len(rates)
        rate_mean = reduce(add, rates, 0.0) / n
        rate_sq_sum = reduce(add, map(mul, rates, rates), 0.0)
        rate_var = rate_sq_sum / n - rate_mean * rate_mean
        noise = (self.config.rate_noise_cv * rate_mean) ** 2
        # var <= noise covers a homogeneous fleet, where float cancellation can leave a tiny var of either sign.
        shrink = 1.0 - noise / rate_var if rate_var > noise else 0.0
        # A fleet within `rate_noise_cv` pools every rate to the mean: exactly, while the rates are finite.
        if shrink == 0.0 and rate_sq_sum < math.inf:
            self._pooled = (rate_mean, None)
        else:
            self._pooled = (rate_mean, [rate_mean + shrink * (x - rate_mean) for x in rates])
        return self._pooled
