"""Soak: a `shoal router` process under steady normal traffic, with hostile traffic beside it for `--minutes`.

Everything runs as processes on 127.0.0.1: a redis-server on a free port, 2 fake replicas
(`python -m tests.fakes.fake_replica`, 10 ms to the first token, 5 ms per token) and one `shoal router` in fleet mode
(`--redis-url`, `--workers 1` unless told otherwise, its request log on, an admin token, `x-session-id` as its
session header). Three phases: `before` (`--calm-s` of normal traffic only), `during` (`--minutes` of normal and
hostile traffic) and `after` (`--calm-s` of normal traffic only).

Normal traffic is open-loop: `--rate` requests a second, whatever the answers do, alternately completions and chats
(`max_tokens` 4, a third streamed, a quarter with a session header) through `/v1/*` with aiohttp, each prompt one of
8 shared system prompts of 1-2 KB and a new question. A request is ok when it gets a 200 with a whole answer (a
stream through `data: [DONE]`) within 30 s; its latency runs from its send to its last byte. `client lag max` is
the most a request left the load generator after its time (its own event loop's stall, not the router's).

Hostile traffic (`benchmarks/soak_hostile.py`: oversized heads and trailers, chunked framing abuse, slow heads,
invalid JSON and deep nesting, prompts of 500k token ids, odd session headers, requests without Host, garbage for
the admin API, records written straight into the fleet's Redis keys) is bounded in rate, count and time; its
outcomes are tallied per kind, and one is bad when the router made a 5xx of its own or stayed silent.

The router's RSS (VmRSS of its process and its children, from /proc) is sampled every `--sample-s`; its /metrics
is scraped at the end of each phase, and its log read at the end for what /metrics does not count: the requests
its HTTP server refused, by reason, and its lines by level. Exits 1 if the router died or a phase's normal
requests failed beyond `--max-failed-fraction`. A JSON copy of everything goes to `--out` (default: a new temporary
folder), with the processes' logs.

    .venv/bin/python -m benchmarks.bench_soak [--minutes 10] [--rate 50] [--workers 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import datetime
import json
import os
import platform
import random
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import command_argv
from benchmarks.soak_hostile import MODEL, SESSION_HEADER, RedisGarbage, Tally, attacks, run_attacks
from router.common.child_processes import parent_death_signal
from router.common.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
SHOAL = [sys.executable, "-c", "import sys; from router.cli import main; sys.exit(main())"]
"""`shoal` from this source tree (run with the repository root as the working directory)."""
PHASES = ("before", "during", "after")
NAMESPACE = "shoal"
HEADER_READ_TIMEOUT_S = 30.0
"""The router's default `limits.header_read_timeout_s`: a slow head is answered 408 this long after its first byte."""
REQUEST_TIMEOUT_S = 30.0
WORDS = ("the", "of", "cache", "router", "replica", "prefix", "token", "stream", "fleet", "session", "block", "prompt")
MAX_IN_FLIGHT = 2000
"""Normal requests the load generator keeps in flight at most; past it a request counts as failed, unsent."""


