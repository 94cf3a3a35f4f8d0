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

The machine's own tail, for scale: after each decision the same fixed pure-Python loop (calibrated at start to take
about `--reference-us`, 50 by default; the machine's speed drifts, so its p50 within a row is printed too) is timed,
and its p50/p99 close each row ("ref"). On a shared virtual machine the loop's p99 is well above its p50 although
its work never varies; what a decision's p99 adds beyond that ratio is the decision's own.

Between decisions the replicas' loads move as the router moves them (untimed): the chosen replica gets the request
(in flight, waiting, its uncached tokens on the prefill backlog), and the oldest requests get their first byte
(waiting -> streaming, the replica's learned prefill rate moves) and finish, so about three replicas change per
decision and a policy that keeps terms between decisions pays for re-deriving them.

`--baseline REV` also decides with `router/policy` as it was at git revision REV (hashing and policy; the prefix
index is the current one, built once), in the same process on the same prompts, states and index, alternating
which of the two decides first; its rows follow each row, and count the decisions that differ. Run pinned to one
core:

    taskset -c 0 .venv/bin/python -m benchmarks.bench_routing
    taskset -c 0 .venv/bin/python -m benchmarks.bench_routing --no-after --baseline main
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
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
from types import ModuleType
from typing import Any

from router.policy import hashing
from router.policy.config import POLICY_NAMES, build_policy, parse_policy_config
from router.policy.hashing import PromptChain, hash_text, hash_tokens, namespace_seed
from router.policy.prefix_index import PrefixIndex, PrefixIndexConfig
from router.policy.routing_text import completion_routing_key
from router.policy.types import Branch, Decision, Policy, ReplicaState, RouteRequest

BLOCKS_PER_PROMPT = 512
TEXT_BLOCK = 64
BYTES_PER_TOKEN = 4.0


def fixed_work(n: int) -> int:
    """A loop whose work never varies: `n` additions."""
    total = 0
    for i in range(n):
        total += i
    return total


def calibrate_fixed_work(target_us: float) -> int:
    """The `n` for which `fixed_work(n)` takes about `target_us` at p50 on this core."""
    n = 1000
    for _ in range(3):
        samples = []
        for _ in range(200):
            t0 = time.perf_counter()
            fixed_work(n)
            samples.append((time.perf_counter() - t0) * 1e6)
        n = max(1, round(n * target_us / percentile(samples, 0.5)))
    return n


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


class Side:
    """One revision's hashing and policy, deciding and timing each step (hash, match, select).

    A side of another revision (`types_module` given) decides over replica states of its own `ReplicaState`
    class, the same objects from one decision to the next as in a router, set field by field to the states of
    the current side before each decision (untimed); a revision whose states have `touch()` is told of each
    change, as its policy requires.
    """

    def __init__(self, label: str, hashing_module: ModuleType, types_module: ModuleType | None = None) -> None:
        self.label = label
        self.hashing = hashing_module
        self.state_class = None if types_module is None else types_module.ReplicaState
        self.mirrors: dict[str, Any] = {}
        self.memo = hashing_module.ChainMemo()
        self.policy: Policy | None = None
        self.chain: PromptChain | None = None
        self.hashes: list[int] = []
        self.last_decision = Decision("", Branch.ONLY_REPLICA)
        self.last_prompt_tokens = 0

    def start(self, policy: Policy) -> None:
        """A new row: `policy`, and empty samples."""
        self.policy = policy
        self.hash_us: list[float] = []
        self.match_us: list[float] = []
        self.select_us: list[float] = []
        self.total_us: list[float] = []

    def mirrored(self, states: list[ReplicaState]) -> list[ReplicaState]:
        """`states` as this side's policy takes them (the class docstring)."""
        if self.state_class is None:
            return states
        out: list[Any] = []  # the baseline's own class, which the policy of its revision reads as ReplicaState
        names = [f.name for f in dataclasses.fields(ReplicaState) if f.name in self.state_class.__dataclass_fields__]
        for state in states:
            mirror = self.mirrors.get(state.id)
            if mirror is None:
                mirror = self.mirrors[state.id] = self.state_class(id=state.id)
            is_changed = False
            for name in names:
                value = getattr(state, name)
                if getattr(mirror, name) != value:
                    setattr(mirror, name, value)
                    is_changed = True
            if is_changed and hasattr(mirror, "touch"):
                mirror.touch()
            out.append(mirror)
        return out

    def decide(
        self,
        prompt: bytes | tuple[list[int], bytes],
        seed: bytes,
        index: PrefixIndex,
        states: list[ReplicaState],
        now: float,
        *,
        no_memo: bool,
    ) -> Decision:
        assert self.policy is not None
        hashing = self.hashing
        states = self.mirrored(states)
        self.chain = None
        t0 = time.perf_counter()
        if isinstance(prompt, bytes):
            if no_memo:
                hashes = hashing.hash_text(prompt, seed, TEXT_BLOCK)
            else:
                self.chain = self.memo.chain_text(prompt, seed, TEXT_BLOCK)
                hashes = self.chain.prefix(index.holds)
            tokens_per_block = TEXT_BLOCK / BYTES_PER_TOKEN
            prompt_tokens = int(len(prompt) / BYTES_PER_TOKEN)
        else:
            ids, packed = prompt
            if no_memo:
                hashes = hashing.hash_tokens(ids, seed)
            else:
                self.chain = self.memo.chain_tokens(ids, seed, packed=packed)
                hashes = self.chain.prefix(index.holds)
            tokens_per_block = 16.0
            prompt_tokens = len(ids)
        num_blocks = len(hashes) if self.chain is None else self.chain.num_blocks
        t1 = time.perf_counter()
        matched = index.match(hashes, now=now)
        t2 = time.perf_counter()
        request = RouteRequest(hashes, prompt_tokens, tokens_per_block, matched, num_blocks=num_blocks)
        decision = self.policy.select(request, states, now=now)
        t3 = time.perf_counter()
        self.hash_us.append((t1 - t0) * 1e6)
        self.match_us.append((t2 - t1) * 1e6)
        self.select_us.append((t3 - t2) * 1e6)
        self.total_us.append((t3 - t0) * 1e6)
        self.hashes = hashes
        self.last_decision = decision
        self.last_prompt_tokens = prompt_tokens
        return decision

    def complete(self) -> list[int]:
        """All of the last prompt's hashes (the router's work after the request is sent)."""
        return self.hashes if self.chain is None else self.chain.complete()


class Load:
    """The router's load bookkeeping (router/policy/routing_core.py: begin, first_byte, finish) over `states`."""

    def __init__(self, states: list[ReplicaState], rng: random.Random, in_flight: int) -> None:
        self.by_id = {s.id: s for s in states}
        self.rng = rng
        self.in_flight = in_flight
        self.waiting: collections.deque[tuple[ReplicaState, int]] = collections.deque()
        self.streaming: collections.deque[ReplicaState] = collections.deque()

    def step(self, decision: Decision, prompt_tokens: int, now: float) -> None:
        s = self.by_id[decision.replica]
        uncached = max(0, prompt_tokens - decision.predicted_cached_tokens)
        s.begin(uncached, now)
        self.waiting.append((s, uncached))
        if len(self.waiting) > self.in_flight // 2:
            s, uncached = self.waiting.popleft()
            s.first_byte(uncached)
            s.prefill_tokens_per_s *= self.rng.uniform(0.97, 1.03)
            self.streaming.append(s)
        if len(self.streaming) > self.in_flight // 2:
            s = self.streaming.popleft()
            s.finish(0, is_waiting=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument(
        "--reference-us", type=float, default=50.0, help="p50 of the fixed loop timed after each decision, for scale"
    )
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
    columns = ("hash p50", "match p50", "select p50", "total p50", "total p99", "after p50", "ref p50", "ref p99")
    work_n = calibrate_fixed_work(args.reference_us)
    header = f"{'policy':<20} {'mode':<6} " + " ".join(f"{c:>10}" for c in columns)
    print(header)
    print("-" * len(header))
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
    sides = [Side("", hashing)]
    if baseline:
        sides.append(Side(f"@{args.baseline}", sys.modules[f"{baseline}.hashing"], sys.modules[f"{baseline}.types"]))
    for name in args.policies.split(","):
        if name not in POLICY_NAMES:
            raise SystemExit(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
        config = parse_policy_config({"kind": name})
        for mode in ("text", "tokens"):
            current = build_policy(config, seed=1)
            for side in sides:
                side.start(current if side is sides[0] else baseline_policy(current, config, baseline or ""))
            states = replica_states(replicas, capacity)
            load = Load(states, random.Random(13), in_flight=3 * len(states))
            after_us: list[float] = []
            reference_us: list[float] = []
            parse_us: list[float] = []
            num_differing = 0
            gc.collect()
            for i in range(args.decisions):
                now = 1e6 + i
                if mode == "text":
                    prompt: bytes | tuple[list[int], bytes] = system_text + os.urandom(16 * 1024)
                else:
                    ids = system_tokens + [rng.randrange(150_000) for _ in range(4096)]
                    # The router checks and packs the ids when it parses the request, before deciding.
                    p0 = time.perf_counter()
                    key = completion_routing_key({"prompt": ids})
                    parse_us.append((time.perf_counter() - p0) * 1e6)
                    assert key.packed is not None
                    prompt = (ids, key.packed)
                # Each side decides on the same prompt, states and index; which goes first alternates.
                decisions = [
                    side.decide(prompt, seed, index, states, now, no_memo=args.no_memo)
                    for side in (sides if i % 2 == 0 else sides[::-1])
                ]
                decision = sides[0].last_decision
                num_differing += not all(same_decision(d, decision) for d in decisions)
                load.step(decision, sides[0].last_prompt_tokens, now=now)
                a0 = time.perf_counter()
                if not args.no_after:
                    recorded.record(decision.replica, sides[0].complete(), now=now)
                after_us.append((time.perf_counter() - a0) * 1e6)
                r0 = time.perf_counter()
                fixed_work(work_n)
                reference_us.append((time.perf_counter() - r0) * 1e6)
                for side in sides[1:]:
                    side.complete()
            for side in sides:
                label = name if side is sides[0] else side.label
                figures = (
                    percentile(side.hash_us, 0.5),
                    percentile(side.match_us, 0.5),
                    percentile(side.select_us, 0.5),
                    percentile(side.total_us, 0.5),
                    percentile(side.total_us, 0.99),
                )
                row = f"{label:<20} {mode:<6} " + " ".join(f"{f:>10.1f}" for f in figures)
                if side is sides[0]:
                    tail = (percentile(after_us, 0.5), percentile(reference_us, 0.5), percentile(reference_us, 0.99))
                    print(row + " " + " ".join(f"{f:>10.1f}" for f in tail))
                else:
                    print(row + f" {'':>10}  ({num_differing} decisions differ)")
            if parse_us:
                parse_p50 = percentile(parse_us, 0.5)
                parse_lines.append(f"{name}: checking and packing 8,192 token ids when parsing, p50 {parse_p50:.1f} us")
    print("\n" + "\n".join(parse_lines))


if __name__ == "__main__":
    main()
