"""Fitting the step model to `shoal replica profile` output, and prefill-only fleets."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from simulations.scenario import policy_entry
from simulations.simulation import Simulation
from simulations.step_model import StepModel, fit_step_model, load_preset

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
