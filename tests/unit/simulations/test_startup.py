"""Cold starts as distributions: lognormal p50/p90 or measured samples, seeded, in scenarios and in runs."""

from __future__ import annotations

import statistics

import pytest
from pydantic import TypeAdapter, ValidationError

from simulations.scaling import AutoscaleConfig
from simulations.scenario import policy_entry
from simulations.simulation import Simulation
from simulations.startup import (
    EmpiricalStartup,
    LognormalStartup,
    StartupSampler,
    StartupTime,
    describe_startup,
    startup_quantile_s,
)

from .conftest import scenario, workload
from .test_autoscale import burst

PARSE = TypeAdapter(StartupTime)


def test_lognormal_draws_have_the_stated_median_and_p90_and_repeat_with_the_seed() -> None:
    spec = PARSE.validate_python({"kind": "lognormal", "p50_s": 90, "p90_s": 180})
    assert isinstance(spec, LognormalStartup)
    assert spec.quantile(0.5) == pytest.approx(90) and spec.quantile(0.9) == pytest.approx(180)
    first = StartupSampler(spec, seed=7)()
    sampler = StartupSampler(spec, seed=7)
    many = [sampler() for _ in range(20_000)]
    assert many[0] == first, "same seed, same first draw"
    cuts = statistics.quantiles(many, n=10)
    assert cuts[4] == pytest.approx(90, rel=0.03) and cuts[8] == pytest.approx(180, rel=0.04)
    other = StartupSampler(spec, seed=8)
    assert [other() for _ in range(5)] != many[:5]
    assert describe_startup(spec) == "lognormal cold starts (p50 90 s, p90 180 s)"


def test_empirical_draws_are_the_measured_seconds() -> None:
    samples = [60.0, 75.0, 90.0, 140.0, 300.0]
    spec = PARSE.validate_python({"kind": "empirical", "samples_s": samples})
    assert isinstance(spec, EmpiricalStartup)
    sampler = StartupSampler(spec, seed=0)
    draws = [sampler() for _ in range(200)]
    assert set(draws) == set(samples), "every sample drawn, nothing else"
    assert startup_quantile_s(spec) == 300.0 and spec.quantile(0.5) == 90.0
    assert "5 samples, p50 90 s, p90 300 s" in describe_startup(spec)


def test_a_fixed_time_is_every_start() -> None:
    sampler = StartupSampler(PARSE.validate_python(120), seed=0)
    assert {sampler() for _ in range(3)} == {120.0}
    assert startup_quantile_s(120.0) == 120.0 and describe_startup(120.0) == "120 s cold starts"


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({"kind": "lognormal", "p50_s": 90, "p90_s": 60}, "must be at least p50_s"),
        ({"kind": "empirical", "samples_s": []}, "at least 1 item"),
        ({"kind": "empirical", "samples_s": [10, -1]}, "finite seconds >= 0"),
        ({"kind": "gamma", "shape": 2}, "does not match any of the expected tags"),
        (-5, "greater than or equal to 0"),
    ],
)
def test_bad_start_times_are_refused_with_a_reason(value: object, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        PARSE.validate_python(value)


def test_a_scenario_runs_with_distributed_cold_starts_deterministically() -> None:
    startup = {"kind": "lognormal", "p50_s": 4.0, "p90_s": 12.0}
    config = {"policy": "shoal", "min_replicas": 1, "max_replicas": 8, "startup_s": startup, "interval_s": 1.0}
    # Shoal plans with the p90 start time.
    policy = AutoscaleConfig.model_validate(config).policy_config()
    assert policy.expected_start_s == pytest.approx(12.0)  # type: ignore[union-attr]

    def run() -> list[float]:
        simulation = Simulation(
            scenario(autoscale=config, sample_interval_s=1.0), policy_entry("least_load"), workload(*burst())
        )
        simulation.run()
        return [m.ready_s - m.created_s for m in simulation.members if m.created_s > 0]

    first = run()
    assert len(first) >= 2 and len(set(first)) == len(first), "each new replica draws its own start time"
    assert run() == first
