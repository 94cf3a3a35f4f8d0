"""Fitting the step model to `shoal replica profile` output, and prefill-only fleets."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from simulations.scenario import FleetConfig, policy_entry
from simulations.simulation import Simulation
from simulations.step_model import SpeculationConfig, StepModel, fit_speculation, fit_step_model, load_preset

from .conftest import request, scenario, workload

TRUE = StepModel(
    step_s=0.004,
    prefill_s_per_token=2e-5,
    decode_s_per_seq=3e-4,
    kv_read_s_per_token=1e-6,
    attention_s_per_token_pair=2e-9,
)


def samples(model: StepModel, n: int = 40, noise: float = 0.0, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = ("prefill", "decode", "mixed")[i % 3]
        prefill = rng.randrange(16, 512) if kind != "decode" else 0
        decode = rng.randrange(1, 32) if kind != "prefill" else 0
        kv = rng.randrange(0, 30_000)
        pairs = prefill * (kv / 4 + (prefill + 1) / 2)
        t = model.step_time_s(prefill, decode, kv, pairs) * (1 + rng.gauss(0, noise))
        out.append(
            {
                "kind": kind,
                "prefill_tokens": prefill,
                "decode_seqs": decode,
                "kv_tokens_read": kv,
                "attention_pairs": pairs,
                "step_s": t,
            }
        )
    return out


def test_the_fit_recovers_known_coefficients() -> None:
    model, report = fit_step_model(samples(TRUE))
    for name, value in TRUE.model_dump().items():
        assert getattr(model, name) == pytest.approx(value, rel=1e-6), name
    assert report.max_abs_rel_error < 1e-6
    assert set(report.by_kind) == {"prefill", "decode", "mixed"}


def test_the_fit_is_non_negative_and_close_under_noise() -> None:
    # A cost that does not exist (no KV-read term) must come out as 0, not as a negative that offsets noise.
    true = TRUE.model_copy(update={"kv_read_s_per_token": 0.0})
    model, report = fit_step_model(samples(true, n=60, noise=0.03, seed=1))
    assert all(v >= 0.0 for v in model.model_dump().values())
    assert model.kv_read_s_per_token < 1e-7
    assert model.prefill_s_per_token == pytest.approx(true.prefill_s_per_token, rel=0.1)
    assert model.decode_s_per_seq == pytest.approx(true.decode_s_per_seq, rel=0.1)
    assert report.median_abs_rel_error < 0.05


DEMO_PROFILE = Path(__file__).parents[3] / "simulations" / "presets" / "shoal_demo_cpu.json"
DEMO_FIT = {
    "step_s": 0.0018020595179581047,
    "prefill_s_per_token": 4.983745748219808e-05,
    "decode_s_per_seq": 0.00010658662824485918,
    "kv_read_s_per_token": 4.4479247505536534e-07,
    "attention_s_per_token_pair": 2.9458008321876862e-08,
    "verify_s_per_token": 9.381864458875856e-05,
    "draft_step_s": 0.002564490710536427,
    "draft_s_per_seq": 0.00017907055688965722,
}
"""The bundled profile's coefficients as an exact non-negative least squares (Lawson and Hanson's active-set
method, in plain Python) gives them: a solver may replace another, but must not move a preset."""


def test_the_bundled_profile_fits_as_before_to_one_part_in_a_billion() -> None:
    preset = load_preset(str(DEMO_PROFILE))
    assert preset.speculation is not None
    fitted = {**preset.step_model.model_dump(), **preset.speculation.model_dump()}
    for name, value in DEMO_FIT.items():
        assert fitted[name] == pytest.approx(value, rel=1e-9, abs=0.0), name


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"step_s": 0.0}, "positive number of seconds"),
        ({"step_s": "soon"}, "lacks a numeric"),
        ({"decode_seqs": None}, "lacks a numeric"),
    ],
)
def test_bad_samples_are_named(change: dict[str, Any], message: str) -> None:
    rows = samples(TRUE, n=6)
    rows[3] = {**rows[3], **change}
    with pytest.raises(ValueError, match=message) as info:
        fit_step_model(rows)
    assert "sample 3" in str(info.value)


def test_too_few_samples_for_five_coefficients() -> None:
    with pytest.raises(ValueError, match="only 4 samples"):
        fit_step_model(samples(TRUE, n=4))


def test_a_profile_file_is_a_preset_with_the_profiled_engine(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    engine = {"block_size": 16, "num_blocks": 700, "max_num_seqs": 12, "max_num_batched_tokens": 384}
    doc = {"kind": "shoal-replica-profile", "version": 1, "model": "m", "engine": engine, "samples": samples(TRUE)}
    path.write_text(json.dumps(doc))
    preset = load_preset(str(path))
    assert preset.engine.num_kv_blocks == 700
    assert preset.engine.max_num_seqs == 12
    assert preset.engine.max_num_batched_tokens == 384
    assert preset.step_model.step_s == pytest.approx(TRUE.step_s, rel=1e-6)
    assert "fitted to 40 timed steps" in preset.description


SPEC_TRUE = SpeculationConfig(
    num_speculative_tokens=3, verify_s_per_token=6e-5, draft_step_s=0.0015, draft_s_per_seq=4e-5
)


def speculative_samples(model: StepModel, spec: SpeculationConfig, ks: tuple[int, ...] = (3,)) -> list[dict[str, Any]]:
    """Timed speculative decode steps as `shoal replica profile` writes them, made by the formula from known costs:
    D sequences of context L each, verifying k drafts (named in a sample when the profile times several k)."""
    out = []
    for k in ks:
        timed = spec.model_copy(update={"num_speculative_tokens": k})
        for d in (1, 2, 4, 8, 16, 32):
            for length in (64, 512, 1024):
                t = timed.step_time_s(model, 0, d, d * length, d * length)
                sample = {"decode_seqs": d, "context_tokens": length, "kv_tokens_read": d * length, "step_s": t}
                out.append(sample if len(ks) == 1 else {**sample, "num_speculative_tokens": k})
    return out


def test_speculative_steps_at_two_k_give_all_three_costs() -> None:
    section = {"num_speculative_tokens": 3, "samples": speculative_samples(TRUE, SPEC_TRUE, ks=(2, 4))}
    fitted, report = fit_speculation(section, TRUE)
    assert fitted.num_speculative_tokens == 3
    for name in ("verify_s_per_token", "draft_step_s", "draft_s_per_seq"):
        assert getattr(fitted, name) == pytest.approx(getattr(SPEC_TRUE, name), rel=1e-6), name
    assert report.max_abs_rel_error < 1e-6


def test_at_one_k_verification_is_taken_at_the_prefill_rate(tmp_path: Path) -> None:
    # k D and D are proportional at one k; costs generated with verification at the prefill rate come back exactly.
    true = SPEC_TRUE.model_copy(update={"verify_s_per_token": None})
    section = {"num_speculative_tokens": 3, "drafter": "block", "samples": speculative_samples(TRUE, true)}
    fitted, report = fit_speculation(section, TRUE)
    assert fitted.verify_s_per_token == pytest.approx(TRUE.prefill_s_per_token, rel=1e-6)
    assert fitted.draft_step_s == pytest.approx(true.draft_step_s, rel=1e-6)
    assert fitted.draft_s_per_seq == pytest.approx(true.draft_s_per_seq, rel=1e-6)
    assert report.max_abs_rel_error < 1e-6
    # Through a profile file: the preset carries the costs, with speculation off until tau is given.
    path = tmp_path / "profile.json"
    engine = {"block_size": 16, "num_blocks": 700, "max_num_seqs": 12, "max_num_batched_tokens": 384}
    doc = {"kind": "shoal-replica-profile", "engine": engine, "samples": samples(TRUE), "speculation": section}
    path.write_text(json.dumps(doc))
    preset = load_preset(str(path))
    assert preset.speculation is not None and not preset.speculation.is_enabled
    assert preset.speculation.draft_step_s == pytest.approx(true.draft_step_s, rel=1e-6)
    assert "block drafter" in preset.description
    resolved = FleetConfig(preset=str(path), speculation={"mean_acceptance_length": 2.5}).resolve().speculation
    assert resolved is not None and resolved.is_enabled
    assert resolved.draft_s_per_seq == pytest.approx(true.draft_s_per_seq, rel=1e-6)


def test_a_speculation_section_with_too_few_or_bad_samples_is_refused() -> None:
    rows = speculative_samples(TRUE, SPEC_TRUE)
    with pytest.raises(ValueError, match="only 2 speculative samples"):
        fit_speculation({"num_speculative_tokens": 3, "samples": rows[:2]}, TRUE)
    rows[4] = {**rows[4], "step_s": -1.0}
    with pytest.raises(ValueError, match="speculative sample 4"):
        fit_speculation({"num_speculative_tokens": 3, "samples": rows}, TRUE)


def test_a_json_file_that_is_not_a_profile_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"samples": []}))
    with pytest.raises(ValueError, match="not a `shoal replica profile` file"):
        load_preset(str(path))
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        load_preset(str(path))


def test_a_prefill_only_fleet_serves_the_first_token_and_keeps_the_prompt_cached() -> None:
    scn = scenario(fleet={"num_replicas": 2, "prefill_only": True})
    first = request(0, 0.0, ((1, 100),), output_tokens=50)
    again = request(1, 1.0, ((1, 100),), output_tokens=50)
    result = Simulation(scn, policy_entry("round_robin"), workload(first, again)).run()
    rec = result.recorder
    # Prefill 100 tokens in one step (0.01 + 0.100 s, as in test_replica) and leave: no decode here.
    assert rec.ttft_s[0] == pytest.approx(0.110)
    assert rec.e2e_s == rec.ttft_s
    assert list(rec.output_tokens) == [1, 1]
    assert list(rec.hit_tokens) == [0, 0]
    # round_robin sends the second request to the other replica, so it misses; a cache-aware policy hits.
    aware = Simulation(scn, policy_entry("estimated_ttft"), workload(first, again)).run()
    assert list(aware.recorder.hit_tokens) == [0, 96]


def test_the_serving_path_latency_adds_to_first_token_and_end() -> None:
    first = request(0, 0.0, ((1, 100),), output_tokens=3)
    plain = Simulation(scenario(), policy_entry("round_robin"), workload(first)).run().recorder
    path = Simulation(scenario(router={"overhead_s": 0.005}), policy_entry("round_robin"), workload(first)).run()
    assert path.recorder.ttft_s[0] == pytest.approx(plain.ttft_s[0] + 0.005)
    assert path.recorder.e2e_s[0] == pytest.approx(plain.e2e_s[0] + 0.005)


def test_the_serving_path_adds_its_cost_per_prompt_token() -> None:
    short, long = request(0, 0.0, ((1, 100),), output_tokens=3), request(1, 10.0, ((2, 400),), output_tokens=3)
    router = {"overhead_s": 0.005, "overhead_s_per_prompt_token": 1e-5}
    plain = Simulation(scenario(), policy_entry("round_robin"), workload(short, long)).run().recorder
    path = Simulation(scenario(router=router), policy_entry("round_robin"), workload(short, long)).run().recorder
    assert path.ttft_s == pytest.approx([plain.ttft_s[0] + 0.005 + 0.001, plain.ttft_s[1] + 0.005 + 0.004])
    assert path.e2e_s == pytest.approx([plain.e2e_s[0] + 0.006, plain.e2e_s[1] + 0.009])
