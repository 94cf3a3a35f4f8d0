"""NVFP4: 4-bit E2M1 values, one E4M3 scale per 16 of them, one FP32 scale per tensor (or per expert).

    value = e2m1 * block_scale * global_scale

- `global_scale` = amax / (6 * 448): the largest block's scale then lands on E4M3's largest value, 448, so block
  scales use E4M3's whole range. A stacked `[E, N, K]` weight may have one global scale per expert (`[E]`).
- `block_scale` = RNE_e4m3(amax16 / 6 / global_scale), clamped to [2^-6, 448] (E4M3's smallest normal, so a
  block of zeros has a finite, non-zero scale; values beyond a calibrated global saturate at 448).
- each value x * ((1 / global_scale) / block_scale) is rounded to nearest, ties to even, onto
  E2M1 = {0, 0.5, 1, 1.5, 2, 3, 4, 6} (sign kept, -0 included) and saturates at 6.
- two 4-bit codes per byte along the last dim, the even element in the low nibble.

Storage: 4 bits + 8/16 bits = 4.5 bits (0.5625 bytes) per value, plus 4 bytes per global scale.

torchao's `NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(amax))` is the spec: the packed
bytes and scales here equal its bit for bit (same float32 operations in the same order), and the tests check it.
torchao is a test dependency only; this module needs torch alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK_SIZE = 16
"""Values per E4M3 block scale, along the last dim."""
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
"""Block scales are clamped up to this: E4M3's subnormals are never produced (as in torchao)."""
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitude of codes 0..7; codes 8..15 are the same with the sign bit (bit 3) set."""

# Round to nearest, ties to even, as 7 thresholds on |x|: code = number of thresholds below |x|. At a tie the even
# code wins: 0.25 -> 0 (code 0), 0.75 -> 1.0 (code 2), 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5 -> 4.0.
# Where the upper neighbour is even the threshold moves one float32 ulp down, so `>` there means `>=`.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_GOES_UP = (False, True, False, True, False, True, False)


def _e2m1_thresholds(device: torch.device) -> torch.Tensor:
    mid = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=device)  # [7]
    below = torch.nextafter(mid, torch.zeros_like(mid))
    return torch.where(torch.tensor(_TIE_GOES_UP, device=device), below, mid)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float32 values already divided by their scales -> uint8 codes 0..15 (sign in bit 3), RNE, saturating."""
    magnitude = torch.bucketize(x.abs(), _e2m1_thresholds(x.device), out_int32=True)  # count of thresholds < |x|
    return (magnitude | (torch.signbit(x).to(torch.int32) << 3)).to(torch.uint8)


