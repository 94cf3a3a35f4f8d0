"""The Triton NVFP4 matmul against its torch reference: on the CPU through TRITON_INTERPRET=1, on CUDA when marked.

The interpreter reads TRITON_INTERPRET when a kernel is decorated, so the CPU check runs in a child Python that
sets it before importing anything. The interpreter multiplies bfloat16 `tl.dot` operands as raw bits
(triton-lang/triton#11584), so on the CPU the kernel is checked with FP32 and FP16 activations; BF16 is in the GPU test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

REPO_ROOT = Path(__file__).resolve().parents[3]

INTERPRETED_CHECK = textwrap.dedent(
    """
    import torch
    from replica.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4
    from replica.quant.triton_nvfp4 import BlockSizes, nvfp4_matmul, nvfp4_matmul_reference

    gen = torch.Generator().manual_seed(0)
    cases = [
        # M, N, K, dtype, tile; K = 160 and 96 leave a partial K step, N = 40 a partial N tile
        (1, 64, 128, torch.float32, None),
        (5, 48, 96, torch.float32, None),
        (33, 40, 160, torch.float32, BlockSizes(16, 16, 64)),
        (7, 32, 64, torch.float16, None),
    ]
    for m, n, k, dtype, tile in cases:
        w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 2, n)[:, None]  # [N, K], rows far apart
        x = torch.randn(m, k, generator=gen).to(dtype)  # [M, K]
        packed, scales, g = quantize_nvfp4(w)
        y = nvfp4_matmul(x, packed, scales, g, block_sizes=tile)  # [M, N]
        ref = nvfp4_matmul_reference(x.float(), packed, scales, g)
        assert y.shape == (m, n) and y.dtype == dtype, (y.shape, y.dtype)
        # Errors are measured against sum_k |x w|, the scale of a summation-order error: FP32 differs only in
        # that order (K * 2^-24 at worst), FP16 adds its output rounding (2^-11).
        magnitude = x.float().abs() @ dequantize_nvfp4(packed, scales, g).abs().T  # [M, N]
        err = ((y.float() - ref).abs() / magnitude).max().item()
        assert err < (1e-6 if dtype == torch.float32 else 1e-3), (m, n, k, dtype, err)

    # Every byte and every non-NaN E4M3 scale (subnormals too, which quantize never makes) through the decoders.
    n, k = 32, 512
    packed = torch.arange(n * k // 2).remainder(256).to(torch.uint8).reshape(n, k // 2)  # [N, K/2]
    scales = torch.arange(n * k // 16).remainder(127).to(torch.uint8).view(torch.float8_e4m3fn).reshape(n, k // 16)
    x = torch.randn(3, k, generator=gen)
    g = torch.tensor(0.5)
    y = nvfp4_matmul(x, packed, scales, g)
    ref = nvfp4_matmul_reference(x, packed, scales, g)
    magnitude = x.abs() @ dequantize_nvfp4(packed, scales, g).abs().T
    assert ((y - ref).abs() / magnitude).max().item() < 1e-6
    print("ok")
    """
)


def test_kernel_matches_reference_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", INTERPRETED_CHECK], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=90
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-4000:]


def test_module_imports_without_triton() -> None:
    probe = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # import triton now raises ImportError
        import torch
        from replica.quant import triton_nvfp4
        from replica.quant.nvfp4 import quantize_nvfp4
        assert not triton_nvfp4.HAS_TRITON
        packed, scales, g = quantize_nvfp4(torch.randn(8, 32))
        x = torch.randn(3, 32)
        assert triton_nvfp4.nvfp4_matmul_reference(x, packed, scales, g).shape == (3, 8)
        try:
            triton_nvfp4.nvfp4_matmul(x, packed, scales, g)
        except RuntimeError as exc:
            assert "needs Triton" in str(exc)
        else:
            raise AssertionError("nvfp4_matmul ran without Triton")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", probe], env=env, cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]


def test_bad_shapes_raise_before_launching() -> None:
    from replica.quant.nvfp4 import quantize_nvfp4
    from replica.quant.triton_nvfp4 import BlockSizes, nvfp4_matmul

    packed, scales, g = quantize_nvfp4(torch.randn(16, 64))
    with pytest.raises(ValueError, match="do not fit"):
        nvfp4_matmul(torch.randn(2, 32), packed, scales, g)
    with pytest.raises(ValueError, match="one global scale"):
        nvfp4_matmul(torch.randn(2, 64), packed, scales, torch.ones(2))
    with pytest.raises(ValueError, match="multiple of 32"):
        nvfp4_matmul(torch.randn(2, 64), packed, scales, g, block_sizes=BlockSizes(16, 16, 48))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 16, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_matches_reference_on_cuda(m: int, dtype: torch.dtype) -> None:
    from replica.quant.nvfp4 import quantize_nvfp4
    from replica.quant.triton_nvfp4 import nvfp4_matmul, nvfp4_matmul_reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1536, 2048, device="cuda", generator=gen) * 0.02  # [2I, H] of a Qwen3-30B-A3B expert
    x = torch.randn(m, 2048, device="cuda", generator=gen).to(dtype)
    packed, scales, g = quantize_nvfp4(w)
    y = nvfp4_matmul(x, packed, scales, g).float()
    ref = nvfp4_matmul_reference(x.float(), packed, scales, g)
    # Dequantized weights are exact in any of these dtypes; FP32 x runs IEEE products, BF16 and FP16 the output's
    # own rounding (2^-8, 2^-11).
    rtol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert ((y - ref).norm() / ref.norm()).item() < rtol
