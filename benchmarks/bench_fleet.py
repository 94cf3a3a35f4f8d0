"""What a router fleet's sharing costs: Redis memory of the capped records stream, the router's per-router view,
and the CPU of encoding and applying batches.

A real redis-server (started here, on a free loopback port) receives batches as routers publish them
(`router.service.fleet`): each batch holds `--records` decisions of `--blocks` block hashes each, plus a load table
of every replica. The stream is capped at `--max-len` entries (XADD MAXLEN ~); once more batches than that are
written, MEMORY USAGE of the stream is its steady-state size. The view is a `PeerRouters` over `--routers` - 1 peers
whose load tables name every replica: its entries and the bytes sys.getsizeof sees in them. Apply time is one
batch applied by a peer to a RoutingCore (index records and load), per record.

    .venv/bin/python -m benchmarks.bench_fleet
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time

import redis.asyncio as redis

from benchmarks import command_argv
from router.common.ports import free_port
from router.policy.estimated_ttft import EstimatedTTFT, EstimatedTTFTConfig
from router.policy.prefix_index import PrefixIndex
from router.policy.routing_core import RoutingConfig, RoutingCore
from router.policy.sharing import Batch, Load, PeerRouters, Routed, decode_batch, encode_batch
from router.policy.types import ReplicaState


def make_batch(rng: random.Random, router: str, seq: int, args: argparse.Namespace) -> Batch:
    replicas = [f"replica-{i}" for i in range(args.replicas)]
    routed = tuple(
        Routed(rng.choice(replicas), tuple(rng.getrandbits(64) for _ in range(args.blocks)), False)
        for _ in range(args.records)
    )
    loads = {rid: Load(rng.randrange(1, 64), rng.randrange(0, 8), rng.randrange(0, 20_000)) for rid in replicas}
    return Batch(router, seq, routed, loads, True)


async def measure_redis(url: str, args: argparse.Namespace, payloads: list[bytes]) -> tuple[int, int]:
    """Write twice the cap of batches; returns the stream's length and MEMORY USAGE."""
    client = redis.from_url(url)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                await client.ping()
                break
            except (redis.ConnectionError, OSError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)  # the server is starting
        for i in range(args.max_len * 2):
            await client.xadd(
                "bench:fleet:records",
                {"r": b"router-0", "d": payloads[i % len(payloads)]},
                maxlen=args.max_len,
                approximate=True,
            )
        length = await client.xlen("bench:fleet:records")
        num_bytes = await client.memory_usage("bench:fleet:records", samples=0)
        return length, int(num_bytes or 0)
    finally:
        await client.aclose()


def run_redis(args: argparse.Namespace, payloads: list[bytes]) -> tuple[int, int]:
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not installed")
    port = free_port()
    with tempfile.TemporaryDirectory() as workdir:
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir],
            stdout=subprocess.DEVNULL,
        )
        try:
            return asyncio.run(measure_redis(f"redis://127.0.0.1:{port}/0", args, payloads))
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routers", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--records", type=int, default=10, help="decisions per batch (50 ms at 200 req/s)")
    parser.add_argument("--blocks", type=int, default=64, help="block hashes per decision")
    parser.add_argument("--max-len", type=int, default=5_000, help="stream cap, in entries")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    batches = [make_batch(rng, "router-0", i + 1, args) for i in range(50)]
    started = time.perf_counter()
    payloads = [encode_batch(b) for b in batches]
    encode_us = (time.perf_counter() - started) / (len(batches) * args.records) * 1e6
    started = time.perf_counter()
    decoded = [decode_batch(p) for p in payloads]
    decode_us = (time.perf_counter() - started) / (len(batches) * args.records) * 1e6

    core = RoutingCore(RoutingConfig(), PrefixIndex(), EstimatedTTFT(EstimatedTTFTConfig()))
    for i in range(args.replicas):
        core.add_replica(ReplicaState(f"replica-{i}"))
    view = PeerRouters(core, load_ttl_s=3.0)
    started = time.perf_counter()
    for batch in decoded:
        view.apply(batch, now=1.0)
    apply_us = (time.perf_counter() - started) / (len(batches) * args.records) * 1e6
    for peer in range(1, args.routers - 1):
        view.apply(make_batch(rng, f"router-{peer}", 1, args), now=1.0)
    view_bytes = sum(sys.getsizeof(loads) for loads in (view.load_of(p) for p in view.peers))
    view_bytes += view.num_entries * sys.getsizeof(Load(1, 2, 3))

    length, stream_bytes = run_redis(args, payloads)
    mean_payload = sum(map(len, payloads)) / len(payloads)
    print(
        f"command: {' '.join(command_argv())}\n"
        f"date: {datetime.date.today()}; machine: {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}\n"
    )
    print(f"{'what':<44} {'value':>14}")
    rows = [
        ("batch payload, bytes (mean)", f"{mean_payload:,.0f}"),
        ("stream entries after 2 x max-len writes", f"{length:,}"),
        ("stream MEMORY USAGE, bytes", f"{stream_bytes:,}"),
        ("stream bytes per entry", f"{stream_bytes / max(length, 1):,.0f}"),
        (f"view entries ({len(view.peers)} peers x {args.replicas} replicas)", f"{view.num_entries:,}"),
        ("view bytes (dicts + Load objects)", f"{view_bytes:,}"),
        (f"encode per decision ({args.blocks} blocks), us", f"{encode_us:.1f}"),
        ("decode per decision, us", f"{decode_us:.1f}"),
        ("apply per decision (index record), us", f"{apply_us:.1f}"),
    ]
    for name, value in rows:
        print(f"{name:<44} {value:>14}")


if __name__ == "__main__":
    main()
