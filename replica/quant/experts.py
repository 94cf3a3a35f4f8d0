"""Routed experts stored in NVFP4: a drop-in `Experts` with 4.5 bits per weight.

E = experts, H = hidden size, I = one expert's hidden size, n = rows routed to one expert.

`NVFP4Experts.from_experts` quantizes each expert's `gate_up [2I, H]` and `down [H, I]` with that expert's own
global scale (amax / 2688, so one outlier expert does not crush the others' block-scale range) and keeps only
packed codes, E4M3 block scales and FP32 globals: the BF16 parameters are gone, 0.5625 bytes per weight remain.
Only `expert_forward` changes, so routing, grouping and the observer calls are the base class's.

- W4A16: each expert's weights are dequantized to the activations' dtype for its matmul (on CUDA with Triton, a
  kernel multiplies straight from the packed bytes instead).
- W4A4: the expert's inputs (x before gate_up, h before down) are also rounded through NVFP4, with per-expert
  activation global scales calibrated offline: `set_activation_scales(gate_up_amax, down_amax)` takes the amax
  per expert that calibration observed at the two points. A dynamic global would need an amax, i.e. a device
  sync, per expert per step; a calibrated one is free. Without calibration W4A4 refuses to run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from replica.model.moe import Experts, ObservePoint
from replica.quant.nvfp4 import (
    dequantize_nvfp4,
    fake_quantize_nvfp4,
    global_scale_from_amax,
    per_expert_global_scale,
    quantize_nvfp4,
)
from replica.quant.triton_nvfp4 import HAS_TRITON, nvfp4_matmul

QuantMode = Literal["w4a16", "w4a4"]
ActivationAmax = Mapping[ObservePoint, torch.Tensor]
"""Calibrated amax of one layer's experts at each observe point: {"gate_up": [E], "down": [E]}."""