def rss_kib(pid: int) -> int:
    """VmRSS of `pid` and of its descendants (a `--workers N` router's workers), KiB; 0 once it is gone."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total


class Fleet:
    """redis-server, the fake replicas and the router, as processes whose logs go to `workdir`."""

    def __init__(self, workdir: Path, args: argparse.Namespace) -> None:
        self.workdir = workdir
        self.args = args
        self.procs: list[subprocess.Popen[bytes]] = []
        self.redis_url = ""
        self.replica_urls: list[str] = []
        self.router: subprocess.Popen[bytes] | None = None
        self.router_port = free_port()
        self.admin_token = secrets.token_hex(16)

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def _start(self, name: str, command: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """From the main thread: the kernel's SIGTERM on the parent's death follows the thread that started it."""
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - the child holds it
        proc = subprocess.Popen(
            list(command), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=parent_death_signal()
        )
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            sys.exit("redis-server is not installed (apt-get install redis-server)")
        port = free_port()
        command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        redis = self._start("redis", [*command, "--dir", str(self.workdir)])
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        for i in range(2):
            port = free_port()
            command = [sys.executable, "-m", "tests.fakes.fake_replica", "--port", str(port), "--name", f"fake-{i}"]
            command += ["--first-byte-delay-s", "0.01", "--per-token-delay-s", "0.005"]
            self._start(f"replica-{i}", command)
            self.replica_urls.append(f"http://127.0.0.1:{port}")
        command = [*SHOAL, "router", "--port", str(self.router_port), "--redis-url", self.redis_url]
        command += ["--workers", str(self.args.workers), "--session-header", SESSION_HEADER]
        for url in self.replica_urls:
            command += ["--replica", url]
        env = {**os.environ, "SHOAL_ROUTER_ADMIN_TOKEN": self.admin_token, "SHOAL_ROUTER_LIMITS__UNREADY_DELAY_S": "0"}
        self.router = self._start("router", command, env)
        deadline = time.monotonic() + 60
        while not self._is_ready():
            if redis.poll() is not None or any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"a process exited at start (logs in {self.workdir})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router did not become ready (logs in {self.workdir})")
            time.sleep(0.1)  # polling processes that are starting, with a deadline

    def _is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.router_url + "/ready", timeout=1) as resp:
                body = resp.read()
        except OSError:
            return False
        return b'"ready"' in body and f'"replicas": {len(self.replica_urls)}'.encode() in body

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


@dataclass
class Sent:
    phase: str
    kind: str
    """completion or chat, `+stream` when streamed."""
    at_s: float
    """When it was sent, on time.monotonic() (the clock of the hostile sends' `events` too)."""
    is_ok: bool = False
    latency_s: float = 0.0
    error: str = ""


class NormalLoad:
    """Open-loop completions and chats (module docstring)."""

    def __init__(self, url: str, rate: float, seed: int) -> None:
        self.url = url
        self.rate = rate
        self.rng = random.Random(seed)
        self.systems = [
            f"System prompt {k}: " + " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randrange(180, 360)))
            for k in range(8)
        ]
        self.sent: list[Sent] = []
        self.phase = "before"
        self.max_lag_s = dict.fromkeys(PHASES, 0.0)
        self.in_flight = 0

    def body(self, i: int) -> tuple[str, bytes, bool, dict[str, str]]:
        system = self.systems[self.rng.randrange(len(self.systems))]
        question = f"Question {i}: what does block {self.rng.randrange(10**6)} hold?"
        is_stream = i % 3 == 0
        body: dict[str, Any]
        if i % 2:
            path, body = "/v1/completions", {"prompt": system + "\n" + question}
        else:
            path = "/v1/chat/completions"
            body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
        body.update(model=MODEL, max_tokens=4, stream=is_stream)
        headers = {"Content-Type": "application/json"}
        if i % 4 == 1:
            headers[SESSION_HEADER] = f"user-{self.rng.randrange(200)}"
        return path, json.dumps(body).encode(), is_stream, headers

    async def one(self, session: aiohttp.ClientSession, i: int) -> None:
        path, body, is_stream, headers = self.body(i)
        kind = ("chat" if path.endswith("chat/completions") else "completion") + ("+stream" if is_stream else "")
        started = time.monotonic()
        sent = Sent(self.phase, kind, started)
        self.sent.append(sent)
        if self.in_flight >= MAX_IN_FLIGHT:
            sent.error = "not sent: the load generator's in-flight cap"
            return
        self.in_flight += 1
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                async with session.post(self.url + path, data=body, headers=headers) as resp:
                    data = await resp.read()
            if resp.status != 200:
                sent.error = f"{resp.status}: {data[:160]!r}"
            elif is_stream and not data.rstrip().endswith(b"data: [DONE]"):
                sent.error = f"a stream without [DONE]: {data[-160:]!r}"
            elif not is_stream and not json.loads(data).get("choices"):
                sent.error = f"no choices: {data[:160]!r}"
            else:
                sent.is_ok = True
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            sent.error = f"{type(exc).__name__}: {exc}"[:200]
        finally:
            self.in_flight -= 1
        sent.latency_s = time.monotonic() - started

    async def run(self, until: float) -> None:
        connector = aiohttp.TCPConnector(limit=MAX_IN_FLIGHT)
        async with aiohttp.ClientSession(connector=connector) as session:
            tasks: set[asyncio.Task[None]] = set()
            origin = time.monotonic()
            i = 0
            while (at := origin + i / self.rate) < until:
                await asyncio.sleep(max(0.0, at - time.monotonic()))  # the open loop's schedule
                self.max_lag_s[self.phase] = max(self.max_lag_s[self.phase], time.monotonic() - at)
                task = asyncio.create_task(self.one(session, i))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
            await asyncio.gather(*tasks)


def scrape(url: str) -> dict[str, float]:
    """The router's counters of interest from its /metrics, as {name{labels}: value}, label sets summed over."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "shoal_router_requests_total":
                key = f"requests_total{{status={s.labels['status']}}}"
            elif s.name in ("shoal_router_task_failures_total", "shoal_router_tasks_down"):
                key = f"{s.name.removeprefix('shoal_router_')}{{task={s.labels.get('task', '')}}}"
            elif s.name == "shoal_router_retries_total":
                key = f"retries_total{{reason={s.labels['reason']}}}"
            elif s.name.startswith("shoal_router_fleet_") or s.name in (
                "shoal_router_request_log_dropped_total",
                "shoal_router_held_requests",
            ):
                key = s.name.removeprefix("shoal_router_")
            else:
                continue
            found[key] = found.get(key, 0.0) + s.value
    return found


async def soak(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    assert fleet.router is not None
    pid = fleet.router.pid
    loop = asyncio.get_running_loop()
    load = NormalLoad(fleet.router_url, args.rate, args.seed)
    replicas = await asyncio.to_thread(_replica_ids, fleet)
    garbage = RedisGarbage(fleet.redis_url, NAMESPACE, replicas)
    rss: list[tuple[str, float, int]] = []
    metrics: dict[str, dict[str, float]] = {}
    tallies: dict[str, Tally] = {}
    origin = time.monotonic()
    ends = {"before": origin + args.calm_s}
    ends["during"] = ends["before"] + args.minutes * 60
    ends["after"] = ends["during"] + args.calm_s

    async def sample() -> None:
        while time.monotonic() < ends["after"]:
            rss.append((load.phase, time.monotonic() - origin, rss_kib(pid)))
            await asyncio.sleep(args.sample_s)  # the sampling period

    async def phases() -> None:
        nonlocal tallies
        for phase in PHASES:
            load.phase = phase
            rss.append((phase, time.monotonic() - origin, rss_kib(pid)))
            if phase == "during":
                kinds = attacks(fleet.router_port, garbage, HEADER_READ_TIMEOUT_S, args.hostile_scale)
                tallies = await run_attacks(kinds, ends["during"], args.seed)
            await asyncio.sleep(max(0.0, ends[phase] - time.monotonic()))  # the phase's end
            rss.append((phase, time.monotonic() - origin, rss_kib(pid)))
            metrics[phase] = await loop.run_in_executor(None, scrape, fleet.router_url)
            print(f"{phase} done", file=sys.stderr, flush=True)

    try:
        await asyncio.gather(load.run(ends["after"]), sample(), phases())
    finally:
        await garbage.close()
    return {"load": load, "rss": rss, "metrics": metrics, "tallies": tallies}


def _replica_ids(fleet: Fleet) -> list[str]:
    request = urllib.request.Request(
        fleet.router_url + "/admin/replicas", headers={"Authorization": f"Bearer {fleet.admin_token}"}
    )
    with urllib.request.urlopen(request, timeout=5) as resp:
        return [r["id"] for r in json.loads(resp.read())["replicas"]]


def router_log(path: Path) -> dict[str, dict[str, int]]:
    """The router's log over the run: its lines by level and logger (the request log's lines by status), and the
    requests its HTTP server refused, by reason (numbers in a reason shown as N): /metrics does not count those."""
    levels: collections.Counter[str] = collections.Counter()
    refusals: collections.Counter[str] = collections.Counter()
    statuses: collections.Counter[str] = collections.Counter()
    with path.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if line.startswith('{"event":"request"'):
                statuses[f"request log, status {json.loads(line).get('status')}"] += 1
                continue
            parts = line.split(" ", 4)
            if line.startswith("Traceback"):
                levels["Traceback"] += 1
            elif len(parts) == 5 and parts[2].isupper():
                levels[f"{parts[2]} {parts[3]}"] += 1
            if "refused a request: " in line:
                reason = line.rstrip().partition("refused a request: ")[2]
                refusals[re.sub(r"\d{4,}", "N", reason)[:90]] += 1
    return {"lines": dict(levels) | dict(statuses), "refusals": dict(refusals)}


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(result: dict[str, Any], is_alive: bool, log: Path, args: argparse.Namespace) -> dict[str, Any]:
    load: NormalLoad = result["load"]
    phases: dict[str, Any] = {}
    for phase in PHASES:
        sent = [s for s in load.sent if s.phase == phase]
        ok = [s.latency_s for s in sent if s.is_ok]
        kib = [k for p, _, k in result["rss"] if p == phase]
        errors: dict[str, int] = {}
        for s in sent:
            if not s.is_ok:
                errors[s.error[:60]] = errors.get(s.error[:60], 0) + 1
        phases[phase] = {
            "sent": len(sent),
            "ok": len(ok),
            "failed": len(sent) - len(ok),
            "p50_ms": _percentile(ok, 0.5) * 1e3,
            "p99_ms": _percentile(ok, 0.99) * 1e3,
            "max_ms": max(ok, default=float("nan")) * 1e3,
            "client_lag_max_ms": load.max_lag_s[phase] * 1e3,
            "rss_start_mib": kib[0] / 1024 if kib else float("nan"),
            "rss_max_mib": max(kib) / 1024 if kib else float("nan"),
            "rss_end_mib": kib[-1] / 1024 if kib else float("nan"),
            "errors": errors,
        }
    worst = max(p["failed"] / max(p["sent"], 1) for p in phases.values())
    tallies: dict[str, Tally] = result["tallies"]
    return {
        "phases": phases,
        "hostile": {name: t.as_json() for name, t in tallies.items()},
        "metrics": result["metrics"],
        "router_log": router_log(log),
        "rss_samples": result["rss"],
        "router_alive": is_alive,
        "worst_failed_fraction": worst,
        "passed": is_alive and worst <= args.max_failed_fraction,
    }


def print_report(report: dict[str, Any], args: argparse.Namespace, load_before: str) -> None:
    print(
        f"command: {' '.join(command_argv())}\n"
        f"date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; machine: {platform.machine()} "
        f"{platform.system()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; load average {load_before} "
        f"before the run, {' '.join(f'{x:.1f}' for x in os.getloadavg())} after\n"
        f"router: `shoal router --workers {args.workers}` in fleet mode (a redis-server of its own), 2 fake replicas "
        f"(10 ms first token, 5 ms a token); normal traffic {args.rate:g} req/s open-loop, max_tokens 4; phases: "
        f"before {args.calm_s:g} s, during {args.minutes:g} min, after {args.calm_s:g} s\n"
    )
    print("## Normal traffic and the router's memory, by phase\n")
    print(
        "| phase | sent | ok | failed | p50 ms | p99 ms | max ms | client lag max ms | RSS start MiB | RSS max MiB "
        "| RSS end MiB |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for phase, p in report["phases"].items():
        print(
            f"| {phase} | {p['sent']} | {p['ok']} | {p['failed']} | {p['p50_ms']:.1f} | {p['p99_ms']:.1f} "
            f"| {p['max_ms']:.1f} | {p['client_lag_max_ms']:.0f} | {p['rss_start_mib']:.1f} | {p['rss_max_mib']:.1f} "
            f"| {p['rss_end_mib']:.1f} |"
        )
    print("\n## Hostile traffic (during): answers by status or outcome; bad = a 5xx of the router's own, or silent\n")
    print("| kind | sent | outcomes | bad | slowest s |")
    print("| --- | ---: | --- | ---: | ---: |")
    for name, t in report["hostile"].items():
        outcomes = ", ".join(f"{r} {n}" for r, n in sorted(t["results"].items()))
        print(f"| {name} | {t['sent']} | {outcomes} | {sum(t['bad'].values())} | {t['max_answer_s']:.2f} |")
    print("\n## Hostile traffic by variant\n")
    print("| kind | variant: outcome | count |")
    print("| --- | --- | ---: |")
    for name, t in report["hostile"].items():
        for what, n in sorted(t["by_variant"].items()):
            print(f"| {name} | {what} | {n} |")
    print("\n## The router's counters at the end of each phase (/metrics)\n")
    print("| counter | " + " | ".join(PHASES) + " |")
    print("| --- |" + " ---: |" * len(PHASES))
    names = sorted({n for m in report["metrics"].values() for n in m})
    for name in names:
        cells = [report["metrics"].get(phase, {}).get(name) for phase in PHASES]
        print(f"| {name} | " + " | ".join("-" if c is None else f"{c:g}" for c in cells) + " |")
    print("\n## The router's log over the run: lines by level and logger, and requests its server refused\n")
    print("| lines | count |")
    print("| --- | ---: |")
    for what, n in sorted(report["router_log"]["lines"].items()):
        print(f"| {what} | {n} |")
    for what, n in sorted(report["router_log"]["refusals"].items(), key=lambda r: -r[1]):
        print(f"| refused: {what} | {n} |")
    print()
    for name, t in report["hostile"].items():
        for what, n in t["bad"].items():
            print(f"bad: {name}, {what} (x{n})")
    for phase, p in report["phases"].items():
        for error, n in sorted(p["errors"].items(), key=lambda e: -e[1])[:5]:
            print(f"failed ({phase}): {error} (x{n})")
    worst = report["worst_failed_fraction"]
    print(
        f"verdict: router {'up' if report['router_alive'] else 'DEAD'}; worst phase's failed fraction {worst:.4f} "
        f"(limit {args.max_failed_fraction}); {'pass' if report['passed'] else 'FAIL'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the hostile phase")
    parser.add_argument("--calm-s", type=float, default=60.0, help="seconds of normal traffic before and after")
    parser.add_argument("--rate", type=float, default=50.0, help="normal requests per second")
    parser.add_argument("--workers", type=int, default=1, help="the router's --workers")
    parser.add_argument("--hostile-scale", type=float, default=1.0, help="multiplies every hostile kind's rate")
    parser.add_argument("--sample-s", type=float, default=2.0, help="seconds between RSS samples")
    parser.add_argument("--max-failed-fraction", type=float, default=0.01, help="of a phase's normal requests")
    parser.add_argument("--out", type=Path, help="folder for the JSON report and logs (default: a new temp folder)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_soak-"))
    out.mkdir(parents=True, exist_ok=True)
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    fleet = Fleet(out, args)
    try:
        fleet.start()
        result = asyncio.run(soak(fleet, args))
        assert fleet.router is not None
        is_alive = fleet.router.poll() is None and fleet._is_ready()
    finally:
        fleet.stop()
    report = summarize(result, is_alive, out / "router.log", args)
    print_report(report, args, load_before)
    report["normal_requests"] = [dataclasses.asdict(s) for s in result["load"].sent]
    (out / "bench_soak.json").write_text(json.dumps(report, indent=1))
    print(f"JSON report and logs: {out}", file=sys.stderr)
    sys.exit(0 if report["passed"] else 1)


if __name__ == "__main__":
    main()
