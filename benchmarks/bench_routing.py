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

Between decisions the replicas' loads move as the router moves them (untimed): the chosen replica gets the request
(in flight, waiting, its uncached tokens on the prefill backlog), and the oldest requests get their first byte
(waiting -> streaming, the replica's learned prefill rate moves) and finish, so about three replicas change per
decision and a policy that keeps terms between decisions pays for re-deriving them.

`--baseline REV` also runs each policy as it was at git revision REV (its module from `git show`), in the same
process on the same inputs, alternating which of the two decides first; its rows reuse the hash and match times,
and the table counts decisions that differ. Run pinned to one core:

    taskset -c 0 .venv/bin/python benchmarks/bench_routing.py
    taskset -c 0 .venv/bin/python benchmarks/bench_routing.py --no-after --baseline main
"""

from __future__ import annotations

import argparse
import collections
import gc
import importlib
import inspect
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from router.policy.config import POLICY_NAMES, build_policy, parse_policy_config
from router.policy.hashing import ChainMemo, hash_text, hash_tokens, namespace_seed
from router.policy.prefix_index import PrefixIndex, PrefixIndexConfig
from router.policy.routing_text import completion_routing_key
from router.policy.types import Decision, Policy, ReplicaState, RouteRequest

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


def replica_states(replicas: list[str], capacity: int) -> list[ReplicaState]:
    """The same random loads for every row: some requests waiting and streaming on each replica."""
    rng = random.Random(11)
    return [
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


def baseline_package(revision: str) -> str:
    """Import `router/policy` as it was at git `revision` under a package name of its own (its absolute imports
    rewritten to it), every module at once; returns the name that stands for `router.policy`."""
    root = Path(__file__).resolve().parent.parent
    package = "shoal_baseline_" + re.sub(r"\W", "_", revision)
    listing = subprocess.run(
        ["git", "-C", str(root), "ls-tree", "--name-only", revision, "router/policy/"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / package / "router" / "policy"
        target.mkdir(parents=True)
        (target.parent.parent / "__init__.py").write_text("")
        (target.parent / "__init__.py").write_text("")
        for path in listing:
            if path.endswith(".py"):
                source = subprocess.run(
                    ["git", "-C", str(root), "show", f"{revision}:{path}"], check=True, capture_output=True, text=True
                ).stdout
                (target / Path(path).name).write_text(re.sub(r"\brouter\.policy\b", f"{package}.router.policy", source))
        sys.path.insert(0, tmp)
        try:
            for path in listing:
                if path.endswith(".py"):
                    importlib.import_module(f"{package}.router.policy.{Path(path).stem}")
        finally:
            sys.path.remove(tmp)
    return f"{package}.router.policy"


def baseline_policy(policy: Policy, config: object, package: str) -> Policy:
    """`policy`'s class from `package` (`baseline_package`), built with `config`."""
    module = sys.modules[type(policy).__module__.replace("router.policy", package, 1)]
    cls = getattr(module, type(policy).__name__)
    if "seed" in inspect.signature(cls).parameters:
        return cls(config, seed=1)  # type: ignore[no-any-return]
    return cls(config)  # type: ignore[no-any-return]


def same_decision(a: Decision, b: Decision) -> bool:
    """Field by field: the baseline's `Decision` and `Branch` are classes of their own."""
    return (a.replica, str(a.branch), a.matched_blocks, a.predicted_cached_tokens, a.predicted_ttft_s) == (
        b.replica,
        str(b.branch),
        b.matched_blocks,
        b.predicted_cached_tokens,
        b.predicted_ttft_s,
    )


class Load:
    """The router's load bookkeeping (router/service/routing.py: begin, first_byte, finish) over `states`."""

    def __init__(self, states: list[ReplicaState], rng: random.Random, in_flight: int) -> None:
        self.by_id = {s.id: s for s in states}
        self.rng = rng
        self.in_flight = in_flight
        self.waiting: collections.deque[tuple[ReplicaState, int]] = collections.deque()
        self.streaming: collections.deque[ReplicaState] = collections.deque()

    def step(self, decision: Decision, prompt_tokens: int, now: float) -> None:
        s = self.by_id[decision.replica]
        uncached = max(0, prompt_tokens - decision.predicted_cached_tokens)
        s.in_flight += 1
        s.waiting += 1
        s.waiting_prompt_tokens += uncached
        s.last_selected = now
        self.waiting.append((s, uncached))
        if len(self.waiting) > self.in_flight // 2:
            s, uncached = self.waiting.popleft()
            s.waiting -= 1
            s.waiting_prompt_tokens -= uncached
            s.streaming += 1
            s.prefill_tokens_per_s *= self.rng.uniform(0.97, 1.03)
            self.streaming.append(s)
        if len(self.streaming) > self.in_flight // 2:
            s = self.streaming.popleft()
            s.in_flight -= 1
            s.streaming -= 1


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
    parser.add_argument(
        "--baseline", metavar="REV", help="also run each policy as at this git revision, interleaved, same inputs"
    )
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
    baseline = baseline_package(args.baseline) if args.baseline else None
    for name in args.policies.split(","):
        if name not in POLICY_NAMES:
            raise SystemExit(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
        config = parse_policy_config({"kind": name})
        for mode in ("text", "tokens"):
            policy = build_policy(config, seed=1)
            base = baseline_policy(policy, config, baseline) if baseline else None
            states = replica_states(replicas, capacity)
            load = Load(states, random.Random(13), in_flight=3 * len(states))
            hash_us, match_us, select_us, total_us, after_us = [], [], [], [], []
            base_select_us, base_total_us = [], []
            num_differing = 0
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
                m1 = time.perf_counter()
                request = RouteRequest(hashes, prompt_tokens, tokens_per_block, matched, num_blocks=num_blocks)
                built = time.perf_counter()
                if base is not None and i % 2:
                    b0 = time.perf_counter()
                    base_decision = base.select(request, states, now=1e6 + i)
                    base_select_us.append((time.perf_counter() - b0 + built - m1) * 1e6)
                t2 = time.perf_counter()
                decision = policy.select(request, states, now=1e6 + i)
                t3 = time.perf_counter()
                if base is not None and not i % 2:
                    b0 = time.perf_counter()
                    base_decision = base.select(request, states, now=1e6 + i)
                    base_select_us.append((time.perf_counter() - b0 + built - m1) * 1e6)
                if base is not None:
                    num_differing += not same_decision(base_decision, decision)
                    base_total_us.append((m1 - t0) * 1e6 + base_select_us[-1])
                load.step(decision, prompt_tokens, now=1e6 + i)
                a0 = time.perf_counter()
                if not args.no_after:
                    if chain is not None:
                        hashes = chain.complete()
                    recorded.record(decision.replica, hashes, now=1e6 + i)
                t4 = time.perf_counter()
                hash_us.append((t1 - t0) * 1e6)
                match_us.append((m1 - t1) * 1e6)
                select_us.append((t3 - t2 + built - m1) * 1e6)
                total_us.append((t3 - t2 + built - t0) * 1e6)
                after_us.append((t4 - a0) * 1e6)
            figures = (
                percentile(hash_us, 0.5),
                percentile(match_us, 0.5),
                percentile(select_us, 0.5),
                percentile(total_us, 0.5),
                percentile(total_us, 0.99),
                percentile(after_us, 0.5),
            )
            print(f"{name:<20} {mode:<6} " + " ".join(f"{f:>10.1f}" for f in figures))
            if base is not None:
                base_figures = (
                    percentile(base_select_us, 0.5),
                    percentile(base_total_us, 0.5),
                    percentile(base_total_us, 0.99),
                )
                label = f"@{args.baseline}"
                print(
                    f"{label:<20} {mode:<6} {'':>10} {'':>10} "
                    + " ".join(f"{f:>10.1f}" for f in base_figures)
                    + f"  ({num_differing} decisions differ)"
                )
            if parse_us:
                parse_p50 = percentile(parse_us, 0.5)
                parse_lines.append(f"{name}: checking and packing 8,192 token ids when parsing, p50 {parse_p50:.1f} us")
    print("\n" + "\n".join(parse_lines))


if __name__ == "__main__":
    main()
