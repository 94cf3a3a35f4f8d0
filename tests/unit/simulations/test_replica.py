"""The simulated engine, checked by hand on small cases (engine of conftest.scenario: 10 ms a step, 1 ms a prefill
token, 2 ms a decoding sequence)."""

from __future__ import annotations

import pytest

from simulations.scenario import Scenario, policy_entry
from simulations.simulation import RunResult, Simulation
from simulations.workload import Request

from .conftest import request, scenario, workload


def run(scn: Scenario, *requests: Request) -> RunResult:
    return Simulation(scn, policy_entry("round_robin"), workload(*requests)).run()


def test_prefill_then_decode_then_a_prefix_hit_worked_by_hand() -> None:
    first = request(0, 0.0, ((1, 100),), output_tokens=3)
    again = request(1, 1.0, ((1, 100),), output_tokens=3)
    result = run(scenario(), first, again)
    rec = result.recorder
    # First: one step prefills 100 tokens (0.01 + 0.100) and samples token 1; two decode steps (0.01 + 0.002 each).
    assert rec.ttft_s[0] == pytest.approx(0.110)
    assert rec.e2e_s[0] == pytest.approx(0.134)
    # Again: 6 of its 6 full blocks are cached, but at least one token is computed, so (100 - 1) // 16 = 6 blocks
    # hit (96 tokens) and 4 tokens are prefilled: 0.01 + 0.004.
    assert list(rec.hit_tokens) == [0, 96]
    assert rec.ttft_s[1] == pytest.approx(0.014)
    assert result.summary["hit_ratio"] == pytest.approx(96 / 200)


def test_long_prompts_prefill_in_chunks_and_decode_alongside() -> None:
    scn = scenario(fleet={"engine": {"max_num_batched_tokens": 1000}})
    short = request(0, 0.0, ((2, 10),), output_tokens=5)
    long = request(1, 0.0, ((1, 2500),), output_tokens=1)
    result = run(scn, short, long)
    ttft = dict(zip(result.recorder.prompt_tokens, result.recorder.ttft_s, strict=True))
    e2e = dict(zip(result.recorder.prompt_tokens, result.recorder.e2e_s, strict=True))
    # Short arrives first and starts a step alone (0.01 + 0.010 s); long joins at the next step boundary. Steps 2
    # and 3: short decodes (one token of the budget) beside 999 of long's tokens (0.01 + 0.999 + 0.002). Step 4:
    # long's last 502 beside short's fourth token. Step 5: short's last token alone (0.01 + 0.002).
    assert ttft[10] == pytest.approx(0.02)
    assert ttft[2500] == pytest.approx(0.02 + 2 * 1.011 + (0.01 + 0.502 + 0.002))
    assert e2e[10] == pytest.approx(ttft[2500] + 0.012)


def test_decode_runs_time_steps_exactly_as_single_steps() -> None:
    requests = [request(i, 0.05 * i, ((i, 300),), output_tokens=40 + 7 * i) for i in range(12)]
    one = run(scenario(decode_steps_per_event=1), *requests)
    many = run(scenario(decode_steps_per_event=64), *requests)
    assert many.num_events < one.num_events / 2
    assert many.recorder.e2e_s == pytest.approx(one.recorder.e2e_s, rel=1e-9)
    assert many.recorder.ttft_s == pytest.approx(one.recorder.ttft_s, rel=1e-9)


@pytest.mark.parametrize("decode_steps_per_event", [1, 64])
def test_a_full_cache_preempts_and_every_request_still_finishes_once(decode_steps_per_event: int) -> None:
    # 40 blocks of 16 tokens: three 200-token prompts (13 blocks each) fit, their outputs do not.
    scn = scenario(fleet={"engine": {"num_kv_blocks": 40}}, decode_steps_per_event=decode_steps_per_event)
    requests = [request(i, 0.0, ((i, 200),), output_tokens=120) for i in range(3)]
    result = run(scn, *requests)
    assert result.summary["preemptions"] > 0
    assert sorted(result.recorder.output_tokens) == [120, 120, 120]
    assert result.summary["requests"] == 3


def test_a_request_larger_than_the_whole_cache_is_refused_not_stuck() -> None:
    scn = scenario(fleet={"engine": {"num_kv_blocks": 8}})  # 128 tokens
    fits = request(0, 0.0, ((1, 64),), output_tokens=2)
    too_long = request(1, 0.0, ((2, 120),), output_tokens=20)  # 140 tokens with its output
    result = run(scn, fits, too_long)
    assert result.summary["requests"] == 1
    assert result.summary["rejected"] == 1
    assert result.summary["slo_attainment"] == 0.5
