"""Router work per request in CPU instructions, counted by callgrind: a figure a busy machine does not move.

`bench_proxy.py` measures requests/s, which on a shared 2-core machine moves by 2x from one minute to the next.
This counts the instructions each router executes per request instead: the router runs under
`valgrind --tool=callgrind` with counting off, serves `--warm` requests, then counting is switched on
(`callgrind_control -i on`) for `--requests` more, sent by loadgen.py (2 KiB chat prompts sharing one system
prefix, `--num-prompts` distinct bodies, closed loop at `--concurrency`) to the canned nginx backend, and the
count is dumped. Instructions are not seconds (a Rust router retires more instructions per cycle than CPython),
so compare rows of the same language, and use it to see what a part of Shoal costs: `shoal-nolog` is Shoal without
the request log, `shoal:round_robin` without the cache-aware index and cost model.

    .venv/bin/python benchmarks/bench_proxy_instructions.py --routers shoal,shoal-nolog,shoal:round_robin,smg

Needs valgrind, nginx and loadgen.py's Python; smg and sglang-router come from `bench_proxy.py --setup-peers`.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_proxy as bp

_SUMMARY = re.compile(rb"^(?:summary|totals):\s+(\d+)", re.M)


def count_router(name: str, upstreams: list[str], args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    port = bp.free_port()
    argv, why = bp.router_argv(name, port, upstreams, args.peer_policy)
    if argv is None:
        return {"skipped": why}
    out = workdir / f"{name.replace(':', '-')}.callgrind"
    valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
    env = {"TOKIO_WORKER_THREADS": "1", "PYTHONHASHSEED": "0"}
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
        report = bp.run_loadgen(url, args.loadgen_core, [*load, "--requests", str(args.requests)], args.timeout_s + 60)
        subprocess.run(["callgrind_control", "-d", str(service.process.pid)], check=True, capture_output=True)
        elapsed_s = time.monotonic() - started
    finally:
        service.stop()
    dumps = [_SUMMARY.search(dump.read_bytes()) for dump in workdir.glob(out.name + "*")]
    counts = [int(found.group(1)) for found in dumps if found]
    num_ok = report["num_ok"]
    return {
        "requests": num_ok,
        "errors": report["num_errors"],
        "instructions_per_request": max(counts, default=0) / max(1, num_ok),
        "elapsed_s": elapsed_s,
    }


READY_BODY = b'{"model":"shoal-demo","max_tokens":8,"messages":[{"role":"user","content":"ready?"}]}'


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
    args = parser.parse_args(argv)
    print(f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; machine: {bp.machine_description()}", flush=True)
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
            for name in args.routers.split(","):
                print(f"  counting {name} ...", flush=True)
                rows[name] = count_router(name, upstreams, args, workdir)
    print(
        f"\n{args.requests} requests a router at concurrency {args.concurrency}, 2 KiB chat prompts "
        f"({args.num_prompts} bodies, one shared system prefix), canned nginx backend, counted by callgrind"
    )
    base = rows.get("shoal", {}).get("instructions_per_request")
    print(f"{'router':20} {'k instructions/req':>19} {'x shoal':>8} {'requests':>9} {'errors':>7}")
    print("-" * 67)
    for name, row in rows.items():
        if "skipped" in row:
            print(f"{name:20} skipped: {row['skipped'][:200]}")
            continue
        ratio = f"{row['instructions_per_request'] / base:8.2f}" if base else f"{'-':>8}"
        print(
            f"{name:20} {row['instructions_per_request'] / 1e3:19.1f} {ratio} {row['requests']:9d} {row['errors']:7d}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
