"""Routing decision cost: hash + prefix match + policy, for an 8k-token prompt against 64 replicas.

The index is first filled with 1,000,000 blocks (prompts of 512 blocks sharing system-prompt prefixes, spread
over the replicas), then each measured decision hashes a fresh ~8k-token prompt (32 KiB of text in text mode,
8,192 token ids in token mode) whose first half is cached on a few replicas, matches it, and asks the policy.
As in the router, hashing goes through a `ChainMemo` (the shared first half is hashed once) and stops, for the
decision, at the first block the index does not hold (`PromptChain.prefix`); the rest of the prompt is hashed and
the prompt recorded after the decision, once the router has written the request to its replica: the "after"
column (recorded into an index of its own, so that every measured decision sees the same index). In token mode the
ids are checked and packed when the request is parsed, as in the router (that cost is printed under the table).
`--no-memo` hashes every block afresh, all of them before the decision. Prints p50/p99 in microseconds per step.
Run pinned to one core:

    taskset -c 0 .venv/bin/python benchmarks/bench_routing.py
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time

from router.policy.config import POLICY_NAMES, build_policy, parse_policy_config
from router.policy.hashing import ChainMemo, hash_text, hash_tokens, namespace_seed
from router.policy.prefix_index import PrefixIndex, PrefixIndexConfig
from router.policy.routing_text import completion_routing_key
from router.policy.types import ReplicaState, RouteRequest

BLOCKS_PER_PROMPT = 512
TEXT_BLOCK = 64
BYTES_PER_TOKEN = 4.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def fill_index(index: PrefixIndex, replicas: list[str], num_blocks: int, rng: random.Random) -> None:
    """Record prompts until the index holds `num_blocks` distinct blocks."""
    shared = [[rng.getrandbits(64) for _ in range(64)] for _ in range(32)]  # 32 system prompts of 64 blocks
    now = 0.0
    i = 0
    while i % 64 or index.stats().num_blocks < num_blocks:
        hashes = shared[i % len(shared)] + [rng.getrandbits(64) for _ in range(BLOCKS_PER_PROMPT - 64)]
        index.record(replicas[i % len(replicas)], hashes, now=now)
        now += 0.001
        i += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument(
        "--no-memo", action="store_true", help="hash every block afresh, without the router's ChainMemo"
    )
    parser.add_argument(
        "--no-after",
        action="store_true",
        help="skip the work after the decision (the rest of the hashing, the record), which cools the CPU caches",
    )
    parser.add_argument("--policies", default="estimated_ttft,sglang_cache_aware,dynamo_kv,llmd_weighted,round_robin")
    args = parser.parse_args()
    rng = random.Random(7)
    replicas = [f"replica-{i}" for i in range(args.replicas)]
    # Capacity large enough that the fill itself is not evicted: per-replica share of 1M blocks plus headroom.
    capacity = 2 * args.blocks // args.replicas + BLOCKS_PER_PROMPT
    index = PrefixIndex(PrefixIndexConfig(capacity_blocks=capacity, ttl_s=1e9))
    for r in replicas:
        index.add_replica(r)
    t0 = time.perf_counter()
    fill_index(index, replicas, args.blocks, rng)
    print(f"filled {index.stats().num_blocks:,} blocks in {time.perf_counter() - t0:.1f} s")

    seed = namespace_seed("bench-model")
    system_text = os.urandom(16 * 1024)
    system_tokens = [rng.randrange(150_000) for _ in range(4096)]
    # Half of each measured prompt is a system prompt cached on three replicas.
    for r in replicas[:3]:
        index.record(r, hash_text(system_text, seed, TEXT_BLOCK), now=1e6)
        index.record(r, hash_tokens(system_tokens, seed), now=1e6)
    states = [
        ReplicaState(
            id=r,
            in_flight=rng.randrange(8),
            waiting=rng.randrange(4),
            waiting_prompt_tokens=rng.randrange(20_000),
            streaming=rng.randrange(8),
            num_running=rng.randrange(16),
            num_waiting=rng.randrange(4),
            kv_usage=rng.random(),
            prefill_tokens_per_s=20_000.0,
            kv_capacity_blocks=capacity,
        )
        for r in replicas
    ]
    print(f"{args.decisions} decisions per row, {args.replicas} replicas, 8k-token prompts, times in microseconds\n")
    columns = ("hash p50", "match p50", "select p50", "total p50", "total p99", "after p50")
    header = f"{'policy':<20} {'mode':<6} " + " ".join(f"{c:>10}" for c in columns)
    print(header)
    print("-" * len(header))
    memo = ChainMemo()
    # The "after" column records into an index of its own, so that the decisions measured all see the same index.
    recorded = PrefixIndex(PrefixIndexConfig(capacity_blocks=capacity, ttl_s=1e9))
    for r in replicas:
        recorded.add_replica(r)
    parse_lines: list[str] = []
    print(
        "hashing through the router's ChainMemo (half of each prompt is a prefix seen before), as far as the index"
        " holds the prompt"
        if not args.no_memo
        else "hashing every block afresh (--no-memo)"
    )
    for name in args.policies.split(","):
        if name not in POLICY_NAMES:
            raise SystemExit(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
        policy = build_policy(parse_policy_config({"kind": name}), seed=1)
        for mode in ("text", "tokens"):
            hash_us, match_us, select_us, total_us, after_us = [], [], [], [], []
            parse_us: list[float] = []
            gc.collect()
            for i in range(args.decisions):
                chain = None
                if mode == "text":
                    data = system_text + os.urandom(16 * 1024)
                    t0 = time.perf_counter()
                    if args.no_memo:
                        hashes = hash_text(data, seed, TEXT_BLOCK)
                    else:
                        chain = memo.chain_text(data, seed, TEXT_BLOCK)
                        hashes = chain.prefix(index.holds)
                    tokens_per_block = TEXT_BLOCK / BYTES_PER_TOKEN
                    prompt_tokens = int(len(data) / BYTES_PER_TOKEN)
                else:
                    ids = system_tokens + [rng.randrange(150_000) for _ in range(4096)]
                    # The router checks and packs the ids when it parses the request, before deciding.
                    p0 = time.perf_counter()
                    key = completion_routing_key({"prompt": ids})
                    parse_us.append((time.perf_counter() - p0) * 1e6)
                    t0 = time.perf_counter()
                    if args.no_memo:
                        hashes = hash_tokens(ids, seed)
                    else:
                        chain = memo.chain_tokens(ids, seed, packed=key.packed)
                        hashes = chain.prefix(index.holds)
                    tokens_per_block = 16.0
                    prompt_tokens = len(ids)
                num_blocks = len(hashes) if chain is None else chain.num_blocks
                t1 = time.perf_counter()
                matched = index.match(hashes, now=1e6 + i)
                t2 = time.perf_counter()
                request = RouteRequest(hashes, prompt_tokens, tokens_per_block, matched, num_blocks=num_blocks)
                decision = policy.select(request, states, now=1e6 + i)
                t3 = time.perf_counter()
                if not args.no_after:
                    if chain is not None:
                        hashes = chain.complete()
                    recorded.record(decision.replica, hashes, now=1e6 + i)
                t4 = time.perf_counter()
                hash_us.append((t1 - t0) * 1e6)
                match_us.append((t2 - t1) * 1e6)
                select_us.append((t3 - t2) * 1e6)
                total_us.append((t3 - t0) * 1e6)
                after_us.append((t4 - t3) * 1e6)
            figures = (
                percentile(hash_us, 0.5),
                percentile(match_us, 0.5),
                percentile(select_us, 0.5),
                percentile(total_us, 0.5),
                percentile(total_us, 0.99),
                percentile(after_us, 0.5),
            )
            print(f"{name:<20} {mode:<6} " + " ".join(f"{f:>10.1f}" for f in figures))
            if parse_us:
                parse_p50 = percentile(parse_us, 0.5)
                parse_lines.append(f"{name}: checking and packing 8,192 token ids when parsing, p50 {parse_p50:.1f} us")
    print("\n" + "\n".join(parse_lines))


if __name__ == "__main__":
    main()
