"""Engines unlike the router's model, each checked by hand on conftest's engine (10 ms a step, 1 ms a prefill token,
2 ms a decoding sequence): a fixed per-request overhead, a small batch limit, a slower replica, longer outputs, a
preset fitted to a bundled profile, and the router's opt-in inference of a batch limit."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from simulations.scenario import FleetVariant, Scenario, policy_entry
from simulations.simulation import RunResult, Simulation
from simulations.step_model import SimulatedEngineConfig, load_preset
from simulations.workload import Request, ScaledOutputWorkload

from .conftest import request, scenario, workload

ALONE_TTFT_S = 0.110
"""A 100-token prompt alone on an idle replica: one step of 0.01 + 100 x 0.001 s."""


def run(scn: Scenario, *requests: Request) -> RunResult:
    return Simulation(scn, policy_entry("round_robin"), workload(*requests)).run()


def test_a_request_overhead_adds_exactly_itself_to_ttft_on_an_idle_replica() -> None:
    plain = run(scenario(), request(0, 0.0, ((1, 100),), output_tokens=1))
    slow = run(scenario(fleet={"engine": {"request_overhead_s": 0.05}}), request(0, 0.0, ((1, 100),), output_tokens=1))
    assert plain.recorder.ttft_s[0] == pytest.approx(ALONE_TTFT_S)
    assert slow.recorder.ttft_s[0] == pytest.approx(ALONE_TTFT_S + 0.05)


def test_the_overhead_is_engine_time_paid_once_per_request() -> None:
    # Both arrive at 0; the first starts a step alone (0.11 + 0.05). The second is admitted in the next step, beside
    # the first's decode: 0.01 + 0.1 + 0.002 + 0.05. The decode steps after it pay none: 0.014 with both, then 0.012.
    scn = scenario(fleet={"engine": {"request_overhead_s": 0.05}})
    result = run(scn, request(0, 0.0, ((1, 100),), output_tokens=3), request(1, 0.0, ((2, 100),), output_tokens=3))
    assert result.recorder.ttft_s == pytest.approx([0.16, 0.322])
    assert result.recorder.e2e_s == pytest.approx([0.336, 0.348])


SERVING_LOOP = {"engine": {"step_overhead_s": 0.004, "output_overhead_s": 0.003}}
"""4 ms between steps, and 3 ms for each sequence that samples in a step."""


def test_the_serving_loop_costs_each_step_and_each_sequence_that_samples() -> None:
    scn = scenario(fleet=SERVING_LOOP)
    # The first alone: 0.01 + 0.1 + 0.004 + 0.003 = 0.117. The second's prefill beside the first's decode, both
    # sampling: 0.01 + 0.1 + 0.002 + 0.004 + 2 x 0.003 = 0.122. Then both decode (0.024), then the second alone (0.019).
    result = run(scn, request(0, 0.0, ((1, 100),), output_tokens=3), request(1, 0.0, ((2, 100),), output_tokens=3))
    assert result.recorder.ttft_s == pytest.approx([0.117, 0.239])
    assert result.recorder.e2e_s == pytest.approx([0.263, 0.282])


@pytest.mark.parametrize("steps_per_event", [1, 64])
def test_a_decode_run_pays_the_serving_loop_as_its_steps_would(steps_per_event: int) -> None:
    scn = scenario(fleet=SERVING_LOOP).model_copy(update={"decode_steps_per_event": steps_per_event})
    result = run(scn, request(0, 0.0, ((1, 100),), output_tokens=10))
    assert result.recorder.ttft_s[0] == pytest.approx(0.117)
    assert result.recorder.e2e_s[0] == pytest.approx(0.117 + 9 * (0.01 + 0.004 + 0.002 + 0.003))


def test_a_decode_run_cut_by_an_arrival_ends_where_single_steps_would() -> None:
    requests = (request(0, 0.0, ((1, 100),), output_tokens=10), request(1, 0.2, ((2, 100),), output_tokens=4))
    runs = [
        run(scenario(fleet=SERVING_LOOP).model_copy(update={"decode_steps_per_event": n}), *requests) for n in (1, 64)
    ]
    assert runs[1].recorder.ttft_s == pytest.approx(runs[0].recorder.ttft_s)
    assert runs[1].recorder.e2e_s == pytest.approx(runs[0].recorder.e2e_s)


def test_only_a_step_that_starts_an_idle_engine_pays_for_waking_it() -> None:
    scn = scenario(fleet={"engine": {"wake_s": 0.02}})
    # The first wakes the engine: 0.11 + 0.02. The second arrives during that step and joins the next one (beside
    # the first's decode: 0.112), which starts a busy engine. The third arrives at 5 s, to an idle engine again.
    requests = (
        request(0, 0.0, ((1, 100),), output_tokens=2),
        request(1, 0.05, ((2, 100),), output_tokens=2),
        request(2, 5.0, ((3, 100),), output_tokens=1),
    )
    result = run(scn, *requests)
    assert result.recorder.ttft_s == pytest.approx([0.13, 0.13 + 0.112 - 0.05, 0.13])


@pytest.mark.parametrize("steps_per_event", [1, 64])
def test_step_jitter_scales_each_step_by_a_seeded_draw_and_a_decode_run_by_the_mean(steps_per_event: int) -> None:
    fleet = {"engine": {"step_jitter": [0.5, 1.0, 2.0]}}
    scn = scenario(fleet=fleet).model_copy(update={"decode_steps_per_event": steps_per_event})
    requests = [request(i, 5.0 * i, ((i + 1, 100),), output_tokens=4) for i in range(12)]
    first, again = run(scn, *requests), run(scn, *requests)
    assert first.recorder.ttft_s == again.recorder.ttft_s  # the seed names the draws
    assert {round(t / ALONE_TTFT_S, 6) for t in first.recorder.ttft_s} == {0.5, 1.0, 2.0}
    if steps_per_event == 64:  # the three decode steps as one run: at the factors' mean, 7 / 6
        decode_s = [e - t for t, e in zip(first.recorder.ttft_s, first.recorder.e2e_s, strict=True)]
        assert decode_s == pytest.approx([3 * 0.012 * 7 / 6] * 12)
    with pytest.raises(ValidationError):
        SimulatedEngineConfig(num_kv_blocks=1, step_jitter=[1.0, 0.0])


def test_a_step_beside_a_busy_peer_lasts_longer_by_the_slowdown() -> None:
    scn = scenario(fleet={"num_replicas": 2, "engine": {"busy_peer_slowdown": 0.5}})
    # Round robin: the first starts on an idle fleet; the second, on the other replica, beside the first's step.
    # The third comes at 5 s, when both are idle again.
    requests = [request(0, 0.0, ((1, 100),), output_tokens=1), request(1, 0.0, ((2, 100),), output_tokens=1)]
    result = run(scn, *requests, request(2, 5.0, ((3, 100),), output_tokens=1))
    assert sorted(result.recorder.ttft_s) == pytest.approx([ALONE_TTFT_S, ALONE_TTFT_S, 1.5 * ALONE_TTFT_S])


def test_a_small_batch_limit_makes_a_request_wait_for_a_slot() -> None:
    requests = (request(0, 0.0, ((1, 100),), output_tokens=3), request(1, 0.0, ((2, 100),), output_tokens=3))
    both = run(scenario(fleet={"engine": {"max_num_seqs": 2}}), *requests)
    one = run(scenario(fleet={"engine": {"max_num_seqs": 1}}), *requests)
    # Two slots: the second is admitted in the step after the first's, beside its decode (0.01 + 0.1 + 0.002).
    assert both.recorder.ttft_s == pytest.approx([ALONE_TTFT_S, ALONE_TTFT_S + 0.112])
    # One slot: the second waits for the first's prefill (0.110) and two decode steps (0.012 each), then prefills.
    assert sorted(one.recorder.ttft_s) == pytest.approx([ALONE_TTFT_S, 0.134 + ALONE_TTFT_S])


def test_a_replica_with_step_time_factor_two_takes_twice_as_long() -> None:
    scn = scenario(fleet={"num_replicas": 2, "step_time_factors": [2.0]})
    # Round robin sends the first to r000 (2x), the second to r001; different prompts, no cache in play.
    result = run(scn, request(0, 0.0, ((1, 100),), output_tokens=3), request(1, 5.0, ((2, 100),), output_tokens=3))
    slow, fast = result.recorder.ttft_s
    assert fast == pytest.approx(ALONE_TTFT_S)
    assert slow == pytest.approx(2 * ALONE_TTFT_S)
    slow_e2e, fast_e2e = result.recorder.e2e_s
    assert slow_e2e - slow == pytest.approx(2 * (fast_e2e - fast))


def test_scaled_outputs_decode_that_many_more_tokens() -> None:
    base = workload(request(0, 0.0, ((1, 100),), output_tokens=3))
    scaled = ScaledOutputWorkload(base, 4.0)
    assert [r.output_tokens for r in scaled.requests()] == [12]
    result = Simulation(scenario(), policy_entry("round_robin"), scaled).run()
    assert result.recorder.e2e_s[0] == pytest.approx(ALONE_TTFT_S + 11 * 0.012)


def test_fleet_variants_cannot_scale_outputs_since_they_share_one_workload() -> None:
    with pytest.raises(ValidationError, match="output_scale"):
        FleetVariant(label="x", fleet={"output_scale": 2.0})


def test_the_bundled_profile_is_a_preset_fitted_by_name() -> None:
    preset = load_preset("shoal_demo_cpu")
    assert preset.name == "profile:shoal_demo_cpu"
    assert "fitted to" in preset.description
    assert (preset.engine.num_kv_blocks, preset.engine.max_num_batched_tokens) == (2048, 512)
    assert preset.step_model.step_s > 0 and preset.step_model.prefill_s_per_token > 0


@pytest.mark.parametrize("is_inferred", [False, True])
def test_the_router_infers_a_batch_limit_from_scrapes_only_when_asked(is_inferred: bool) -> None:
    scn = scenario(
        fleet={"engine": {"max_num_seqs": 2}},
        router={"scrape_interval_s": 0.05, "infer_max_num_seqs": is_inferred},
    )
    requests = [request(i, 0.0, ((i + 1, 100),), output_tokens=20) for i in range(6)]
    simulation = Simulation(scn, policy_entry("round_robin"), workload(*requests))
    simulation.run()
    assert simulation.router.state("r000").max_num_seqs == (2 if is_inferred else None)


@pytest.mark.parametrize("is_exported", [False, True])
def test_engines_that_export_their_batch_limit_tell_the_router_at_the_first_scrape(is_exported: bool) -> None:
    scn = scenario(
        fleet={"engine": {"max_num_seqs": 3, "exports_max_num_seqs": is_exported}},
        router={"scrape_interval_s": 0.05},
    )
    # One request at a time: no scrape ever sees a queue, so nothing could be inferred.
    requests = [request(i, 0.5 * i, ((i + 1, 100),), output_tokens=2) for i in range(2)]
    simulation = Simulation(scn, policy_entry("round_robin"), workload(*requests))
    simulation.run()
    assert simulation.router.state("r000").max_num_seqs == (3 if is_exported else None)
