"""Autoscaling policies driving the simulated fleet: deterministic, and they grow the fleet under a burst."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from simulations.scaling import FleetObservation, PolicyFleet
from simulations.scenario import Scenario, policy_entry
from simulations.simulation import Simulation

from .conftest import request, scenario, workload


def burst() -> list:
    # 1 request/s for 20 s, then 150 at 10 per second (each 500-token prompt is 0.5 s of prefill on the test
    # engine: one replica serves 2 per second), then quiet.
    calm = [request(i, float(i), ((i, 500),), output_tokens=10) for i in range(20)]
    burst = [request(20 + i, 20.0 + 0.1 * i, ((20 + i, 500),), output_tokens=10) for i in range(150)]
    return calm + burst


def autoscaled(policy: str, **autoscale: object) -> Scenario:
    return scenario(
        autoscale={"policy": policy, "min_replicas": 1, "max_replicas": 8, "startup_s": 5.0, "interval_s": 1.0}
        | autoscale,
        sample_interval_s=1.0,
    )


@pytest.mark.parametrize("policy", ["shoal", "hpa", "keda"])
def test_an_autoscaled_fleet_grows_under_a_burst_after_its_start_up(policy: str) -> None:
    simulation = Simulation(autoscaled(policy), policy_entry("least_load"), workload(*burst()))
    result = simulation.run()
    assert result.summary["requests"] == 170
    added = [m for m in simulation.members if m.created_s > 0]
    assert added, "the fleet never grew"
    assert all(m.created_s >= 20.0 and m.ready_s == pytest.approx(m.created_s + 5.0) for m in added)
    assert max(s.num_replicas for s in result.recorder.samples) > 1
    assert isinstance(simulation.scaling, PolicyFleet)
    assert simulation.scaling.reasons["scale_up"] >= 1


def test_an_autoscaled_run_is_deterministic_with_a_seed() -> None:
    runs = [Simulation(autoscaled("shoal"), policy_entry("least_load"), workload(*burst())).run() for _ in range(2)]
    assert list(runs[0].recorder.ttft_s) == list(runs[1].recorder.ttft_s)
    assert runs[0].summary["replica_seconds"] == runs[1].summary["replica_seconds"]
    assert [s.num_replicas for s in runs[0].recorder.samples] == [s.num_replicas for s in runs[1].recorder.samples]


def test_the_static_policy_starts_and_stays_at_its_count() -> None:
    simulation = Simulation(autoscaled("static", static_replicas=3), policy_entry("least_load"), workload(*burst()))
    result = simulation.run()
    assert len(simulation.members) == 3 and all(m.created_s == 0.0 for m in simulation.members)
    assert result.summary["replica_seconds"] == pytest.approx(3 * result.summary["duration_s"])


def test_autoscale_and_a_schedule_cannot_both_drive_the_fleet() -> None:
    with pytest.raises(ValidationError):
        scenario(autoscale={"policy": "hpa"}, scaling={"kind": "schedule", "steps": [[0.0, 1]]})
    with pytest.raises(ValidationError):
        scenario(autoscale={"policy": "shoal", "hpa": {"no_such_knob": 1}})


def test_metric_lag_delays_what_the_policy_sees_of_a_burst() -> None:
    from simulations.scaling import AutoscaleConfig, FleetObservation, PolicyFleet

    def tick(now: float, in_flight: int) -> FleetObservation:
        return FleetObservation(
            now_s=now,
            num_ready=2,
            num_starting=0,
            num_draining=0,
            in_flight=in_flight,
            router_waiting=0,
            held=0,
            engine_running=0,
            engine_waiting=0,
            mean_kv_usage=0.0,
            arrivals_per_s=0.0,
        )

    def first_scale_up(lag_s: float) -> float:
        config = AutoscaleConfig(policy="hpa", target_requests_per_replica=8.0, metric_lag_s=lag_s, max_replicas=8)
        fleet = PolicyFleet(config)
        for step in range(40):
            now = 5.0 * step
            # Idle until t=50, then 48 requests in flight (6 replicas' worth) from then on.
            if fleet.desired_replicas(tick(now, 48 if now >= 50.0 else 0)) > 2:
                return now
        raise AssertionError("never scaled up")

    prompt, lagged = first_scale_up(0.0), first_scale_up(30.0)
    assert prompt < 50.0 + 15.0 + 5.0  # the HPA's 15 s sync period
    assert lagged >= prompt + 30.0


def test_the_routers_ttft_reaches_shoals_breach_rule_within_one_tick() -> None:
    from simulations.scaling import AutoscaleConfig, FleetObservation, PolicyFleet

    def tick(now: float, ttfts_s: tuple[float, ...]) -> FleetObservation:
        return FleetObservation(
            now_s=now,
            num_ready=2,
            num_starting=0,
            num_draining=0,
            in_flight=4,
            router_waiting=0,
            held=0,
            engine_running=4,
            engine_waiting=0,
            mean_kv_usage=0.0,
            arrivals_per_s=1.0,
            ttfts_s=ttfts_s,
        )

    config = AutoscaleConfig(policy="shoal", target_requests_per_replica=8.0, shoal={"target_ttft_s": 2.0})
    fleet = PolicyFleet(config)
    # Nine first tokens within the target and one far over it: the p90 (nearest rank) is within it. Two over it:
    # the p90 is 30 s, and the next tick grows the fleet.
    assert fleet.desired_replicas(tick(0.0, (0.5,) * 9 + (30.0,))) == 2
    assert fleet.reasons["scale_up"] == fleet.reasons["ttft_breach"] == 0
    assert (fleet.desired_replicas(tick(5.0, (0.5,) * 8 + (30.0, 30.0))) or 0) > 2
    assert fleet.reasons["scale_up"] + fleet.reasons["ttft_breach"] == 1


def test_a_simulated_queue_shows_as_ttft_in_the_observation() -> None:
    class Recording:
        """A driver that never scales and keeps what it was shown."""

        interval_s = 1.0

        def __init__(self) -> None:
            self.ttfts_s: list[float] = []

        def desired_replicas(self, observation: FleetObservation) -> int | None:
            self.ttfts_s.extend(observation.ttfts_s)
            return None

    simulation = Simulation(autoscaled("shoal"), policy_entry("least_load"), workload(*burst()))
    driver = Recording()
    simulation.scaling = driver
    result = simulation.run()
    # Every first token is shown once, at the tick after it, with the TTFT the recorder keeps.
    assert sorted(driver.ttfts_s) == pytest.approx(sorted(result.recorder.ttft_s))
