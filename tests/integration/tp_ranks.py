"""The two ranks of the tensor-parallel engine test, each in its own process (`multiprocessing` spawn targets).

Both load the same random checkpoint, join a gloo group on loopback and keep their shard; each rank's logits are
perturbed with noise of its own (a forward hook on the LM head, seeded by the rank), so that a rank deciding from
its own logits would choose other tokens. Rank 0 runs the engine over `REQUESTS` and then over `SOLO` alone, and
writes what it emitted (per step in the solo phase) and its own argmax at every sampled row; rank 1 follows the
steps and writes, per step, the tokens it ran and the argmax of its own perturbed logits. With `speculate`, rank 0's
engine drafts k = 3 with a drafter of its own (an unperturbed, unsharded copy of the target) and verifies them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from replica.drafters.dense import ModelDrafter
from replica.engine.engine import EngineConfig, LLMEngine
from replica.engine.sampling import SamplingParams
from replica.model.model import MoEForCausalLM

NOISE_STD = 1.0
"""Of the logits' noise; the random model's logits spread about as much, so noise flips many choices."""
ENGINE = EngineConfig(num_blocks=96, block_size=16, max_num_seqs=8, max_num_batched_tokens=48, seed=5)
REQUESTS: list[tuple[list[int], dict[str, Any]]] = [
    ([5, 9, 2, 7, 11, 3, 8], {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}),
    (list(range(20, 80)), {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}),  # prefilled in chunks
    ([40, 41, 42], {"max_tokens": 20, "temperature": 0.8, "top_p": 0.9, "seed": 11, "ignore_eos": True}),
    ([7, 7, 7, 7], {"max_tokens": 18, "temperature": 1.0, "ignore_eos": True}),  # the engine's own generator
]
SPECULATIVE_K = 3
SOLO: tuple[list[int], dict[str, Any]] = ([3, 1, 4, 1, 5, 9, 2, 6], {"max_tokens": 20, "temperature": 0.0})
MAX_STEPS = 400


def perturb_logits(model: MoEForCausalLM, rank: int) -> list[list[int]]:
    """Add rank-seeded noise to every LM-head output; -> the list each call's argmax rows are appended to."""
    generator = torch.Generator().manual_seed(1000 + rank)
    argmaxes: list[list[int]] = []

    def hook(_module: torch.nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        noisy = out + NOISE_STD * torch.randn(out.shape, generator=generator, dtype=out.dtype)
        argmaxes.append(noisy.argmax(-1).tolist())
        return noisy

    model.lm_head.register_forward_hook(hook)
    return argmaxes


def load(checkpoint: Path, *, nvfp4: bool) -> MoEForCausalLM:
    from replica.model.loader import load_model
    from replica.quant.experts import quantize_model_experts

    model = load_model(checkpoint)
    if nvfp4:
        quantize_model_experts(model)
    return model


def _drive(
    engine: LLMEngine, requests: list[tuple[list[int], dict[str, Any]]], per_step: list[list[int]] | None = None
) -> Iterator[tuple[int, list[int]]]:
    ids = [engine.add_request(prompt, SamplingParams(**params)) for prompt, params in requests]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    for _ in range(MAX_STEPS):
        if not engine.has_work:
            break
        outputs = engine.step().outputs
        for out in outputs:
            tokens[out.seq_id].extend(out.new_token_ids)
        if per_step is not None and outputs:
            per_step.append([t for out in outputs for t in out.new_token_ids])
    assert not engine.has_work, f"not done after {MAX_STEPS} steps"
    for i in ids:
        yield i, tokens[i]


def self_drafter(checkpoint: Path) -> ModelDrafter:
    """The target itself, whole and unperturbed, drafting greedily for rank 0."""
    from tests.unit.replica_engine.test_speculative_engine import model_drafter

    return model_drafter(load(checkpoint, nvfp4=False), SPECULATIVE_K, ENGINE)


def run_engine(model: MoEForCausalLM, drafter: ModelDrafter | None = None) -> dict[str, Any]:
    """Both phases on one engine -> {"batch": [tokens per request], "solo": tokens, "solo_steps": [tokens emitted
    per step]}."""
    config = ENGINE if drafter is None else replace(ENGINE, num_speculative_tokens=SPECULATIVE_K)
    engine = LLMEngine(model, replace(config, adaptive_speculation=False), eos_token_ids=(0,), drafter=drafter)
    batch = [tokens for _, tokens in _drive(engine, REQUESTS)]
    solo_steps: list[list[int]] = []
    (solo,) = [tokens for _, tokens in _drive(engine, [SOLO], solo_steps)]
    return {"batch": batch, "solo": solo, "solo_steps": solo_steps}


def rank_main(rank: int, master_port: int, checkpoint: str, out_dir: str, nvfp4: bool, speculate: bool) -> None:
    from replica.engine.parallel import TensorParallel, initial_capacity
    from replica.engine.runner import ModelRunner, follow_steps
    from replica.model.shard import shard_model

    torch.set_num_threads(1)
    model = load(Path(checkpoint), nvfp4=nvfp4)
    group = TensorParallel.join(
        rank=rank,
        world_size=2,
        master_port=master_port,
        device=torch.device("cpu"),
        timeout_s=60,
        capacity=initial_capacity(ENGINE.max_num_batched_tokens, ENGINE.max_num_seqs),
    )
    shard_model(model, group)
    argmaxes = perturb_logits(model, rank)
    if rank == 0:
        result = run_engine(model, self_drafter(Path(checkpoint)) if speculate else None)
        group.send_stop()
        result["argmax"] = argmaxes
        result["num_steps"] = group.stats.num_step_messages
    else:
        runner = ModelRunner(model, num_blocks=ENGINE.num_blocks, block_size=ENGINE.block_size)
        steps: list[dict[str, Any]] = []

        def on_step(plan: Any, hidden: torch.Tensor) -> None:
            if plan.sample_rows:
                model.compute_logits(hidden[plan.sample_rows])  # through the noisy hook: this rank's own choice
            steps.append({"input_ids": plan.input_ids, "argmax": argmaxes[-1] if plan.sample_rows else []})

        result = {"num_steps": follow_steps(runner, group, on_step), "steps": steps}
    group.close()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
