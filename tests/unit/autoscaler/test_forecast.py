"""Predictive scale-up on a virtual clock: a ramp is met earlier, and the forecast only ever raises the fleet."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from autoscaler.policy import (
    Action,
    Cap,
    ForecastConfig,
    Observation,
    PanicConfig,
    Reason,
    ScalingPolicyConfig,
    Window,
    decide,
)
from autoscaler.policy.forecast import forecast_demand
from autoscaler.policy.types import Sample
from tests.unit.autoscaler.virtual_fleet import VirtualFleet, requests

# Panic off: these tests are about the stable window and the forecast alone.
PLAIN = ScalingPolicyConfig(max_replicas=20, panic=PanicConfig(enabled=False), expected_start_s=120.0)
PREDICTIVE = PLAIN.model_copy(update={"forecast": ForecastConfig(enabled=True)})


def ramp(t: float) -> float:
    """8 requests (one replica) for 10 minutes, then 0.04 more each second: a replica's worth every 200 s."""
    return 8.0 + max(0.0, t - 600.0) * 0.04


def shortfall(fleet: VirtualFleet, demand: float) -> float:
    """Requests beyond what the ready replicas carry at their target (before this tick's decision)."""
    return max(0.0, demand - fleet.num_ready * fleet.config.target_requests_per_replica)


def run_ramp(config: ScalingPolicyConfig, until: float) -> tuple[VirtualFleet, float]:
    """A fleet of one on `ramp` with 120 s cold starts; returns it and the summed shortfall (request-ticks)."""
    fleet = VirtualFleet(config, start_s=120.0, num_ready=1)
    missing = 0.0
    while fleet.now < until:
        missing += shortfall(fleet, ramp(fleet.now))
        fleet.tick(requests(ramp(fleet.now)))
        fleet.now += 2.0
    return fleet, missing


def test_a_linear_ramp_with_slow_cold_starts_is_met_earlier_with_prediction() -> None:
    plain, plain_short = run_ramp(PLAIN, 1800.0)
    predictive, predictive_short = run_ramp(PREDICTIVE, 1800.0)

    def started(fleet: VirtualFleet) -> dict[int, float]:
        """When each fleet size was first targeted."""
        return {n: t for t, a, n in reversed(fleet.actions()) if a is Action.UP}

    plain_at, predictive_at = started(plain), started(predictive)
    assert all(a is Action.UP for fleet in (plain, predictive) for _, a, _ in fleet.actions())
    # Without a forecast each replica starts once the 60 s mean passes its share plus the tolerance band, and is
    # ready 120 s later. Once the trend window (600 s) has seen enough of the ramp, each starts about the
    # forecast's lead (120 s ahead plus the stable mean's 30 s age) earlier: never later, and no earlier than the
    # lead accounts for.
    assert sorted(plain_at) == sorted(predictive_at) == [2, 3, 4, 5, 6, 7]
    assert all(predictive_at[n] <= plain_at[n] for n in plain_at)
    for n in (5, 6, 7):
        assert 120.0 <= plain_at[n] - predictive_at[n] <= 160.0, (n, plain_at, predictive_at)
    # The requests left beyond the ready replicas' target over the ramp fall by more than half.
    assert predictive_short < 0.5 * plain_short


def test_a_forecast_decision_says_so() -> None:
    fleet, _ = run_ramp(PREDICTIVE, 1800.0)
    forecasts = [d for _, d in fleet.history if d.window is Window.FORECAST]
    assert forecasts
    ups = [d for d in forecasts if d.action is Action.UP]
    assert ups and all(d.reason is Reason.SCALE_UP for d in ups)
    assert all(d.recommended_replicas is not None and d.recommended_replicas > d.current_replicas for d in ups)
    detail = ups[0].detail
    assert "forecast in 120 s" in detail and "requests/min over 600 s" in detail and "over the stable window" in detail


def test_prediction_never_lowers_a_recommendation_nor_scales_down_on_its_own() -> None:
    # At every tick of a noisy random walk, the decision with prediction, from the same state and observation,
    # recommends and targets at least what the decision without it does.
    rng = random.Random(7)
    fleet = VirtualFleet(PREDICTIVE, start_s=120.0, num_ready=3)
    level = 24.0
    num_raised = 0
    for _ in range(3000):
        level = max(0.0, level + rng.gauss(0.0, 1.0))
        observation = Observation(
            requests(max(0.0, level + rng.gauss(0.0, 4.0))),
            num_ready=fleet.num_ready,
            starting_since=tuple(fleet.starting),
        )
        with_forecast, _ = decide(observation, fleet.state, PREDICTIVE, now=fleet.now)
        without, _ = decide(observation, fleet.state, PLAIN, now=fleet.now)
        assert (with_forecast.recommended_replicas or 0) >= (without.recommended_replicas or 0)
        assert with_forecast.target_replicas >= without.target_replicas
        if with_forecast.action is Action.DOWN:
            assert without.action is Action.DOWN and with_forecast.window is not Window.FORECAST
        num_raised += with_forecast.target_replicas > without.target_replicas
        fleet.tick(observation.demand)
        fleet.now += 2.0
    assert num_raised > 0, "the walk never gave the forecast anything to do"


