"""The online prefill-rate estimate: converges, ignores what says nothing about the rate, never reaches 0."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from router.policy.prefill_rate import PrefillRate, PrefillRateEstimator


def observe_noisy(
    estimator: PrefillRateEstimator,
    state: PrefillRate,
    true_tokens_per_s: float,
    count: int,
    rng: random.Random,
    noise_sigma: float = 0.25,
) -> PrefillRate:
    """Prompts of 500..8000 uncached tokens, some behind a backlog; TTFB off by a log-normal factor."""
    for _ in range(count):
        uncached = rng.randint(500, 8000)
        ahead = rng.choice([0, 0, rng.randint(0, 20_000)])
        ttfb_s = (uncached + ahead) / true_tokens_per_s * rng.lognormvariate(0.0, noise_sigma)
        state = estimator.update(state, uncached_tokens=uncached, ttfb_s=ttfb_s, queue_tokens_ahead=ahead)
    return state


@pytest.mark.parametrize("true_tokens_per_s", [800.0, 4_000.0, 60_000.0])
def test_converges_to_the_true_rate_from_noisy_observations(true_tokens_per_s: float) -> None:
    estimator = PrefillRateEstimator()
    rng = random.Random(1)
    state = observe_noisy(estimator, estimator.initial(), true_tokens_per_s, 10, rng)
    assert state.tokens_per_s == pytest.approx(true_tokens_per_s, rel=0.3)  # a cold replica learns fast
    state = observe_noisy(estimator, state, true_tokens_per_s, 300, rng)
    assert state.tokens_per_s == pytest.approx(true_tokens_per_s, rel=0.12)
    assert state.num_observations == 310


def test_follows_a_replica_that_slows_down() -> None:
    estimator = PrefillRateEstimator()
    rng = random.Random(2)
    state = observe_noisy(estimator, estimator.initial(), 12_000.0, 200, rng)
    state = observe_noisy(estimator, state, 6_000.0, 60, rng)
    assert state.tokens_per_s == pytest.approx(6_000.0, rel=0.15)


def test_prior_holds_until_the_first_observation_which_replaces_it() -> None:
    estimator = PrefillRateEstimator(prior_tokens_per_s=10_000.0)
    state = estimator.initial()
    assert state == PrefillRate(tokens_per_s=10_000.0, num_observations=0)
    state = estimator.update(state, uncached_tokens=2_000, ttfb_s=1.0)
    assert state.tokens_per_s == pytest.approx(2_000.0)


def test_ignores_tiny_prompts() -> None:
    estimator = PrefillRateEstimator(min_tokens=256)
    state = estimator.initial()
    assert estimator.update(state, uncached_tokens=100, ttfb_s=5.0) is state
    assert estimator.update(state, uncached_tokens=255, ttfb_s=0.001) is state


def test_counts_the_backlog_ahead_of_the_request() -> None:
    estimator = PrefillRateEstimator()
    # A tiny prompt behind 9,900 tokens of backlog is a real observation of 10,000 tokens in 2 s.
    state = estimator.update(estimator.initial(), uncached_tokens=100, ttfb_s=2.0, queue_tokens_ahead=9_900)
    assert state.tokens_per_s == pytest.approx(5_000.0)
    assert state.num_observations == 1


def test_a_single_stall_moves_a_warm_estimate_by_a_bounded_step() -> None:
    estimator = PrefillRateEstimator()
    state = estimator.update(estimator.initial(), uncached_tokens=4_000, ttfb_s=1.0)
    stalled = estimator.update(state, uncached_tokens=4_000, ttfb_s=100.0)  # 100x slower than usual
    assert stalled.tokens_per_s > 0.6 * state.tokens_per_s
    recovered = observe_noisy(estimator, stalled, 4_000.0, 20, random.Random(3), noise_sigma=0.0)
    assert recovered.tokens_per_s == pytest.approx(4_000.0, rel=0.05)


def test_never_reaches_zero_or_below() -> None:
    estimator = PrefillRateEstimator()
    state = estimator.initial()
    for _ in range(500):
        state = estimator.update(state, uncached_tokens=1_000, ttfb_s=1e12)
        assert state.tokens_per_s > 0.0
    assert state.tokens_per_s == estimator.min_tokens_per_s
    for bad_ttfb_s in (0.0, -1.0, float("nan")):
        assert estimator.update(state, uncached_tokens=4_000, ttfb_s=bad_ttfb_s) is state
    # Overhead larger than the TTFB leaves no prefill time to divide by.
    with_overhead = PrefillRateEstimator(overhead_s=0.5)
    assert with_overhead.update(state, uncached_tokens=4_000, ttfb_s=0.4) is state


def test_estimate_is_bounded_above() -> None:
    estimator = PrefillRateEstimator(max_tokens_per_s=1e6)
    state = estimator.initial()
    for _ in range(100):
        state = estimator.update(state, uncached_tokens=10_000, ttfb_s=1e-9)
    assert state.tokens_per_s == 1e6


def test_estimator_config_is_frozen_and_strict() -> None:
    with pytest.raises(ValidationError):
        PrefillRateEstimator(prior_tokens_per_s=0.0)
    with pytest.raises(ValidationError):
        PrefillRateEstimator(half_life=8)  # type: ignore[call-arg]
    estimator = PrefillRateEstimator()
    with pytest.raises(ValidationError):
        estimator.min_tokens = 1
    for name, info in PrefillRateEstimator.model_fields.items():
        assert info.description, name


def test_an_unobserved_replica_starts_from_the_fleets_learned_mean() -> None:
    estimator = PrefillRateEstimator(prior_tokens_per_s=10_000.0)
    assert estimator.initial().tokens_per_s == 10_000.0
    fleet = [
        PrefillRate(tokens_per_s=30_000.0, num_observations=5),
        PrefillRate(tokens_per_s=50_000.0, num_observations=2),
        PrefillRate(tokens_per_s=10_000.0),  # never observed: not part of the mean
    ]
    start = estimator.initial(fleet)
    assert start.tokens_per_s == 40_000.0
    assert start.num_observations == 0
