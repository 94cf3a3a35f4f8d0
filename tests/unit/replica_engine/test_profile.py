"""`shoal replica profile`: every sample is one real engine step of the shape it claims, and the simulator can fit
the file it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from replica.engine.engine import EngineConfig, LLMEngine
from replica.model.model import MoEForCausalLM
from replica.profile import ProfileGrid, Profiler, profile_document
from simulations.step_model import load_preset

GRID = ProfileGrid(
    prefill_tokens=(16, 64),
    is_budget_chunk_timed=False,
    prefix_tokens=(0, 64),
    decode_seqs=(1, 3),
    decode_context_tokens=(32,),
    mixed=((2, 16),),
    mixed_context_tokens=32,
    repeats=2,
    warmup_steps=1,
)


def engine(model: MoEForCausalLM, **changes: object) -> LLMEngine:
    config = EngineConfig(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=128)
    return LLMEngine(model, replace(config, **changes))


def test_each_sample_is_a_step_of_the_shape_it_claims(model: MoEForCausalLM) -> None:
    eng = engine(model)
    batches: list[tuple[int, int, int]] = []
    step = eng.step

    def counting_step():  # type: ignore[no-untyped-def]
        result = step()
        decoding = sum(1 for o in result.outputs if o.num_output_tokens > 1)
        batches.append((result.num_batched_tokens, decoding, len(result.outputs)))
        return result

    eng.step = counting_step  # type: ignore[method-assign]
    lines: list[str] = []
    samples = Profiler(eng, progress=lines.append).run(GRID)

    kinds = [s.kind for s in samples]
    assert kinds.count("prefill") == 4 and kinds.count("decode") == 2 and kinds.count("mixed") == 1
    assert len(lines) == 7 and lines[-1].startswith("[7/7] mixed 2 x 32 + 16")
    by_shape = {(s.kind, s.prefill_tokens, s.kv_tokens_read): s for s in samples}
    after_prefix = by_shape[("prefill", 64, 64)]
    assert after_prefix.attention_pairs == 64 * (64 + 65 / 2)
    assert len(after_prefix.step_s_all) == 2 and after_prefix.step_s > 0
    decode3 = next(s for s in samples if s.kind == "decode" and s.decode_seqs == 3)
    # Three sequences of 32 prompt tokens, one warm-up step and two timed ones: contexts of 33..34 computed tokens.
    assert 3 * 33 <= decode3.kv_tokens_read <= 3 * 35
    # Every request ends: nothing holds blocks once profiling is over.
    assert not eng.has_work
    eng.check_invariants()
    # The timed prefill steps really computed chunk-sized batches (64 new tokens after a cached 64-token prefix).
    assert (64, 0, 1) in batches


def test_the_engines_own_chunk_budget_is_timed(model: MoEForCausalLM) -> None:
    # A long prompt runs in chunks of max_num_batched_tokens (128 here): the grid times that size after each prefix
    # where it fits, beside its own sizes.
    samples = Profiler(engine(model)).run(replace(GRID, is_budget_chunk_timed=True))
    prefills = sorted((s.kv_tokens_read, s.prefill_tokens) for s in samples if s.kind == "prefill")
    assert prefills == [(0, 16), (0, 64), (0, 128), (64, 16), (64, 64), (64, 128)]


def test_the_simulator_fits_the_document(model: MoEForCausalLM, tmp_path: Path) -> None:
    eng = engine(model)
    samples = Profiler(eng).run(GRID)
    doc = profile_document(eng, samples, meta={"model": "tiny", "device": "cpu", "dtype": "float32"})
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    preset = load_preset(str(path))
    assert preset.engine.num_kv_blocks == 64 and preset.engine.max_num_batched_tokens == 128
    assert preset.step_model.step_s > 0
    assert "fitted to 7 timed steps" in preset.description


def test_profiling_needs_prefix_caching(model: MoEForCausalLM) -> None:
    with pytest.raises(ValueError, match="prefix caching"):
        Profiler(engine(model, enable_prefix_caching=False))


def test_the_command_writes_a_profile(tmp_path: Path) -> None:
    from tests.replica_checkpoint import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path / "tiny")
    out = tmp_path / "out" / "profile.json"
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "shoal"),
            "replica",
            "profile",
            "--model",
            str(ckpt),
            "--quick",
            "--threads",
            "1",
            "--num-blocks",
            "256",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["kind"] == "shoal-replica-profile" and doc["engine"]["num_blocks"] == 256
    assert doc["threads"] == 1 and len(doc["samples"]) == 7
    assert "[7/7]" in proc.stderr


def test_a_decode_batch_whose_prompts_take_several_steps_to_prefill(model: MoEForCausalLM) -> None:
    # 8 prompts of 64 tokens against a 128-token step budget: the first ones decode while the last ones prefill,
    # and none may finish before all of them decode together.
    eng = engine(model)
    sample = Profiler(eng).decode(8, 64, repeats=2, warmup=1)
    assert sample.decode_seqs == 8
    assert sample.kv_tokens_read >= 8 * 65
    assert not eng.has_work


def test_with_a_drafter_the_command_times_speculative_steps_the_simulator_fits(tmp_path: Path) -> None:
    from replica.drafters.checkpoint import save_drafter
    from replica.drafters.train import DrafterRecipe, new_drafter
    from replica.model.loader import load_model
    from tests.replica_checkpoint import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path / "tiny")
    drafter = new_drafter(load_model(ckpt), DrafterRecipe(kind="block", block_size=4))
    save_drafter(drafter, ckpt / "drafter", target_hash=None, training={})
    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "shoal"), "replica", "profile", "--model", str(ckpt), "--quick",
         "--threads", "1", "--num-blocks", "256", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    section = json.loads(out.read_text())["speculation"]
    assert section["num_speculative_tokens"] == 4 and section["drafter"] == "block"
    # Both k = 2 and k = 4 at each of the quick grid's decode points (1 and 4 sequences of 64 tokens).
    assert sorted((s["num_speculative_tokens"], s["decode_seqs"]) for s in section["samples"]) == [
        (2, 1), (2, 4), (4, 1), (4, 4)
    ]  # fmt: skip
    assert all(s["step_s"] > 0 and s["context_tokens"] == 64 for s in section["samples"])
    preset = load_preset(str(out))
    assert preset.speculation is not None and preset.speculation.num_speculative_tokens == 4
    assert preset.speculation.mean_acceptance_length is None  # random prompts say nothing of acceptance
