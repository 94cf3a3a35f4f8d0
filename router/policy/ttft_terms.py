"""estimated_ttft's per-replica terms that do not depend on the request, kept from one decision to the next.

The router decides once per request over every replica, and between two decisions only a few replicas' fields
change (the chosen one's counts, a first byte, a finish; every replica's gauges once a scrape interval). So the
terms each replica's cost needs whatever the prompt (backlog, decode and KV-pressure seconds, the queue-cap test,
the tie key) are kept by position in the replica list and re-derived only for the replicas that are another
object than last time or whose `ReplicaState.version` moved (its methods bump it on every change).

A replica's estimate from its terms `(W, decode_s, attention_s, pressure_s, queue_s, fixed_s)` (`ttfts_s`, the one
place of the sum), with its pooled prefill `rate`, its own prefill `own` and `u` uncached tokens:

    W / rate + own + decode_s * (1 + (W + u) / prefill_tokens_per_step) + attention_s + pressure_s + queue_s + fixed_s
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from functools import reduce
from itertools import compress, count
from operator import add, attrgetter, is_, mul, ne
from typing import TYPE_CHECKING

from router.policy.types import ReplicaState

if TYPE_CHECKING:
    from router.policy.estimated_ttft import EstimatedTTFTConfig

MIN_PREFILL_TOKENS_PER_S = 1.0
"""Floor on a replica's prefill rate, so a corrupt rate cannot divide by zero."""

_VAR_ROUNDING_PER_REPLICA = 1e-14
"""Bound on the rounding of the policy's float variance over n rates, per replica, relative to max**2 (it is
below 3.4e-16 * n * max**2): `rate_pooling` adds it to the bound var <= (max - min)**2 / 4, so that a fleet the
bound calls homogeneous is one by the policy's own float arithmetic too."""

_version_of = attrgetter("version")

Row = tuple[int, float, float, float, float, float]
"""A replica's request-independent terms: (backlog tokens W, decode s per engine step, the backlog's attention s,
KV pressure s, wait for a batch slot s, fixed per-request s)."""

QUEUE = 4
"""Position of the slot wait in a `Row`."""


def slot_wait_s(r: ReplicaState, assumed_slots: int | None = None) -> float:
    """Seconds a new request waits for a batch slot on `r` (`service_time`): with n requests there and B slots
    (`r.batch_slots`, else `assumed_slots`) held slot_s each, it waits for n - B + 1 completions at B / slot_s per
    second; 0 while a slot is free or either figure is unknown."""
    slots = r.batch_slots
    if slots is None:
        slots = assumed_slots
    slot_s = r.slot_s
    n = r.queue_depth
    if slots is None or slot_s is None or slots <= 0 or n < slots:
        return 0.0
    return (n - slots + 1) * slot_s / slots


def replica_row(r: ReplicaState, config: EstimatedTTFTConfig) -> Row:
    """The terms of `r` (estimated_ttft's module docstring: W, decode, the backlog's attention, pressure, queue,
    fixed)."""
    backlog = r.waiting_prompt_tokens
    running = r.num_running or 0
    streaming = r.streaming
    decode_s = config.decode_s_per_seq_step * (streaming if streaming > running else running)
    waiting = r.waiting
    # A 0.0 term leaves a sum of non-negative terms unchanged, bit for bit: `ttfts_s` adds these always.
    attention_s = config.attention_s_per_token_pair * backlog * backlog / (2 * waiting) if waiting > 0 else 0.0
    threshold = config.kv_pressure_threshold
    kv = r.kv_usage
    excess = ((kv if kv < 1.0 else 1.0) - threshold) if kv is not None and kv > threshold else 0.0
    pressure_s = config.kv_pressure_s / ((1.0 - threshold) ** 2) * excess * excess
    return (backlog, decode_s, attention_s, pressure_s, slot_wait_s(r, config.assumed_batch_slots), r.fixed_s)


def ttfts_s(
    rows: Sequence[Row],
    rates: Sequence[float],
    owns_s: Sequence[float],
    uncached: Sequence[int],
    inv_step_tokens: float,
) -> list[float]:
    """The estimate of each replica, the one place of the sum: terms `rows`, pooled `rates` (tokens/s), the prompt's
    own prefill there `owns_s` over `uncached` tokens; `inv_step_tokens` is 1 / prefill_tokens_per_step."""
    return [
        w / rate + own_s + decode_s * (1.0 + (w + u) * inv_step_tokens) + attention_s + pressure_s + queue_s + fixed_s
        for (w, decode_s, attention_s, pressure_s, queue_s, fixed_s), rate, own_s, u in zip(
            rows, rates, owns_s, uncached, strict=True
        )
    ]


def is_fleet_charged(r: ReplicaState, config: EstimatedTTFTConfig) -> bool:
    """Whether recomputing a prefix on `r` pays the fleet cost: requests are in flight there to wait behind it, or
    `charges_idle_replicas` charges every replica."""
    return config.charges_idle_replicas or r.queue_depth > 0


