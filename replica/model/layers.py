"""Small building blocks of the decoder: RMSNorm and rotary position embeddings (RoPE, half-split layout)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in FP32 over the last dimension."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables of RoPE for positions 0..max_positions-1, theta_i = base^(-2i/D)."""

    def __init__(
        self, head_dim: int, max_positions: int, base: float, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)  # [D/2]
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=device), inv_freq)  # [P, D/2]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.max_positions = max_positions

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin) [T, D/2]."""
        return self.get_buffer("cos")[positions], self.get_buffer("sin")[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, heads, D] rotated by position, cos/sin [T, D/2]; D's halves are real and imaginary (HF layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [T, 1, D/2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
