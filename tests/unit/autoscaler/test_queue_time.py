"""Queue time as demand: held and engine-queued requests count, and a TTFT breach scales up at once."""

from __future__ import annotations

import math

import pytest

from autoscaler.policy import (
    Action,
    Demand,
    Observation,
    Reason,
    ScalerState,
    ScalingPolicyConfig,
    Signal,
    Window,
    decide,
    fleet_demand,
)
from tests.unit.autoscaler.virtual_fleet import VirtualFleet

CONFIG = ScalingPolicyConfig(max_replicas=20, target_ttft_s=2.0)


def test_held_and_engine_queued_requests_are_demand() -> None:
    # Held requests (no replica can take them) are requests, and waiting ones.
    demand = fleet_demand(in_flight=10, waiting=2, held=5)
    assert (demand.requests, demand.waiting) == (15, 7)
    # Engines that queue more than the routers count as waiting (other clients reach them): the excess is added.
    demand = fleet_demand(in_flight=10, waiting=2, held=5, engine_waiting=30)
    assert (demand.requests, demand.waiting) == (10 + 28 + 5, 30 + 5)
    # Engines that report less than the routers know of never lower them (a scrape behind the routers).
    demand = fleet_demand(in_flight=10, waiting=4, held=0, engine_waiting=1)
    assert (demand.requests, demand.waiting) == (10, 4)
    with pytest.raises(ValueError, match="held must be a count"):
        fleet_demand(in_flight=1, waiting=0, held=-1)
    with pytest.raises(ValueError, match="waiting must be a count"):
        fleet_demand(in_flight=1, waiting=math.nan, held=0)


def test_held_requests_alone_size_the_fleet() -> None:
    # Four ready replicas carry their target (8 each) and the routers hold 48 more at their in-flight limit:
    # 80 requests need 10 replicas, though every running batch is exactly at target.
    fleet = VirtualFleet(CONFIG, num_ready=4)
    decision = fleet.tick(fleet_demand(in_flight=32, waiting=0, held=48))
    assert decision.action is Action.UP and decision.signal is Signal.REQUESTS
    assert decision.desired_by_signal[Signal.REQUESTS] == 10


def test_a_queue_growing_behind_full_batches_scales_the_fleet() -> None:
    # The engines run 8 sequences each (the target) the whole time; their queues, fed by clients that reach them
    # directly, grow by 2 requests a second. A policy on running sequences would never move; this one follows
    # the queue, tick by tick.
    fleet = VirtualFleet(CONFIG, num_ready=4, start_s=30.0)
    fleet.run(90.0, lambda t: fleet_demand(in_flight=32, waiting=0, held=0, engine_waiting=0))
    assert fleet.size == 4
    grow_from = fleet.now

    def demand(t: float) -> Demand:
        queued = 2.0 * (t - grow_from)
        return fleet_demand(in_flight=32, waiting=0, held=0, engine_waiting=queued)

    fleet.run(grow_from + 120.0, demand)
    ups = [(t, d) for t, d in fleet.history if t >= grow_from and d.action is Action.UP]
    assert ups and all(d.signal is Signal.REQUESTS for _, d in ups)
    # Within 30 s of the queue appearing (60 requests queued) the fleet is growing, and it keeps up with it:
    # at the end (240 queued, 272 requests: 34 replicas wanted, 20 at most) it is at its ceiling.
    assert ups[0][0] - grow_from <= 30.0
    assert fleet.size == CONFIG.max_replicas


def steady(num_ready: int, load: float, config: ScalingPolicyConfig = CONFIG) -> VirtualFleet:
    fleet = VirtualFleet(config, num_ready=num_ready, start_s=60.0)
    fleet.run(90.0, lambda t: Demand(requests=load, ttft_s=0.5))
    assert fleet.size == num_ready, fleet.actions()
    return fleet


def test_a_ttft_breach_scales_up_within_one_interval() -> None:
    # Four replicas at their requests target, TTFT well within the 2 s SLO; then one interval's TTFT is 3 s.
    fleet = steady(4, 32)
    breach_at = fleet.now
    decision = fleet.tick(Demand(requests=32, ttft_s=3.0))
    assert decision.action is Action.UP and decision.target_replicas == 5
    assert (decision.reason, decision.window, decision.signal) == (Reason.TTFT_BREACH, Window.LATEST, Signal.TTFT)
    assert "breaches the 2 s target" in decision.detail
    # Averaged over the stable window, the same 3 s would not have moved the fleet: the breach rule did.
    averaged = ScalingPolicyConfig(max_replicas=20, target_ttft_s=2.0).model_copy(update={"target_ttft_s": None})
    quiet, _ = decide(Observation(Demand(requests=32, ttft_s=3.0), num_ready=4), steady(4, 32).state, averaged, now=90)
    assert quiet.action is Action.HOLD
    # The breach lasts while the new replica loads (60 s). Once the short window's average TTFT is over too, the
    # TTFT signal (4 ready x 3 s / 2 s = 6) sizes the fleet; replicas still starting count as capacity, so it
    # stops there instead of adding one per tick.
    fleet.now += 2.0
    fleet.run(breach_at + 58.0, lambda t: Demand(requests=32, ttft_s=3.0))
    assert fleet.num_ready == 4 and fleet.size == 6 and fleet.num_created == 2
    # The first is ready and TTFT is still over: the fleet grows again in that same interval.
    fleet.now = breach_at + 60.0
    decision = fleet.tick(Demand(requests=32, ttft_s=3.0))
    assert fleet.num_ready == 5 and decision.action is Action.UP and decision.target_replicas > 6


def test_a_breach_holds_off_scale_down_for_a_stable_window() -> None:
    fleet = steady(6, 48)
    fleet.tick(Demand(requests=48, ttft_s=2.5))
    assert fleet.size == 7
    # Demand falls away right after: panic mode, armed by the breach, removes nothing for a stable window.
    after = fleet.now
    fleet.now += 2.0
    fleet.run(after + CONFIG.stable_window_s - 2.0, lambda t: Demand(requests=4, ttft_s=0.3))
    assert all(d.action is not Action.DOWN for t, d in fleet.history if t > after)
    assert {d.reason for t, d in fleet.history if t > after} == {Reason.PANIC_HOLD}


def test_no_breach_without_a_target_or_at_zero() -> None:
    plain = ScalingPolicyConfig(max_replicas=20)
    decision, _ = decide(Observation(Demand(requests=8, ttft_s=30.0), num_ready=1), ScalerState(), plain, now=0.0)
    assert decision.reason is not Reason.TTFT_BREACH and decision.action is Action.HOLD
    # At zero there is no TTFT to breach; a waiting request wakes the fleet instead.
    zero = CONFIG.model_copy(update={"scale_to_zero": CONFIG.scale_to_zero.model_copy(update={"enabled": True})})
    decision, _ = decide(Observation(Demand(requests=1, waiting=1), num_ready=0), ScalerState(), zero, now=0.0)
    assert decision.reason is Reason.WAKE_FROM_ZERO and decision.target_replicas == 1
