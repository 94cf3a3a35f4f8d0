"""NVFP4 routed experts: memory per weight, and one expert's matmul time against BF16.

Shapes are one Qwen3-30B-A3B expert (H = 2048, I = 768): gate_up multiplies x [M, H] by W [2I, H], down
h [M, I] by W [H, I]. Decode rows (M = 1..16, the tokens one expert sees in a decode step) are bound by reading W,
where NVFP4 moves 3.6x fewer bytes; prefill rows (M = 512..4096) are bound by math, where the kernel's dequantize
is overhead on top of a BF16 `tl.dot`.

- CUDA: the Triton kernel (`replica.quant.triton_nvfp4.nvfp4_matmul`) against `torch.matmul` on BF16, timed with
  CUDA events (median of `--iters` after warm-up); `--sweep` also tries a few tile shapes per M and prints the best.
- CPU: there is no kernel to time; the torch W4A16 path the experts use off-GPU (dequantize, then `F.linear`) is
  timed against BF16 and FP32 `F.linear`, at a few decode M (it dequantizes every call, so it is slower: its point
  is memory, not speed).

The memory table quantizes `--experts` real experts and sums their tensors' bytes, then scales to the full model.

    .venv/bin/python -m benchmarks.bench_nvfp4            # CUDA if present, else the CPU tables
    .venv/bin/python -m benchmarks.bench_nvfp4 --sweep --iters 200
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from replica.model.moe import Experts
from replica.quant.experts import NVFP4Experts, routed_expert_bytes
from replica.quant.nvfp4 import quantize_nvfp4
from replica.quant.triton_nvfp4 import HAS_TRITON, BlockSizes, nvfp4_matmul, nvfp4_matmul_reference

HIDDEN, INTERMEDIATE = 2048, 768  # Qwen3-30B-A3B
NUM_LAYERS, NUM_EXPERTS = 48, 128
DECODE_ROWS = (1, 2, 4, 8, 16)
PREFILL_ROWS = (512, 1024, 2048, 4096)
SWEEP_TILES = (
    BlockSizes(16, 32, 128),
    BlockSizes(16, 64, 128),
    BlockSizes(16, 64, 256),
    BlockSizes(16, 128, 128),
    BlockSizes(64, 64, 128),
    BlockSizes(64, 128, 64, num_warps=4),
    BlockSizes(128, 128, 64, num_warps=8),
    BlockSizes(128, 256, 64, num_warps=8),
)


def cuda_median_us(fn: Callable[[], object], iters: int) -> float:
    for _ in range(max(3, iters // 10)):
        fn()
    torch.cuda.synchronize()
    times_us = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        end.synchronize()
        times_us.append(float(start.elapsed_time(end)) * 1e3)
    return statistics.median(times_us)


def cpu_median_us(fn: Callable[[], object], iters: int, budget_s: float) -> float:
    fn()
    times_us: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times_us) < iters and (not times_us or time.perf_counter() < deadline):
        started = time.perf_counter()
        fn()
        times_us.append((time.perf_counter() - started) * 1e6)
    return statistics.median(times_us)


def matmul_shapes() -> list[tuple[str, int, int]]:
    return [("gate_up", 2 * INTERMEDIATE, HIDDEN), ("down", HIDDEN, INTERMEDIATE)]  # (name, N, K)


def bench_cuda(iters: int, sweep: bool) -> None:
    print(f"{torch.cuda.get_device_name()}: one expert, x [M, K] @ W [N, K]^T, median us of {iters}\n")
    header = (
        f"{'matrix':<8} {'M':>5} {'bf16 us':>9} {'nvfp4 us':>9} {'speedup':>8} {'nvfp4 W GB/s':>13} "
        f"{'nvfp4 TFLOP/s':>14}" + (f" {'best tile (m, n, k, warps)':>28} {'best us':>8}" if sweep else "")
    )
    print(header)
    print("-" * len(header))
    for name, n, k in matmul_shapes():
        w = torch.randn(n, k, device="cuda") * 0.02  # [N, K]
        w_bf16 = w.bfloat16()
        packed, scales, g = quantize_nvfp4(w)
        weight_bytes = packed.nbytes + scales.nbytes
        for m in DECODE_ROWS + PREFILL_ROWS:
            x = torch.randn(m, k, device="cuda").bfloat16()  # [M, K]
            bf16_us = cuda_median_us(partial(torch.matmul, x, w_bf16.T), iters)
            fp4_us = cuda_median_us(partial(nvfp4_matmul, x, packed, scales, g), iters)
            row = (
                f"{name:<8} {m:>5} {bf16_us:>9.1f} {fp4_us:>9.1f} {bf16_us / fp4_us:>7.2f}x "
                f"{weight_bytes / fp4_us / 1e3:>13.0f} {2 * m * n * k / fp4_us / 1e6:>14.1f}"
            )
            if sweep:
                timed = [
                    (cuda_median_us(partial(nvfp4_matmul, x, packed, scales, g, block_sizes=t), iters), t)
                    for t in SWEEP_TILES
                    if t.m <= max(16, m)
                ]
                best_us, best = min(timed)
                row += f" {f'({best.m}, {best.n}, {best.k}, {best.num_warps})':>28} {best_us:>8.1f}"
            print(row)


def bench_cpu(iters: int, budget_s: float) -> None:
    print("No CUDA device: no Triton kernel to time. The torch W4A16 path (dequantize + F.linear) against dense")
    print(f"F.linear, one expert, median us (at most {iters} runs or {budget_s:.0f} s per cell)\n")
    header = f"{'matrix':<8} {'M':>5} {'fp32 us':>10} {'bf16 us':>10} {'w4a16 us':>10} {'of which dequant us':>20}"
    print(header)
    print("-" * len(header))
    for name, n, k in matmul_shapes():
        w = torch.randn(n, k) * 0.02  # [N, K]
        w_bf16 = w.bfloat16()
        packed, scales, g = quantize_nvfp4(w)
        no_rows = torch.zeros(0, k, dtype=torch.bfloat16)  # times the dequantize alone
        dequant_us = cpu_median_us(partial(nvfp4_matmul_reference, no_rows, packed, scales, g), iters, budget_s)
        for m in (1, 16, 64):
            x = torch.randn(m, k)
            x_bf16 = x.bfloat16()
            fp32_us = cpu_median_us(partial(F.linear, x, w), iters, budget_s)
            bf16_us = cpu_median_us(partial(F.linear, x_bf16, w_bf16), iters, budget_s)
            fp4_us = cpu_median_us(partial(nvfp4_matmul_reference, x_bf16, packed, scales, g), iters, budget_s)
            print(f"{name:<8} {m:>5} {fp32_us:>10.0f} {bf16_us:>10.0f} {fp4_us:>10.0f} {dequant_us:>20.0f}")


def memory_table(num_experts: int) -> None:
    experts = Experts(num_experts, HIDDEN, INTERMEDIATE, dtype=torch.bfloat16)
    with torch.no_grad():
        experts.gate_up.normal_(0, 0.02)
        experts.down.normal_(0, 0.02)
    bf16_bytes, params = routed_expert_bytes(experts)
    fp4_bytes, _ = routed_expert_bytes(NVFP4Experts.from_experts(experts))
    model_params = NUM_LAYERS * NUM_EXPERTS * 3 * HIDDEN * INTERMEDIATE
    print(f"\nRouted-expert storage, measured on {num_experts} experts of H={HIDDEN}, I={INTERMEDIATE}")
    print(f"(full model: {NUM_LAYERS} layers x {NUM_EXPERTS} experts = {model_params / 1e9:.1f} G routed weights)\n")
    header = f"{'format':<7} {'bytes/weight':>13} {'bits/weight':>12} {'full model GiB':>15} {'vs bf16':>8}"
    print(header)
    print("-" * len(header))
    for fmt, num_bytes in (("bf16", bf16_bytes), ("nvfp4", fp4_bytes)):
        per_param = num_bytes / params
        print(
            f"{fmt:<7} {per_param:>13.4f} {8 * per_param:>12.3f} {per_param * model_params / 2**30:>15.2f} "
            f"{bf16_bytes / num_bytes:>7.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=50, help="timed runs per cell (after warm-up)")
    parser.add_argument("--cpu-budget-s", type=float, default=2.0, help="CPU: stop a cell after this many seconds")
    parser.add_argument("--sweep", action="store_true", help="CUDA: also try each tile shape and print the best")
    parser.add_argument("--experts", type=int, default=8, help="experts quantized for the memory table")
    parser.add_argument("--cpu", action="store_true", help="the CPU tables even when CUDA is present")
    args = parser.parse_args()
    torch.manual_seed(0)
    if torch.cuda.is_available() and HAS_TRITON and not args.cpu:
        bench_cuda(args.iters, args.sweep)
    else:
        bench_cpu(args.iters, args.cpu_budget_s)
    memory_table(args.experts)


if __name__ == "__main__":
    main()
