"""Shoal's default policy: send each request where its estimated time to first token, plus the prefill time its
placement costs the rest of the fleet, is smallest.

Every term is in seconds, so replicas of different speeds, caches and loads compare on one scale. For request
with `P` prompt tokens and replica r, with `W` = r.waiting_prompt_tokens (the router's prefill backlog, `k` =
r.waiting requests) and `c(r)` = cached_tokens(r) (predicted prefix match, from the PrefixIndex):

    u(r)        = P - c(r)                                      # tokens r would compute
    rate(r)     = mean + lam * (learned(r) - mean),  lam = max(0, 1 - (rate_noise_cv * mean)**2 / var)
    own(r)      = u / rate + attn * u * (c + u / 2)             # the prompt's own prefill on r
    decode(r)   = decode_s_per_seq_step * max(r.streaming, r.num_running or 0) * (1 + (W + u) / prefill_tokens_per_step)
    pressure(r) = kv_pressure_s * x**2,   x = max(0, min(kv_usage, 1) - threshold) / (1 - threshold)
    queue(r)    = (n - B + 1) * slot_s / B  if n >= B else 0        # n = r.queue_depth, B = r.batch_slots or assumed
    ttft(r)     = W / rate + own(r)                             # the backlog's prefill, then the prompt's own
                  + decode(r)
                  + attn * W**2 / (2 * k)                       # the backlog's attention; 0 when k = 0
                  + pressure(r) + queue(r) + r.fixed_s
    fleet(r)    = fleet_cost_weight * (own(r) - min_r' own(r'))  if r.queue_depth > 0, else 0
    cost(r)     = ttft(r) + fleet(r)

- prefill: engines prefill first come, first served, so the request waits for the backlog ahead of it and then
  computes its own uncached tokens. The linear part runs at the replica's learned rate (`prefill_rate`); causal
  attention adds `attn` seconds per (query, key) pair, which makes a 64k-token prefill ~1.5x its linear time: a
  prompt with prefix c computes u * (c + u / 2) pairs, and the backlog's k prompts at least W**2 / (2k) (equal
  sizes minimise the sum of squares; their cached prefixes are unknown and left out, so it is a lower bound).
- rate: the learned rates of identical replicas scatter (noisy first-byte observations), often by as much as
  the backlog differences the policy must resolve. Each rate is shrunk towards
  the fleet mean (James-Stein): by all of its deviation when the fleet's spread is no larger than
  `rate_noise_cv`, by little when the replicas really differ (a 5k and a 20k replica keep 83% of it).
- decode: a chunked-prefill engine runs one token of every decoding sequence in each step beside the prefill
  chunks, and the request waits for about 1 + (W + u) / prefill_tokens_per_step steps. The router's own
  streaming count is exact; the engine's running count also sees other routers' requests; the larger is used.
- pressure: above the threshold the KV cache is close to full and a new request waits for blocks (or causes a
  preemption); the term grows quadratically to `kv_pressure_s` at a full cache. It is 0 when the engine does
  not export KV usage.
- queue: an engine runs at most B sequences at once (`max_num_seqs`); past them a request waits for a slot
  whatever its cache, n - B + 1 completions at B / slot_s per second. B and slot_s (seconds a request holds a
  slot) and the fixed per-request time `fixed_s` are learned per replica (`service_time`), B from the engine's
  gauges when they say it, else `assumed_batch_slots` (vLLM's default limit). This is what spills a hot prefix
  whose replica's queue costs more than a cold prefill elsewhere, whether prefill, decode or a fixed cost makes
  that queue; the term is 0 until learned.
- fleet: TTFT alone is a greedy, per-request view. Recomputing a prefix that another replica holds spends fleet
  capacity, and every request that queues behind that work pays for it: in a queue at utilisation rho, work x
  delays the requests after it by about x * rho / (1 - rho) in total. So a placement is charged its prefill time
  beyond the cheapest placement's (0 on the replica with the longest match when rates are equal), times the
  weight. Without it, near saturation requests leave the replica holding their prefix for a slightly shorter
  queue, the hit ratio falls, and the saturated fleet pays for the recomputation in queueing. A replica with
  nothing in flight is not charged: no request there waits behind the recomputation (later ones see it as
  backlog), and a copy made there is how a prefix hotter than its holders can serve spreads: charged, the
  holders of a hot prefix queue while other replicas take no request. `charges_idle_replicas` charges them too.

Choice. A replica whose queue depth is at or past `max_queue_per_replica` is skipped while another is under
the cap; when every replica is at it, the smallest cost over all wins and the branch is OVERLOADED. Every
candidate within `tie_epsilon_s + tie_rel_epsilon * best` of the best cost is tied, and the tie goes to the
longest cached prefix (a short prompt's hit can tie an idle replica's miss, which no fleet cost separates), then
to fewer requests in flight, then the least recently chosen (`last_selected`, which the driver sets to `now`),
then the smallest id. Idle replicas therefore take cache misses in turn instead of the first one taking all, while
a real difference (a cache hit, a backlog, a faster replica) still decides.

Branch: ONLY_REPLICA for a single replica, OVERLOADED as above, else CACHE_HIT / SPILL / CACHE_MISS as in
`decisions.cache_branch`, with SPILL made SPILL_QUEUE when a replica with the longest match would have been tied
with the choice but for its slot wait. The decision carries the chosen replica's `ttft(r)` as `predicted_ttft_s`
(the fleet term is a cost, not a latency).

Evaluation. `ttft_and_own_s` is the formula for one replica, term by term in the order above; `select` evaluates
it over the replicas at every decision, reading each `ReplicaState` as it is then, and adds the fleet term. In
that per-replica code a max or min of two numbers is a conditional expression: the builtin's call costs about
100 ns, as much as a term (`ReplicaState.batch_slots` and `RouteRequest.cached_tokens` likewise).

Parameters: `EstimatedTTFTConfig` below.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from router.policy.decisions import branch_for_blocks, decision
from router.policy.types import Branch, Decision, PolicyConfigModel, ReplicaState, RouteRequest

MIN_PREFILL_TOKENS_PER_S = 1.0
"""Floor on a replica's prefill rate, so that a corrupt rate cannot divide by zero."""


