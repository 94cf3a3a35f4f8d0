"""Proxy overhead benchmark: throughput, added latency and CPU per request of routers on loopback.

Every router fronts the same backend, nginx returning a canned OpenAI answer (nginx_canned.conf), which is far
faster than any router, so what is measured is the router. The routers are Shoal at its defaults (the request
log on), Shoal with `--no-request-log`, a bare aiohttp proxy
(bare_proxy.py), and `sglang-router` and `smg` from PyPI, each from its own virtual environment under
benchmarks/.venvs/ (`--setup-peers` makes them; they are never dependencies of the project). Each router runs
pinned to one core (`taskset`), the load generator (loadgen.py, closed loop) and nginx to another. A run straight
at nginx is the reference for the added latency. Router CPU time per request comes from /proc/<pid>/stat
(utime + stime of the router's process tree) before and after each point.

The streaming check sends streamed requests one at a time through each router to a fake replica that writes one
SSE chunk every 2 ms, and reports the time to the first body byte and to the end of the stream next to the same
figures straight from the replica: a router without TCP_NODELAY adds ~40 ms stalls (Nagle and delayed ACKs).

`--client wrk` drives the load with wrk and `wrk_chat.lua` instead (2 KiB prompts over 48 shared prefixes), a load
generator that shares no code with the routers. `--probe` runs Shoal under a wrapper that samples event-loop lag
and times garbage collections, per point; `--py-spy-s` records it with py-spy; `--baseline REV` adds Shoal as it
was at a git revision, in the same interleaved run.

Not a test: it prints tables (and writes JSON under benchmarks/out/). Every load run is bounded by a request count
and a time limit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import command_argv, command_line, machine_description
from benchmarks.loadgen import make_bodies

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
VENVS = BENCH / ".venvs"
PEER_PACKAGES = {"sglang-router": "sglang-router==0.3.2", "smg": "smg==1.13.0"}
ROUTERS = ("shoal", "shoal-nolog", "bare", "sglang-router", "smg")
MODEL = "shoal-demo"
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
SHOAL_FROM_SOURCE = (
    "import argparse, sys; from router.cli import add_router_command; "
    "p = argparse.ArgumentParser(prog='shoal'); add_router_command(p.add_subparsers(dest='command')); "
    "a = p.parse_args(sys.argv[1:]); sys.exit(a.run(a))"
)

# `--probe`: Shoal run with an event-loop lag sampler and gc pause timing around its own serve(). SIGUSR1 writes what
# was seen since the last one to $SHOAL_PROBE_OUT (JSON) and starts afresh, so each point gets its own figures.
SHOAL_PROBE = r"""
import asyncio, gc, json, os, signal, sys, time
import router.service.server as _server
_INTERVAL_S = 0.002
_lags, _gc, _gc_start = [], {0: [], 1: [], 2: []}, [0.0]
def _on_gc(phase, info):
    if phase == "start":
        _gc_start[0] = time.perf_counter()
    else:
        _gc[info["generation"]].append(time.perf_counter() - _gc_start[0])
gc.callbacks.append(_on_gc)
_serve = _server._serve
async def _probed(settings):
    if os.environ.get("SHOAL_PROBE_GC_THRESHOLD"):
        gc.set_threshold(*map(int, os.environ["SHOAL_PROBE_GC_THRESHOLD"].split(",")))
    if os.environ.get("SHOAL_PROBE_SWITCH_INTERVAL_S"):
        sys.setswitchinterval(float(os.environ["SHOAL_PROBE_SWITCH_INTERVAL_S"]))
    loop = asyncio.get_running_loop()
    due = [time.perf_counter() + _INTERVAL_S]
    def tick():
        now = time.perf_counter()
        _lags.append(now - due[0])
        due[0] = now + _INTERVAL_S
        loop.call_later(_INTERVAL_S, tick)
    loop.call_later(_INTERVAL_S, tick)
    def dump():
        lags = sorted(_lags)
        def q(f):
            return 1000 * lags[min(len(lags) - 1, int(f * len(lags)))] if lags else 0.0
        report = {"ticks": len(lags), "lag_p50_ms": q(0.5), "lag_p99_ms": q(0.99), "lag_max_ms": q(1.0),
                  "lag_over_5ms": sum(1 for x in lags if x > 0.005),
                  "gen2_objects": len(gc.get_objects(2)), "frozen": gc.get_freeze_count(), "gc": {
                      str(g): {"count": len(v), "total_ms": 1000 * sum(v), "max_ms": 1000 * max(v, default=0.0)}
                      for g, v in _gc.items()}}
        _lags.clear()
        for v in _gc.values():
            v.clear()
        path = os.environ["SHOAL_PROBE_OUT"]
        with open(path + ".tmp", "w") as f:
            json.dump(report, f)
        os.replace(path + ".tmp", path)
    loop.add_signal_handler(signal.SIGUSR1, dump)
    await _serve(settings)
