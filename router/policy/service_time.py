"""A replica's service behaviour beyond its prefill rate, learned online: batch slots and fixed per-request time.

Engines in the field are often bound by batch slots (`max_num_seqs`), decode or a fixed per-request cost rather
than by prefill tokens. A replica that holds a hot prefix then looks free to a prefill-only cost model (every
request is a cheap cache hit) while its queue for slots grows. This model gives `estimated_ttft` the terms it needs
to see that queue, per replica:

    slot_s   mean seconds a request holds a batch slot (from being sent to its last byte, the wait for a slot left out)
    slots    the engine's batch slots B: known (scraped, `ReplicaState.max_num_seqs`) or learned here
    fixed_s  seconds of a first byte that no prefill token explains (HTTP, tokenisation, scheduling, one step)

With n requests on the replica (running or queued), FIFO slots and completions at B / slot_s per second, a new
request waits for n - B + 1 completions, and a request that joined behind n others takes

    duration = max(B, n + 1) * slot_s / B

so each finished request teaches slot_s = duration * B / max(B, n + 1) when B is known. When B is not known, a
request whose duration stays within `queued_ratio` of slot_s found a free slot (it teaches slot_s), and one that
took longer waited for one, so that B = (n + 1) * slot_s / duration (it teaches B). Every request, streamed or
not, teaches these (its total latency); streams whose prompt was too short to teach the prefill rate teach
fixed_s = ttfb - work / rate when they found a free slot.

Estimates are exponentially weighted averages (alpha = max(1 - 2 ** (-1 / half_life), 1 / n)), so the first
observation replaces the unknown and later ones form a running mean until alpha reaches its floor. `ServiceTime`
is one replica's state, kept by the routing core; every update is pure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pydantic import BaseModel, ConfigDict, Field


@dataclass(frozen=True, slots=True)
class ServiceTime:
    """One replica's learned service terms."""

    slot_s: float | None = None
    """Mean seconds a request holds a batch slot; None until a request finished."""
    slots: float | None = None
    """Batch slots learned from latencies (used when the engine's own limit is unknown); None until a request was
    seen to wait for one."""
    fixed_s: float = 0.0
    """Seconds of each first byte not spent on prefill tokens."""
    num_slot_observations: int = 0
    num_slots_observations: int = 0
    num_fixed_observations: int = 0


def _alpha(half_life: float, num_observations: int) -> float:
    floor: float = 1.0 - 0.5 ** (1.0 / half_life)
    return max(floor, 1.0 / num_observations)


class ServiceTimeEstimator(BaseModel):
    """Parameters of the online service-time model (module docstring), and its pure updates."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    half_life_observations: float = Field(default=16.0, gt=0.0)
    """Observations after which an old one's weight has halved. Request durations vary with their output length
    far more than prefill rates vary, so this averages over twice as many as the prefill rate does."""

    learn_slots: bool = False
    """Learn an engine's batch slots from the durations of requests that seem to have queued, when the engine
    does not export its limit. Off by default: on continuous-batching engines whose queue comes from the KV cache
    or the token budget rather than from slots, and whose durations vary with output length, the inferred limit
    is too small, and the wait for a slot it predicts moves requests off their cached replica for nothing (the
    Mooncake scenario 01: SLO attainment 0.947 -> 0.836 with it on, until `ReplicaState.batch_slots` held a learned
    limit at or above the most the engine was seen running; 0.945 on or off since)."""

    learn_fixed: bool = False
    """Learn a fixed per-request time from short streams' first bytes. Off by default: replicas alike learn
    slightly different values from noisy first bytes, and those differences outweigh the tie-break on requests in
    flight, so idle replicas stop sharing cache misses evenly."""

    queued_ratio: float = Field(default=1.5, gt=1.0)
    """With the batch limit unknown, a request that took more than this many times `slot_s` is taken to have
    waited for a slot. 1.5: above the spread of similar requests' durations on a free engine, below the 2x that
    one slot's wait adds when every slot is busy."""

    max_fixed_tokens: int = Field(default=256, ge=1)
    """Work tokens (uncached prompt plus backlog ahead) below which a stream's first byte teaches `fixed_s`: the
    prefill rate's `min_tokens`, so that short prompts teach the fixed time and long ones the rate."""

    def observe_finish(
        self, state: ServiceTime, *, duration_s: float, num_ahead: int, known_slots: int | None
    ) -> ServiceTime:
        """The state after a request that joined behind `num_ahead` others finished after `duration_s`."""
        if not duration_s > 0.0 or num_ahead < 0:
            return state
        slot_s = state.slot_s
        if known_slots is not None and known_slots > 0:
            observed = duration_s * known_slots / max(known_slots, num_ahead + 1)
            return self._with_slot_s(state, observed)
        if not self.learn_slots or slot_s is None or duration_s <= self.queued_ratio * slot_s:
            return self._with_slot_s(state, duration_s)
        observed_slots = min(max((num_ahead + 1) * slot_s / duration_s, 1.0), float(num_ahead + 1))
        n = state.num_slots_observations + 1
        slots = observed_slots if state.slots is None else state.slots
        slots += _alpha(self.half_life_observations, n) * (observed_slots - slots)
        return replace(state, slots=slots, num_slots_observations=n)

    def observe_first_byte(
        self, state: ServiceTime, *, ttfb_s: float, work_tokens: int, tokens_per_s: float, had_free_slot: bool
    ) -> ServiceTime:
        """The state after a stream's first byte came `ttfb_s` after it was sent, with `work_tokens` of prefill
        ahead of it at `tokens_per_s`; only short work on a free slot teaches `fixed_s`."""
        if not self.learn_fixed or not had_free_slot or work_tokens >= self.max_fixed_tokens or not ttfb_s >= 0.0:
            return state
        observed = max(0.0, ttfb_s - max(work_tokens, 0) / tokens_per_s)
        n = state.num_fixed_observations + 1
        fixed_s = state.fixed_s + _alpha(self.half_life_observations, n) * (observed - state.fixed_s)
        return replace(state, fixed_s=fixed_s, num_fixed_observations=n)

    def _with_slot_s(self, state: ServiceTime, observed: float) -> ServiceTime:
        n = state.num_slot_observations + 1
        slot_s = observed if state.slot_s is None else state.slot_s
        slot_s += _alpha(self.half_life_observations, n) * (observed - slot_s)
        return replace(state, slot_s=slot_s, num_slot_observations=n)