class EstimatedTTFTConfig(PolicyConfigModel):
    """Shoal's default: minimise the predicted time to first token (see `estimated_ttft`)."""

    kind: Literal["estimated_ttft"] = "estimated_ttft"

    decode_s_per_seq_step: float = Field(default=0.00055, ge=0.0)
    """Seconds one decoding sequence adds to each engine step. A chunked-prefill engine runs every running
    sequence's next token in the same steps as the prefill chunks: one token of compute plus reading its KV. On
    the LLaMA-70B / 8 x A100 preset that is 0.11 ms + 15k tokens of context x 29 ns = ~0.55 ms; a smaller model
    or shorter contexts cost less. Multiplied by the steps the request waits (see `prefill_tokens_per_step`)."""

    prefill_tokens_per_step: int = Field(default=8192, gt=0)
    """Prompt tokens an engine prefills per step (vLLM V1's default `max_num_batched_tokens` for the online
    server), so that a request waits about 1 + (backlog + uncached) / this many steps, each lengthened by every
    decoding sequence."""

    attention_s_per_token_pair: float = Field(default=2.1e-9, ge=0.0)
    """Seconds of prefill per (query, key) token pair: causal attention, which a per-token rate cannot express
    and which makes a 64k-token prompt ~1.5x its linear prefill time. 4 x layers x hidden FLOPs per pair over the
    GPUs' attention throughput: for LLaMA-70B (80 x 8192) on 8 x A100 at ~50% of peak, 2.6 MFLOP / 1.25 PFLOPS =
    2.1 ns, the simulator preset's figure. Scale it with the model (about 0.3 ns for an 8B model on one GPU);
    0 turns the term off."""

    rate_noise_cv: float = Field(default=0.25, ge=0.0)
    """Coefficient of variation (fraction of the mean) that learned prefill rates show between identical
    replicas. Each rate is shrunk towards the fleet mean by the share of the fleet's variance this much noise
    explains (James-Stein). Simulated Mooncake runs on 16 identical replicas: the learned rates' CV averages
    0.19-0.20 (5.4k-9.8k tokens/s around 7.8k); 0.25 pools such a fleet entirely almost always, while a 5k and a
    20k replica keep 83% of their difference. 0 uses each replica's own rate."""

    fleet_cost_weight: float = Field(default=1.5, ge=0.0)
    """Seconds of cost per second of prefill a placement adds beyond the cheapest placement (dimensionless).
    Recomputed prefix work delays the requests queued after it: by about rho / (1 - rho) times the work at
    utilisation rho, 1.5 at rho = 0.6, the load at which affinity starts to decide the tail (near saturation on
    the Mooncake trace prefill needs ~57% of the fleet). On simulated Mooncake runs, 1 to 2 keep the hit ratio
    within 10% of the ceiling at both loads; 0 is the greedy per-request TTFT."""

    charges_idle_replicas: bool = False
    """Charge the fleet cost on replicas with nothing in flight too. Off: recomputing a prefix on an idle replica
    delays no request there, and it is how a hot prefix gets a second copy."""

    kv_pressure_s: float = Field(default=1.0, ge=0.0)
    """Seconds added when the KV cache is full (kv_usage 1.0). A request then waits for running sequences to
    finish and free blocks, or causes a preemption; 1 s is of the order of a sequence's remaining decode time,
    yet below a moderate prefill backlog, so pressure steers traffic away without vetoing a replica."""

    kv_pressure_threshold: float = Field(default=0.8, ge=0.0, lt=1.0)
    """KV usage fraction (0..1) below which the pressure term is 0. vLLM and SGLang count only blocks held by
    running requests as used (cached, unreferenced blocks are free), so below ~80% new work fits without
    preemption; above it the term grows quadratically to `kv_pressure_s` at 1.0."""

    tie_epsilon_s: float = Field(default=0.005, ge=0.0)
    """Seconds within which estimates count as tied. About one engine step: a smaller difference is not
    observable in TTFT, and spreading tied cache misses over idle replicas is worth more than it."""

    tie_rel_epsilon: float = Field(default=0.0, ge=0.0)
    """Fraction of the minimum cost added to `tie_epsilon_s`. 0: the noise of learned prefill rates, which this
    margin used to absorb, is pooled away (`rate_noise_cv`), and a relative margin would hand a long prompt to a
    replica with up to that fraction more backlog (2% of an 8 s prefill: 160 ms) for a smaller in-flight count."""

    assumed_batch_slots: int | None = Field(default=256, ge=1)
    """Batch slots B of a replica whose engine does not export its limit and has none learned (vLLM exports
    none): vLLM's long-standing default `max_num_seqs`. Past it a request waits for a slot, which the queue term
    prices with the replica's learned slot time: an engine at its limit whose sequences hold slots for a minute
    turns one over every quarter second, far less than recomputing a long cached context elsewhere. It only
    prices what the former hard cap at 256 forbade outright, so an engine with more slots is never treated worse
    than under that cap. None: no slot wait where the limit is not known or learned."""

    max_queue_per_replica: int = Field(default=1024, ge=1)
    """Hard cap on a replica's queue depth (requests): a replica at or past it is skipped while another is
    under it. A backstop for queues the slot wait does not price (its slot time not learned yet): four times
    `assumed_batch_slots`, a queue that waits for its slots three times over."""


