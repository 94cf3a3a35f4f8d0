"""Block hashing cost per prompt: direct (`hash_text`) against the router's `ChainMemo`, interleaved.

Each iteration builds the next prompt and hashes it both ways, alternating which goes first, so both see the
same machine state (timings on shared machines drift by more than the difference being measured otherwise).
Workloads, each ~32 KiB of text (~8k tokens, 512 blocks of 64 bytes):

- fresh: every prompt is new (the memo only adds work);
- half shared: a 16 KiB system prompt, then 16 KiB never seen before;
- conversation: each turn resends the conversation so far plus a 1 KiB new turn (a new conversation every
  24 turns, so prompts stay around 8k tokens).

    taskset -c 0 .venv/bin/python -m benchmarks.bench_hashing
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterator

from router.policy.hashing import ChainMemo, hash_text, namespace_seed

SEED = namespace_seed("bench-model")


def fresh() -> Iterator[bytes]:
    while True:
        yield os.urandom(32 * 1024)


def half_shared() -> Iterator[bytes]:
    system = os.urandom(16 * 1024)
    while True:
        yield system + os.urandom(16 * 1024)


def conversation() -> Iterator[bytes]:
    while True:
        text = os.urandom(8 * 1024)
        for _ in range(24):
            text += os.urandom(1024)
            yield text


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=2000, help="prompts per workload")
    args = parser.parse_args()
    workloads: dict[str, Callable[[], Iterator[bytes]]] = {
        "fresh": fresh,
        "half shared": half_shared,
        "conversation": conversation,
    }
    print(f"{args.prompts} prompts per workload, microseconds per prompt\n")
    header = f"{'workload':<14} {'direct p50':>11} {'memo p50':>9} {'direct p99':>11} {'memo p99':>9} {'blocks':>7}"
    print(header)
    print("-" * len(header))
    for name, make in workloads.items():
        memo = ChainMemo()
        prompts = make()
        direct_us: list[float] = []
        memo_us: list[float] = []
        num_blocks = 0
        for i in range(args.prompts):
            data = next(prompts)
            order = (0, 1) if i % 2 else (1, 0)
            for which in order:
                started = time.perf_counter()
                hashes = hash_text(data, SEED) if which == 0 else memo.hash_text(data, SEED)
                elapsed_us = (time.perf_counter() - started) * 1e6
                (direct_us if which == 0 else memo_us).append(elapsed_us)
            num_blocks += len(hashes)
        print(
            f"{name:<14} {percentile(direct_us, 0.5):>11.1f} {percentile(memo_us, 0.5):>9.1f} "
            f"{percentile(direct_us, 0.99):>11.1f} {percentile(memo_us, 0.99):>9.1f} {num_blocks // args.prompts:>7}"
        )


if __name__ == "__main__":
    main()