def floored_rate(r: ReplicaState) -> float:
    rate = r.prefill_tokens_per_s
    return MIN_PREFILL_TOKENS_PER_S if rate < MIN_PREFILL_TOKENS_PER_S else rate


class FleetTerms:
    """The request-independent terms of the replicas of the last decision, by position in its replica list."""

    def __init__(self, config: EstimatedTTFTConfig) -> None:
        self.config = config
        self.inv_step_tokens = 1.0 / config.prefill_tokens_per_step
        self.states: list[ReplicaState] = []
        """The replicas the terms were derived from (held, so that an identity test cannot see a reused id)."""
        self.versions: list[int] = []
        """Each replica's `ReplicaState.version` when its terms were derived."""
        self.rows: list[Row] = []
        self.rates: list[float] = []
        """Learned prefill rates (tokens/s), floored."""
        self.pooled: tuple[float, list[float] | None] | None = None
        """(fleet mean rate, pooled rate of each replica or None when all pool to the mean); None: not pooled
        since a rate changed."""
        self.is_under_cap: list[bool] = []
        """Queue depth under `max_queue_per_replica`."""
        self.num_under_cap = 0
        self.is_charged: list[bool] = []
        """The fleet cost applies here (`is_fleet_charged`)."""
        self.tie_keys: list[tuple[int, float, str]] = []
        """(in flight, last selected, id): the near-tie order."""
        self.positions: dict[str, int] = {}
        """Position of each replica id."""

    def update(self, replicas: Sequence[ReplicaState]) -> None:
        """Make the terms those of `replicas`, re-deriving what changed since the last call."""
        versions = list(map(_version_of, replicas))
        n = len(replicas)
        changed: Iterable[int]
        if len(self.states) == n:
            before, held = self.versions, self.states
            if all(map(is_, replicas, held)):  # the same replicas (a router's usual case): compare versions in C
                if versions == before:
                    return
                changed = list(compress(count(), map(ne, versions, before)))
            else:
                changed = [i for i in range(n) if versions[i] != before[i] or replicas[i] is not held[i]]
        else:
            changed = range(n)
            self.rows = [(0, 0.0, 0.0, 0.0, 0.0, 0.0)] * n
            self.rates = [math.nan] * n
            self.is_under_cap = [False] * n
            self.is_charged = [False] * n
            self.tie_keys = [(0, 0.0, "")] * n
            self.positions = {}
        self.states = list(replicas)
        self.versions = versions
        cfg = self.config
        rows, rates, is_under_cap, tie_keys = self.rows, self.rates, self.is_under_cap, self.tie_keys
        is_charged = self.is_charged
        cap = cfg.max_queue_per_replica
        for i in changed:
            r = replicas[i]
            rows[i] = replica_row(r, cfg)
            rate = floored_rate(r)
            if rate != rates[i]:
                rates[i] = rate
                self.pooled = None
            is_under_cap[i] = r.queue_depth < cap
            is_charged[i] = is_fleet_charged(r, cfg)
            if tie_keys[i][2] != r.id:
                self.positions = {}
            tie_keys[i] = (r.in_flight, r.last_selected, r.id)
        if not self.positions:
            self.positions = {r.id: i for i, r in enumerate(replicas)}
        self.num_under_cap = is_under_cap.count(True)

    def pool_rates(self) -> tuple[float, list[float] | None]:
        """(fleet mean, pooled rate per replica or None when every one pools to the mean) of the current rates
        (`rate_pooling`), kept until a rate changes."""
        if self.pooled is not None:
            return self.pooled
        rates = self.rates
        mean, shrink = rate_pooling(rates, self.config.rate_noise_cv)
        # A fleet within `rate_noise_cv` pools every rate to the mean, exactly while the rates are finite (a finite
        # mean of rates of at least 1 token/s means they all are).
        if shrink == 0.0 and math.isfinite(mean):
            self.pooled = (mean, None)
        else:
            self.pooled = (mean, [mean + shrink * (x - mean) for x in rates])
        return self.pooled


def rate_pooling(rates: Sequence[float], rate_noise_cv: float) -> tuple[float, float]:
    """(fleet mean, shrink) of floored prefill rates, every sum taken in list order: a replica's rate pools to
    `mean + shrink * (rate - mean)` (James-Stein, `estimated_ttft`'s module docstring); shrink 0.0 pools them all
    to the mean."""
    n = len(rates)
    mean = reduce(add, rates, 0.0) / n
    noise = (rate_noise_cv * mean) ** 2
    high = max(rates)
    spread = high - min(rates)
    margin = _VAR_ROUNDING_PER_REPLICA * n * high * high
    if math.isfinite(mean) and high < 1e150 and spread * spread / 4 + margin < noise:
        return mean, 0.0  # var <= spread**2 / 4 < noise: no need for the sum of squares to know it
    var = reduce(add, map(mul, rates, rates), 0.0) / n - mean * mean
    # var <= noise covers a homogeneous fleet, where float cancellation can leave a tiny var of either sign.
    return mean, (1.0 - noise / var if var > noise else 0.0)