def pooled_rates(replicas: Sequence[ReplicaState], rate_noise_cv: float) -> list[float]:
    """Each replica's learned prefill rate (tokens/s, floored) shrunk towards the fleet mean by the share of the
    fleet's variance that `rate_noise_cv` explains (James-Stein, module docstring: rate)."""
    floor = MIN_PREFILL_TOKENS_PER_S
    rates = [rate if rate > floor else floor for rate in [r.prefill_tokens_per_s for r in replicas]]
    total = total_squares = 0.0
    for rate in rates:
        total += rate
        total_squares += rate * rate
    mean = total / len(rates)
    var = total_squares / len(rates) - mean * mean
    noise = (rate_noise_cv * mean) ** 2
    # var <= noise covers a homogeneous fleet, where float cancellation can leave a tiny var of either sign.
    if var <= noise:
        return [mean] * len(rates)
    shrink = 1.0 - noise / var
    return [mean + shrink * (rate - mean) for rate in rates]


def slot_wait_s(r: ReplicaState, assumed_slots: int | None = None) -> float:
    """Seconds a new request waits for a batch slot on `r` (module docstring: queue): with n requests there and B
    slots (`r.batch_slots`, else `assumed_slots`) held slot_s each, it waits for n - B + 1 completions at B / slot_s
    per second; 0 while a slot is free or either figure is unknown."""
    if r.slot_s is None:
        return 0.0
    slots = r.batch_slots
    if slots is None:
        slots = assumed_slots
    n = r.queue_depth
    if slots is None or slots <= 0 or n < slots:
        return 0.0
    return (n - slots + 1) * r.slot_s / slots


