"""Poisson noise at a few requests per replica: panic's noise margin and the requests signal's square-root headroom.

Demand is drawn from a seeded Poisson generator, one count per 2 s tick (requests in flight under Poisson arrivals
are Poisson distributed), on a virtual clock.
"""

from __future__ import annotations

import math
import random

import pytest

from autoscaler.policy import Observation, PanicConfig, ScalerState, ScalingPolicyConfig, Signal, Window, decide
from tests.unit.autoscaler.virtual_fleet import requests

THREE_PER_REPLICA = ScalingPolicyConfig(max_replicas=20, target_requests_per_replica=3.0)


def poisson(rng: random.Random, mean: float) -> int:
    """Knuth's method: fine for the small means here."""
    limit, count, product = math.exp(-mean), 0, rng.random()
    while product > limit:
        count += 1
        product *= rng.random()
    return count


def panic_onsets(config: ScalingPolicyConfig, num_ready: int, means: list[float], *, seed: int) -> list[float]:
    """Times at which panic engages on a fleet held at `num_ready` ready replicas (nothing is actuated), with
    Poisson demand of `means[i]` at tick i."""
    rng = random.Random(seed)
    state, onsets, was_panicking = ScalerState(), [], False
    for i, mean in enumerate(means):
        now = 2.0 * i
        observation = Observation(requests(poisson(rng, mean)), num_ready=num_ready)
        decision, state = decide(observation, state, config, now=now)
        if decision.is_panicking and not was_panicking:
            onsets.append(now)
        was_panicking = decision.is_panicking
    return onsets


@pytest.mark.parametrize("num_ready", [1, 2, 3])
def test_panic_does_not_fire_on_poisson_noise_at_three_requests_per_replica(num_ready: int) -> None:
    # Two hours at the target: 3 requests per ready replica on average.
    two_hours = [3.0 * num_ready] * 3600
    assert panic_onsets(THREE_PER_REPLICA, num_ready, two_hours, seed=num_ready) == []


def test_without_the_noise_margin_a_single_replica_panics_on_noise() -> None:
    # The same noise on one replica: 2x its capacity (6 requests over the 6 s window) is only ~1.7 standard
    # deviations of a Poisson count of 3, and it is crossed many times in two hours.
    no_margin = THREE_PER_REPLICA.model_copy(update={"panic": PanicConfig(noise_margin_sd=0.0)})
    assert len(panic_onsets(no_margin, 1, [3.0] * 3600, seed=1)) >= 5


@pytest.mark.parametrize("num_ready", [1, 2, 3])
def test_panic_fires_on_a_real_3x_burst_at_three_requests_per_replica(num_ready: int) -> None:
    calm, burst = [3.0 * num_ready] * 300, [9.0 * num_ready] * 30
    onsets = panic_onsets(THREE_PER_REPLICA, num_ready, calm + burst, seed=10 + num_ready)
    assert onsets and onsets[0] >= 2.0 * len(calm)
    assert onsets[0] <= 2.0 * len(calm) + THREE_PER_REPLICA.panic.window_s  # within one panic window


def test_panic_compares_demand_before_rounding_up() -> None:
    # 9.5 requests at 3 per replica need 3.2 replicas: ceil() makes that 4, twice the 2 ready (Knative's rule
    # would panic); unrounded it is 1.6x.
    decision, _ = decide(Observation(requests(9.5), num_ready=2), ScalerState(), THREE_PER_REPLICA, now=0.0)
    assert not decision.is_panicking and decision.window is Window.STABLE
    decision, _ = decide(Observation(requests(16.0), num_ready=2), ScalerState(), THREE_PER_REPLICA, now=0.0)
    assert decision.is_panicking and decision.window is Window.PANIC


def test_the_noise_margin_applies_to_the_requests_signal_only() -> None:
    config = THREE_PER_REPLICA.model_copy(update={"target_prefill_backlog_tokens_per_replica": 1000.0})
    # 2.1x the one ready replica on prefill backlog: a panic, though the request count (3) is no burst.
    backlog = Observation(requests(3, waiting=3, prefill_backlog_tokens=2100.0), num_ready=1)
    decision, _ = decide(backlog, ScalerState(), config, now=0.0)
    assert decision.is_panicking and decision.signal is Signal.PREFILL_BACKLOG
    # 7 requests on one replica of 3: 2.3x, but only 2.3 standard deviations above its capacity.
    decision, _ = decide(Observation(requests(7.0), num_ready=1), ScalerState(), config, now=0.0)
    assert not decision.is_panicking


@pytest.mark.parametrize(
    ("demand", "without", "with_headroom"),
    [(0.0, 0, 0), (4.0, 1, 2), (9.0, 3, 3), (16.0, 4, 5), (100.0, 25, 28)],
)
def test_square_root_headroom(demand: float, without: int, with_headroom: int) -> None:
    # Target 4 with one standard deviation of headroom: ceil((d + sqrt(d)) / 4).
    plain = ScalingPolicyConfig(max_replicas=40, target_requests_per_replica=4.0, panic=PanicConfig(enabled=False))
    headroom = plain.model_copy(update={"requests_headroom_sd": 1.0})
    for config, expected in ((plain, without), (headroom, with_headroom)):
        decision, _ = decide(Observation(requests(demand), num_ready=1), ScalerState(), config, now=0.0)
        assert decision.desired_by_signal[Signal.REQUESTS] == expected, config.requests_headroom_sd


def test_the_headroom_is_a_shrinking_share_of_a_growing_fleet() -> None:
    config = ScalingPolicyConfig(max_replicas=400, target_requests_per_replica=4.0, requests_headroom_sd=1.5)
    shares = []
    for demand in (8.0, 32.0, 128.0, 512.0):
        decision, _ = decide(Observation(requests(demand), num_ready=1), ScalerState(), config, now=0.0)
        shares.append(decision.desired_by_signal[Signal.REQUESTS] * 4.0 / demand - 1.0)
    assert shares == sorted(shares, reverse=True) and shares[-1] < 0.1 < 0.5 < shares[0]
