"""The scaling policy on a virtual clock: one test per behaviour of issue 4's policy section."""

from __future__ import annotations

import itertools

import pytest
from pydantic import BaseModel, ValidationError

from autoscaler.policy import (
    Action,
    Cap,
    Demand,
    MetricsConfig,
    Observation,
    PanicConfig,
    Reason,
    ScaleDecision,
    ScaleDownConfig,
    ScalerState,
    ScaleToZeroConfig,
    ScaleUpConfig,
    ScalingPolicyConfig,
    Signal,
    Window,
    decide,
)
from autoscaler.policy import config as config_module
from tests.unit.autoscaler.virtual_fleet import VirtualFleet, requests

DEFAULT = ScalingPolicyConfig(max_replicas=20)


def steady_fleet(num_ready: int, load: float, config: ScalingPolicyConfig = DEFAULT, **kw: float) -> VirtualFleet:
    """A fleet of `num_ready` replicas that has carried `load` requests for a stable window and a half."""
    fleet = VirtualFleet(config, num_ready=num_ready, **kw)
    fleet.run(config.stable_window_s * 1.5, lambda t: requests(load))
    assert fleet.size == num_ready, fleet.actions()
    return fleet


def test_burst_with_slow_cold_starts_does_not_cascade() -> None:
    # 80 requests need 10 replicas; each new one takes 120 s to load. Starting replicas are capacity on its way,
    # so the fleet goes 1 -> 5 (the rate cap) -> 10 and stays there, although none is ready for two minutes.
    # HPA's rule (a step per period, whatever is starting): the second step follows the first by a period.
    hpa_rule = DEFAULT.model_copy(update={"scale_up": ScaleUpConfig(is_step_from_ready=False)})
    fleet = VirtualFleet(hpa_rule, start_s=120.0, num_ready=1)
    fleet.run(400.0, lambda t: requests(80))
    assert fleet.actions() == [(0.0, Action.UP, 5), (16.0, Action.UP, 10)]
    assert fleet.num_created == 9
    assert fleet.num_ready == 10 and not fleet.starting
    # While they loaded, the policy kept saying why it held: at its target, with the burst still on.
    holds = [d for t, d in fleet.history if 16 < t < 136]
    assert {d.reason for d in holds} == {Reason.AT_TARGET}
    assert all(d.current_replicas == 10 for d in holds)


def test_a_scale_up_step_waits_for_the_previous_one_to_serve() -> None:
    # The default: the step is measured from the ready replicas, so the second step (5 -> 10) comes once the
    # first four are ready, and the policy says meanwhile that the rate cap holds it.
    fleet = VirtualFleet(DEFAULT, start_s=120.0, num_ready=1)
    fleet.run(400.0, lambda t: requests(80))
    assert fleet.actions() == [(0.0, Action.UP, 5), (120.0, Action.UP, 10)]
    assert fleet.num_created == 9
    assert fleet.num_ready == 10 and not fleet.starting
    held = [d for t, d in fleet.history if 0 < t < 120]
    assert held and all(d.reason is Reason.SCALE_UP and d.cap is Cap.SCALE_UP_RATE for d in held)
    assert all(d.target_replicas == d.current_replicas == 5 and d.recommended_replicas == 10 for d in held)


