"""A drafter from captures to a folder: load the target and the captured requests, train, measure, save.

`shoal replica train-drafter` and `shoal replica build-demo` (for the demo drafter) both run `build_drafter`. The
acceptance length it records is measured by the engine itself on held-out prompts (`train.measure_acceptance`),
greedy and at temperature 0.7, with k = the block size (a dense drafter: 4), and `shoal replica` logs it at start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from replica.drafters.checkpoint import DrafterModel, save_drafter, target_fingerprint
from replica.drafters.train import (
    DrafterRecipe,
    Example,
    TrainReport,
    load_capture_examples,
    measure_acceptance,
    train_drafter,
)
from replica.model.model import MoEForCausalLM
from replica.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class TrainDrafterError(RuntimeError):
    """Training cannot start (no captures, an unusable target)."""


def build_drafter(
    target: MoEForCausalLM,
    tokenizer: Tokenizer,
    train: list[Example],
    heldout: list[Example],
    recipe: DrafterRecipe,
    *,
    out: Path | None,
    target_hash: str | None,
    progress: Callable[[str], None] = print,
    show_bar: bool = True,
    save_dtype: torch.dtype | None = None,
) -> tuple[DrafterModel, TrainReport]:
    """Train, measure and (with `out`) save a drafter. With `save_dtype` its weights are rounded to that dtype
    before the measurement, so what is measured is what is saved."""
    if not train:
        raise TrainDrafterError("the captures hold no request with output to train on")
    progress(f"drafter: {len(train)} requests to train on ({sum(len(e.output_ids) for e in train):,} output tokens), "
             f"{len(heldout)} held out")  # fmt: skip
    drafter, report = train_drafter(target, train, heldout, recipe, progress=progress, show_bar=show_bar)
    if save_dtype is not None:
        with torch.no_grad():
            for param in drafter.parameters():
                param.copy_(param.to(save_dtype))
    k = recipe.block_size if recipe.kind == "block" else 4
    prompts = [e.prompt_ids for e in heldout[: recipe.eval_prompts]]
    if prompts:
        for name, temperature in (("greedy", 0.0), ("sampled", 0.7)):
            report.acceptance_length[name] = round(
                measure_acceptance(
                    target,
                    drafter,
                    prompts,
                    num_speculative_tokens=k,
                    temperature=temperature,
                    max_tokens=recipe.eval_max_tokens,
                    eos_token_ids=tokenizer.eos_token_ids,
                    seed=recipe.seed,
                ),
                3,
            )
        progress(
            f"held-out acceptance length at k={k} over {len(prompts)} prompts: "
            f"{report.acceptance_length['greedy']:.2f} greedy, "
            f"{report.acceptance_length['sampled']:.2f} at temperature 0.7"
        )
    if out is not None:
        training = {"recipe": vars(recipe), **report.to_dict()}
        save_drafter(drafter, out, target_hash=target_hash, training=training, dtype=save_dtype)
        progress(f"drafter written to {out}")
    return drafter, report


def train_drafter_command(
    *, checkpoint: Path, traces: Path, out: Path, recipe: DrafterRecipe, threads: int | None
) -> TrainReport:
    """`checkpoint`: the target's folder (`shoal replica train-drafter` resolves `demo` to the packaged one)."""
    from replica.model.loader import load_model

    if threads:
        torch.set_num_threads(threads)
    try:
        target = load_model(checkpoint)
        tokenizer = Tokenizer.from_file(checkpoint / "tokenizer.json")
    except (OSError, ValueError) as exc:
        raise TrainDrafterError(f"cannot load the target model: {exc}") from None
    if not traces.is_dir():
        raise TrainDrafterError(f"{traces} is not a directory of capture files")
    train, heldout = load_capture_examples(
        traces, max_len=target.config.max_position_embeddings, heldout_fraction=recipe.heldout_fraction
    )
    _, report = build_drafter(
        target, tokenizer, train, heldout, recipe, out=out, target_hash=target_fingerprint(checkpoint)
    )
    return report
