"""estimated_ttft's per-replica terms that do not depend on the request, kept from one decision to the next.

The router decides once per request over every replica, and between two decisions only a few replicas' fields
change (the chosen one's counts, a first byte, a finish; every replica's gauges once a scrape interval). So the
terms each replica's cost needs whatever the prompt (backlog, decode and KV-pressure seconds, the queue-cap test,
the tie key) are kept by position in the replica list and re-derived only for the replicas whose
`ReplicaState.stamp`, a new object on every write to a field, is not the one they were derived at. Reading the
stamps is one attribute per replica; a list of other replicas, or in another order, is re-derived where it
differs.

Two forms of the terms, for estimated_ttft's two ways of costing a replica that matches nothing (`rate` is the
fleet's pooled prefill rate, `P` the prompt's tokens):

    exact (summed as the policy's reference sums it):
        W / rate + own + decode_s * (1 + (W + P) / prefill_tokens_per_step) + attention_s + pressure_s
    line (the same sum in another order, a few float roundings apart, for ranking):
        W * (1 / rate) + fixed_s + P * per_token_s + own,
        fixed_s = decode_s * (1 + W / prefill_tokens_per_step) + attention_s + pressure_s
        per_token_s = decode_s / prefill_tokens_per_step
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence
from functools import reduce
from itertools import compress, count
from operator import add, is_not, mul
from typing import TYPE_CHECKING

from router.policy.types import ReplicaState

if TYPE_CHECKING:
    from router.policy.config import EstimatedTTFTConfig

MIN_PREFILL_TOKENS_PER_S = 1.0
"""Floor on a replica's prefill rate, so a corrupt rate cannot divide by zero."""

_VAR_ROUNDING_PER_REPLICA = 1e-14
"""Bound on the rounding of the policy's float variance over n rates, per replica, relative to max**2 (it is
below 3.4e-16 * n * max**2): `rate_pooling` adds it to the bound var <= (max - min)**2 / 4, so that a fleet the
bound calls homogeneous is one by the policy's own float arithmetic too."""


class FleetTerms:
    """The request-independent terms of the replicas of the last decision, by position in its replica list."""

    def __init__(self, config: EstimatedTTFTConfig) -> None:
        self.config = config
        self.inv_step_tokens = 1.0 / config.prefill_tokens_per_step
        self.stamps: list[object] = []
        """Each replica's `ReplicaState.stamp` when its terms were derived."""
        self.rows: list[tuple[int, float, float, float]] = []
        """Exact form: (backlog tokens W, decode s per engine step, the backlog's attention s, KV pressure s)."""
        # Line form, in flat arrays (read on every decision, they stay in few cache lines):
        self.line_backlogs = array("d")
        """Backlog tokens W."""
        self.line_fixed_s = array("d")
        self.line_per_token_s = array("d")
        self.num_irregular = 0
        """Replicas with a negative backlog or decode count (a driver's miscount): their line form may cancel."""
        self.rates: list[float] = []
        """Learned prefill rates (tokens/s), floored."""
        self.pooled: tuple[float, list[float] | None] | None = None
        """(fleet mean rate, pooled rate of each replica or None when all pool to the mean); None: not pooled
        since a rate changed."""
        self.is_under_cap: list[bool] = []
        """Queue depth under `max_queue_per_replica`."""
        self.num_under_cap = 0
        self.tie_keys: list[tuple[int, float, str]] = []
        """(in flight, last selected, id): the near-tie order."""
        self.positions: dict[str, int] = {}
        """Position of each replica id."""

    def update(self, replicas: Sequence[ReplicaState]) -> None:
        """Make the terms those of `replicas`, re-deriving what changed since the last call."""
        stamps = [r.stamp for r in replicas]
        if stamps == self.stamps:
            return
        n = len(replicas)
        changed: Iterable[int]
        if len(self.stamps) == n:
            changed = list(compress(count(), map(is_not, stamps, self.stamps)))
        else:
            changed = range(n)
            self.rows = [(0, 0.0, 0.0, 0.0)] * n
            self.line_backlogs = array("d", bytes(8 * n))
            self.line_fixed_s = array("d", bytes(8 * n))
            self.line_per_token_s = array("d", bytes(8 * n))
            self.rates = [math.nan] * n
            self.is_under_cap = [False] * n
            self.tie_keys = [(0, 0.0, "")] * n
            self.positions = {}
            self.num_irregular = 0
        self.stamps = stamps
        cfg = self.config
        rows, rates, is_under_cap, tie_keys = self.rows, self.rates, self.is_under_cap, self.tie_keys
        line_backlogs, line_fixed_s, line_per_token_s = self.line_backlogs, self.line_fixed_s, self.line_per_token_s
        step_s = cfg.decode_s_per_seq_step
        inv_step_tokens = self.inv_step_tokens
        attn = cfg.attention_s_per_token_pair
        threshold = cfg.kv_pressure_threshold
        pressure_scale = cfg.kv_pressure_s / ((1.0 - threshold) ** 2)
        cap = cfg.max_queue_per_replica
        for i in changed:
            r = replicas[i]
            backlog = r.waiting_prompt_tokens
            running = r.num_running or 0
            streaming = r.streaming
            decoding = streaming if streaming > running else running
            decode_s = step_s * decoding
            waiting = r.waiting
            # A 0.0 term leaves a sum of non-negative terms unchanged, bit for bit: the policy adds these always.
            attention_s = attn * backlog * backlog / (2 * waiting) if waiting > 0 else 0.0
            kv = r.kv_usage
            excess = ((kv if kv < 1.0 else 1.0) - threshold) if kv is not None and kv > threshold else 0.0
            pressure_s = pressure_scale * excess * excess
            self.num_irregular += (backlog < 0 or decode_s < 0.0) - (rows[i][0] < 0 or rows[i][1] < 0.0)
            rows[i] = (backlog, decode_s, attention_s, pressure_s)
            line_backlogs[i] = backlog
            line_fixed_s[i] = decode_s * (1.0 + backlog * inv_step_tokens) + attention_s + pressure_s
            line_per_token_s[i] = decode_s * inv_step_tokens
            rate = r.prefill_tokens_per_s
            rate = MIN_PREFILL_TOKENS_PER_S if rate < MIN_PREFILL_TOKENS_PER_S else rate
            if rate != rates[i]:
                rates[i] = rate
                self.pooled = None
            in_flight = r.in_flight
            engine_depth = running + (r.num_waiting or 0)
            is_under_cap[i] = (in_flight if in_flight > engine_depth else engine_depth) < cap
            if tie_keys[i][2] != r.id:
                self.positions = {}
            tie_keys[i] = (in_flight, r.last_selected, r.id)
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
