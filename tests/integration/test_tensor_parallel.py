"""Two gloo ranks on loopback whose logits are perturbed differently (`tests/integration/tp_ranks.py`): the output
is exactly what rank 0's decisions give, rank 1 only ever runs rank 0's tokens, nothing stalls; with FP32 and with
NVFP4 experts; and with speculation, rank 1 runs exactly the drafts rank 0 proposed and the tokens rank 0 kept."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import torch

from replica.model.config import ModelConfig
from replica.model.loader import init_weights, save_checkpoint
from replica.model.model import MoEForCausalLM
from tests.integration import tp_ranks
from tests.integration.ports import free_ports

DEADLINE_S = 180.0
"""Both ranks must be done by then: loading, two phases of generation, and the stop message."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = ModelConfig(
        vocab_size=160,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=64,
        shared_expert_gate=True,  # a shared expert is written as Qwen2-MoE's: gated, q/k/v bias, no q/k norm
        qkv_bias=True,
        qk_norm=False,
        max_position_embeddings=512,
    )
    model = MoEForCausalLM(config)
    init_weights(model, seed=2, std=0.15)
    path = tmp_path_factory.mktemp("tp-ckpt")
    save_checkpoint(model, path)
    return path


def _run_two_ranks(checkpoint: Path, out_dir: Path, *, nvfp4: bool, speculate: bool = False) -> tuple[dict, dict]:  # type: ignore[type-arg]
    context = multiprocessing.get_context("spawn")
    port = free_ports(1)
    ranks = [
        context.Process(target=tp_ranks.rank_main, args=(rank, port, str(checkpoint), str(out_dir), nvfp4, speculate))
        for rank in (0, 1)
    ]
    for process in ranks:
        process.start()
    try:
        for process in ranks:
            process.join(timeout=DEADLINE_S)
        stalled = [rank for rank, process in enumerate(ranks) if process.is_alive()]
        assert not stalled, f"ranks {stalled} still running after {DEADLINE_S:g} s"
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join()
    assert [p.exitcode for p in ranks] == [0, 0]
    return tuple(json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1))  # type: ignore[return-value]


@pytest.mark.parametrize("nvfp4", [False, True], ids=["fp32-experts", "nvfp4-experts"])
def test_ranks_with_perturbed_logits_follow_rank_0(checkpoint: Path, tmp_path: Path, nvfp4: bool) -> None:
    rank0, rank1 = _run_two_ranks(checkpoint, tmp_path, nvfp4=nvfp4)

    # The replica's output is what rank 0's own perturbed logits decide: a whole model whose logits get rank 0's
    # noise emits the same tokens (the ranks' sums differ from it only in the last bits, far below the noise).
    torch.set_num_threads(1)
    reference_model = tp_ranks.load(checkpoint, nvfp4=nvfp4)
    tp_ranks.perturb_logits(reference_model, rank=0)
    reference = tp_ranks.run_engine(reference_model)
    assert rank0["batch"] == reference["batch"]
    assert rank0["solo"] == reference["solo"]
    assert [len(t) for t in rank0["batch"]] == [p["max_tokens"] for _, p in tp_ranks.REQUESTS]

    # No stall: rank 1 ran every step rank 0 broadcast, then stopped.
    assert rank1["num_steps"] == rank0["num_steps"] - 1  # the last message is the stop
    steps = rank1["steps"]
    assert len(rank0["argmax"]) == sum(1 for s in steps if s["argmax"])

    # Rank 1's own logits would often have chosen otherwise: the perturbation is real.
    own = [row for s in steps for row in s["argmax"]]
    decided = [row for rows in rank0["argmax"] for row in rows]
    assert len(own) == len(decided)
    differ = sum(a != b for a, b in zip(own, decided, strict=True))
    assert differ > len(own) // 4, f"only {differ} of {len(own)} rows differ: the noise does not test anything"

    # The solo request decodes one token per step at the end: each step rank 1 ran the token rank 0 decided at the
    # step before, never its own choice where they differ.
    solo_steps = steps[-len(rank0["solo"]) :]
    solo_decided = rank0["argmax"][-len(rank0["solo"]) :]
    ran = [s["input_ids"][-1] for s in solo_steps[1:]]
    assert ran == [rows[-1] for rows in solo_decided[:-1]] == rank0["solo"][:-1]
    assert any(s["argmax"][-1] != rows[-1] for s, rows in zip(solo_steps, solo_decided, strict=True))


def test_with_drafts_rank_1_runs_what_rank_0_drafted_and_kept(checkpoint: Path, tmp_path: Path) -> None:
    rank0, rank1 = _run_two_ranks(checkpoint, tmp_path, nvfp4=False, speculate=True)
    assert [len(t) for t in rank0["batch"]] == [p["max_tokens"] for _, p in tp_ranks.REQUESTS]
    assert rank1["num_steps"] == rank0["num_steps"] - 1
    # The solo phase, one sequence: after its prefill, each step rank 1 ran the last token rank 0 emitted the step
    # before, then the drafts rank 0 proposed; rank 0 emitted the drafts it kept (a prefix of them) and one more.
    solo_steps = rank0["solo_steps"]
    ran = [s["input_ids"] for s in rank1["steps"][-len(solo_steps) :]]
    kept_counts = []
    for emitted_before, inputs, emitted in zip(solo_steps, ran[1:], solo_steps[1:], strict=False):
        assert inputs[0] == emitted_before[-1]
        drafts = inputs[1:]
        kept = len(emitted) - 1
        assert emitted[:kept] == drafts[:kept]
        kept_counts.append((kept, len(drafts)))
    assert [t for step in solo_steps for t in step] == rank0["solo"]
    assert any(d == tp_ranks.SPECULATIVE_K for _, d in kept_counts)  # rank 1 verified whole drafts
    assert any(k == d for k, d in kept_counts) and any(k < d for k, d in kept_counts)  # kept all, and refused some
    # Rank 0's noisy logits decided what was kept: rank 1's own choices at the same rows often differ.
    own = [row for s in rank1["steps"] for row in s["argmax"]]
    decided = [row for rows in rank0["argmax"] for row in rows]
    assert len(own) == len(decided)
    assert sum(a != b for a, b in zip(own, decided, strict=True)) > len(own) // 4