def _e2m1_table(device: torch.device) -> torch.Tensor:
    """float32 [16]: the value of each code."""
    return torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=device)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 -> float32 values (code 8 is -0.0)."""
    return F.embedding(codes.to(torch.int32), _e2m1_table(codes.device).unsqueeze(-1)).squeeze(-1)


def decode_e2m1_pairs(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., n/2] -> float32 [..., n/2, 2] (low nibble first): one 256-row table look-up per byte."""
    table = _e2m1_table(packed.device)  # [16]
    byte = torch.arange(256, device=packed.device)
    pairs = torch.stack((table[byte & 0xF], table[byte >> 4]), dim=-1)  # [256, 2]
    return F.embedding(packed.to(torch.int32), pairs)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., n] -> bytes [..., n/2]; element 2j in the low nibble, 2j+1 in the high one."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., n/2] -> uint8 codes [..., n]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """amax (any shape) -> float32 global scale amax / (6 * 448); 1.0 where amax is 0 (all-zero data)."""
    amax = amax.to(torch.float32)
    return torch.where(amax > 0, amax / (E4M3_MAX * E2M1_MAX), torch.ones_like(amax))


def per_expert_global_scale(w: torch.Tensor) -> torch.Tensor:
    """Stacked weights w [E, ...] -> one global scale per expert, float32 [E]."""
    if w.dim() < 2:
        raise ValueError(f"per_expert_global_scale needs stacked weights [E, ...], got shape {tuple(w.shape)}")
    return global_scale_from_amax(w.detach().abs().amax(dim=tuple(range(1, w.dim()))))


def _check_input(x: torch.Tensor) -> None:
    if not x.is_floating_point():
        raise ValueError(f"NVFP4 quantizes floating-point tensors, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"NVFP4 needs the last dim to be a multiple of {BLOCK_SIZE}, got shape {tuple(x.shape)}")


def _canonical_global(global_scale: torch.Tensor, shape: torch.Size, device: torch.device) -> torch.Tensor:
    """A scalar, [E] or [E, 1, ..., 1] global scale for data of `shape` -> float32 [] or [E]."""
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=device)
    if g.dim() == 0:
        return g
    if len(shape) >= 2 and g.numel() == shape[0] and g.shape[0] == shape[0] and g.dim() <= len(shape):
        return g.reshape(shape[0])
    raise ValueError(
        f"global_scale must be a scalar or one per leading index ([{shape[0] if shape else '?'}]) "
        f"for data of shape {tuple(shape)}, got shape {tuple(g.shape)}"
    )


def _broadcastable(g: torch.Tensor, ndim: int) -> torch.Tensor:
    """float32 [] or [E] -> a shape that broadcasts against an ndim-dim block-scale tensor [E, ..., n/16]."""
    return g if g.dim() == 0 else g.reshape(g.shape[0], *([1] * (ndim - 1)))


def quantize_nvfp4(
    x: torch.Tensor, global_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., n] -> (packed uint8 [..., n/2], block_scales float8_e4m3fn [..., n/16], global_scale float32).

    `global_scale=None` takes one over the whole tensor (amax / 2688). Given, it is a positive scalar or one per
    leading index (`[E]` or `[E, 1, 1]` for `x [E, N, K]`, see `per_expert_global_scale`) and comes back as `[]`
    or `[E]`. Values are first rounded to float32.
    """
    _check_input(x)
    if global_scale is None:
        g = global_scale_from_amax(x.detach().abs().amax())  # []
    else:
        g = _canonical_global(global_scale, x.shape, x.device)
        if not bool(torch.isfinite(g).all()) or not bool((g > 0).all()):
            raise ValueError("global_scale must be positive and finite")
    packed, block_scales = _quantize_blocks(x, g)
    return packed, block_scales, g


def _quantize_blocks(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n], g float32 [] or [E] (unchecked) -> (packed [..., n/2], block_scales [..., n/16])."""
    n = x.shape[-1]
    blocks = x.detach().to(torch.float32).reshape(*x.shape[:-1], n // BLOCK_SIZE, BLOCK_SIZE)  # [..., n/16, 16]
    g = _broadcastable(g, x.dim())
    block_amax = blocks.abs().amax(dim=-1)  # [..., n/16]
    block_scales = ((block_amax / E2M1_MAX) / g).clamp(E4M3_MIN_NORMAL, E4M3_MAX).to(torch.float8_e4m3fn)
    encode_scale = (1.0 / g) / block_scales.to(torch.float32)  # [..., n/16]; x * this lands in [-6, 6]
    codes = encode_e2m1(blocks * encode_scale.unsqueeze(-1)).reshape(x.shape)  # [..., n]
    return pack_nibbles(codes), block_scales


def dequantize_nvfp4(
    packed: torch.Tensor,
    block_scales: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """packed uint8 [..., n/2], block_scales e4m3 [..., n/16], global [] or [E] -> values [..., n] in `dtype`."""
    if packed.dtype != torch.uint8 or block_scales.dtype != torch.float8_e4m3fn:
        raise ValueError(f"expected uint8 codes and float8_e4m3fn scales, got {packed.dtype}, {block_scales.dtype}")
    n = 2 * packed.shape[-1]
    if packed.shape[:-1] != block_scales.shape[:-1] or n != BLOCK_SIZE * block_scales.shape[-1]:
        raise ValueError(
            f"packed {tuple(packed.shape)} and block_scales {tuple(block_scales.shape)} do not describe one tensor"
        )
    g = _broadcastable(_canonical_global(global_scale, packed.shape, packed.device), packed.dim())
    scales = g * block_scales.to(torch.float32)  # [..., n/16]
    values = decode_e2m1_pairs(packed).reshape(*packed.shape[:-1], n // BLOCK_SIZE, BLOCK_SIZE)  # [..., n/16, 16]
    return (values * scales.unsqueeze(-1)).reshape(*packed.shape[:-1], n).to(dtype)


def fake_quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype: what an FP4 tensor core sees of an activation (W4A4).

    The global scale is a calibrated one and is not checked here (that would cost a device sync per call).
    """
    _check_input(x)
    g = _canonical_global(global_scale, x.shape, x.device)
    packed, block_scales = _quantize_blocks(x, g)
    return dequantize_nvfp4(packed, block_scales, g, x.dtype)