def test_sawtooth_load_does_not_flap() -> None:
    # Load swings between 8 and 40 requests every minute for half an hour. The fleet grows once to the peak's
    # size and holds; it never shrinks between peaks.
    fleet = VirtualFleet(DEFAULT, start_s=60.0, num_ready=1)
    fleet.run(1800.0, lambda t: requests(40 if int(t // 60) % 2 == 0 else 8))
    actions = fleet.actions()
    assert [a for _, a, _ in actions] == [Action.UP]
    assert fleet.size == 5
    # Once the sawtooth stops at the low level (its last peak ended at 1740 s), the fleet comes down only after
    # the stabilization window, and only down.
    fleet.run(3000.0, lambda t: requests(8))
    downs = fleet.actions(since=1800.0)
    assert downs and all(a == Action.DOWN for _, a, _ in downs)
    assert downs[0][0] >= 1740.0 + DEFAULT.scale_down.stabilization_window_s
    assert fleet.size == 1


def test_panic_engages_on_a_burst_and_releases_after_a_stable_window() -> None:
    fleet = steady_fleet(4, 32)
    burst_start = fleet.now
    fleet.run(burst_start + 10.0, lambda t: requests(100))
    # The 6 s panic window sees the burst on its second tick: 10 replicas wanted, 2.5x the 4 ready.
    t_panic, first = next((t, d) for t, d in fleet.history if t >= burst_start and d.is_panicking)
    assert t_panic == burst_start + 2.0
    assert first.window is Window.PANIC and first.action is Action.UP and first.target_replicas == 8
    assert first.cap is Cap.SCALE_UP_RATE
    assert fleet.size == 8
    last_burst_tick = fleet.history[-1][0]

    fleet.run(last_burst_tick + 200.0, lambda t: requests(32))
    after = [(t, d) for t, d in fleet.history if t > last_burst_tick]
    panicking = [t for t, d in after if d.is_panicking]
    # The short window still holds the burst for a few seconds; panic then lasts one stable window.
    assert max(panicking) < last_burst_tick + DEFAULT.panic.window_s + DEFAULT.stable_window_s
    assert max(panicking) >= last_burst_tick + DEFAULT.stable_window_s - 2.0
    assert all(d.action is not Action.DOWN for t, d in after if d.is_panicking)
    assert {d.reason for t, d in after if d.is_panicking and t > last_burst_tick + 10} == {Reason.PANIC_HOLD}
    # Released: the lower recommendation now waits out the stabilization window instead.
    released = [d for t, d in after if not d.is_panicking]
    assert released and {d.reason for d in released} == {Reason.STABILIZING}
    assert all(d.window is Window.STABILIZATION for d in released)


def test_panic_sizes_on_the_short_window_and_stable_mode_on_the_long_one() -> None:
    no_panic = DEFAULT.model_copy(update={"panic": PanicConfig(enabled=False)})
    calm = steady_fleet(4, 32, no_panic)
    calm.run(calm.now + 6.0, lambda t: requests(100))
    # Three ticks of 100 requests move the 60 s average to ~39: 5 replicas, on the stable window.
    decision = calm.history[-1][1]
    assert decision.window is Window.STABLE and calm.size == 5
    hot = steady_fleet(4, 32)
    hot.run(hot.now + 6.0, lambda t: requests(100))
    decision = hot.history[-1][1]
    assert decision.window is Window.PANIC and hot.size == 8


def test_idle_fleet_goes_to_zero_and_the_first_waiting_request_wakes_it() -> None:
    config = DEFAULT.model_copy(update={"scale_to_zero": ScaleToZeroConfig(enabled=True, idle_s=600.0)})
    fleet = steady_fleet(2, 16, config)
    idle_from = fleet.now - 2.0  # the last busy tick
    fleet.run(idle_from + 1000.0, lambda t: requests(0))
    zero = [(t, d) for t, d in fleet.history if d.reason is Reason.SCALE_TO_ZERO]
    assert len(zero) == 1
    t_zero, d_zero = zero[0]
    assert idle_from + 600.0 <= t_zero <= idle_from + 604.0
    assert d_zero.target_replicas == 0 and d_zero.window is Window.IDLE
    assert fleet.size == 0
    assert {d.reason for t, d in fleet.history if t > t_zero} == {Reason.IDLE_AT_ZERO}

    # A request held by the router (waiting, nothing in flight yet) wakes the fleet at once.
    decision = fleet.tick(Demand(requests=1, waiting=1))
    assert decision.reason is Reason.WAKE_FROM_ZERO
    assert decision.action is Action.UP and decision.target_replicas == 1


def test_scale_to_zero_never_removes_a_replica_that_is_still_starting() -> None:
    config = DEFAULT.model_copy(update={"scale_to_zero": ScaleToZeroConfig(enabled=True, idle_s=60.0)})
    fleet = VirtualFleet(config, num_ready=1, start_s=300.0)
    fleet.run(100.0, lambda t: requests(0))
    assert fleet.size == 0
    decision = fleet.tick(Demand(requests=1, waiting=1))
    assert decision.reason is Reason.WAKE_FROM_ZERO
    fleet.now += 2.0
    fleet.run(fleet.now + 200.0, lambda t: requests(0))  # the request went away; the replica still loads
    assert fleet.size == 1 and len(fleet.starting) == 1
    assert all(d.target_replicas == 1 for t, d in fleet.history[-50:])


def test_scale_to_zero_is_off_by_default() -> None:
    fleet = steady_fleet(3, 24)
    fleet.run(fleet.now + 3600.0, lambda t: requests(0))
    assert fleet.size == DEFAULT.min_replicas == 1
    assert all(d.reason is not Reason.SCALE_TO_ZERO for _, d in fleet.history)


def test_missing_or_stale_metrics_never_scale_down_and_say_so() -> None:
    fleet = steady_fleet(5, 40)
    start = fleet.now
    # The routers stop answering for far longer than the stabilization window.
    fleet.run(start + 1000.0, lambda t: None)
    assert fleet.size == 5
    reasons = [d.reason for t, d in fleet.history if t >= start]
    hold_after = DEFAULT.metrics.hold_after_failures
    assert reasons[: hold_after - 1] == [Reason.METRICS_STALE] * (hold_after - 1)
    assert set(reasons[hold_after - 1 :]) == {Reason.METRICS_UNAVAILABLE}
    assert "no figures from the routers" in fleet.history[-1][1].detail
    assert fleet.history[-1][1].window is Window.NONE
    # Figures that arrive but are old count the same: a zero that is a minute old is no reason to shrink.
    fleet.run(fleet.now + 1000.0, lambda t: requests(0), metrics_age_s=60.0)
    assert fleet.size == 5
    assert "60 s old" in fleet.history[-1][1].detail
    # Fresh figures again: the count of failures resets and the fleet shrinks (stabilized, step by step).
    decision = fleet.tick(requests(0))
    assert decision.reason is Reason.STABILIZING
    assert fleet.state.failed_observations == 0


def test_metrics_fallback_only_raises_the_fleet() -> None:
    config = DEFAULT.model_copy(update={"metrics": MetricsConfig(hold_after_failures=2, fallback_replicas=7)})
    fleet = steady_fleet(3, 24, config)
    first = fleet.tick(None)
    assert first.reason is Reason.METRICS_STALE and first.action is Action.HOLD
    fleet.now += 2.0
    second = fleet.tick(None)
    assert second.reason is Reason.METRICS_UNAVAILABLE
    assert second.target_replicas == 7 and second.cap is Cap.FALLBACK
    low = config.model_copy(update={"metrics": MetricsConfig(hold_after_failures=1, fallback_replicas=1)})
    big = steady_fleet(4, 32, low)
    decision = big.tick(None)
    assert decision.reason is Reason.METRICS_UNAVAILABLE and decision.target_replicas == 4


def test_rate_caps_scale_up_and_scale_down() -> None:
    # Up: max(4 replicas, 100%) per 15 s. From 2 to a demand of 40: 2 -> 6 -> 12 -> 24 -> 40 (max 40).
    config = ScalingPolicyConfig(max_replicas=40)
    fleet = VirtualFleet(config, num_ready=2, start_s=10.0)
    fleet.run(100.0, lambda t: requests(8 * 40))
    ups = fleet.actions()
    assert [target for _, _, target in ups] == [6, 12, 24, 40]
    assert [t for t, _, _ in ups] == [0.0, 16.0, 32.0, 48.0]
    capped = [d for _, d in fleet.history if d.cap is Cap.SCALE_UP_RATE]
    assert capped and all(d.recommended_replicas == 40 for d in capped)

    # Down: max(1 replica, 10%) per 30 s once stabilized. 40 -> 36 -> 33 -> 30 -> ...
    quiet_from = fleet.now
    fleet.run(quiet_from + config.scale_down.stabilization_window_s + 300.0, lambda t: requests(0))
    downs = fleet.actions(since=quiet_from)
    assert downs[0][0] >= quiet_from + config.scale_down.stabilization_window_s
    assert [target for _, _, target in downs[:3]] == [36, 32, 28]
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(downs)]
    assert all(gap >= config.scale_down.period_s for gap in gaps)


def test_scale_down_step_is_configurable() -> None:
    # A short stable window, so the recommendation drops to the floor at once and the step alone paces the fall.
    config = DEFAULT.model_copy(
        update={
            "stable_window_s": 6.0,
            "scale_down": ScaleDownConfig(stabilization_window_s=60.0, max_replicas=1, max_percent=0, period_s=10),
        }
    )
    fleet = steady_fleet(6, 48, config)
    last_busy = fleet.now - 2.0
    fleet.run(fleet.now + 200.0, lambda t: requests(0))
    downs = fleet.actions()
    assert all(a is Action.DOWN for _, a, _ in downs)
    assert [target for _, _, target in downs] == [5, 4, 3, 2, 1]
    assert downs[0][0] == last_busy + 60.0
    assert [b[0] - a[0] for a, b in itertools.pairwise(downs)] == [10.0] * 4
    down_decisions = [d for _, d in fleet.history if d.action is Action.DOWN]
    assert all(d.cap is Cap.SCALE_DOWN_RATE for d in down_decisions[:-1])
    assert down_decisions[-1].cap is Cap.MIN_REPLICAS  # the floor, not the step, ends the fall


def test_without_a_stabilization_window_scale_down_follows_at_once() -> None:
    config = DEFAULT.model_copy(
        update={"stable_window_s": 6.0, "scale_down": ScaleDownConfig(stabilization_window_s=0, max_percent=100)}
    )
    fleet = steady_fleet(4, 32, config)
    start = fleet.now
    fleet.run(start + 20.0, lambda t: requests(8))
    downs = fleet.actions()
    assert downs and downs[0][0] <= start + 6.0  # as soon as the 6 s average falls
    assert fleet.size == 1


def test_tolerance_band() -> None:
    fleet = steady_fleet(10, 80)
    decision = fleet.tick(requests(80))
    assert decision.reason is Reason.AT_TARGET
    fleet.run(fleet.now + 120.0, lambda t: requests(86))  # 10.75 replicas: 7.5% above 10
    assert fleet.size == 10
    assert fleet.history[-1][1].reason is Reason.WITHIN_TOLERANCE
    assert fleet.history[-1][1].desired_by_signal == {Signal.REQUESTS: 11}
    fleet.run(fleet.now + 120.0, lambda t: requests(92))  # 11.5 replicas: 15% above 10, 4.5% above 11
    assert fleet.size == 11
    assert fleet.history[-1][1].reason is Reason.WITHIN_TOLERANCE
    fleet = steady_fleet(10, 80)
    past_window_s = DEFAULT.scale_down.stabilization_window_s + 300.0
    fleet.run(fleet.now + past_window_s, lambda t: requests(73))  # 9.1 replicas: 9% below
    assert fleet.size == 10
    fleet.run(fleet.now + past_window_s, lambda t: requests(70))  # 8.75 replicas: 12.5% below
    assert fleet.size == 9


def test_starting_replicas_past_their_deadline_count_as_failed_and_are_replaced() -> None:
    fleet = VirtualFleet(DEFAULT, num_ready=1, start_s=float("inf"))
    fleet.run(10.0, lambda t: requests(16))  # 2 replicas: one is started, and never becomes ready
    assert fleet.size == 2 and len(fleet.starting) == 1
    started_at = fleet.starting[0]
    fleet.run(started_at + DEFAULT.start_deadline_s + 1.0, lambda t: requests(16))
    overdue = [(t, d) for t, d in fleet.history if d.num_overdue]
    assert overdue, "the stuck replica was never declared failed"
    t_fail, decision = overdue[0]
    assert t_fail >= started_at + DEFAULT.start_deadline_s
    assert decision.current_replicas == 1 and decision.action is Action.UP and decision.target_replicas == 2
    assert "past their start deadline" in decision.detail
    # Before the deadline it counted as capacity: no second replica was started.
    assert fleet.num_created == 2


def test_every_decision_carries_its_reason_signal_window_and_cap() -> None:
    config = ScalingPolicyConfig(max_replicas=6, target_prefill_backlog_tokens_per_replica=4000)
    fleet = VirtualFleet(config, num_ready=1)
    decision = fleet.tick(Demand(requests=4, waiting=4, prefill_backlog_tokens=40_000))
    assert decision.signal is Signal.PREFILL_BACKLOG
    assert decision.desired_by_signal == {Signal.REQUESTS: 1, Signal.PREFILL_BACKLOG: 10}
    assert decision.reason is Reason.SCALE_UP and decision.window is Window.PANIC
    assert decision.recommended_replicas == 6 and decision.cap is Cap.SCALE_UP_RATE  # max 6, then 1 + 4
    assert decision.target_replicas == 5
    assert "prefill backlog tokens over the panic window" in decision.detail
    assert "capped by scale_up_rate" in decision.detail
    fleet.now += fleet.start_s  # the step is measured from ready replicas: the first four serve now
    decision = fleet.tick(Demand(requests=4, waiting=4, prefill_backlog_tokens=40_000))
    assert decision.target_replicas == 6 and decision.cap is Cap.MAX_REPLICAS


def test_kv_usage_and_ttft_signals() -> None:
    config = ScalingPolicyConfig(max_replicas=20, target_kv_usage_per_replica=0.8, target_ttft_s=0.5)
    fleet = steady_fleet(4, 8, config)  # requests alone want 1 replica
    observation = Observation(Demand(requests=8, kv_usage=3.6), num_ready=4)
    decision, _ = decide(observation, fleet.state, config, now=fleet.now)
    assert decision.signal is Signal.KV_USAGE and decision.desired_by_signal[Signal.KV_USAGE] == 5
    observation = Observation(Demand(requests=8, kv_usage=1.0, ttft_s=1.0), num_ready=4)
    decision, _ = decide(observation, fleet.state, config, now=fleet.now)
    assert decision.signal is Signal.TTFT and decision.desired_by_signal[Signal.TTFT] == 8


def test_min_replicas_is_held_and_a_fleet_below_it_is_refilled() -> None:
    config = ScalingPolicyConfig(min_replicas=2, max_replicas=5)
    decision, _ = decide(Observation(requests(0), num_ready=0), ScalerState(), config, now=0.0)
    assert decision.action is Action.UP and decision.target_replicas == 2
    assert decision.reason is Reason.SCALE_UP and decision.cap is Cap.MIN_REPLICAS
    decision, _ = decide(Observation(None, num_ready=1), ScalerState(), config, now=0.0)
    assert decision.target_replicas == 2 and decision.reason is Reason.METRICS_STALE


def test_decide_is_pure() -> None:
    state = ScalerState()
    observation = Observation(requests(50), num_ready=2, starting_since=(0.0,))
    first = decide(observation, state, DEFAULT, now=5.0)
    again = decide(observation, state, DEFAULT, now=5.0)
    assert first == again
    assert state == ScalerState()


def test_config_fields_document_themselves_and_reject_unknowns() -> None:
    models: list[type[BaseModel]] = [
        v for v in vars(config_module).values() if isinstance(v, type) and issubclass(v, BaseModel)
    ]
    for model in models:
        for name, info in model.model_fields.items():
            if name != "kind" and model is not config_module._Config:
                assert info.description, f"{model.__name__}.{name} has no docstring"
    with pytest.raises(ValidationError):
        ScalingPolicyConfig.model_validate({"max_replica": 3})
    with pytest.raises(ValidationError):
        ScalingPolicyConfig(min_replicas=5, max_replicas=2)
    config = ScalingPolicyConfig.model_validate({"scale_to_zero": {"enabled": True, "idle_s": 30}})
    assert config.scale_to_zero.idle_s == 30 and config.target_requests_per_replica == 8


def test_the_window_forgets_what_a_fleet_short_of_its_replicas_measured() -> None:
    # 2 replicas carry 16 requests; 4 more start and, while they load, the 2 read 80 in flight (their batches
    # slow). Once the 6 serve, 16 again: the readings made while they started are not kept, so the window lets the
    # fleet shrink at once; kept (HPA's way), they hold it for the whole window.
    def after_the_start(config: ScalingPolicyConfig) -> ScaleDecision:
        state = ScalerState()
        _, state = decide(Observation(requests(16), num_ready=2), state, config, now=0.0)
        starting = Observation(requests(80), num_ready=2, starting_since=(1.0,) * 4)
        for now in (5.0, 60.0, 115.0):
            _, state = decide(starting, state, config, now=now)
        decision, _ = decide(Observation(requests(16), num_ready=6), state, config, now=200.0)
        return decision

    forgotten = after_the_start(DEFAULT)
    assert forgotten.action is Action.DOWN and forgotten.reason is Reason.SCALE_DOWN
    kept = after_the_start(DEFAULT.model_copy(update={"scale_down": ScaleDownConfig(is_kept_while_starting=True)}))
    assert kept.action is Action.HOLD and kept.reason is Reason.STABILIZING
