"""Small building blocks of the decoder: RMSNorm and rotary position embeddings (RoPE, half-split layout)."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dimension, in FP32; weight broadcasts against x."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:  # no casts: they cost a dispatch each
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x32 * weight.float()).to(x.dtype)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in FP32 over the last dimension."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """RoPE tables for positions 0..max_positions-1, theta_i = base^(-2i/D), laid out for `apply_rope`.

    `cos` is [P, D] (each frequency twice: for the real and the imaginary half) and `sin` is [P, D] with its first
    half negated, so rotating x = (x1, x2) is `x * cos + swap_halves(x) * sin` = (x1 c - x2 s, x2 c + x1 s): three
    element-wise ops on tables looked up once per step, for queries and keys of every layer.
    """

    def __init__(
        self, head_dim: int, max_positions: int, base: float, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)  # [D/2]
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=device), inv_freq)  # [P, D/2]
        cos, sin = angles.cos(), angles.sin()
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), dim=-1), persistent=False)
        self.max_positions = max_positions

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin) [T, 1, D], broadcasting over heads."""
        return self.get_buffer("cos")[positions].unsqueeze(-2), self.get_buffer("sin")[positions].unsqueeze(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, heads, D] rotated by position with `RotaryEmbedding`'s tables [T, 1, D]; D's halves are real and
    imaginary (HF layout). In FP32: (x1 c - x2 s, x2 c + x1 s), the same products and sums as HF's rotate_half."""
    x32 = x if x.dtype == torch.float32 else x.float()
    swapped = x32.view(*x32.shape[:-1], 2, -1).flip(-2).flatten(-2)  # (x2, x1)
    out: torch.Tensor = x32 * cos + swapped * sin
    return out if out.dtype == x.dtype else out.to(x.dtype)