_server._serve = _probed
"""

CANNED_CHAT = {
    "id": "chatcmpl-canned",
    "object": "chat.completion",
    "created": 1700000000,
    "model": MODEL,
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "canned answer of eight tokens here ok"},
            "logprobs": None,
            "finish_reason": "length",
        }
    ],
    "usage": {"prompt_tokens": 256, "completion_tokens": 8, "total_tokens": 264},
}
CANNED_COMPLETION = {
    "id": "cmpl-canned",
    "object": "text_completion",
    "created": 1700000000,
    "model": MODEL,
    "choices": [
        {"index": 0, "text": "canned answer of eight tokens here ok", "logprobs": None, "finish_reason": "length"}
    ],
    "usage": {"prompt_tokens": 256, "completion_tokens": 8, "total_tokens": 264},
}
CANNED_MODELS = {
    "object": "list",
    "data": [{"id": MODEL, "object": "model", "created": 1700000000, "owned_by": "bench"}],
}
# What SGLang-style routers may ask a worker for (/get_server_info, /get_model_info): every other path gets this.
CANNED_INFO = {
    "model_path": MODEL,
    "served_model_name": MODEL,
    "tokenizer_path": None,
    "is_generation": True,
    "max_total_num_tokens": 1_000_000,
    "status": "ok",
}


@dataclass
class Service:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, num_lines: int = 15) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join("    " + line for line in lines[-num_lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_service(
    name: str, argv: list[str], core: int | str, workdir: Path, env: dict[str, str] | None = None, cwd: Path = REPO
) -> Service:
    log_path = workdir / f"{name}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            ["taskset", "-c", str(core), *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    return Service(name, process, log_path)


def wait_ready(service: Service, url: str, body: bytes, timeout_s: float) -> str | None:
    """Poll with a real request until it answers 200; the reason it never did, or None."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if service.process.poll() is not None:
            return f"exited with status {service.process.returncode}"
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=2) as resp:
                resp.read()
                if resp.status == 200:
                    return None
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}: {exc.read()[:200]!r}"
        except (OSError, ValueError) as exc:
            last = repr(exc)
        time.sleep(0.2)
    return f"not ready after {timeout_s:.0f} s ({last})"


