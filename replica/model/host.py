"""Whether the host may branch on a tensor's values: on a CPU reading one transfers nothing, so the sampler and the
MoE layer decide per step what to compute from values; on an accelerator they run the same ops whatever the values,
so that a step keeps its one host transfer (`replica.engine.decide`)."""

from __future__ import annotations

import torch

HOST_DECISIONS_ON_CPU = True
"""False takes the accelerator's way on a CPU too (the tests that count host transfers)."""


def decides_on_host(tensor: torch.Tensor) -> bool:
    """Whether code may branch on `tensor`'s values (`HOST_DECISIONS_ON_CPU`)."""
    return HOST_DECISIONS_ON_CPU and tensor.device.type == "cpu"