def test_a_falling_ramp_is_followed_exactly_as_without_prediction() -> None:
    def falling(t: float) -> float:
        return max(8.0, 80.0 - 0.04 * t)

    runs = []
    for config in (PLAIN, PREDICTIVE):
        fleet = VirtualFleet(config, start_s=120.0, num_ready=10)
        fleet.run(3000.0, lambda t: requests(falling(t)))
        runs.append([(t, d.target_replicas, d.reason) for t, d in fleet.history])
    assert runs[0] == runs[1]
    assert runs[1][-1][1] == 1


def test_prediction_stays_within_max_replicas_and_the_rate_cap() -> None:
    config = PREDICTIVE.model_copy(
        update={"max_replicas": 12, "forecast": ForecastConfig(enabled=True, window_s=300.0, max_ratio=4.0)}
    )
    fleet = VirtualFleet(config, start_s=120.0, num_ready=1)
    fleet.run(1000.0, lambda t: requests(8.0 if t < 600.0 else 8.0 + (t - 600.0) * 2.0))
    forecast = [(t, d) for t, d in fleet.history if d.window is Window.FORECAST]
    assert max(d.target_replicas for _, d in fleet.history) == 12
    assert any(d.cap is Cap.MAX_REPLICAS and d.recommended_replicas == 12 for _, d in forecast)
    assert any(d.cap is Cap.SCALE_UP_RATE and d.target_replicas < (d.recommended_replicas or 0) for _, d in forecast)
    # However far the forecast looks, no 15 s adds more than max(4 replicas, 100%) of the size before it.
    period = config.scale_up.period_s
    for t, d in forecast:
        before = [e.current_replicas for u, e in fleet.history if t - period < u <= t]
        base = before[0] if before else d.current_replicas
        assert d.target_replicas - base <= max(config.scale_up.max_replicas, base), (t, d)


def test_the_forecast_is_clamped_to_max_ratio_and_needs_half_a_window_of_history() -> None:
    config = ForecastConfig(enabled=True, window_s=300.0, max_ratio=1.5)
    steep = [Sample(float(t), requests(10.0 + t)) for t in range(0, 301, 5)]
    stable = requests(280.0)
    forecast = forecast_demand(steep, stable, config, horizon_s=120.0, stable_since=240.0, now=300.0)
    assert forecast is not None
    assert forecast.requests_per_s == pytest.approx(1.0)
    assert forecast.demand.requests == pytest.approx(1.5 * 280.0)
    gentle = [Sample(float(t), requests(100.0 + 0.01 * t)) for t in range(0, 301, 5)]
    forecast = forecast_demand(gentle, requests(103.0), config, horizon_s=120.0, stable_since=240.0, now=300.0)
    assert forecast is not None
    # Lead: 120 s ahead, plus the stable mean's age (its samples' mean time is 30 s ago when evenly spread).
    assert forecast.lead_s == pytest.approx(150.0, abs=3.0)
    assert forecast.demand.requests == pytest.approx(103.0 + 0.01 * forecast.lead_s)
    young = [s for s in gentle if s.at > 160.0]  # 140 s of history, under half the window
    assert forecast_demand(young, requests(103.0), config, horizon_s=120.0, stable_since=240.0, now=300.0) is None
    falling = [Sample(float(t), requests(100.0 - 0.1 * t)) for t in range(0, 301, 5)]
    forecast = forecast_demand(falling, requests(73.0), config, horizon_s=120.0, stable_since=240.0, now=300.0)
    assert forecast is not None and forecast.demand.requests == 73.0


def test_forecast_config() -> None:
    assert not ScalingPolicyConfig().forecast.enabled
    assert PREDICTIVE.forecast_horizon_s == PREDICTIVE.expected_start_s == 120.0
    config = ScalingPolicyConfig.model_validate({"forecast": {"enabled": True, "horizon_s": 200}})
    assert config.forecast_horizon_s == 200
    with pytest.raises(ValidationError):
        ScalingPolicyConfig.model_validate({"forecast": {"enabled": True, "window_s": 30}})  # under the stable window
    with pytest.raises(ValidationError):
        ScalingPolicyConfig.model_validate({"forecast": {"max_ratio": 1.0}})