class NVFP4Experts(Experts):
    """E routed SwiGLU experts with NVFP4 weights (and, in W4A4, NVFP4-rounded activations)."""

    has_stacked_weights = False  # experts dequantize one by one; only experts with rows are dequantized

    gate_up_packed: torch.Tensor  # [E, 2I, H/2] uint8
    gate_up_scales: torch.Tensor  # [E, 2I, H/16] float8_e4m3fn
    gate_up_global: torch.Tensor  # [E] float32
    down_packed: torch.Tensor  # [E, H, I/2] uint8
    down_scales: torch.Tensor  # [E, H, I/16] float8_e4m3fn
    down_global: torch.Tensor  # [E] float32
    act_gate_up_global: torch.Tensor | None  # [E] float32, W4A4 only
    act_down_global: torch.Tensor | None  # [E] float32, W4A4 only

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        mode: QuantMode = "w4a16",
        device: torch.device | str | None = None,
        layer: int = 0,
    ) -> None:
        """Empty (zero) quantized experts; `from_experts` fills them, or `load_state_dict` does."""
        if mode not in get_args(QuantMode):
            raise ValueError(f"mode must be one of {get_args(QuantMode)}, not {mode!r}")
        if hidden_size % 16 or intermediate_size % 16:
            raise ValueError(f"NVFP4 needs H and I to be multiples of 16, got H={hidden_size}, I={intermediate_size}")
        # The base class's BF16 parameters are made on `meta` (no memory) and dropped.
        super().__init__(num_experts, hidden_size, intermediate_size, dtype=torch.bfloat16, device="meta", layer=layer)
        del self.gate_up
        del self.down
        self.mode: QuantMode = mode
        e, h, i = num_experts, hidden_size, intermediate_size
        self.register_buffer("gate_up_packed", torch.zeros(e, 2 * i, h // 2, dtype=torch.uint8, device=device))
        self.register_buffer("gate_up_scales", torch.zeros(e, 2 * i, h // 16, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("gate_up_global", torch.ones(e, dtype=torch.float32, device=device))
        self.register_buffer("down_packed", torch.zeros(e, h, i // 2, dtype=torch.uint8, device=device))
        self.register_buffer("down_scales", torch.zeros(e, h, i // 16, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("down_global", torch.ones(e, dtype=torch.float32, device=device))
        self.register_buffer("act_gate_up_global", None)
        self.register_buffer("act_down_global", None)

    @classmethod
    def from_experts(
        cls, experts: Experts, *, mode: QuantMode = "w4a16", activation_amax: ActivationAmax | None = None
    ) -> NVFP4Experts:
        """Quantize `experts` (left untouched) one expert at a time, so the FP32 scratch is one expert's size."""
        if isinstance(experts, NVFP4Experts):
            raise TypeError("these experts are already NVFP4")
        out = cls(
            experts.num_experts,
            experts.hidden_size,
            experts.intermediate_size,
            mode=mode,
            device=experts.gate_up.device,
            layer=experts.layer,
        )
        out.observer = experts.observer
        with torch.no_grad():
            for weight, packed, scales, global_scales in (
                (experts.gate_up, out.gate_up_packed, out.gate_up_scales, out.gate_up_global),
                (experts.down, out.down_packed, out.down_scales, out.down_global),
            ):
                global_scales.copy_(per_expert_global_scale(weight))  # [E]
                for expert in range(experts.num_experts):
                    # Row-major, blocks of 16 along the input dimension (loaded Experts store theirs transposed).
                    p, s, _ = quantize_nvfp4(weight[expert].contiguous(), global_scales[expert])
                    packed[expert].copy_(p)
                    scales[expert].copy_(s)
        if activation_amax is not None:
            missing = [point for point in get_args(ObservePoint) if point not in activation_amax]
            if missing:
                raise ValueError(f"activation_amax has no {missing} (expected keys {get_args(ObservePoint)})")
            out.set_activation_scales(activation_amax["gate_up"], activation_amax["down"])
        return out

    def set_activation_scales(self, gate_up_amax: torch.Tensor, down_amax: torch.Tensor) -> None:
        """Per-expert activation amax [E] observed at "gate_up" (x) and "down" (h) -> W4A4 global scales.

        An expert calibration never routed to (amax 0) borrows the largest amax of its layer at that point.
        """
        scales = []
        for point, amax in (("gate_up", gate_up_amax), ("down", down_amax)):
            amax = torch.as_tensor(amax, dtype=torch.float32).detach().reshape(-1).to(self.gate_up_global.device)
            if amax.shape[0] != self.num_experts:
                raise ValueError(f"{point} amax has {amax.shape[0]} entries for {self.num_experts} experts")
            if not bool(torch.isfinite(amax).all()) or bool((amax < 0).any()):
                raise ValueError(f"{point} amax must be finite and non-negative")
            if not bool((amax > 0).any()):
                raise ValueError(f"{point} amax is 0 for every expert of layer {self.layer}: nothing was calibrated")
            amax = torch.where(amax > 0, amax, amax.max())
            scales.append(global_scale_from_amax(amax))  # [E]
        self.act_gate_up_global, self.act_down_global = scales

    @property
    def has_activation_scales(self) -> bool:
        return self.act_gate_up_global is not None and self.act_down_global is not None

    def expert_forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """One expert's SwiGLU on its rows: x [n, H] -> [n, H] in x's dtype."""
        if self.observer is not None:
            self.observer.observe(self.layer, expert, "gate_up", x)
        if self.mode == "w4a4":
            if self.act_gate_up_global is None or self.act_down_global is None:
                raise RuntimeError(
                    f"W4A4 experts of layer {self.layer} have no activation scales: calibrate, then call "
                    "set_activation_scales(gate_up_amax, down_amax) or pass activation_amax"
                )
            x = fake_quantize_nvfp4(x, self.act_gate_up_global[expert])
        gate, up = self._linear(
            x, self.gate_up_packed[expert], self.gate_up_scales[expert], self.gate_up_global[expert]
        ).chunk(2, dim=-1)  # [n, I] each
        h = F.silu(gate) * up  # [n, I]
        if self.observer is not None:
            self.observer.observe(self.layer, expert, "down", h)
        if self.mode == "w4a4":
            assert self.act_down_global is not None
            h = fake_quantize_nvfp4(h, self.act_down_global[expert])
        return self._linear(h, self.down_packed[expert], self.down_scales[expert], self.down_global[expert])

    @staticmethod
    def _linear(
        x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor
    ) -> torch.Tensor:
        """x [n, K] @ dequant(W [N, K])^T -> [n, N]."""
        if x.is_cuda and HAS_TRITON:
            return nvfp4_matmul(x, packed, scales, global_scale)
        return F.linear(x, dequantize_nvfp4(packed, scales, global_scale, x.dtype))

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, mode={self.mode}, layer={self.layer}"
        )


def quantize_model_experts(
    model: nn.Module, *, mode: QuantMode = "w4a16", activation_amax: Mapping[ObservePoint, torch.Tensor] | None = None
) -> int:
    """Swap every BF16 `Experts` in `model` for `NVFP4Experts` on its parent; returns how many were swapped.

    `activation_amax` is calibration's output for W4A4 (`replica.quant.calibrate.load_amax`): observe point ->
    amax [L, E], row `Experts.layer` for each layer's experts.
    """
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, Experts) and not isinstance(module, NVFP4Experts)
    ]
    for name, experts in targets:
        if not name:
            raise TypeError("quantize_model_experts swaps experts on their parent; use NVFP4Experts.from_experts")
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        amax = None
        if activation_amax is not None:
            amax = {point: activation_amax[point][experts.layer] for point in get_args(ObservePoint)}  # [E] each
        setattr(parent, attr, NVFP4Experts.from_experts(experts, mode=mode, activation_amax=amax))
    return len(targets)


def routed_expert_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes held, weights represented) over every routed `Experts` in `model`: their tensors' nbytes, summed."""
    num_bytes = num_params = 0
    for module in model.modules():
        if isinstance(module, Experts):
            tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            num_bytes += sum(t.nbytes for t in tensors)
            num_params += module.num_experts * 3 * module.hidden_size * module.intermediate_size
    return num_bytes, num_params
