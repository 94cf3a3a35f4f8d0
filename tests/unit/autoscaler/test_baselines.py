"""The HPA, KEDA and static baselines on a virtual clock, with figures worked out from the Kubernetes docs."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from autoscaler.policy import ScalingPolicyConfig
from autoscaler.policy.baselines import (
    BaselineReason,
    HPAConfig,
    HPAObservation,
    HPAState,
    KEDAConfig,
    KEDAObservation,
    KEDAState,
    StaticConfig,
    hpa_decide,
    keda_decide,
    static_decide,
)

HPA = HPAConfig(max_replicas=100)


def hpa_once(current: int, total: float, num_with_metric: int | None = None, config: HPAConfig = HPA) -> int:
    ready = current if num_with_metric is None else num_with_metric
    decision, _ = hpa_decide(HPAObservation(current, total, ready), HPAState(), config, now=0.0)
    return decision.target_replicas


def test_hpa_changes_nothing_within_the_ten_percent_tolerance() -> None:
    # 3 pods, target 8 each: 26 requests is a ratio of 1.083, inside the band; 27 is 1.125, outside.
    decision, _ = hpa_decide(HPAObservation(3, 26.0, 3), HPAState(), HPA, now=0.0)
    assert (decision.target_replicas, decision.reason) == (3, BaselineReason.WITHIN_TOLERANCE)
    assert hpa_once(3, 27.0) == 4  # ceil(27 / 8)


def test_hpa_acts_only_every_sync_period() -> None:
    decision, state = hpa_decide(HPAObservation(2, 16.0, 2), HPAState(), HPA, now=0.0)
    assert decision.reason is BaselineReason.WITHIN_TOLERANCE  # a ratio of exactly 1 is inside the band
    decision, state = hpa_decide(HPAObservation(2, 80.0, 2), state, HPA, now=14.9)
    assert (decision.target_replicas, decision.reason) == (2, BaselineReason.NOT_SYNCED)
    decision, _ = hpa_decide(HPAObservation(2, 80.0, 2), state, HPA, now=15.0)
    assert (decision.target_replicas, decision.reason) == (6, BaselineReason.SCALE_UP)  # 10 wanted, +4 allowed


def test_hpa_scale_up_rate_is_the_larger_of_four_pods_and_doubling_per_period() -> None:
    # 2 pods, 200 requests want 25: 4 pods beat 100% (2), so 6.
    decision, state = hpa_decide(HPAObservation(2, 200.0, 2), HPAState(), HPA, now=0.0)
    assert decision.target_replicas == 6 and decision.is_rate_limited
    # 15 s later the 4 new pods are still starting (no metric, counted as 0 for a scale-up): the ratio over all 6
    # pods is 200 / 48 = 4.17, still 25 wanted; the period restarted at 6 pods, and doubling (12) beats +4 (10).
    decision, state = hpa_decide(HPAObservation(6, 200.0, 2), state, HPA, now=15.0)
    assert decision.target_replicas == 12
    # Within the same period no further step: 12 is the period's start (6) doubled.
    decision, _ = hpa_decide(HPAObservation(12, 200.0, 2), state, HPA, now=29.0)
    assert decision.reason is BaselineReason.NOT_SYNCED
    assert hpa_once(10, 400.0) == 20  # 100% of 10


def test_hpa_counts_pods_without_a_metric_as_idle_when_scaling_up() -> None:
    # 4 pods, 2 ready carrying 20 requests (ratio 1.25 over the ready ones): the 2 starting ones count as 0, the
    # ratio over 4 becomes 0.625 and reverses the direction, so the HPA holds rather than adding pods.
    decision, _ = hpa_decide(HPAObservation(4, 20.0, 2), HPAState(), HPA, now=0.0)
    assert (decision.target_replicas, decision.reason) == (4, BaselineReason.WITHIN_TOLERANCE)
    # Far above target they dampen the step: 2 ready pods with 64 requests want 8 alone, with the 2 starting
    # counted as 0 the ratio is 64 / 32 = 2 over 4 pods: 8 (ceil(2 x 4)), not ceil(4 x 2) + 2.
    assert hpa_once(4, 64.0, num_with_metric=2) == 8


def test_hpa_counts_pods_without_a_metric_at_target_when_scaling_down() -> None:
    # 4 pods, 2 ready carrying 4 requests (ratio 0.25): the 2 starting ones count as 8 each, so the ratio over 4
    # is 20 / 32 = 0.625 and the recommendation 3, not 1. (The 300 s window then holds it; see below.)
    decision, _ = hpa_decide(HPAObservation(4, 4.0, 2), HPAState(), HPA, now=0.0)
    assert decision.recommended_replicas == 3


def test_hpa_scales_down_only_after_the_300_s_stabilization_window_then_all_at_once() -> None:
    state = HPAState()
    decision, state = hpa_decide(HPAObservation(10, 80.0, 10), state, HPA, now=0.0)
    assert decision.reason is BaselineReason.WITHIN_TOLERANCE  # a ratio of exactly 1 is inside the band
    t = 15.0
    while t < 300.0:
        decision, state = hpa_decide(HPAObservation(10, 8.0, 10), state, HPA, now=t)
        assert (decision.target_replicas, decision.reason) == (10, BaselineReason.STABILIZING), t
        t += 15.0
    # At 300 s the recommendation of 10 made at 0 s leaves the window; 100% per 15 s allows going straight to 1.
    decision, _ = hpa_decide(HPAObservation(10, 8.0, 10), state, HPA, now=300.0)
    assert (decision.target_replicas, decision.reason) == (1, BaselineReason.SCALE_DOWN)


def test_hpa_respects_min_and_max_and_does_nothing_without_metrics() -> None:
    config = HPAConfig(min_replicas=2, max_replicas=5)
    assert hpa_once(4, 400.0, config=config) == 5
    decision, _ = hpa_decide(HPAObservation(3, 0.0, 0), HPAState(), config, now=0.0)
    assert (decision.target_replicas, decision.reason) == (3, BaselineReason.NO_METRICS)


def test_keda_activates_from_zero_only_on_its_30_s_poll() -> None:
    state = KEDAState()
    decision, state = keda_decide(KEDAObservation(0, 0.0), state, KEDAConfig(), now=0.0)
    assert decision.target_replicas == 0
    for t in (5.0, 15.0, 29.9):
        decision, state = keda_decide(KEDAObservation(0, 3.0), state, KEDAConfig(), now=t)
        assert decision.target_replicas == 0, t
    decision, _ = keda_decide(KEDAObservation(0, 3.0), state, KEDAConfig(), now=30.0)
    assert (decision.target_replicas, decision.reason) == (1, BaselineReason.ACTIVATE)


def test_keda_scales_to_zero_after_the_300_s_cooldown_without_activity() -> None:
    config = KEDAConfig()
    state = KEDAState()
    decision, state = keda_decide(KEDAObservation(1, 2.0), state, config, now=0.0)
    t = 5.0
    while t < 300.0:
        decision, state = keda_decide(KEDAObservation(1, 0.0), state, config, now=t)
        assert decision.target_replicas == 1, t
        t += 5.0
    decision, _ = keda_decide(KEDAObservation(1, 0.0), state, config, now=300.0)
    assert (decision.target_replicas, decision.reason) == (0, BaselineReason.TO_ZERO)
    # With minReplicaCount 1 it never goes to zero.
    floor = KEDAConfig(min_replicas=1)
    state = KEDAState()
    for t in range(0, 900, 5):
        decision, state = keda_decide(KEDAObservation(1, 0.0), state, floor, now=float(t))
        assert decision.target_replicas == 1


def test_keda_feeds_the_hpa_an_external_average_value_metric() -> None:
    # External metric: desired = ceil(total / target) over every pod, starting ones included, no readiness
    # handling: 4 pods (all starting) and 40 requests want 5, where the Pods metric's HPA would have no metric.
    decision, _ = keda_decide(KEDAObservation(4, 40.0), KEDAState(), KEDAConfig(), now=0.0)
    assert decision.target_replicas == 5
    # Within 10% of 4 pods x 8: unchanged.
    decision, _ = keda_decide(KEDAObservation(4, 34.0), KEDAState(), KEDAConfig(), now=0.0)
    assert (decision.target_replicas, decision.reason) == (4, BaselineReason.WITHIN_TOLERANCE)


def test_static_holds_its_count_and_configs_stay_apart() -> None:
    assert static_decide(3, StaticConfig(replicas=7)).target_replicas == 7
    with pytest.raises(ValidationError):
        ScalingPolicyConfig.model_validate({"kind": "hpa"})
    with pytest.raises(ValidationError):
        HPAConfig(min_replicas=5, max_replicas=2)