def process_tree_cpu_s(root_pid: int) -> float:
    """utime + stime of a process and all its descendants, in seconds."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # fields[0] is field 3 (state) of proc(5)
        parents[int(entry)] = int(fields[1])
        ticks[int(entry)] = int(fields[11]) + int(fields[12])
    tree, frontier = {root_pid}, [root_pid]
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parents.items() if parent == pid and child not in tree]
        tree.update(children)
        frontier += children
    return sum(ticks.get(pid, 0) for pid in tree) / CLOCK_TICKS_PER_S


def run_wrk(
    url: str, core: int, concurrency: int, args: argparse.Namespace, num_requests: int, duration_s: float
) -> dict[str, Any]:
    """One wrk run (`wrk_chat.lua`, one thread, `concurrency` connections) pinned to `core`: a report with
    loadgen.py's keys, from the JSON line the script's done() prints. Its CPU time comes from getrusage of the
    reaped child (only wrk is reaped while it runs)."""
    argv = [
        "taskset",
        "-c",
        str(core),
        args.wrk,
        "-t1",
        f"-c{concurrency}",
        f"-d{max(1, round(duration_s))}s",
        "--timeout",
        "10s",
        "-s",
        str(BENCH / "wrk_chat.lua"),
        url,
        "--",
        str(args.prompt_bytes),
        str(args.prefixes),
        str(args.variants),
        str(num_requests),
        MODEL,
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=duration_s + 30)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = [line for line in done.stdout.splitlines() if line.startswith("WRK_JSON ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stdout[-1000:]}{done.stderr[-1000:]}")
    raw: dict[str, Any] = json.loads(lines[-1].removeprefix("WRK_JSON "))
    num_errors = sum(raw[key] for key in raw if key.startswith("errors_"))
    return {
        **raw,
        "num_ok": max(0, raw["num_requests"] - raw["errors_status"]),
        "num_errors": num_errors,
        "cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
    }


def run_loadgen(url: str, core: int, extra: list[str], timeout_s: float) -> dict[str, Any]:
    """One loadgen.py run pinned to `core`: its JSON report."""
    argv = ["taskset", "-c", str(core), sys.executable, str(BENCH / "loadgen.py"), "--url", url, *extra]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"loadgen failed: {done.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(done.stdout)
    return report


# -- backends and routers ------------------------------------------------------------------------------------------


def nginx_config(workdir: Path, ports: list[int]) -> Path:
    def quoted(value: object) -> str:
        return json.dumps(value, separators=(",", ":")).replace("\\", "\\\\").replace("'", "\\'")

    text = (BENCH / "nginx_canned.conf").read_text()
    listen = "\n".join(f"        listen 127.0.0.1:{port} reuseport backlog=4096;" for port in ports)
    for key, value in (
        ("@@DIR@@", str(workdir)),
        ("@@LISTEN@@", listen),
        ("@@CHAT@@", quoted(CANNED_CHAT)),
        ("@@COMPLETION@@", quoted(CANNED_COMPLETION)),
        ("@@MODELS@@", quoted(CANNED_MODELS)),
        ("@@INFO@@", quoted(CANNED_INFO)),
    ):
        text = text.replace(key, value)
    path = workdir / "nginx.conf"
    path.write_text(text)
    return path


def router_argv(
    name: str, port: int, upstreams: list[str], peer_policy: str, probe: bool = False
) -> tuple[list[str] | None, str]:
    """The command line of one router, or None and why it cannot run here."""
    if name == "bare":
        argv = [sys.executable, str(BENCH / "bare_proxy.py"), "--host", "127.0.0.1", "--port", str(port)]
        return argv + [a for u in upstreams for a in ("--upstream", u)], ""
    if is_shoal(name):
        shoal = REPO / ".venv" / "bin" / "shoal"
        if probe:
            command = [str(REPO / ".venv" / "bin" / "python"), "-c", SHOAL_PROBE + SHOAL_FROM_SOURCE]
        elif name == "shoal@base":  # run from the baseline's tree (its cwd), with this venv's packages
            command = [str(REPO / ".venv" / "bin" / "python"), "-c", SHOAL_FROM_SOURCE]
        elif shoal.exists():
            command = [str(shoal)]
        elif (REPO / "router" / "cli.py").exists():  # not installed (`make install`): run the source tree's CLI
            command = [str(REPO / ".venv" / "bin" / "python"), "-c", SHOAL_FROM_SOURCE]
        else:
            return None, f"{shoal} not found (run `make install`)"
        argv = [
            *command,
            "router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "WARNING",
            *(["--no-request-log"] if name == "shoal-nolog" else []),
            *(["--workers", "2"] if name == "shoal-w2" else []),
            *(["--policy", name.partition(":")[2]] if name.startswith("shoal:") else []),
        ]
        return argv + [a for u in upstreams for a in ("--replica", u)], ""
    python = VENVS / name / "bin" / "python"
    if not python.exists():
        return None, f"{python} not found (run with --setup-peers)"
    metrics = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    common = [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *upstreams,
        "--policy",
        peer_policy,
        "--log-level",
        "warn",
        *metrics,
    ]
    if name == "sglang-router":
        return [str(python), "-m", "sglang_router.launch_router", *common], ""
    if name == "smg":
        return [str(VENVS / name / "bin" / "smg"), "launch", *common], ""
    return None, f"unknown router {name!r}"


def peer_version(name: str) -> str:
    python = VENVS / name / "bin" / "python"
    if not python.exists():
        return "not installed"
    package = PEER_PACKAGES[name].split("==")[0]
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60).stdout.strip()


def setup_peers() -> None:
    for name, requirement in PEER_PACKAGES.items():
        venv = VENVS / name
        if not (venv / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        print(f"installing {requirement} into {venv}", flush=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", requirement], check=True)


# -- the run -------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def running(service: Service) -> Iterator[Service]:
    try:
        yield service
    finally:
        service.stop()


def warm_up(url: str, args: argparse.Namespace) -> None:
    if args.client == "wrk":
        run_wrk(url, args.loadgen_core, 16, args, args.warmup_requests, 10)
        return
    warmup = [
        "--concurrency",
        "16",
        "--requests",
        str(args.warmup_requests),
        "--duration-s",
        "10",
        "--prompt-bytes",
        str(args.prompt_bytes),
    ]
    run_loadgen(url, args.loadgen_core, warmup, args.duration_s + 60)


def is_shoal(name: str) -> bool:
    return name in ("shoal", "shoal-nolog", "shoal-tuned", "shoal@base", "shoal-w2") or name.startswith("shoal:")


def read_probe(pid: int, path: Path) -> dict[str, Any]:
    """Ask a probed router (SIGUSR1) for what its probe saw since the last ask, and wait for the file."""
    path.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the probe of router {pid} wrote nothing to {path} within 10 s")
        time.sleep(0.01)
    report: dict[str, Any] = json.loads(path.read_text())
    return report


def measure_point(
    name: str, url: str, pid: int | None, concurrency: int, args: argparse.Namespace, record: bool = False
) -> dict[str, Any]:
    """One closed-loop run of `concurrency` connections through one router: loadgen's report plus the router's CPU."""
    extra = [
        "--concurrency",
        str(concurrency),
        "--requests",
        str(args.requests),
        "--duration-s",
        str(args.duration_s),
        "--prompt-bytes",
        str(args.prompt_bytes),
        "--client",
        args.client,
    ]
    probe_path = Path(args.workdir) / f"{name}.probe.json"
    probed = pid if args.probe and is_shoal(name) else None
    if probed is not None:
        read_probe(probed, probe_path)  # forget what the probe saw before this point
    spy = None
    if record and args.py_spy_s > 0 and is_shoal(name) and pid is not None:
        out = BENCH / "out" / f"py-spy-{name.replace(':', '-')}-c{concurrency}-{time.strftime('%H%M%S')}.txt"
        out.parent.mkdir(exist_ok=True)
        spy_argv = [str(REPO / ".venv" / "bin" / "py-spy"), "record", "--pid", str(pid), "--nonblocking"]
        spy_argv += ["--rate", "250", "--duration", str(max(1, round(args.py_spy_s))), "--format", "raw"]
        spy_argv += ["--output", str(out)]
        spy = subprocess.Popen(["taskset", "-c", str(args.loadgen_core), *spy_argv], stdout=subprocess.DEVNULL)
    cpu_before_s = process_tree_cpu_s(pid) if pid else 0.0
    if args.client == "wrk":
        report = run_wrk(url, args.loadgen_core, concurrency, args, args.requests, args.duration_s)
    else:
        report = run_loadgen(url, args.loadgen_core, extra, args.duration_s + 60)
    cpu_s = process_tree_cpu_s(pid) - cpu_before_s if pid else 0.0
    if probed is not None:
        report["probe"] = read_probe(probed, probe_path)
    if spy is not None:
        spy.wait(timeout=args.py_spy_s + 30)
    num_requests = max(1, report["num_ok"] + report["num_errors"])
    report["router_cpu_us_per_request"] = cpu_s * 1e6 / num_requests if pid else None
    report["loadgen_cpu_percent"] = 100 * report["cpu_s"] / max(1e-9, report["elapsed_s"])
    print(
        f"  {name:14s} c={concurrency:<3d} {report['requests_per_s']:9.0f} req/s  "
        f"p50 {report['p50_ms']:7.3f} ms  errors {report['num_errors']}",
        flush=True,
    )
    return report


def median_report(rounds: list[dict[str, Any]], smg_rounds: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The round with the median throughput, carrying every round's throughput and, when smg ran, the median and
    range of the per-round ratios to it (round k of each router ran back to back, so a ratio compares like with
    like even while the machine's speed drifts)."""
    ordered = sorted(rounds, key=lambda r: r["requests_per_s"])
    report = dict(ordered[(len(ordered) - 1) // 2])
    report["rounds_requests_per_s"] = [r["requests_per_s"] for r in rounds]
    cpus = sorted(r["router_cpu_us_per_request"] for r in rounds if r["router_cpu_us_per_request"] is not None)
    report["router_cpu_us_per_request"] = cpus[(len(cpus) - 1) // 2] if cpus else None
    if smg_rounds:
        ratios = sorted(r["requests_per_s"] / s["requests_per_s"] for r, s in zip(rounds, smg_rounds, strict=True))
        report["x_smg_rounds"] = ratios
        report["x_smg"] = ratios[(len(ratios) - 1) // 2]
    return report


def stream_check(name: str, url: str, args: argparse.Namespace) -> dict[str, Any]:
    extra = ["--stream", "--requests", str(args.stream_requests), "--duration-s", "20"]
    report = run_loadgen(url, args.loadgen_core, extra, 80)
    print(
        f"  {name:14s} stream: first byte p50 {report['first_byte_p50_ms']:.1f} ms, "
        f"end p50 {report['end_p50_ms']:.1f} ms (max {report['end_max_ms']:.1f})",
        flush=True,
    )
    return report


def start_router(
    name: str, upstreams: list[str], args: argparse.Namespace, workdir: Path, ready_body: bytes
) -> tuple[Service | None, str, str]:
    port = free_port()
    probe = args.probe and is_shoal(name)
    argv, why = router_argv(name, port, upstreams, args.peer_policy, probe)
    if argv is None:
        return None, "", why
    env = {"SHOAL_PROBE_OUT": str(workdir / f"{name}.probe.json")}
    if not args.per_host:
        env["TOKIO_WORKER_THREADS"] = "1"
    if name == "shoal-tuned":
        env["SHOAL_PROBE_GC_THRESHOLD"] = args.probe_gc_threshold
        env["SHOAL_PROBE_SWITCH_INTERVAL_S"] = args.probe_switch_interval_s
    cwd = REPO
    if name == "shoal@base":
        cwd = Path(args.baseline_dir)
        env["PYTHONPATH"] = str(cwd)
    # shoal-w2 (two worker processes) gets both cores, the load generator's included: the most a second core gives.
    cores = f"{args.router_core},{args.loadgen_core}" if name == "shoal-w2" else str(args.router_core)
    if args.per_host:  # every router on every core, as a host is given to it
        cores = args.loadgen_core
    service = start_service(name, argv, cores, workdir, env=env, cwd=cwd)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    error = wait_ready(service, url, ready_body, args.startup_timeout_s)
    if error:
        service.stop()
        return None, "", f"{error}; `{shlex.join(argv)}` said:\n{service.log_tail()}"
    return service, url, ""


def print_tables(
    results: dict[str, dict[int, dict[str, Any]]], streams: dict[str, dict[str, Any]], args: argparse.Namespace
) -> None:
    if args.client == "wrk":
        client = "wrk (wrk_chat.lua, 1 thread)"
        prompts = f" over {args.prefixes} shared prefixes ({args.prefixes * args.variants} bodies)"
    else:
        client, prompts = f"loadgen.py ({args.client} client)", " sharing one prefix (64 bodies)"
    for concurrency in args.concurrency:
        print(
            f"\nconcurrency {concurrency}: {args.requests} requests per router or {args.duration_s:g} s, "
            f"{args.prompt_bytes}-byte chat prompts{prompts}, canned nginx backend, {client}; median of "
            f"{args.rounds} interleaved round{'s' if args.rounds != 1 else ''}"
        )
        header = (
            f"{'router':16s}{'req/s':>9s}{'x smg':>8s}{'x smg range':>13s}{'p50 ms':>9s}{'p99 ms':>9s}"
            f"{'+p50 ms':>9s}{'CPU us/req':>12s}{'loadgen CPU':>13s}{'errors':>8s}"
        )
        print(header)
        print("-" * len(header))
        direct = results.get("direct", {}).get(concurrency)
        for name, by_concurrency in results.items():
            row = by_concurrency.get(concurrency)
            if row is None:
                continue
            ratios = row.get("x_smg_rounds")
            ratio = f"{row['x_smg']:.2f}" if ratios else "-"
            spread = f"{ratios[0]:.2f}-{ratios[-1]:.2f}" if ratios else "-"
            added = f"{row['p50_ms'] - direct['p50_ms']:+.3f}" if direct and name != "direct" else "-"
            cpu = row["router_cpu_us_per_request"]
            cpu_text = f"{cpu:.0f}" if cpu is not None else "-"
            label = "direct (nginx)" if name == "direct" else name
            print(
                f"{label:16s}{row['requests_per_s']:9.0f}{ratio:>8s}{spread:>13s}{row['p50_ms']:9.3f}{row['p99_ms']:9.3f}"
                f"{added:>9s}{cpu_text:>12s}{row['loadgen_cpu_percent']:12.0f}%{row['num_errors']:8d}"
            )
    probed = [(n, c, r["probe"]) for n, by_c in results.items() for c, r in by_c.items() if "probe" in r]
    if probed:
        print("\nprobe (median round): event-loop lag of a 2 ms timer, and gc pauses (gc.callbacks) per generation")
        header = (
            f"{'router':16s}{'conc':>5s}{'lag p50':>9s}{'lag p99':>9s}{'lag max':>9s}{'>5ms':>6s}"
            f"{'gc0 n/ms/max':>16s}{'gc1 n/ms/max':>16s}{'gc2 n/ms/max':>16s}{'gen2 objs':>10s}"
        )
        print(header)
        print("-" * len(header))
        for name, concurrency, probe in probed:
            gcs = [probe["gc"][g] for g in "012"]
            per_gen = "".join(f"{g['count']:>6d}/{g['total_ms']:.0f}/{g['max_ms']:.1f}".rjust(16) for g in gcs)
            print(
                f"{name:16s}{concurrency:5d}{probe['lag_p50_ms']:9.2f}{probe['lag_p99_ms']:9.2f}"
                f"{probe['lag_max_ms']:9.2f}{probe['lag_over_5ms']:6d}{per_gen}{probe['gen2_objects']:10d}"
            )
    if streams:
        print(
            f"\nstreaming: {args.stream_requests} sequential streamed chats of 8 tokens from a fake replica that "
            "writes an SSE chunk every 2 ms (10 chunks, ~18 ms); Nagle shows as +40 ms steps"
        )
        header = f"{'router':16s}{'first byte p50':>16s}{'end p50':>10s}{'end max':>10s}{'errors':>8s}"
        print(header)
        print("-" * len(header))
        for name, row in streams.items():
            label = "direct (fake)" if name == "direct" else name
            print(
                f"{label:16s}{row['first_byte_p50_ms']:14.1f}ms{row['end_p50_ms']:8.1f}ms"
                f"{row['end_max_ms']:8.1f}ms{row['num_errors']:8d}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--routers",
        default=",".join(ROUTERS),
        help=f"comma-separated subset of {ROUTERS}; shoal:POLICY runs Shoal with --policy POLICY",
    )
    parser.add_argument("--concurrency", default="1,16,64", help="comma-separated concurrency levels")
    parser.add_argument("--requests", type=int, default=2000, help="requests per point")
    parser.add_argument("--duration-s", type=float, default=20.0, help="time cap per point")
    parser.add_argument(
        "--rounds", type=int, default=3, help="runs of each point, interleaved across routers; tables show the median"
    )
    parser.add_argument("--warmup-requests", type=int, default=300)
    parser.add_argument("--prompt-bytes", type=int, default=None, help="default 2048 with --client wrk, else 1024")
    parser.add_argument("--num-replicas", type=int, default=2, help="nginx listens on this many ports, one a replica")
    parser.add_argument("--peer-policy", default="cache_aware", help="--policy of sglang-router and smg")
    parser.add_argument(
        "--client",
        choices=("raw", "aiohttp", "wrk"),
        default="raw",
        help="load generator: loadgen.py's raw or aiohttp client, or wrk with wrk_chat.lua (an independent one)",
    )
    parser.add_argument("--wrk", default="wrk", help="the wrk binary (--client wrk)")
    parser.add_argument("--prefixes", type=int, default=48, help="--client wrk: distinct system prompts")
    parser.add_argument("--variants", type=int, default=16, help="--client wrk: distinct questions per prefix")
    parser.add_argument("--router-core", type=int, default=0)
    parser.add_argument("--loadgen-core", type=int, default=1, help="also runs nginx and the fake replica")
    parser.add_argument(
        "--per-host",
        action="store_true",
        help="nothing pinned apart: every router, nginx and the load generator on all cores (peers with their default "
        "thread counts; Shoal as shoal-w2, two worker processes)",
    )
    parser.add_argument("--startup-timeout-s", type=float, default=60.0)
    parser.add_argument("--stream-requests", type=int, default=30, help="0 skips the streaming check")
    parser.add_argument(
        "--probe",
        action="store_true",
        help="run Shoal with an event-loop lag sampler and gc pause timing, and print what they saw per point",
    )
    parser.add_argument(
        "--probe-gc-threshold",
        default="",
        help="A,B,C: with --probe, also run a `shoal-tuned` row, Shoal with gc.set_threshold(A, B, C)",
    )
    parser.add_argument(
        "--probe-switch-interval-s",
        default="",
        help="with --probe, also run a `shoal-tuned` row, Shoal with sys.setswitchinterval(S) (default 0.005)",
    )
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="also run a `shoal@base` row: Shoal at its defaults with router/ as it was at git revision REV",
    )
    parser.add_argument(
        "--py-spy-s",
        type=float,
        default=0.0,
        help="record Shoal with py-spy (on the load generator's core) for this long during each point at the "
        "highest concurrency of the last round; flame graphs under benchmarks/out/",
    )
    parser.add_argument(
        "--setup-peers", action="store_true", help=f"create benchmarks/.venvs/ for {PEER_PACKAGES} and exit"
    )
    args = parser.parse_args(argv)
    if args.per_host:
        args.router_core = args.loadgen_core = f"0-{(os.cpu_count() or 1) - 1}"
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.prompt_bytes is None:
        args.prompt_bytes = 2048 if args.client == "wrk" else 1024
    if min(args.concurrency) < 1 or args.requests < 1 or args.duration_s <= 0 or args.prompt_bytes < 64:
        parser.error("--concurrency and --requests must be positive, --duration-s too, --prompt-bytes at least 64")
    if args.prefixes < 1 or args.variants < 1:
        parser.error("--prefixes and --variants must be at least 1")
    if args.client == "wrk" and shutil.which(args.wrk) is None:
        parser.error(f"{args.wrk} not found: apt-get install -y wrk")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    names = [n.strip() for n in args.routers.split(",") if n.strip()]
    if args.probe and (args.probe_gc_threshold or args.probe_switch_interval_s):
        names.append("shoal-tuned")
    if args.baseline:
        names.insert(names.index("shoal") + 1 if "shoal" in names else 0, "shoal@base")
    known = (*ROUTERS, "shoal-tuned", "shoal@base", "shoal-w2")
    unknown = {n for n in names if n not in known and not n.startswith("shoal:")}
    if unknown:
        parser.error(f"unknown routers {sorted(unknown)}; known: {ROUTERS}")

    print(command_line())
    print(f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; machine: {machine_description()}", flush=True)
    if args.setup_peers:
        setup_peers()
        return 0
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        print("nginx not found: apt-get install -y nginx-light", file=sys.stderr)
        return 1
    print(
        f"cores: router {args.router_core}, loadgen+nginx {args.loadgen_core}; "
        + ", ".join(f"{n} {peer_version(n)}" for n in PEER_PACKAGES),
        flush=True,
    )

    ready_body = make_bodies(1, 256, MODEL)[0]
    results: dict[str, dict[int, dict[str, Any]]] = {}
    streams: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="shoal-bench-") as tmp:
        workdir = Path(tmp)
        args.workdir = str(workdir)
        if args.baseline:
            base = workdir / "base"
            base.mkdir()
            archive = subprocess.run(
                ["git", "-C", str(REPO), "archive", args.baseline, "router"], capture_output=True, timeout=60
            )
            if archive.returncode != 0:
                print(f"git archive {args.baseline} failed: {archive.stderr.decode()[-500:]}", file=sys.stderr)
                return 1
            subprocess.run(["tar", "-x", "-C", str(base)], input=archive.stdout, check=True, timeout=60)
            args.baseline_dir = str(base)
            print(f"shoal@base: router/ at {args.baseline}", flush=True)
        ports = [free_port() for _ in range(args.num_replicas)]
        upstreams = [f"http://127.0.0.1:{p}" for p in ports]
        config = nginx_config(workdir, ports)
        fake_port = free_port()
        fake_argv = [
            sys.executable,
            "-m",
            "tests.fakes.fake_replica",
            "--port",
            str(fake_port),
            "--name",
            "stream",
            "--per-token-delay-s",
            "0.002",
            "--num-output-tokens",
            "16",
        ]
        with (
            running(
                start_service("nginx", [nginx, "-c", str(config), "-p", str(workdir)], args.loadgen_core, workdir)
            ) as backend,
            running(start_service("fake", fake_argv, args.loadgen_core, workdir)) as fake,
        ):
            for service, url in ((backend, upstreams[0]), (fake, f"http://127.0.0.1:{fake_port}")):
                error = wait_ready(service, url + "/v1/chat/completions", ready_body, 20)
                if error:
                    print(f"{service.name} did not start: {error}\n{service.log_tail()}", file=sys.stderr)
                    return 1
            # Every router is started up front and the points interleave: for each concurrency, round k runs each
            # router once, in an order that alternates between rounds, so slow minutes of the machine fall on
            # every router alike.
            live: dict[str, tuple[Service, str]] = {}
            with contextlib.ExitStack() as stack:
                for name in names:
                    router, url, why = start_router(name, upstreams, args, workdir, ready_body)
                    if router is None:
                        skipped[name] = why
                        print(f"  skipped {name}: {why}", flush=True)
                        continue
                    stack.enter_context(running(router))
                    live[name] = (router, url)
                order = ["direct", *live]
                urls: dict[str, tuple[int | None, str]] = {"direct": (None, upstreams[0] + "/v1/chat/completions")}
                urls.update({name: (router.process.pid, url) for name, (router, url) in live.items()})
                for name in order:
                    warm_up(urls[name][1], args)
                for concurrency in args.concurrency:
                    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in order}
                    for k in range(args.rounds):
                        print(f"concurrency {concurrency}, round {k + 1} of {args.rounds}:", flush=True)
                        for name in order if k % 2 == 0 else order[::-1]:
                            pid, url = urls[name]
                            record = k == args.rounds - 1 and concurrency == max(args.concurrency)
                            rounds[name].append(measure_point(name, url, pid, concurrency, args, record))
                    for name in order:
                        results.setdefault(name, {})[concurrency] = median_report(rounds[name], rounds.get("smg"))
            if args.stream_requests:
                streams["direct"] = stream_check("direct", f"http://127.0.0.1:{fake_port}/v1/chat/completions", args)
                for name in live:
                    router, url, why = start_router(name, [f"http://127.0.0.1:{fake_port}"], args, workdir, ready_body)
                    if router is None:
                        print(f"  streaming check of {name} skipped: {why}", flush=True)
                        continue
                    with running(router):
                        streams[name] = stream_check(name, url, args)

    print_tables(results, streams, args)
    for name, why in skipped.items():
        print(f"\nskipped {name}: {why}")
    out_dir = BENCH / "out"
    out_dir.mkdir(exist_ok=True)
    out_path = out_dir / f"bench_proxy-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out_path.write_text(
        json.dumps({"argv": command_argv(), "results": results, "streams": streams, "skipped": skipped}, indent=1)
    )
    print(f"\nJSON: {out_path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
