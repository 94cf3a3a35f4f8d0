"""Speculative decoding in the simulator: the acceptance law, the step-time formula, the adaptive rule, and whole
runs (by hand on the engine of conftest.scenario: 10 ms a step, 1 ms a prefill token, 2 ms a decoding sequence)."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from pydantic import ValidationError

from simulations.scenario import Scenario, build_workload, policy_entry
from simulations.simulation import RunResult, Simulation
from simulations.speculation import acceptance_rate, accepted_drafts, mean_tokens_per_step
from simulations.step_model import SpeculationConfig, StepModel
from simulations.workload import Request

from .conftest import request, scenario, workload

# The drafter of the by-hand cases: 3 ms a speculative step and 0.5 ms per decoding sequence.
DRAFTER = {"draft_step_s": 0.003, "draft_s_per_seq": 0.0005}


def spec(k: int = 4, tau: float | None = 3.0, **extra: Any) -> dict[str, Any]:
    return {"num_speculative_tokens": k, "mean_acceptance_length": tau, **DRAFTER, **extra}


def run(scn: Scenario, *requests: Request) -> RunResult:
    return Simulation(scn, policy_entry("round_robin"), workload(*requests)).run()


# ---- The acceptance law ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 4, 7])
def test_alpha_at_the_ends_of_tau(k: int) -> None:
    assert acceptance_rate(k, 1.0) == 0.0
    assert acceptance_rate(k, k + 1.0) == 1.0


@pytest.mark.parametrize(
    ("k", "tau", "alpha"),
    [
        (1, 1.6, 0.6),  # tau = 1 + alpha
        (2, 1.75, 0.5),  # 1 + 0.5 + 0.25
        (3, 1 + 0.9 + 0.81 + 0.729, 0.9),
    ],
)
def test_alpha_in_between_solves_the_mean(k: int, tau: float, alpha: float) -> None:
    assert acceptance_rate(k, tau) == pytest.approx(alpha, abs=1e-9)


@pytest.mark.parametrize("tau", [0.5, 5.5])
def test_tau_outside_one_to_k_plus_one_is_refused(tau: float) -> None:
    with pytest.raises(ValueError, match=r"\[1, 5\]"):
        acceptance_rate(4, tau)
    with pytest.raises(ValidationError):
        SpeculationConfig.model_validate(spec(4, tau))


@pytest.mark.parametrize(("k", "tau"), [(4, 3.0), (4, 1.5), (2, 2.9), (7, 4.0)])
def test_many_draws_average_tau_and_follow_the_truncated_geometric_law(k: int, tau: float) -> None:
    alpha = acceptance_rate(k, tau)
    rng = random.Random(7)
    n = 40_000
    draws = [accepted_drafts(rng.random(), alpha, k) for _ in range(n)]
    assert min(draws) >= 0 and max(draws) <= k
    # E[A] = sum_j P(A >= j) and E[A^2] = sum_j (2j - 1) P(A >= j), with P(A >= j) = alpha^j: 4 standard errors.
    variance = sum((2 * j - 1) * alpha**j for j in range(1, k + 1)) - (tau - 1) ** 2
    assert 1 + sum(draws) / n == pytest.approx(tau, abs=4 * math.sqrt(variance / n))
    for j in range(1, k + 1):
        p = alpha**j
        share = sum(1 for a in draws if a >= j) / n
        assert share == pytest.approx(p, abs=4 * math.sqrt(p * (1 - p) / n) + 1e-12), j


def test_mean_tokens_per_step_is_the_closed_form() -> None:
    assert mean_tokens_per_step(4, 0.5) == pytest.approx((1 - 0.5**5) / (1 - 0.5))
    assert mean_tokens_per_step(4, 1.0) == 5.0


# ---- The step time ----------------------------------------------------------------------------------------------

MODEL = StepModel(
    step_s=0.01,
    prefill_s_per_token=0.001,
    decode_s_per_seq=0.002,
    kv_read_s_per_token=1e-6,
    attention_s_per_token_pair=1e-8,
)


def test_a_speculative_step_adds_verified_positions_their_attention_and_the_drafter() -> None:
    config = SpeculationConfig.model_validate(spec(k=2))
    # 50 prefill tokens (1,000 pairs) beside 3 decoding sequences of 100 computed tokens each; 400 KV tokens read.
    # Each sequence's 2 drafts come after 101 tokens: 2 * 101 + 2 * 3 / 2 = 205 pairs, 615 for the three.
    plain = 0.01 + 0.050 + 0.006 + 400e-6 + 1000e-8
    expected = plain + 615e-8 + 0.001 * 2 * 3 + 0.003 + 0.0005 * 3
    assert config.step_time_s(MODEL, 50, 3, 300, 400, 1000.0) == pytest.approx(expected, rel=1e-12)
    assert MODEL.step_time_s(50, 3, 400, 1000.0) == pytest.approx(plain, rel=1e-12)
    # An explicit verification cost replaces the prefill rate for the draft positions only.
    cheaper = SpeculationConfig.model_validate(spec(k=2, verify_s_per_token=0.0002))
    assert cheaper.step_time_s(MODEL, 50, 3, 300, 400, 1000.0) == pytest.approx(expected - 0.0008 * 2 * 3, rel=1e-12)


def test_the_adaptive_rule_compares_tokens_per_second() -> None:
    config = SpeculationConfig.model_validate(spec(tau=2.0))
    assert config.is_faster(0.010, 0.019)  # 2 tokens in 19 ms beat 1 in 10 ms
    assert not config.is_faster(0.010, 0.021)


# ---- Whole runs -------------------------------------------------------------------------------------------------


def test_every_draft_accepted_worked_by_hand() -> None:
    # tau = k + 1: every draft is accepted, so each speculative step emits 5 tokens. Prefill of 100 tokens: 0.110 s
    # and the first token; then 10 tokens in 2 steps of 0.01 + 0.002 + 4 x 0.001 (verification) + 0.003 + 0.0005.
    scn = scenario(fleet={"speculation": spec(k=4, tau=5.0)})
    result = run(scn, request(0, 0.0, ((1, 100),), output_tokens=11))
    assert result.recorder.ttft_s[0] == pytest.approx(0.110)
    assert result.recorder.e2e_s[0] == pytest.approx(0.110 + 2 * 0.0195)
    assert result.summary["speculation"] == {
        "spec_steps": 2,
        "plain_decode_steps": {},
        "spec_tokens_per_step": 5.0,
    }
    plain = run(scenario(), request(0, 0.0, ((1, 100),), output_tokens=11))
    assert plain.recorder.e2e_s[0] == pytest.approx(0.110 + 10 * 0.012)
    assert "speculation" not in plain.summary


def test_the_last_step_emits_only_what_the_output_has_left() -> None:
    # 7 tokens after the first: 5, then 2 of the 5 the second step could have given.
    result = run(scenario(fleet={"speculation": spec(k=4, tau=5.0)}), request(0, 0.0, ((1, 100),), output_tokens=8))
    assert list(result.recorder.output_tokens) == [8]
    assert result.summary["speculation"]["spec_steps"] == 2
    assert result.summary["speculation"]["spec_tokens_per_step"] == pytest.approx(3.5)


def test_a_batch_where_speculation_costs_more_than_it_saves_does_not_speculate() -> None:
    # tau = 1.2: 1.2 tokens in 19.5 ms against 1 in 12 ms, so the adaptive rule keeps every step plain and the
    # latencies are plain decoding's; without the rule every step speculates, and the request takes longer.
    req = request(0, 0.0, ((1, 100),), output_tokens=11)
    adaptive = run(scenario(fleet={"speculation": spec(tau=1.2)}), req)
    assert adaptive.summary["speculation"]["spec_steps"] == 0
    assert adaptive.summary["speculation"]["plain_decode_steps"] == {"slower": 10}
    assert adaptive.recorder.e2e_s[0] == pytest.approx(0.110 + 10 * 0.012)
    always = run(scenario(fleet={"speculation": spec(tau=1.2, adaptive=False)}), req)
    assert always.summary["speculation"]["spec_steps"] > 0
    assert always.recorder.e2e_s[0] > adaptive.recorder.e2e_s[0]


def test_an_unknown_acceptance_length_means_no_speculation() -> None:
    result = run(scenario(fleet={"speculation": spec(tau=None)}), request(0, 0.0, ((1, 100),), output_tokens=11))
    assert "speculation" not in result.summary
    assert result.recorder.e2e_s[0] == pytest.approx(0.110 + 10 * 0.012)


def test_drafts_without_blocks_or_budget_run_plain_and_nothing_leaks() -> None:
    # 7 blocks of 16 tokens hold the 100-token prompt and its 12 outputs, not always 4 drafts more: once the
    # context passes 107 tokens the drafts' positions need an 8th block, and those steps run plain.
    scn = scenario(fleet={"engine": {"num_kv_blocks": 7}, "speculation": spec(k=4, tau=5.0)})
    simulation = Simulation(scn, policy_entry("round_robin"), workload(request(0, 0.0, ((1, 100),), 12)))
    result = simulation.run()
    assert list(result.recorder.output_tokens) == [12]
    assert result.summary["speculation"]["plain_decode_steps"].get("no_blocks", 0) > 0
    cache = simulation.members[0].replica.cache
    assert cache.num_free + len(cache.evictable) == cache.num_blocks
    # A budget of 8 tokens leaves 7 beside a decoding sequence's last token: not enough for 8 drafts.
    scn = scenario(fleet={"engine": {"max_num_batched_tokens": 8}, "speculation": spec(k=8, tau=9.0)})
    result = run(scn, request(0, 0.0, ((1, 8),), 6))
    assert result.summary["speculation"]["spec_steps"] == 0
    assert result.summary["speculation"]["plain_decode_steps"] == {"no_budget": 5}


def low_load(num_requests: int = 300) -> list[Request]:
    """Short prompts arriving one every 0.5 s on average, 20-200 output tokens: a few sequences decode at once."""
    rng = random.Random(3)
    out, t = [], 0.0
    for i in range(num_requests):
        t += rng.expovariate(2.0)
        out.append(request(i, t, ((i, rng.randrange(20, 120)),), output_tokens=rng.randrange(20, 200)))
    return out


LOW_LOAD_FLEET = {"engine": {"num_kv_blocks": 20_000}, "step_model": {"prefill_s_per_token": 1e-4}}


def test_speculation_lowers_latency_at_low_load_and_a_seed_names_one_run() -> None:
    requests = low_load()
    plain = run(scenario(fleet=LOW_LOAD_FLEET), *requests)
    speculative = scenario(fleet={**LOW_LOAD_FLEET, "speculation": spec(k=4, tau=3.0)})
    first, again = run(speculative, *requests), run(speculative, *requests)
    assert first.summary["requests"] == plain.summary["requests"] == 300
    assert first.summary["e2e_p50_s"] < 0.6 * plain.summary["e2e_p50_s"]
    assert first.summary["e2e_p99_s"] < plain.summary["e2e_p99_s"]
    # About tau tokens per speculative step, a little less where outputs end.
    assert 2.8 < first.summary["speculation"]["spec_tokens_per_step"] < 3.05
    assert first.summary == again.summary
    assert first.recorder.e2e_s == again.recorder.e2e_s
    other = run(speculative.model_copy(update={"seed": 1}), *requests)
    assert other.recorder.e2e_s != first.recorder.e2e_s
    # Decode runs are off while speculating: the event budget changes nothing.
    single = run(speculative.model_copy(update={"decode_steps_per_event": 1}), *requests)
    assert single.recorder.e2e_s == first.recorder.e2e_s


def test_preempted_speculating_sequences_finish_once_and_the_kv_events_match_the_caches() -> None:
    # Conversations whose answers are cached as they are computed, on caches small enough to preempt: blocks taken
    # for drafts go back, rejected positions never reach the prefix cache, and the exact index follows the engines.
    scn = scenario(
        trace={
            "kind": "sessions",
            "num_sessions": 40,
            "session_rate_per_s": 3.0,
            "think_time_s": 2.0,
            "system_prompt_tokens": [100, 600],
            "user_tokens": [20, 200],
            "output_tokens": [20, 300],
        },
        fleet={
            "num_replicas": 2,
            "engine": {"num_kv_blocks": 400, "max_num_batched_tokens": 512},
            "step_model": {"prefill_s_per_token": 1e-4},
            "speculation": spec(tau=3.5, adaptive=False),
        },
        router={"index_mode": "exact"},
    )
    workload = build_workload(scn)
    simulation = Simulation(scn, policy_entry("estimated_ttft"), workload)
    result = simulation.run()
    assert result.summary["preemptions"] > 0 and result.summary["speculation"]["spec_steps"] > 0
    assert result.summary["requests"] + result.summary["rejected"] == len(list(workload.requests()))
    assert result.summary["index"]["events_skipped"] == 0
    for member in simulation.members:
        cache = member.replica.cache
        assert cache.num_free + len(cache.evictable) == cache.num_blocks
        assert not any(cache.refs.values())
        assert simulation.router.index.stats().blocks_per_replica[member.replica.id] == len(cache.refs)
