"""PrefixIndex cost at fleet scale: memory per block, match latency, record cost, sweeps and KV events.

Workload (approximate mode): 64 replicas; prompts of 512 blocks = a system prompt (32 blocks, ends up on every
replica) + one of 256 group prefixes (96 blocks, each group served by 4 replicas) + 384 blocks of its own. Each
prompt is recorded on one of its group's replicas until the index holds 1,000,000 (block, replica) entries
(`fresh`); then as many blocks again are recorded with every replica at its capacity (1M / 64 blocks), so that
eviction and dict churn reach a steady state (`steady`), and then twice as many again (`steady x3`), to show
whether churn keeps growing the index. Hashes are random 64-bit ints, as xxh3 values are, and every prompt is
built of new int objects, as the router hashes every request afresh.

Memory is what tracemalloc sees allocated while the workload is built and recorded (the prompts' own lists die
as soon as they are recorded), per entry and per distinct block; the breakdown sizes the index's parts with
sys.getsizeof. Times are wall-clock per call on the steady index. `match` runs the binary search of
prefix-closed replicas; `walk` rows time the same queries after every replica has seen an engine `removed`,
which sends it to the one-look-up-per-block walk. `record` rows record another 1M blocks, and give the slowest
call too (dict resizes and rebuilds land there). `gc.collect()` is a full collection, median of 5, with the
index alive and after it is gone; the difference is what the index costs every collection. Pin to one core for
stable numbers:

    taskset -c 0 .venv/bin/python -m benchmarks.bench_index
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from functools import partial

from router.policy.hashing import hash_tokens, namespace_seed
from router.policy.kv_events import BlockRemoved, BlockStored
from router.policy.prefix_index import IndexStats, PrefixIndex, PrefixIndexConfig

SYSTEM_BLOCKS = 32
GROUP_BLOCKS = 96
NUM_GROUPS = 256
REPLICAS_PER_GROUP = 4
TOKENS_PER_BLOCK = 16


class Workload:
    """Prompt hash lists, each regenerated from its id so that the benchmark keeps none alive."""

    def __init__(self, num_replicas: int, prompt_blocks: int, seed: int) -> None:
        self.seed = seed
        self.replicas = [f"replica-{i}" for i in range(num_replicas)]
        self.prompt_blocks = prompt_blocks

    def system(self) -> list[int]:
        rng = random.Random(self.seed * 1_000_003 - 1)
        return [rng.getrandbits(64) for _ in range(SYSTEM_BLOCKS)]

    def group(self, group: int) -> list[int]:
        rng = random.Random(self.seed * 1_000_003 - 2 - group)
        return self.system() + [rng.getrandbits(64) for _ in range(GROUP_BLOCKS)]

    def prompt(self, prompt_id: int) -> tuple[str, list[int]]:
        rng = random.Random(self.seed * 1_000_003 + prompt_id)
        group = prompt_id % NUM_GROUPS
        slot = (group * REPLICAS_PER_GROUP + rng.randrange(REPLICAS_PER_GROUP)) % len(self.replicas)
        return self.replicas[slot], self.with_new_blocks(self.group(group), rng)

    def with_new_blocks(self, prefix: list[int], rng: random.Random) -> list[int]:
        return prefix + [rng.getrandbits(64) for _ in range(self.prompt_blocks - len(prefix))]


def fill(index: PrefixIndex, workload: Workload, first_id: int, num_entries: int) -> Iterator[tuple[int, float]]:
    """Record prompts from `first_id` on until `num_entries` blocks were recorded; yields (blocks, seconds) per
    call."""
    prompt_id = first_id
    recorded = 0
    while recorded < num_entries:
        replica, hashes = workload.prompt(prompt_id)
        t0 = time.perf_counter_ns()
        index.record(replica, hashes, now=prompt_id * 0.01)
        yield len(hashes), (time.perf_counter_ns() - t0) / 1e9
        recorded += len(hashes)
        prompt_id += 1


def breakdown(index: PrefixIndex) -> list[tuple[str, int]]:
    """Bytes by part, from sys.getsizeof; an object many entries share (a replica's single-bit mask, one
    record's deadline, a block hash int that both a shard and a replica's guesses key on) is counted once."""
    holders = index._holders
    bounds = index._bounds
    replicas = index._replicas.values()
    shared_masks = {id(r.bit) for r in replicas}
    masks = {id(m): m for shard in holders for m in shard.values() if id(m) not in shared_masks}
    keys = {id(h) for shard in holders for h in shard}
    others = {id(h): h for r in replicas for h in r.guesses if id(h) not in keys}
    others.update((id(h), h) for shard in bounds for h in shard if id(h) not in keys)
    floats = {id(d): d for r in replicas for d in r.guesses.values()}
    floats.update((id(d), d) for shard in bounds for d in shard.values())
    return [
        ("block dict tables (hash -> holders), all shards", sum(map(sys.getsizeof, holders))),
        ("block hash ints (their keys)", sum(sys.getsizeof(h) for shard in holders for h in shard)),
        ("equal hash ints from later records (touch, join)", sum(map(sys.getsizeof, others.values()))),
        ("multi-holder mask ints", sum(map(sys.getsizeof, masks.values()))),
        ("per-replica guess dict tables (hash -> deadline)", sum(sys.getsizeof(r.guesses) for r in replicas)),
        ("shared-block bounds tables (hash -> deadline)", sum(map(sys.getsizeof, bounds))),
        ("deadline floats (one per record call)", sum(map(sys.getsizeof, floats.values()))),
    ]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def full_gc_ms(repeat: int = 5) -> float:
    gc.collect()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t0) * 1e3)
    return percentile(times, 0.5)


def timed_us(fn: Callable[[], object], repeat: int) -> str:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return f"p50 {percentile(times, 0.5):.1f} µs, p99 {percentile(times, 0.99):.1f} µs"


Rows = list[tuple[str, str]]
Snapshot = tuple[str, IndexStats, int, list[tuple[str, int]]]


def build(workload: Workload, capacity: int, num_entries: int) -> tuple[PrefixIndex, int, list[Snapshot]]:
    """Fill an index four times over under tracemalloc; returns it, the prompts recorded and memory snapshots
    after the first, second and fourth fill."""
    gc.collect()
    tracemalloc.start()
    base_bytes = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(PrefixIndexConfig(capacity_blocks=capacity, ttl_s=1e9))
    for r in workload.replicas:
        index.add_replica(r)
    snapshots: list[Snapshot] = []
    num_prompts = 0
    for name in ("fresh", "steady", "", "steady x3"):
        num_prompts += sum(1 for _ in fill(index, workload, num_prompts, num_entries))
        if name:
            gc.collect()
            used_bytes = tracemalloc.get_traced_memory()[0] - base_bytes
            snapshots.append((name, index.stats(), used_bytes, breakdown(index)))
    tracemalloc.stop()
    return index, num_prompts, snapshots


def time_index(
    index: PrefixIndex, workload: Workload, num_prompts: int, num_entries: int, repeat: int, rows: Rows
) -> None:
    rng = random.Random(workload.seed + 1)
    now = num_prompts * 0.01
    cases = {
        "hit (512 on 1 replica, 128 on 3, 32 on all)": workload.prompt(num_prompts - 1)[1],
        "group prefix (128 on 4, 32 on all)": workload.with_new_blocks(workload.group(3), rng),
        "system prompt (32 on all 64)": workload.with_new_blocks(workload.system(), rng),
        "miss": workload.with_new_blocks([], rng),
    }
    gc.collect()
    for name, hashes in cases.items():
        rows.append((f"match {name}", timed_us(partial(index.match, hashes, now=now), repeat)))
    seed = namespace_seed("bench")
    for i, r in enumerate(workload.replicas):
        index.apply(r, BlockStored((i,), None, tuple(range(TOKENS_PER_BLOCK)), TOKENS_PER_BLOCK), seed=seed, now=now)
        index.apply(r, BlockRemoved((i,)), seed=seed, now=now)
    for name, hashes in cases.items():
        rows.append((f"walk  {name}", timed_us(partial(index.match, hashes, now=now), repeat)))

    calls = list(fill(index, workload, num_prompts, num_entries))
    per_block = [seconds / num_blocks for num_blocks, seconds in calls]
    p50, p99, mean = percentile(per_block, 0.5), percentile(per_block, 0.99), sum(per_block) / len(per_block)
    slowest_ms = max(seconds for _, seconds in calls) * 1e3
    per_block_ns = f"p50 {p50 * 1e9:.0f}, p99 {p99 * 1e9:.0f}, mean {mean * 1e9:.0f} ns/block"
    rows.append(("record new prompts, evicting as it goes", f"{per_block_ns}, slowest call {slowest_ms:.0f} ms"))
    replica, hashes = workload.prompt(num_prompts - 1)
    rows.append(
        ("record the same prompt again (touches)", timed_us(lambda: index.record(replica, hashes, now=now), 500))
    )


def time_sweep(workload: Workload, capacity: int, num_entries: int, rows: Rows) -> None:
    index = PrefixIndex(PrefixIndexConfig(capacity_blocks=capacity, ttl_s=10.0))
    for r in workload.replicas:
        index.add_replica(r)
    for _ in fill(index, workload, 0, num_entries):
        pass
    t0 = time.perf_counter()
    removed = index.expire(1e9)
    sweep_ns = (time.perf_counter() - t0) * 1e9 / max(removed, 1)
    rows.append(("expire() of every entry", f"{sweep_ns:.0f} ns/entry over {removed:,} entries"))


def time_events(num_blocks: int, rows: Rows) -> None:
    rng = random.Random(0)
    seed = namespace_seed("bench")
    index = PrefixIndex()
    index.add_replica("r0")
    token_ids = tuple(rng.randrange(150_000) for _ in range(TOKENS_PER_BLOCK * num_blocks))
    engine_hashes = tuple(range(1, num_blocks + 1))
    stored = BlockStored(engine_hashes, None, token_ids, TOKENS_PER_BLOCK)
    removed = BlockRemoved(engine_hashes)

    def store_and_remove() -> None:
        index.apply("r0", stored, seed=seed, now=0.0)
        index.apply("r0", removed, seed=seed, now=0.0)

    rows.append((f"apply stored + removed of {num_blocks} blocks", timed_us(store_and_remove, 200)))
    rows.append((f"  of which hash_tokens of {num_blocks} blocks", timed_us(lambda: hash_tokens(token_ids, seed), 200)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--entries", type=int, default=1_000_000, help="(block, replica) entries to fill")
    parser.add_argument("--prompt-blocks", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=2000, help="calls per timed case")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    capacity = args.entries // args.replicas
    workload = Workload(args.replicas, args.prompt_blocks, args.seed)
    rows: Rows = []

    index, num_prompts, snapshots = build(workload, capacity, args.entries)
    for name, stats, used_bytes, _ in snapshots:
        rows.append((f"{name}: entries / distinct blocks", f"{stats.num_entries:,} / {stats.num_blocks:,}"))
        per_entry, per_block = used_bytes / stats.num_entries, used_bytes / stats.num_blocks
        rows.append((f"{name}: bytes per entry / per distinct block", f"{per_entry:.0f} / {per_block:.0f}"))
    time_index(index, workload, num_prompts, args.entries, args.repeat, rows)
    gc_with_ms, num_tracked = full_gc_ms(), len(gc.get_objects())
    del index
    gc_without_ms, num_tracked_without = full_gc_ms(), len(gc.get_objects())
    rows.append(("gc.collect() with the index alive / without it", f"{gc_with_ms:.1f} / {gc_without_ms:.1f} ms"))
    rows.append(("objects the GC tracks for the index", f"{num_tracked - num_tracked_without:,}"))
    time_sweep(workload, capacity, args.entries // 4, rows)
    time_events(args.prompt_blocks, rows)

    width = max(len(k) for k, _ in rows)
    print(f"PrefixIndex: {args.replicas} replicas, {args.prompt_blocks}-block prompts, capacity {capacity:,}/replica")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    for name, stats, used_bytes, parts in snapshots:
        total = used_bytes / stats.num_entries
        print(f"\nwhere the bytes go ({name}, per entry, by sys.getsizeof; tracemalloc total {total:.0f}):")
        for part, size in parts:
            print(f"  {part:<{width - 2}}  {size / stats.num_entries:5.1f}")


if __name__ == "__main__":
    main()
