"""NVFP4 quantize/dequantize against torchao's NVFP4Tensor, the spec: packed bytes, scales and values bit for bit."""

from __future__ import annotations

import pytest
import torch

from replica.quant.nvfp4 import (
    E2M1_VALUES,
    decode_e2m1,
    dequantize_nvfp4,
    per_expert_global_scale,
    quantize_nvfp4,
    unpack_nibbles,
)

nvfp4_tensor = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")


def torchao_quantize(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchao's (packed, scales as uint8 bits, dequantized FP32) for x with a scalar or [E, 1, 1] global."""
    t = nvfp4_tensor.NVFP4Tensor.to_nvfp4(x.contiguous(), per_tensor_scale=global_scale)
    return t.qdata, t.scale.view(torch.uint8), t.dequantize(torch.float32)


def torchao_global(x: torch.Tensor) -> torch.Tensor:
    g: torch.Tensor = nvfp4_tensor.per_tensor_amax_to_scale(x.abs().amax())
    return g


def assert_matches_torchao(x: torch.Tensor, global_scale: torch.Tensor | None = None) -> None:
    packed, scales, g = quantize_nvfp4(x, global_scale)
    ref_global = torchao_global(x) if global_scale is None else global_scale.reshape(-1, *[1] * (x.dim() - 1))
    if global_scale is not None and global_scale.dim() == 0:
        ref_global = global_scale
    ref_packed, ref_scale_bits, ref_values = torchao_quantize(x, ref_global)
    assert torch.equal(g, ref_global.reshape(g.shape))
    assert torch.equal(packed, ref_packed)
    assert torch.equal(scales.view(torch.uint8), ref_scale_bits)
    values = dequantize_nvfp4(packed, scales, g, torch.float32)
    assert torch.equal(values.view(torch.int32), ref_values.view(torch.int32))  # -0.0 included


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_data_matches_torchao_bit_for_bit(dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows_scale = torch.logspace(-4, 4, 96)[:, None]  # blocks far below the tensor amax exercise the scale floor
    x = (torch.randn(96, 512, generator=gen) * rows_scale).to(dtype)
    assert_matches_torchao(x)


def test_heavy_tailed_data_matches_torchao() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.distributions.StudentT(2.0).sample((64, 256)) * (torch.rand(64, 256, generator=gen) < 0.5)
    assert_matches_torchao(x)


def test_dequantize_matches_torchao_in_bf16() -> None:
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    packed, scales, g = quantize_nvfp4(x)
    ref = nvfp4_tensor.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=torchao_global(x)).dequantize(torch.bfloat16)
    assert torch.equal(dequantize_nvfp4(packed, scales, g, torch.bfloat16).view(torch.int16), ref.view(torch.int16))


def test_e2m1_table_matches_torchao_for_all_16_codes() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    ours = decode_e2m1(codes)
    assert torch.equal(ours.view(torch.int32), kernels.f4_unpacked_to_f32(codes).view(torch.int32))
    assert ours[:8].tolist() == list(E2M1_VALUES)


def test_exact_ties_round_to_even_and_saturate() -> None:
    # With global 1 and a block amax of 6 the block scale is exactly 1, so these values reach E2M1 unchanged.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expected = [0, 2, 2, 4, 4, 6, 6]  # codes of 0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0: the even neighbour each time
    block = torch.tensor([6.0, *ties, *[-t for t in ties], 0.0])  # [16]
    packed, scales, _ = quantize_nvfp4(block[None, :], torch.tensor(1.0))
    assert scales.float().item() == 1.0
    codes = unpack_nibbles(packed)[0].tolist()
    assert codes == [7, *expected, *[c | 8 for c in expected], 0]
    assert_matches_torchao(block[None, :], torch.tensor(1.0))
    # One ulp either side of each tie leaves no tie: nearest wins.
    above = torch.nextafter(torch.tensor(ties), torch.tensor(10.0))
    below = torch.nextafter(torch.tensor(ties), torch.tensor(0.0))
    for nudged, shift in ((above, 1), (below, 0)):
        block = torch.cat([torch.tensor([6.0]), nudged, torch.zeros(8)])[None, :]
        codes = unpack_nibbles(quantize_nvfp4(block, torch.tensor(1.0))[0])[0, 1:8].tolist()
        assert codes == list(range(shift, 7 + shift))
        assert_matches_torchao(block, torch.tensor(1.0))


def test_ties_after_a_derived_global_scale_match_torchao() -> None:
    # amax / 2688 is inexact, so scaled values land an ulp off the midpoints; torchao decides which side.
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x = torch.cat([ties, -ties]).repeat(8, 4) * torch.logspace(-2, 2, 8)[:, None]  # [8, 64]
    assert_matches_torchao(x)


def test_values_beyond_a_calibrated_global_saturate() -> None:
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(5)) * 100
    small_global = torch.tensor(0.01)  # amax / 2688 would be ~0.15: block scales want > 448
    packed, scales, _ = quantize_nvfp4(x, small_global)
    assert scales.float().max().item() == 448.0
    magnitudes = unpack_nibbles(packed) & 7
    assert (magnitudes == 7).any()
    assert_matches_torchao(x, small_global)