def ttft_and_own_s(
    request: RouteRequest, r: ReplicaState, rate: float, config: EstimatedTTFTConfig
) -> tuple[float, float]:
    """(ttft(r), own(r)) of the module docstring, in seconds: the predicted time to the first token of `request` on
    `r` at prefill `rate` tokens/s, its terms summed in the order written there, and the prompt's own prefill in
    it, which the fleet term compares across replicas."""
    attn = config.attention_s_per_token_pair
    backlog, waiting = r.waiting_prompt_tokens, r.waiting  # W, k
    cached = request.cached_tokens(r.id)  # c
    uncached = request.prompt_tokens - cached  # u
    own_s = uncached / rate + attn * uncached * (cached + uncached / 2)
    running = r.num_running or 0
    decoding = r.streaming if r.streaming > running else running  # max(streaming, num_running)
    decode_s = config.decode_s_per_seq_step * decoding * (1.0 + (backlog + uncached) / config.prefill_tokens_per_step)
    threshold = config.kv_pressure_threshold
    pressure_s = 0.0  # also when the engine does not export its KV usage
    if r.kv_usage is not None and r.kv_usage > threshold:
        excess = (r.kv_usage if r.kv_usage < 1.0 else 1.0) - threshold
        pressure_s = config.kv_pressure_s / (1.0 - threshold) ** 2 * excess * excess
    ttft_s = (
        backlog / rate
        + own_s
        + decode_s
        + (attn * backlog * backlog / (2 * waiting) if waiting > 0 else 0.0)
        + pressure_s
        + slot_wait_s(r, config.assumed_batch_slots)
        + r.fixed_s
    )
    return ttft_s, own_s


class EstimatedTTFT:
    """Minimise estimated TTFT plus fleet prefill cost; break near-ties towards the longest cached prefix, then idle,
    least recently used replicas."""

    name = "estimated_ttft"

    def __init__(self, config: EstimatedTTFTConfig) -> None:
        self.config = config

    def select(self, request: RouteRequest, replicas: Sequence[ReplicaState], *, now: float) -> Decision:
        cfg = self.config
        rates = pooled_rates(replicas, cfg.rate_noise_cv)
        estimates = [ttft_and_own_s(request, r, rate, cfg) for r, rate in zip(replicas, rates, strict=True)]
        if len(replicas) == 1:
            return decision(request, replicas[0].id, Branch.ONLY_REPLICA, estimates[0][0])
        floor_s = min([own_s for _, own_s in estimates])
        depths = [r.queue_depth for r in replicas]
        weight, charges_idle, cap = cfg.fleet_cost_weight, cfg.charges_idle_replicas, cfg.max_queue_per_replica
        costs = [
            ttft_s + weight * (own_s - floor_s) if charges_idle or depth > 0 else ttft_s
            for (ttft_s, own_s), depth in zip(estimates, depths, strict=True)
        ]
        under_cap = [i for i, depth in enumerate(depths) if depth < cap]
        candidates = under_cap or range(len(replicas))
        best_s = min([costs[i] for i in candidates])
        tied_below_s = best_s + cfg.tie_epsilon_s + cfg.tie_rel_epsilon * best_s
        matched = request.matched_blocks

        def tie_order(i: int) -> tuple[int, int, float, str]:
            r = replicas[i]
            return -matched.get(r.id, 0), r.in_flight, r.last_selected, r.id

        best = min([i for i in candidates if costs[i] <= tied_below_s], key=tie_order)
        chosen_id = replicas[best].id
        longest = max([matched.get(r.id, 0) for r in replicas]) if matched else 0
        branch = branch_for_blocks(longest, matched.get(chosen_id, 0)) if under_cap else Branch.OVERLOADED
        if branch is Branch.SPILL and self._is_queue_spill(request, replicas, costs, longest, tied_below_s):
            branch = Branch.SPILL_QUEUE
        return decision(request, chosen_id, branch, estimates[best][0])

    def _is_queue_spill(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaState],
        costs: Sequence[float],
        longest: int,
        tied_below_s: float,
    ) -> bool:
        """Whether a replica holding the longest match would have been tied with the choice but for its wait for
        a batch slot: the request left its cached replica because of queueing, not of prefill backlog."""
        for r, cost in zip(replicas, costs, strict=True):
            if request.matched_blocks.get(r.id, 0) >= longest:
                queue_s = slot_wait_s(r, self.config.assumed_batch_slots)
                if queue_s > 0.0 and cost - queue_s <= tied_below_s:
                    return True
        return False
