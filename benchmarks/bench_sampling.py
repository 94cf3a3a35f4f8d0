"""The cost of deciding a step's tokens when a batch mixes greedy and sampled requests.

A speculative step verifies k drafts, so each sequence brings k + 1 rows of logits; the replica turns them into
distributions (`sampler.probabilities`: temperature, top-k/top-p, softmax) and draws (`sampler.sample`: one
Exp(1) per row and token). On an accelerator the sampler computes every row, sorts every row for top-p and draws
for every token, so that a step makes one host transfer; on a CPU it skips greedy rows, ranks a nucleus (`topk`)
and draws for its tokens only (`replica.model.host.HOST_DECISIONS_ON_CPU`). The table times both ways on this CPU,
on the same logits, and checks their tokens equal.

    .venv/bin/python -m benchmarks.bench_sampling              # vocabulary 2048 (the demo model's), k = 8
    .venv/bin/python -m benchmarks.bench_sampling --vocab 32768 --k 4
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial

import torch

from replica.engine.sampler import SamplingTensors, noise_keys, probabilities, sample
from replica.engine.sampling import SamplingParams
from replica.model import host

MIXES = ((15, 1), (8, 8), (0, 16))
"""(greedy, sampled) sequences per batch."""


def _step(logits: torch.Tensor, tensors: SamplingTensors, keys: torch.Tensor, *, host_decisions: bool) -> torch.Tensor:
    host.HOST_DECISIONS_ON_CPU = host_decisions
    try:
        return sample(probabilities(logits, tensors), keys, tensors.drawing if host_decisions else None)
    finally:
        host.HOST_DECISIONS_ON_CPU = True


def median_ms(step: Callable[[], object], repeats: int) -> float:
    for _ in range(5):
        step()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2] * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--k", type=int, default=8, help="drafts verified per sequence (rows = k + 1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{now}; {platform.machine()}, {args.threads} threads; vocabulary {args.vocab}, k = {args.k}; top_p 0.95")
    print("| batch | rows | every row, sorted ms | host decisions ms | x |")
    print("| --- | ---: | ---: | ---: | ---: |")
    generator = torch.Generator().manual_seed(0)
    for num_greedy, num_sampled in MIXES:
        params = [SamplingParams(temperature=0.0)] * num_greedy
        params += [SamplingParams(temperature=0.8, top_p=0.95)] * num_sampled
        tensors = SamplingTensors.build(params, torch.device("cpu")).repeat([args.k + 1] * len(params))
        rows = len(params) * (args.k + 1)
        logits = torch.randn(rows, args.vocab, generator=generator) * 3
        keys = noise_keys(torch.arange(rows), torch.full((rows, 1), 7)).squeeze(-1)

        before = partial(_step, logits, tensors, keys, host_decisions=False)
        now_ = partial(_step, logits, tensors, keys, host_decisions=True)
        assert torch.equal(before(), now_())
        old_ms, new_ms = median_ms(before, args.repeats), median_ms(now_, args.repeats)
        label = f"{num_greedy} greedy + {num_sampled} sampled"
        print(f"| {label} | {rows} | {old_ms:.2f} | {new_ms:.2f} | {old_ms / new_ms:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
