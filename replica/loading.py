"""What a replica process loads before it serves: its OpenMP threads' policy, the checkpoint the settings name (the
demo's built first if missing), the model (quantized as asked), its tokenizer and its drafter. `shoal replica`,
its tensor-parallel ranks and `shoal replica profile` load through here."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from replica.settings import ReplicaSettings

if TYPE_CHECKING:
    from replica.drafters.checkpoint import DrafterModel

log = logging.getLogger(__name__)


def sleeping_omp_threads() -> None:
    """Idle OpenMP threads sleep instead of spinning (`OMP_WAIT_POLICY=PASSIVE`), unless the environment already says.

    On shared or quota-limited CPUs (a busy 2-core machine, a pod with a CPU limit) a spinning worker takes the
    cycles the working thread needs, and a short prefill can take tens of times longer than with passive threads.
    OpenMP reads the variable once, when torch loads it, so this runs before anything imports torch.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def check_cores(cores: list[int]) -> None:
    """Refuse cores this process may not run on (outside its affinity: another cgroup's, or offline)."""
    allowed = os.sched_getaffinity(0)
    missing = [core for core in cores if core not in allowed]
    if missing:
        raise ValueError(
            f"cpus {','.join(map(str, missing))} are not available to this process "
            f"(it may run on {','.join(map(str, sorted(allowed)))})"
        )


def own_cores(cores: list[int]) -> None:
    """This process runs on `cores` only, and its idle OpenMP threads spin for a while before they sleep (libgomp's
    default, which `sleeping_omp_threads` would turn off): the cores are the replica's alone, as vLLM's CPU build
    binds its threads to `VLLM_CPU_OMP_THREADS_BIND`. A sleeping thread must be woken for each operation of a
    step; on 2 cores spinning made decode steps 2-3x faster. Where other work shares the cores, spinning threads
    take its cycles instead, so this is for cores the replica owns. Before torch loads."""
    os.sched_setaffinity(0, cores)


def checkpoint_dir(settings: ReplicaSettings) -> Path:
    """The checkpoint folder `settings.model` names; the demo model's is built first if it is not cached yet."""
    if settings.model == "demo":
        from replica.demo.build import ensure_demo_model

        return ensure_demo_model(progress=lambda line: log.info("%s", line))
    return Path(settings.model)


def load_for_serving(settings: ReplicaSettings) -> tuple[object, object]:
    """-> (model, tokenizer), the demo model built first when `model == "demo"` and not yet cached."""
    import torch

    from replica.model.loader import load_model
    from replica.tokenizer import Tokenizer

    path = checkpoint_dir(settings)
    dtype = getattr(torch, settings.dtype)
    model = load_model(path, dtype=dtype, device=settings.device)
    if settings.quantization != "none":
        from replica.quant.calibrate import load_amax
        from replica.quant.experts import quantize_model_experts

        mode: Literal["w4a16", "w4a4"] = "w4a4" if settings.quantization == "nvfp4-w4a4" else "w4a16"
        amax = load_amax(settings.activation_scales) if settings.activation_scales else None
        count = quantize_model_experts(model, mode=mode, activation_amax=amax)
        log.info("quantized the routed experts of %d layers to NVFP4 (%s)", count, mode)
    tokenizer = Tokenizer.from_file(path / "tokenizer.json")
    return model, tokenizer


def drafter_dir(settings: ReplicaSettings, checkpoint: Path) -> Path | None:
    """The drafter folder the settings name: `auto` is the checkpoint's own `drafter/` if there is one."""
    if settings.drafter == "none" or settings.num_speculative_tokens == 0:
        return None
    if settings.drafter == "auto":
        own = checkpoint / "drafter"
        return own if (own / "drafter.json").is_file() else None
    return Path(settings.drafter)


def load_drafter_for_serving(settings: ReplicaSettings, model: object, checkpoint: Path) -> DrafterModel | None:
    """The drafter model to speculate with, or None; logs what was loaded and how it was measured."""
    from replica.drafters.checkpoint import (
        default_num_speculative_tokens,
        load_drafter,
        read_drafter_meta,
        target_fingerprint,
    )
    from replica.model.model import MoEForCausalLM

    folder = drafter_dir(settings, checkpoint)
    if folder is None:
        return None
    assert isinstance(model, MoEForCausalLM)
    drafter = load_drafter(folder, model, target_hash=target_fingerprint(checkpoint))
    meta = read_drafter_meta(folder)
    measured = meta.get("training", {}).get("acceptance_length", {})
    from replica.engine.engine import MAX_FORCED_DRAFTS

    log.info(
        "speculative decoding: %s drafter from %s, up to %d drafted tokens per step%s, and in constrained requests up "
        "to %d more that the grammar forces (the per-position metric counts both); held-out acceptance length %s",
        meta["kind"],
        folder,
        settings.speculative_tokens(default_num_speculative_tokens(drafter)),
        " (adaptive)" if settings.adaptive_speculation else "",
        MAX_FORCED_DRAFTS,
        ", ".join(f"{k} {v:.2f}" for k, v in measured.items()) or "not measured",
    )
    return drafter
