"""Routed experts on the CPU: weights row-major ([E, out, in], as Hugging Face stores them and training keeps
them) against the serving layout (`Experts.use_serving_layout`: stored transposed, [E, in, out] in memory).

Every expert matmul multiplies x [n, in] by the transposed weight. Row-major weights make that operand a strided
view; in the serving layout it is contiguous. Each row times one layer's routed experts (`Experts.forward`, the
engine's path: grouping, the two grouped GEMMs, the weighted scatter) at the demo model's shapes (16 experts,
H = I = 128, top-2) for a step of T tokens, with the weights left in the CPU caches ("warm") or pushed out of them
first by a 64 MB write ("flushed", as in serving, where the KV cache and the other layers' weights pass through
the caches between two uses of a layer's experts). Medians over `--repeats`; the two layouts alternate.

    taskset -c 1 .venv/bin/python -m benchmarks.bench_expert_layout
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from replica.model.moe import Experts

E, H, INTER, A = 16, 128, 128, 2  # experts, hidden, expert hidden, top-k


def forward_us(experts: list[Experts], tokens: int, *, flush: torch.Tensor | None, repeats: int) -> list[float]:
    """Median microseconds of one forward of each of `experts` on the same T tokens, alternating between them."""
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:A] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, A, generator=gen), dim=-1)
    times: list[list[float]] = [[] for _ in experts]
    with torch.inference_mode():
        for _ in range(repeats):
            for module, samples in zip(experts, times, strict=True):
                if flush is not None:
                    flush.add_(1.0)
                started = time.perf_counter()
                module(x, ids, weights)
                samples.append(time.perf_counter() - started)
    return [statistics.median(samples) * 1e6 for samples in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    row_major = Experts(E, H, INTER, dtype=torch.float32)
    with torch.no_grad():
        row_major.gate_up.normal_(0, 0.02)
        row_major.down.normal_(0, 0.02)
    serving = copy.deepcopy(row_major)
    serving.use_serving_layout()
    flush = torch.zeros(16 * 1024 * 1024)  # 64 MB
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); one layer's routed experts, microseconds")
    print(
        f"{'tokens':>6} {'warm row-major':>15} {'warm serving':>13} {'flushed row-major':>18} "
        f"{'flushed serving':>16} {'flushed gain':>13}"
    )
    for tokens in (1, 4, 16, 32, 112, 204, 1024):
        warm = forward_us([row_major, serving], tokens, flush=None, repeats=args.repeats)
        flushed = forward_us([row_major, serving], tokens, flush=flush, repeats=args.repeats)
        gain = 1.0 - flushed[1] / flushed[0]
        print(
            f"{tokens:>6} {warm[0]:>15.0f} {warm[1]:>13.0f} {flushed[0]:>18.0f} {flushed[1]:>16.0f} "
            f"{100 * gain:>12.0f}%"
        )


if __name__ == "__main__":
    main()