def test_all_zero_blocks_and_all_zero_tensor() -> None:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(6))
    x[:, 16:32] = 0.0
    x[3] = 0.0
    assert_matches_torchao(x)
    packed, scales, g = quantize_nvfp4(torch.zeros(4, 32))
    assert g.item() == 1.0  # amax 0: any positive global works, torchao's 0 would give NaN scales
    assert packed.eq(0).all()
    assert scales.float().eq(2.0**-6).all()
    assert dequantize_nvfp4(packed, scales, g).eq(0).all()


@pytest.mark.parametrize("magnitude", [1e-30, 1e-12, 1e12, 1e30])
def test_tiny_and_huge_magnitudes(magnitude: float) -> None:
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(7)) * magnitude
    assert_matches_torchao(x)
    packed, scales, g = quantize_nvfp4(x)
    error = (dequantize_nvfp4(packed, scales, g) - x) / magnitude  # norms of 1e30-sized values overflow fp32
    relative_rms = error.norm() / (x / magnitude).norm()
    assert relative_rms < 0.15  # the same relative error at every scale: the global absorbs the magnitude


def test_per_expert_global_scales_match_torchao_per_expert_and_stacked() -> None:
    gen = torch.Generator().manual_seed(8)
    magnitudes = torch.tensor([1e-3, 1.0, 30.0, 5e3])[:, None, None]
    w = (torch.randn(4, 48, 128, generator=gen) * magnitudes).bfloat16()  # [E, N, K]
    g = per_expert_global_scale(w)  # [E]
    assert g.shape == (4,)
    assert torch.equal(g, nvfp4_tensor.per_tensor_amax_to_scale(w.float().abs().amax(dim=(1, 2))))
    packed, scales, g_out = quantize_nvfp4(w, g)
    assert torch.equal(g_out, g)
    assert_matches_torchao(w, g)  # torchao's stacked [E, 1, 1] path
    for expert in range(4):
        ref_packed, ref_scale_bits, _ = torchao_quantize(w[expert], g[expert])
        assert torch.equal(packed[expert], ref_packed)
        assert torch.equal(scales[expert].view(torch.uint8), ref_scale_bits)
    # [E, 1, 1] is accepted the same; one global for all experts would flush the small expert to zero.
    assert torch.equal(quantize_nvfp4(w, g.reshape(4, 1, 1))[0], packed)
    flushed = dequantize_nvfp4(*quantize_nvfp4(w))[0]
    assert flushed.abs().max() < dequantize_nvfp4(packed, scales, g)[0].abs().max()


def test_layout_even_element_in_low_nibble() -> None:
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 6.0, -1.0  # codes 7 and 8 | 2
    packed, _, _ = quantize_nvfp4(x, torch.tensor(1.0))
    assert packed[0, 0].item() == 0x7 | (0xA << 4)


def test_bad_inputs_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(torch.randn(4, 24))
    with pytest.raises(ValueError, match="floating-point"):
        quantize_nvfp4(torch.ones(4, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="global_scale must be a scalar or one per leading index"):
        quantize_nvfp4(torch.randn(4, 8, 16), torch.ones(3))
    with pytest.raises(ValueError, match="positive and finite"):
        quantize_nvfp4(torch.randn(4, 16), torch.tensor(0.0))
    packed, scales, g = quantize_nvfp4(torch.randn(4, 32))
    with pytest.raises(ValueError, match="do not describe one tensor"):
        dequantize_nvfp4(packed[:, :8], scales, g)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_nvfp4(packed, scales.float(), g)
    with pytest.raises(ValueError, match="stacked"):
        per_expert_global_scale(torch.randn(16))
