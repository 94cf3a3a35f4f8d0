"""One expert's NVFP4 linear in Triton: y [M, N] = x [M, K] @ dequant(W [N, K])^T, W never materialised.

Each program owns a [BLOCK_M, BLOCK_N] tile of y and walks K in BLOCK_K steps: it loads x's tile, W's packed bytes
[BLOCK_N, BLOCK_K/2] and their E4M3 scales [BLOCK_N, BLOCK_K/16], decodes both with integer ops (no lookup table,
no float8 loads, so `TRITON_INTERPRET=1` runs it on a CPU), multiplies each 16-value block by its scale and feeds
`tl.dot` in x's dtype, accumulating in float32. E2M1 times an E4M3 scale has at most 6 significant bits, so the
dequantized tile is exact in BF16; the FP32 global scale multiplies the accumulator once at the end.

`nvfp4_matmul_reference` is the same product in plain torch (dequantize, then `F.linear`) and what the kernel is
tested against. Importing this module works without Triton; `HAS_TRITON` says whether the kernel exists.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from replica.quant.nvfp4 import BLOCK_SIZE, dequantize_nvfp4

try:
    import triton  # type: ignore[import-untyped,unused-ignore]
    import triton.language as tl  # type: ignore[import-untyped,unused-ignore]

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised on machines without Triton
    HAS_TRITON = False


class BlockSizes(NamedTuple):
    """Tile of one program: rows of x, rows of W, and K per step (a multiple of 32: 16 bytes, 2 scales)."""

    m: int
    n: int
    k: int
    num_warps: int = 4
    num_stages: int = 3


def default_block_sizes(num_rows: int) -> BlockSizes:
    """Decode (a few rows) wants many narrow programs to spread W's bytes over SMs; prefill wants big tiles."""
    if num_rows <= 16:
        return BlockSizes(16, 64, 128)
    if num_rows <= 128:
        return BlockSizes(64, 64, 128)
    return BlockSizes(128, 128, 64, num_warps=8)


def nvfp4_matmul_reference(
    x: torch.Tensor, packed: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor
) -> torch.Tensor:
    """x [M, K], packed [N, K/2], block_scales [N, K/16], global [] -> y [M, N] in x's dtype."""
    return F.linear(x, dequantize_nvfp4(packed, block_scales, global_scale, x.dtype))


