"""Routed experts' grouped GEMMs on the CPU: weights row-major ([E, out, in], as Hugging Face stores them) against
stored transposed ([E, in, out] in memory, the layout `Experts.use_serving_layout` gives loaded models).

Every expert matmul multiplies x [n, in] by the transposed weight. Row-major weights make that operand a strided
view; stored transposed, it is contiguous. Each row times one SwiGLU of the demo model's shapes (16 experts,
H = I = 128, top-2) through two `grouped_mm` calls, for a step of T tokens, with the weights left in the CPU
caches ("warm") or pushed out of them first by a 64 MB write ("flushed", as in serving, where the KV cache and the
other layers' weights pass through the caches between two uses of a layer's experts). Medians over `--repeats`.

    taskset -c 1 .venv/bin/python benchmarks/bench_expert_layout.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

E, H, INTER, A = 16, 128, 128, 2  # experts, hidden, expert hidden, top-k


def grouped_swiglu_us(
    tokens: int, gate_up: torch.Tensor, down: torch.Tensor, *, flush: torch.Tensor | None, repeats: int
) -> float:
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, E, (tokens * A,), generator=gen)
    order = ids.sort(stable=True).indices
    ends = torch.bincount(ids, minlength=E).cumsum(0, dtype=torch.int32)
    x = torch.randn(tokens, H, generator=gen)[order // A]
    times = []
    for _ in range(repeats):
        if flush is not None:
            flush.add_(1.0)
        started = time.perf_counter()
        gate, up = F.grouped_mm(x, gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        F.grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=ends)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not hasattr(F, "grouped_mm"):
        raise SystemExit(f"torch {torch.__version__} has no grouped_mm")
    row_major = (torch.randn(E, 2 * INTER, H), torch.randn(E, H, INTER))
    transposed = tuple(w.transpose(1, 2).contiguous().transpose(1, 2) for w in row_major)
    flush = torch.zeros(16 * 1024 * 1024)  # 64 MB
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); one layer's SwiGLU, microseconds")
    print(
        f"{'tokens':>6} {'warm row-major':>15} {'warm transposed':>16} {'flushed row-major':>18} "
        f"{'flushed transposed':>19} {'flushed gain':>13}"
    )
    for tokens in (1, 4, 16, 32, 112, 204, 1024):
        figures = [
            grouped_swiglu_us(tokens, *weights, flush=cache, repeats=args.repeats)
            for cache in (None, flush)
            for weights in (row_major, transposed)
        ]
        gain = 1.0 - figures[3] / figures[2]
        print(
            f"{tokens:>6} {figures[0]:>15.0f} {figures[1]:>16.0f} {figures[2]:>18.0f} {figures[3]:>19.0f} "
            f"{100 * gain:>12.0f}%"
        )


if __name__ == "__main__":
    main()
