"""What a replica carries, from the fleet's figures: demand from arrivals, and a target learnt from TTFT."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from pydantic import ValidationError

from autoscaler.policy import (
    Action,
    CapacityConfig,
    Demand,
    Observation,
    Reason,
    ScalerState,
    ScalingPolicyConfig,
    Signal,
    decide,
    fleet_demand,
)
from autoscaler.policy.capacity import nominal_request_s, sized_demand
from tests.unit.autoscaler.virtual_fleet import VirtualFleet

ARRIVALS = ScalingPolicyConfig(max_replicas=20, target_ttft_s=2.0, capacity=CapacityConfig(from_arrivals=True))
LEARN = ScalingPolicyConfig(
    max_replicas=20,
    target_ttft_s=2.0,
    expected_start_s=60.0,
    capacity=CapacityConfig(from_arrivals=True, learn_target=True),
)


def load(arrivals_per_s: float, request_s: float, *, in_flight: float, ttft_s: float, waiting: float = 0) -> Demand:
    return fleet_demand(
        in_flight=in_flight,
        waiting=waiting,
        held=0,
        arrivals_per_s=arrivals_per_s,
        request_s=request_s,
        ttft_s=ttft_s,
    )


def test_the_nominal_request_time_follows_healthy_intervals_only() -> None:
    healthy = Demand(requests=1, request_s=10.0, ttft_s=0.5)
    assert nominal_request_s(None, healthy, ARRIVALS, elapsed_s=5.0) == 10.0  # the first reading, as it is
    # An interval of the window moves it 1 - 1/e of the way.
    moved = nominal_request_s(10.0, Demand(requests=1, request_s=20.0, ttft_s=0.5), ARRIVALS, elapsed_s=600.0)
    assert moved == pytest.approx(10.0 + 10.0 * (1 - math.exp(-1)))
    # An overloaded interval (TTFT over the 2 s target) and one where nothing finished leave it as it was.
    assert nominal_request_s(10.0, Demand(requests=1, request_s=40.0, ttft_s=3.0), ARRIVALS, elapsed_s=600) == 10.0
    assert nominal_request_s(10.0, Demand(requests=1, ttft_s=0.5), ARRIVALS, elapsed_s=600.0) == 10.0


def test_demand_from_arrivals_counts_the_queue_and_falls_back_to_in_flight() -> None:
    # 3 requests/s of 10 s keep 30 in flight at a healthy pace; the 12 waiting ones (queued or held) count on top.
    demand = load(3.0, 10.0, in_flight=55, waiting=12, ttft_s=0.5)
    assert sized_demand(demand, 10.0, ARRIVALS).requests == pytest.approx(42.0)
    # Without a nominal time yet, without measured arrivals, or with the option off: the requests in flight.
    assert sized_demand(demand, None, ARRIVALS).requests == 55
    assert sized_demand(Demand(requests=55), 10.0, ARRIVALS).requests == 55
    assert sized_demand(demand, 10.0, ARRIVALS.model_copy(update={"capacity": CapacityConfig()})).requests == 55


def test_an_overload_does_not_inflate_the_demand_from_arrivals() -> None:
    # Four replicas carry 3.2 requests/s of 10 s: 32 in flight, the target of 8 each. Then their batches slow to
    # 20 s a request: 64 in flight for the same arrivals, TTFT 3 s over its 2 s target.
    def healthy(t: float) -> Demand:
        return load(3.2, 10.0, in_flight=32, ttft_s=0.5)

    def slowed(t: float) -> Demand:
        return load(3.2, 20.0, in_flight=64, ttft_s=3.0)

    plain = ARRIVALS.model_copy(update={"capacity": CapacityConfig()})
    wanted = {}
    for name, config in (("arrivals", ARRIVALS), ("in flight", plain)):
        fleet = VirtualFleet(config, num_ready=4, start_s=60.0)
        fleet.run(120.0, healthy)
        assert fleet.size == 4
        slow_from = fleet.now
        fleet.run(240.0, slowed)
        wanted[name] = max(d.desired_by_signal[Signal.REQUESTS] for t, d in fleet.history if t >= slow_from)
    # In flight, the slowdown reads as twice the load. From arrivals the load is what it was (the TTFT breach
    # and the TTFT signal still grow the fleet: a queue can form while the figures look fine).
    assert wanted == {"in flight": 8, "arrivals": 4}


def knee(fleet: VirtualFleet, at_per_replica: float) -> Callable[[float], Demand]:
    """3.2 requests/s of 10 s (32 in flight), with TTFT 0.3 s up to `at_per_replica` per ready replica and
    3 s beyond: a replica's capacity the policy is not told."""

    def demand(t: float) -> Demand:
        per_replica = 32 / max(1, fleet.num_ready)
        return load(3.2, 10.0, in_flight=32, ttft_s=0.3 if per_replica <= at_per_replica else 3.0)

    return demand