def nvfp4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    block_scales: torch.Tensor,
    global_scale: torch.Tensor,
    *,
    block_sizes: BlockSizes | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16, fp16 or fp32), packed uint8 [N, K/2], block_scales e4m3 [N, K/16], global [] -> y [M, N]."""
    if not HAS_TRITON:
        raise RuntimeError("nvfp4_matmul needs Triton; use nvfp4_matmul_reference")
    if x.dim() != 2 or packed.dim() != 2 or block_scales.dim() != 2:
        raise ValueError("nvfp4_matmul multiplies 2-D x [M, K] by one 2-D packed weight [N, K/2]")
    num_rows, k = x.shape
    n = packed.shape[0]
    if packed.dtype != torch.uint8 or block_scales.dtype != torch.float8_e4m3fn:
        raise ValueError(f"expected uint8 codes and float8_e4m3fn scales, got {packed.dtype}, {block_scales.dtype}")
    if k % BLOCK_SIZE or packed.shape[1] * 2 != k or tuple(block_scales.shape) != (n, k // BLOCK_SIZE):
        raise ValueError(
            f"x {tuple(x.shape)}, packed {tuple(packed.shape)}, block_scales {tuple(block_scales.shape)} do not fit"
        )
    if global_scale.numel() != 1:
        raise ValueError(f"nvfp4_matmul takes one global scale, got shape {tuple(global_scale.shape)}")
    tile = block_sizes or default_block_sizes(num_rows)
    if tile.k % 32 or min(tile.m, tile.n) < 16:
        raise ValueError(f"block sizes {tile} need k a multiple of 32 and m, n >= 16")
    g = global_scale.to(device=x.device, dtype=torch.float32).reshape(1)
    scale_bits = block_scales.view(torch.uint8)  # [N, K/16]; decoded in the kernel
    y = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)  # [M, N]
    grid = (triton.cdiv(num_rows, tile.m), triton.cdiv(n, tile.n))
    _nvfp4_matmul_kernel[grid](
        x, packed, scale_bits, g, y,
        num_rows, n, k,
        x.stride(0), x.stride(1), packed.stride(0), packed.stride(1),
        scale_bits.stride(0), scale_bits.stride(1), y.stride(0), y.stride(1),
        BLOCK_M=tile.m, BLOCK_N=tile.n, BLOCK_K=tile.k,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 x: exact products, not TF32
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    return y


if HAS_TRITON:

    @triton.jit  # type: ignore[untyped-decorator,misc,unused-ignore]
    def _decode_e2m1(codes):  # type: ignore[no-untyped-def]
        """4-bit codes (int32) -> float32: magnitude m, e = m >> 1; e == 0: (m & 1) / 2, else (2 + m&1) 2^e / 4."""
        magnitude = codes & 7
        exponent = magnitude >> 1
        mantissa = (magnitude & 1).to(tl.float32)
        normal = (2.0 + mantissa) * (1 << exponent).to(tl.float32) * 0.25
        value = tl.where(exponent == 0, mantissa * 0.5, normal)
        return tl.where((codes & 8) != 0, -value, value)

    @triton.jit  # type: ignore[untyped-decorator,misc,unused-ignore]
    def _decode_e4m3(bits):  # type: ignore[no-untyped-def]
        """E4M3 bytes (int32, sign 0) -> float32, built as float32 bits: exponent bias 7 -> 127, 3 mantissa bits."""
        exponent = (bits >> 3) & 0xF
        mantissa = bits & 7
        normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
        return tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9

    @triton.jit  # type: ignore[untyped-decorator,misc,unused-ignore]
    def _nvfp4_matmul_kernel(  # type: ignore[no-untyped-def]
        x_ptr, w_ptr, s_ptr, g_ptr, y_ptr,
        M, N, K,
        stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, stride_ym, stride_yn,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        offs_k = tl.arange(0, BLOCK_K)  # [BK] values
        offs_b = tl.arange(0, BLOCK_K // 2)  # [BK/2] packed bytes
        offs_s = tl.arange(0, BLOCK_K // 16)  # [BK/16] block scales
        row_ok = offs_m[:, None] < M
        col_ok = offs_n[:, None] < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            x_ptrs = x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk
            x = tl.load(x_ptrs, mask=row_ok & (k[None, :] < K), other=0.0)  # [BM, BK]
            b = k0 // 2 + offs_b
            w_ptrs = w_ptr + offs_n[:, None] * stride_wn + b[None, :] * stride_wk
            packed = tl.load(w_ptrs, mask=col_ok & (b[None, :] < K // 2), other=0).to(tl.int32)  # [BN, BK/2]
            s = k0 // 16 + offs_s
            s_ptrs = s_ptr + offs_n[:, None] * stride_sn + s[None, :] * stride_sk
            scale_bits = tl.load(s_ptrs, mask=col_ok & (s[None, :] < K // 16), other=0).to(tl.int32)  # [BN, BK/16]
            codes = tl.interleave(packed & 0xF, packed >> 4)  # [BN, BK]: even element from the low nibble
            w = tl.reshape(_decode_e2m1(codes), (BLOCK_N, BLOCK_K // 16, 16)) * _decode_e4m3(scale_bits)[:, :, None]
            w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(x.dtype)  # [BN, BK], exact in bf16
            acc = tl.dot(x, tl.trans(w), acc, input_precision=INPUT_PRECISION)  # [BM, BN] fp32
        acc = acc * tl.load(g_ptr)
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok & (offs_n[None, :] < N))
