"""Router work per request in CPU instructions, counted by callgrind: a figure a busy machine does not move.

`bench_proxy.py` measures requests/s, which on a shared 2-core machine moves by 2x from one minute to the next.
This counts the instructions each router executes per request instead: the router runs under
`valgrind --tool=callgrind` with counting off, serves `--warm` requests, then counting is switched on
(`callgrind_control -i on`) for `--requests` more, sent by loadgen.py (2 KiB chat prompts sharing one system
prefix, `--num-prompts` distinct bodies, closed loop at `--concurrency`) to the canned nginx backend, and the
count is dumped; then the router idles as long (at most `--idle-s`) and that count is dumped too, so that what
its timers cost a second can be taken out (`less idle`): under callgrind a request takes ~50x its native time,
and per-second costs would weigh ~50x as much per request as at native speed. Instructions are not seconds (a
Rust router retires more instructions per cycle than CPython), so compare rows of the same language, and use it
to see what a part of Shoal costs: `shoal-nolog` is Shoal without
the request log, `shoal:round_robin` without the cache-aware index and cost model, `shoal+redis` with fleet
sharing: a redis-server and a second Shoal router (not counted) are started, and while the counted router serves
its requests the peer serves as many, so the count holds publishing its own records and applying the peer's, as
in a fleet of two routers under equal load. The counted router publishes every `--fleet-flush-interval-s` (or
once 256 records wait), so that its batches are as full as at native speed.

    .venv/bin/python -m benchmarks.bench_proxy_instructions --routers shoal,shoal-nolog,shoal:round_robin,smg
    .venv/bin/python -m benchmarks.bench_proxy_instructions --routers shoal,shoal+redis

Needs valgrind, nginx and loadgen.py's Python; smg and sglang-router come from `bench_proxy.py --setup-peers`.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks import bench_proxy as bp
from benchmarks import machine_description

_SUMMARY = re.compile(rb"^(?:summary|totals):\s+(\d+)", re.M)


def count_router(
    name: str, upstreams: list[str], args: argparse.Namespace, workdir: Path, peer: tuple[str, str] | None
) -> dict[str, Any]:
    """`peer`: (Redis URL, URL of a peer router sharing through it), for `shoal+redis`."""
    port = bp.free_port()
    argv, why = bp.router_argv(name.removesuffix("+redis"), port, upstreams, args.peer_policy)
    if argv is None:
        return {"skipped": why}
    if name.endswith("+redis"):
        if peer is None:
            return {"skipped": "no redis-server"}
        argv += ["--redis-url", peer[0]]
    out = workdir / f"{name.replace(':', '-')}.callgrind"
    valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
    env = {"TOKIO_WORKER_THREADS": "1", "PYTHONHASHSEED": "0"}
    if name.endswith("+redis"):
        # Batches as full as at native speed: a router publishes every 50 ms, which at ~4000 requests/s holds some
        # 200 decisions, but under callgrind only a few; past 256 queued records (max_batch_records) it publishes
        # at once, so a long interval makes full batches and a batch's own cost is shared as it is natively.
        env["SHOAL_ROUTER_FLEET__FLUSH_INTERVAL_S"] = str(args.fleet_flush_interval_s)
    service = bp.start_service(name, [*valgrind, *argv], args.router_core, workdir, env=env)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        error = bp.wait_ready(service, url, READY_BODY, args.startup_timeout_s)
        if error:
            return {"skipped": f"{error}: {service.log_tail()}"}
        load = ["--concurrency", str(args.concurrency), "--duration-s", str(args.timeout_s)]
        load += ["--prompt-bytes", "2048", "--num-prompts", str(args.num_prompts)]
        bp.run_loadgen(url, args.loadgen_core, [*load, "--requests", str(args.warm)], args.timeout_s + 60)
        subprocess.run(["callgrind_control", "-i", "on", str(service.process.pid)], check=True, capture_output=True)
        started = time.monotonic()
        peer_load = None
        if name.endswith("+redis") and peer is not None:  # the peer serves as many requests meanwhile
            peer_argv = ["taskset", "-c", str(args.loadgen_core), sys.executable, str(bp.BENCH / "loadgen.py")]
            peer_argv += ["--url", peer[1], *load, "--requests", str(args.requests)]
            peer_load = subprocess.Popen(peer_argv, stdout=subprocess.DEVNULL, cwd=bp.REPO)
        report = bp.run_loadgen(url, args.loadgen_core, [*load, "--requests", str(args.requests)], args.timeout_s + 60)
        if peer_load is not None:
            peer_load.wait(timeout=args.timeout_s)
        subprocess.run(["callgrind_control", "-d", str(service.process.pid)], check=True, capture_output=True)
        elapsed_s = time.monotonic() - started
        # The same router idle: what its timers cost a second (sweeps, and with sharing its publish and read
        # loops). Under callgrind a request takes ~50x its native time, so those costs would weigh ~50x too.
        idle_s = min(elapsed_s, args.idle_s)
        time.sleep(idle_s)
        subprocess.run(["callgrind_control", "-d", str(service.process.pid)], check=True, capture_output=True)
    finally:
        service.stop()
    load_dump, idle_dump = Path(f"{out}.1"), Path(f"{out}.2")
    load_count, idle_count = (_count_of(dump) for dump in (load_dump, idle_dump))
    kept = bp.BENCH / "out" / f"callgrind-{name.replace(':', '-')}.out"  # for callgrind_annotate
    kept.parent.mkdir(exist_ok=True)
    shutil.copyfile(load_dump, kept)
    num_ok = max(1, report["num_ok"])
    idle_per_s = idle_count / idle_s
    return {
        "requests": report["num_ok"],
        "errors": report["num_errors"],
        "instructions_per_request": load_count / num_ok,
        "idle_instructions_per_s": idle_per_s,
        "busy_instructions_per_request": (load_count - idle_per_s * elapsed_s) / num_ok,
        "elapsed_s": elapsed_s,
    }


def _count_of(dump: Path) -> int:
    found = _SUMMARY.search(dump.read_bytes())
    if found is None:
        raise RuntimeError(f"no instruction count in {dump}")
    return int(found.group(1))


READY_BODY = b'{"model":"shoal-demo","max_tokens":8,"messages":[{"role":"user","content":"ready?"}]}'


@contextlib.contextmanager
def redis_and_peer(upstreams: list[str], args: argparse.Namespace, workdir: Path) -> Iterator[tuple[str, str]]:
    """A redis-server and a Shoal router sharing through it, both on the load generator's core."""
    redis_port = bp.free_port()
    redis_argv = ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    with bp.running(bp.start_service("redis", redis_argv, args.loadgen_core, workdir)):
        port = bp.free_port()
        argv, _ = bp.router_argv("shoal", port, upstreams, args.peer_policy)
        assert argv is not None
        peer = bp.start_service("shoal-peer", [*argv, "--redis-url", redis_url], args.loadgen_core, workdir)
        with bp.running(peer):
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            error = bp.wait_ready(peer, url, READY_BODY, 60)
            if error:
                raise RuntimeError(f"the peer router did not start: {error}\n{peer.log_tail()}")
            yield redis_url, url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--routers", default="shoal,shoal-nolog,shoal:round_robin", help="as in bench_proxy.py")
    parser.add_argument("--requests", type=int, default=1000, help="requests counted, per router")
    parser.add_argument("--warm", type=int, default=200, help="requests sent before counting starts")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=768, help="distinct bodies, sent in turn")
    parser.add_argument("--num-replicas", type=int, default=2)
    parser.add_argument("--peer-policy", default="cache_aware")
    parser.add_argument("--router-core", type=int, default=0)
    parser.add_argument("--loadgen-core", type=int, default=1)
    parser.add_argument("--startup-timeout-s", type=float, default=300.0, help="routers start slowly under valgrind")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="bound of each load run")
    parser.add_argument("--idle-s", type=float, default=10.0, help="idle window counted after the load, at most")
    parser.add_argument(
        "--fleet-flush-interval-s", type=float, default=10.0, help="shoal+redis's publish interval under callgrind"
    )
    args = parser.parse_args(argv)
    print(f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; machine: {machine_description()}", flush=True)
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="shoal-bench-") as tmp:
        workdir = Path(tmp)
        ports = [bp.free_port() for _ in range(args.num_replicas)]
        config = bp.nginx_config(workdir, ports)
        nginx = bp.start_service("nginx", ["nginx", "-c", str(config), "-p", str(workdir)], args.loadgen_core, workdir)
        with bp.running(nginx):
            upstreams = [f"http://127.0.0.1:{port}" for port in ports]
            error = bp.wait_ready(nginx, upstreams[0] + "/v1/chat/completions", READY_BODY, 20)
            if error:
                print(f"nginx did not start: {error}", file=sys.stderr)
                return 1
            with contextlib.ExitStack() as stack:
                peer = None
                if any(name.endswith("+redis") for name in args.routers.split(",")):
                    peer = stack.enter_context(redis_and_peer(upstreams, args, workdir))
                for name in args.routers.split(","):
                    print(f"  counting {name} ...", flush=True)
                    rows[name] = count_router(name, upstreams, args, workdir, peer)
    print(
        f"\n{args.requests} requests a router at concurrency {args.concurrency}, 2 KiB chat prompts "
        f"({args.num_prompts} bodies, one shared system prefix), canned nginx backend, counted by callgrind"
    )
    print("k instr/req: all the router executed over the requests; less idle: without what the same router executes")
    print("idle over as long (its timers), as a router serving at native speed would not pay per request")
    base = rows.get("shoal", {}).get("busy_instructions_per_request")
    print(f"{'router':20} {'k instr/req':>12} {'idle k instr/s':>15} {'less idle':>10} {'x shoal':>8} {'requests':>9}")
    print("-" * 79)
    for name, row in rows.items():
        if "skipped" in row:
            print(f"{name:20} skipped: {row['skipped'][:200]}")
            continue
        busy = row["busy_instructions_per_request"]
        ratio = f"{busy / base:8.2f}" if base else f"{'-':>8}"
        print(
            f"{name:20} {row['instructions_per_request'] / 1e3:12.1f} {row['idle_instructions_per_s'] / 1e3:15.1f}"
            f" {busy / 1e3:10.1f} {ratio} {row['requests']:9d}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