def test_the_target_is_learnt_from_loads_carried_well() -> None:
    # Configured at 8 requests per replica (4 replicas for 32), replicas carry up to 12 within TTFT: 3 replicas
    # (10.7 each) do, 2 (16 each) would not.
    fleet = VirtualFleet(LEARN, num_ready=4, start_s=60.0)
    fleet.run(3600.0, knee(fleet, 12.0))
    targets = [d.target_requests_per_replica or 0.0 for _, d in fleet.history]
    assert targets[0] == 8.0 and targets == sorted(targets)
    # At 8 each the target may grow to 8 / 0.7 = 11.4, past 10.7: the fleet goes to 3 once the stabilization
    # window has passed. At 10.7 each it may grow to 15.2, short of the 16 at which 2 replicas would be asked
    # for: a step of +50% per replica is more than the 43% beyond a load carried well that a shrink may ask.
    assert fleet.actions() == [(772.0, Action.DOWN, 3)]
    assert max(targets) <= 32 / 3 / 0.7 and max(targets) > 32 / 3
    assert not any(d.reason is Reason.TTFT_BREACH for _, d in fleet.history)


def test_the_target_is_cut_where_ttft_breaks_below_it() -> None:
    # Configured at 16 (2 replicas for 32), replicas carry only 12. The first breach is on the fleet the policy
    # found (not one it settled on): no lesson; the replica it adds makes 3 (10.7 each, fine), so the target
    # stays 16, and once the stabilization window passes the fleet goes back to 2: a breach on a settled fleet,
    # which cuts the target to 12.8. From then on 3 replicas: the target grows to no more than 10.7 / 0.7, short
    # of the 16 at which 2 would be asked for again.
    config = LEARN.model_copy(update={"target_requests_per_replica": 16.0})
    fleet = VirtualFleet(config, num_ready=2, start_s=60.0)
    fleet.run(3600.0, knee(fleet, 12.0))
    cuts = [(t, d) for t, d in fleet.history if "requests per replica: TTFT" in d.detail]
    assert len(cuts) == 1 and "target 16.0 -> 12.8" in cuts[0][1].detail and cuts[0][1].current_replicas == 2
    late = [d for t, d in fleet.history if t >= 1500.0]
    assert {d.current_replicas for d in late} == {3}
    assert max(d.target_requests_per_replica or 0.0 for d in late) <= 32 / 3 / 0.7


def test_lightly_loaded_or_starting_fleets_teach_nothing() -> None:
    # Ten replicas for 32 requests (3.2 each, under 70% of the target of 8): low TTFT says nothing of capacity.
    light = VirtualFleet(LEARN, num_ready=10, start_s=60.0)
    light.run(600.0, lambda t: load(3.2, 10.0, in_flight=32, ttft_s=0.3))
    assert {d.target_requests_per_replica for _, d in light.history} == {8.0}
    # A breach while a replica is starting is the fleet being short of what it asked for, not a wrong target.
    state = ScalerState(previous_fleet=(5, 1))
    observation = Observation(load(3.2, 10.0, in_flight=32, ttft_s=5.0), num_ready=4, starting_since=(0.0,))
    decision, state = decide(observation, state, LEARN, now=1.0)
    assert decision.target_requests_per_replica == 8.0 and state.learnt_target == 8.0


def test_the_learnt_target_stays_within_its_bounds() -> None:
    # TTFT never rises, and the target may reach 1.25x the configured 8: it stops at 10, four replicas of 32.
    high = LEARN.model_copy(update={"capacity": LEARN.capacity.model_copy(update={"max_factor": 1.25})})
    fleet = VirtualFleet(high, num_ready=4, start_s=60.0)
    fleet.run(3600.0, lambda t: load(3.2, 10.0, in_flight=32, ttft_s=0.3))
    assert fleet.history[-1][1].target_requests_per_replica == 10.0 and fleet.size == 4
    # TTFT always over on a fleet at its ceiling: cut once per cold start down to a quarter, never below.
    low = VirtualFleet(LEARN.model_copy(update={"max_replicas": 4}), num_ready=4, start_s=60.0)
    low.run(3600.0, lambda t: load(3.2, 10.0, in_flight=32, ttft_s=9.0))
    targets = [d.target_requests_per_replica or 0.0 for _, d in low.history]
    assert min(targets) == 2.0 and targets == sorted(targets, reverse=True)


def test_learning_needs_a_ttft_target() -> None:
    with pytest.raises(ValidationError, match="learn_target needs target_ttft_s"):
        ScalingPolicyConfig(capacity=CapacityConfig(learn_target=True))
