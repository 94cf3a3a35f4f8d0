"""Drafter checkpoints: a folder with `drafter.json` (kind, config, the target it was trained for, how it was
trained) and `drafter.safetensors` (its own weights; a block drafter's embeddings and LM head are the target's and
are not in it).

`load_drafter(path, target)` refuses a drafter whose vocabulary or hidden size does not fit the target, and warns
when the target is not the one it was trained on (it still works, with lower acceptance). `drafter_runtime` wraps
a loaded model for an engine's cache layout.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from replica.drafters.block import BlockDrafter, BlockDrafterConfig, BlockDrafterModel
from replica.drafters.dense import DenseDrafterConfig, DenseDrafterModel, ModelDrafter
from replica.engine.drafting import Drafter
from replica.model.model import MoEForCausalLM

log = logging.getLogger(__name__)

DrafterModel = DenseDrafterModel | BlockDrafterModel


class DrafterError(ValueError):
    """A drafter folder that cannot serve this target."""


def target_fingerprint(checkpoint: Path) -> str:
    """What a drafter records of its target: sha256 of the target's config.json and tokenizer.json (cheap, where
    hashing the weights of a large model is not; a fine-tuned target with the same shape is not told apart)."""
    digest = hashlib.sha256()
    for name in ("config.json", "tokenizer.json"):
        path = checkpoint / name
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def save_drafter(
    model: DrafterModel,
    path: str | Path,
    *,
    target_hash: str | None,
    training: dict[str, Any],
    dtype: torch.dtype | None = None,
) -> None:
    """Write the drafter's weights (in `dtype` if given) and what it was trained for and on."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    kind = "block" if isinstance(model, BlockDrafterModel) else "dense"
    meta = {"kind": kind, "config": model.config.to_dict(), "target_hash": target_hash, "training": training}
    (folder / "drafter.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    state = {name: (t if dtype is None else t.to(dtype)).contiguous() for name, t in model.state_dict().items()}
    save_file(state, str(folder / "drafter.safetensors"), metadata={"format": "pt"})


def read_drafter_meta(path: str | Path) -> dict[str, Any]:
    folder = Path(path)
    if not (folder / "drafter.json").is_file():
        raise DrafterError(f"{folder} has no drafter.json (write one with `shoal replica train-drafter`)")
    meta: dict[str, Any] = json.loads((folder / "drafter.json").read_text(encoding="utf-8"))
    if meta.get("kind") not in ("dense", "block"):
        raise DrafterError(f"{folder}/drafter.json: kind must be dense or block, got {meta.get('kind')!r}")
    return meta


def load_drafter(path: str | Path, target: MoEForCausalLM, *, target_hash: str | None = None) -> DrafterModel:
    """The drafter in `path`, on the target's device and in its dtype."""
    from safetensors.torch import load_file

    folder = Path(path)
    meta = read_drafter_meta(folder)
    device, dtype = target.device, target.dtype
    model: DrafterModel
    try:
        if meta["kind"] == "block":
            raw = dict(meta["config"])
            raw["feature_layers"] = tuple(raw["feature_layers"])
            model = BlockDrafterModel(BlockDrafterConfig(**raw), target, dtype=dtype, device=device)
        else:
            model = DenseDrafterModel(DenseDrafterConfig(**meta["config"]), dtype=dtype, device=device)
    except (TypeError, ValueError) as exc:
        raise DrafterError(f"{folder}: {exc}") from None
    if model.config.vocab_size != target.config.vocab_size:
        raise DrafterError(
            f"{folder}: the drafter's vocabulary ({model.config.vocab_size}) is not the target's "
            f"({target.config.vocab_size}); a drafter needs the target's tokenizer"
        )
    state = load_file(str(folder / "drafter.safetensors"), device=str(device))
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    if missing or unexpected:
        raise DrafterError(
            f"{folder}: drafter.safetensors does not fit: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    trained_for = meta.get("target_hash")
    if target_hash and trained_for and trained_for != target_hash:
        log.warning("the drafter in %s was trained for another target model; expect fewer accepted drafts", folder)
    return model.eval()


DENSE_DEFAULT_TOKENS = 4
"""A dense drafter's default k: each draft is one pass of it."""


def default_num_speculative_tokens(model: DrafterModel) -> int:
    """A block drafter's block size (one pass drafts that many), 4 for a dense drafter."""
    return model.config.block_size if isinstance(model, BlockDrafterModel) else DENSE_DEFAULT_TOKENS


def drafter_runtime(model: DrafterModel, *, num_blocks: int, block_size: int, num_speculative_tokens: int) -> Drafter:
    if isinstance(model, BlockDrafterModel):
        return BlockDrafter(
            model, num_blocks=num_blocks, block_size=block_size, num_speculative_tokens=num_speculative_tokens
        )
    return ModelDrafter.of(
        model, num_blocks=num_blocks, block_size=block_size, num_speculative_tokens=num_speculative_tokens
    )
