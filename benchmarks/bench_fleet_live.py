"""A live router fleet with and without sharing: 3 routers, 3 Shoal replicas of the demo model, a real Redis.

Everything runs as processes on 127.0.0.1: a redis-server, `--replicas` `shoal replica` processes of the packaged
demo model (1 CPU thread each, `--num-blocks` KV blocks of 16 tokens, no speculation) and `--routers` `shoal router`
processes in front of all of them, with `--redis-url` when sharing is on (`on`), without it for the baseline (`off`).
Routers run in approximate mode (their index holds routing decisions, their own and, with sharing, the others');
`+events` modes run them in exact mode, the replicas' KV events feeding every router's index and the demo
tokenizer making chats route on the token ids those events name. Each mode starts fresh replicas: all meet cold
caches.

Workload: `--prompts` system prompts of 1-2 KB, each asked a new question every round, rounds in a
shuffled order; request j goes to router j mod 3 (as a load balancer in front would), `--concurrency` at a time,
streamed through the official openai client, `max_tokens` 4. Together the prompts need more KV than one replica
holds, so a prefix sent to a different replica than last time is a miss there and evicts others. Phases, the same
requests in every mode:

- `warm`: the first `--warm-rounds` rounds.
- `restart`: router 3 leaves the rotation, gets SIGTERM and starts again; once its /ready answers, the next round
  goes to it alone (the prompts another router has served). `agreed` is the share it sent to the replica the other
  routers last chose for that prompt (the bar: 95% within 2 s of the start).
- `outage`: `--outage-rounds` rounds while Redis is SIGSTOPped for `--pause-s`, SIGCONTed, then stopped and
  started again (empty) after `--down-s`; without sharing only the requests run.
- `after`: `--after-rounds` rounds, once every router's `shoal_router_fleet_redis_up` is 1 again.

`hit` is the replicas' cached prompt tokens over prompt tokens (`usage.prompt_tokens_details.cached_tokens`,
streamed with `stream_options.include_usage`); TTFT is the time to the first streamed content token at the client;
branches are the routers' `shoal_router_requests_total` (router 3's from before its restart added in). Every
request's figures go to `benchmarks/out/bench_fleet_live.json`.

    .venv/bin/python -m benchmarks.bench_fleet_live [--prompts 24] [--num-blocks 256] [--concurrency 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import command_argv
from replica.demo.build import PACKAGED_DIR as DEMO_DIR
from replica.demo.corpus import generate_conversations
from router.common.child_processes import parent_death_signal
from router.common.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
MODEL = "shoal-demo"
MODES = ("off", "on", "off+events", "on+events")
"""Sharing off or on; `+events`: exact mode (module docstring)."""
RESTARTED = 2
"""Index of the router that is restarted."""
SHOAL = [sys.executable, "-c", "import sys; from router.cli import main; sys.exit(main())"]
"""`shoal` from this source tree (run with the repository root as the working directory)."""


@dataclass
class Result:
    mode: str
    phase: str
    prompt: int
    router: int
    sent_s: float
    """Seconds since the benchmark's clock origin (time.monotonic)."""
    is_ok: bool = False
    error: str = ""
    ttft_s: float | None = None
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replica: str | None = None


def workload(num_prompts: int, num_rounds: int, seed: int) -> tuple[list[str], list[list[str]]]:
    """System prompts of 1-2 KB, each unique from its first bytes, and a question per prompt per round."""
    rng = random.Random(seed)
    texts: list[str] = []
    questions: list[str] = []
    for conversation in generate_conversations(200, seed=seed):
        for message in conversation:
            content = message.get("content")
            if isinstance(content, str) and content:
                (texts if message["role"] == "system" else questions).append(content)
    systems = []
    for p in range(num_prompts):
        target_bytes = rng.randrange(1024, 2048)
        text = f"Tenant {p:02d}, account {rng.randrange(10**6):06d}."
        while len(text.encode()) < target_bytes:
            text += " " + rng.choice(texts + questions)
        systems.append(text.encode()[:target_bytes].decode(errors="ignore"))
    asked = [[rng.choice(questions) + f" (ref {p}-{r})" for r in range(num_rounds)] for p in range(num_prompts)]
    return systems, asked


def _get(url: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except (urllib.error.URLError, OSError):
        return 0, b""


def _metrics(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A /metrics page as {sample name: [(labels, value)]}; empty if it does not answer."""
    status, body = _get(url + "/metrics")
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    if status != 200:
        return samples
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def _value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float | None:
    found = samples.get(name)
    return found[0][1] if found else None


class Fleet:
    """The processes of one mode: Redis (shared by the modes), replicas and routers."""

    def __init__(self, workdir: Path, args: argparse.Namespace) -> None:
        self.workdir = workdir
        self.args = args
        self.redis_port = free_port()
        self.redis: subprocess.Popen[bytes] | None = None
        self.replicas: list[subprocess.Popen[bytes]] = []
        self.replica_urls: list[str] = []
        self.routers: list[subprocess.Popen[bytes] | None] = []
        self.router_ports = [free_port() for _ in range(args.routers)]
        self.redis_url: str | None = None

    def _start(self, name: str, command: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Call from the main thread: the kernel's SIGTERM on the parent's death follows the thread that started
        the child (router.common.child_processes)."""
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - the child holds it
        return subprocess.Popen(
            list(command),
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=parent_death_signal(),
        )

    # --- Redis ---------------------------------------------------------------------------------------------------

    def start_redis(self) -> None:
        self.spawn_redis()
        self.wait_redis()

    def spawn_redis(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            sys.exit("redis-server is not installed (apt-get install redis-server)")
        command = [binary, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        command += ["--dir", str(self.workdir)]
        self.redis = self._start("redis", command)
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"

    def wait_redis(self, timeout_s: float = 10.0) -> None:
        assert self.redis is not None
        deadline = time.monotonic() + timeout_s
        while not self._redis_answers():
            if self.redis.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)  # polling a process that is starting, with a deadline

    def _redis_answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.redis_port), timeout=1) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop_redis(self) -> None:
        if self.redis is not None and self.redis.poll() is None:
            self.redis.send_signal(signal.SIGCONT)  # a stopped server cannot act on SIGTERM
            self.redis.terminate()
            self.redis.wait(timeout=10)
        self.redis = None

    def signal_redis(self, sig: signal.Signals) -> None:
        assert self.redis is not None
        self.redis.send_signal(sig)

    def flush_redis(self) -> None:
        with socket.create_connection(("127.0.0.1", self.redis_port), timeout=2) as conn:
            conn.sendall(b"FLUSHALL\r\n")
            conn.recv(16)

    # --- replicas and routers ------------------------------------------------------------------------------------

    def start_replicas(self, timeout_s: float = 300.0) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.replica_urls = []
        for i in range(self.args.replicas):
            port = free_port()
            command = [*SHOAL, "replica", "--model", str(DEMO_DIR), "--served-model-name", MODEL]
            command += ["--port", str(port)]
            command += ["--threads", "1", "--num-blocks", str(self.args.num_blocks), "--num-speculative-tokens", "0"]
            self.replicas.append(self._start(f"replica-{i}", command, env))
            self.replica_urls.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + timeout_s
        for url in self.replica_urls:
            while _get(url + "/health")[0] != 200:
                if any(p.poll() is not None for p in self.replicas) or time.monotonic() > deadline:
                    raise RuntimeError(f"replica {url} did not start (logs in {self.workdir})")
                time.sleep(0.2)  # polling processes that are loading the model, with a deadline

    def start_router(self, i: int, is_sharing: bool, has_events: bool) -> float:
        """Start router `i`; returns the seconds from its start until /ready said ready with every replica."""
        started = self.spawn_router(i, is_sharing, has_events)
        return self.wait_router(i, started)

    def spawn_router(self, i: int, is_sharing: bool, has_events: bool) -> float:
        """Start router `i`; returns when, on time.monotonic()."""
        command = [*SHOAL, "router", "--port", str(self.router_ports[i]), "--no-request-log"]
        for url in self.replica_urls:
            command += ["--replica", url]
        if is_sharing:
            assert self.redis_url is not None
            command += ["--redis-url", self.redis_url]
        # The load balancer in front (this script) takes a router out of rotation before stopping it.
        env = {**os.environ, "SHOAL_ROUTER_LIMITS__UNREADY_DELAY_S": "0"}
        if has_events:
            command += ["--tokenizer", f"{MODEL}={DEMO_DIR}"]
            env["SHOAL_ROUTER_KV_EVENTS__SOURCE"] = "sse"
        started = time.monotonic()
        proc = self._start(f"router-{i}", command, env)
        if i < len(self.routers):
            self.routers[i] = proc
        else:
            self.routers.append(proc)
        return started

    def wait_router(self, i: int, started: float) -> float:
        """Seconds from `started` until router `i`'s /ready said ready with every replica."""
        proc = self.routers[i]
        assert proc is not None
        deadline = started + 60
        while True:
            status, body = _get(self.router_url(i) + "/ready", timeout_s=1.0)
            if status == 200 and b'"ready"' in body and f'"replicas": {len(self.replica_urls)}'.encode() in body:
                return time.monotonic() - started
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"router {i} did not become ready (logs in {self.workdir})")
            time.sleep(0.01)  # polling a starting process, with a deadline

    def wait_kv_events(self, i: int, timeout_s: float = 30.0) -> None:
        """Until router `i` follows every replica's KV-event stream."""
        deadline = time.monotonic() + timeout_s
        while _value(_metrics(self.router_url(i)), "shoal_router_kv_events_live_streams") != len(self.replica_urls):
            if time.monotonic() > deadline:
                raise RuntimeError(f"router {i} did not follow the replicas' KV events (logs in {self.workdir})")
            time.sleep(0.05)  # polling the router's gauge, with a deadline

    def stop_router(self, i: int) -> None:
        proc = self.routers[i]
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=90)
        self.routers[i] = None

    def router_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.router_ports[i]}"

    def stop_all(self) -> None:
        for i in range(len(self.routers)):
            self.stop_router(i)
        for proc in self.replicas:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.replicas:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.replicas = []
        self.routers = []


class Load:
    """Chat requests to the routers, streamed through the openai client; every result is kept."""

    def __init__(self, mode: str, fleet: Fleet, systems: list[str], questions: list[list[str]], args: Any) -> None:
        self.mode = mode
        self.fleet = fleet
        self.systems = systems
        self.questions = questions
        self.args = args
        self.results: list[Result] = []
        self.clients = [
            openai.AsyncOpenAI(base_url=fleet.router_url(i) + "/v1", api_key="unused", max_retries=0, timeout=60)
            for i in range(args.routers)
        ]

    async def close(self) -> None:
        for client in self.clients:
            await client.close()

    async def send(self, phase: str, prompt: int, question: str, router: int) -> Result:
        result = Result(self.mode, phase, prompt, router, time.monotonic())
        try:
            raw = await self.clients[router].chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[{"role": "system", "content": self.systems[prompt]}, {"role": "user", "content": question}],
                max_tokens=4,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            result.replica = raw.headers.get("x-shoal-replica")
            async for chunk in raw.parse():
                if result.ttft_s is None and chunk.choices and chunk.choices[0].delta.content:
                    result.ttft_s = time.monotonic() - result.sent_s
                if chunk.usage is not None:
                    result.prompt_tokens = chunk.usage.prompt_tokens
                    details = chunk.usage.prompt_tokens_details
                    result.cached_tokens = (details.cached_tokens or 0) if details is not None else 0
            result.is_ok = result.prompt_tokens > 0
            if not result.is_ok:
                result.error = "no usage in the stream"
        except openai.OpenAIError as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:200]
        result.e2e_s = time.monotonic() - result.sent_s
        self.results.append(result)
        return result

    async def run(self, phase: str, requests: list[tuple[int, str]], routers: Sequence[int], max_s: float) -> None:
        """`requests` (prompt, question), request j to routers[j mod len(routers)], `concurrency` at a time;
        none is started past `max_s`."""
        deadline = time.monotonic() + max_s
        queue = list(enumerate(requests))
        queue.reverse()

        async def lane() -> None:
            while queue and time.monotonic() < deadline:
                j, (prompt, question) = queue.pop()
                await self.send(phase, prompt, question, routers[j % len(routers)])

        await asyncio.gather(*(lane() for _ in range(self.args.concurrency)))

    def rounds(self, first: int, last: int, rng: random.Random) -> list[tuple[int, str]]:
        """Rounds `first`..`last - 1`: every prompt's question of the round, each round in its own shuffled order."""
        requests = []
        for r in range(first, last):
            order = list(range(len(self.systems)))
            rng.shuffle(order)
            requests += [(p, self.questions[p][r]) for p in order]
        return requests


def branches(fleet: Fleet, routers: Sequence[int]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for i in routers:
        for labels, value in _metrics(fleet.router_url(i)).get("shoal_router_requests_total", []):
            counts[labels["branch"]] = counts.get(labels["branch"], 0) + int(value)
    return counts


async def run_mode(
    mode: str, fleet: Fleet, systems: list[str], questions: list[list[str]], args: Any
) -> dict[str, Any]:
    is_sharing = mode.startswith("on")
    has_events = mode.endswith("+events")
    rng = random.Random(args.seed)  # the same request order in both modes
    fleet.start_replicas()
    if is_sharing:
        fleet.flush_redis()
    for i in range(args.routers):
        fleet.start_router(i, is_sharing, has_events)
        if has_events:
            fleet.wait_kv_events(i)
    load = Load(mode, fleet, systems, questions, args)
    everyone = list(range(args.routers))
    report: dict[str, Any] = {"mode": mode}
    started = time.monotonic()
    try:
        warm, outage_end = args.warm_rounds, args.warm_rounds + 1 + args.outage_rounds
        await load.run("warm", load.rounds(0, warm, rng), everyone, args.max_phase_s)

        # Restart: out of rotation, SIGTERM, start again, then round 3 to it alone.
        home: dict[int, str] = {}
        for r in load.results:
            if r.is_ok and r.router != RESTARTED and r.replica is not None:
                home[r.prompt] = r.replica
        before = branches(fleet, [RESTARTED])
        await asyncio.to_thread(fleet.stop_router, RESTARTED)
        restart_at = fleet.spawn_router(RESTARTED, is_sharing, has_events)
        ready_s = await asyncio.to_thread(fleet.wait_router, RESTARTED, restart_at)
        ready_at = restart_at + ready_s
        probe = [(p, q) for p, q in load.rounds(warm, warm + 1, rng) if p in home]
        await load.run("restart", probe, [RESTARTED], args.max_phase_s)
        probes = [r for r in load.results if r.phase == "restart" and r.is_ok]
        agreed = [r for r in probes if r.replica == home[r.prompt]]
        report["restart"] = {
            "ready_s": ready_s,
            "probes": len(probes),
            "within_2s_of_start": sum(r.sent_s - restart_at <= 2.0 for r in probes),
            "agreed_within_2s_of_start": sum(r.sent_s - restart_at <= 2.0 for r in agreed),
            "within_2s_of_ready": sum(r.sent_s - ready_at <= 2.0 for r in probes),
            "agreed_within_2s_of_ready": sum(r.sent_s - ready_at <= 2.0 for r in agreed),
            "agreed": len(agreed),
        }

        # Outage (sharing only): Redis stopped with SIGSTOP, continued, then stopped and started again, under load.
        outage: dict[str, Any] = {}
        if is_sharing:
            applied_before = [
                _value(_metrics(fleet.router_url(i)), "shoal_router_fleet_batches_applied_total") or 0 for i in everyone
            ]
            outage_task = asyncio.create_task(redis_outage(fleet, args, outage))
        await load.run("outage", load.rounds(warm + 1, outage_end, rng), everyone, args.max_phase_s)
        if is_sharing:
            await outage_task
        await load.run("after", load.rounds(outage_end, args.rounds, rng), everyone, args.max_phase_s)
        if is_sharing:
            after = [_metrics(fleet.router_url(i)) for i in everyone]
            outage["applied_since"] = [
                int((_value(m, "shoal_router_fleet_batches_applied_total") or 0) - b)
                for m, b in zip(after, applied_before, strict=True)
            ]
            outage["outages"] = [int(_value(m, "shoal_router_fleet_outages_total") or 0) for m in after]
            for name, (begin, end) in {
                "stopped (SIGSTOP)": ("paused_at", "resumed_at"),
                "down": ("stopped_at", "restarted_at"),
                "SIGSTOP to restart": ("paused_at", "restarted_at"),
            }.items():
                window = [r for r in load.results if outage[begin] <= r.sent_s <= outage[end]]
                outage[name] = (len(window), sum(not r.is_ok for r in window), outage[end] - outage[begin])
        report["outage"] = outage
        report["branches"] = branches(fleet, everyone)
        for name, count in before.items():
            report["branches"][name] = report["branches"].get(name, 0) + count
    finally:
        await load.close()
        fleet.stop_all()
    report["seconds"] = time.monotonic() - started
    report["results"] = load.results
    return report


async def redis_outage(fleet: Fleet, args: Any, timeline: dict[str, Any]) -> None:
    """SIGSTOP Redis, SIGCONT it, stop it, start it again; the times go into `timeline`."""
    await asyncio.sleep(args.outage_delay_s)  # the outage's schedule, not a wait on state
    timeline["paused_at"] = time.monotonic()
    fleet.signal_redis(signal.SIGSTOP)
    await asyncio.sleep(args.pause_s)
    fleet.signal_redis(signal.SIGCONT)
    timeline["resumed_at"] = time.monotonic()
    await asyncio.sleep(args.pause_s)
    timeline["stopped_at"] = time.monotonic()
    await asyncio.to_thread(fleet.stop_redis)
    await asyncio.sleep(args.down_s)
    fleet.spawn_redis()
    await asyncio.to_thread(fleet.wait_redis)
    timeline["restarted_at"] = time.monotonic()
    timeline["up_again_s"] = await redis_up_again(fleet, range(args.routers), timeline["restarted_at"])


async def redis_up_again(fleet: Fleet, routers: Sequence[int], since: float, timeout_s: float = 30.0) -> float | None:
    """Seconds after `since` until every router's shoal_router_fleet_redis_up is 1; None past the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ups = [
            _value(await asyncio.to_thread(_metrics, fleet.router_url(i)), "shoal_router_fleet_redis_up")
            for i in routers
        ]
        if all(up == 1.0 for up in ups):
            return time.monotonic() - since
        await asyncio.sleep(0.1)  # polling the routers' gauges, with a deadline
    return None


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _hit(results: list[Result]) -> str:
    prompt = sum(r.prompt_tokens for r in results if r.is_ok)
    return f"{sum(r.cached_tokens for r in results if r.is_ok) / prompt:.3f}" if prompt else "-"


def _share(part: int, whole: int) -> str:
    return f"{part}/{whole} ({part / whole:.0%})" if whole else "0/0"


def print_tables(reports: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"command: {' '.join(command_argv())}\n"
        f"date: {datetime.date.today()}; machine: {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}; {args.replicas} replicas (demo model, 1 thread, {args.num_blocks} "
        f"KV blocks of 16 tokens each), {args.routers} routers, {args.prompts} system prompts x {args.rounds} "
        f"rounds, concurrency {args.concurrency}, max_tokens 4; load average {args.load_before} before the run, "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} after\n"
    )
    print("## Sharing off against on (all phases; TTFT = first streamed token at the client)\n")
    print(
        "| sharing | requests | errors | hit | TTFT mean ms | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | e2e p99 ms "
        "| seconds | branches |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for rep in reports:
        res: list[Result] = rep["results"]
        ok = [r for r in res if r.is_ok]
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        names = ", ".join(f"{b} {n}" for b, n in sorted(rep["branches"].items()))
        e2e_p99_ms = _percentile([r.e2e_s for r in ok], 0.99) * 1e3
        print(
            f"| {rep['mode']} | {len(res)} | {len(res) - len(ok)} | {_hit(res)} "
            f"| {sum(ttfts) / max(len(ttfts), 1) * 1e3:.0f} | {_percentile(ttfts, 0.5) * 1e3:.0f} "
            f"| {_percentile(ttfts, 0.9) * 1e3:.0f} | {_percentile(ttfts, 0.99) * 1e3:.0f} | {e2e_p99_ms:.0f} "
            f"| {rep['seconds']:.0f} | {names} |"
        )
    print("\n## Hit ratio by phase\n")
    phases = ("warm", "restart", "outage", "after")
    print("| sharing | " + " | ".join(phases) + " |")
    print("| --- |" + " --- |" * len(phases))
    for rep in reports:
        cells = [_hit([r for r in rep["results"] if r.phase == p]) for p in phases]
        print(f"| {rep['mode']} | " + " | ".join(cells) + " |")
    print("\n## Where the prompts went (outage and after phases): per replica, prompts it served and its hit\n")
    print("| sharing | " + " | ".join(f"replica {i + 1}" for i in range(args.replicas)) + " |")
    print("| --- |" + " --- |" * args.replicas)
    for rep in reports:
        late = [r for r in rep["results"] if r.phase in ("outage", "after") and r.is_ok]
        cells = []
        for replica in sorted({r.replica for r in late if r.replica is not None}):
            served = [r for r in late if r.replica == replica]
            cells.append(f"{len({r.prompt for r in served})} prompts, hit {_hit(served)}")
        print(f"| {rep['mode']} | " + " | ".join(cells) + " |")
    print(f"\n## Restart of router {RESTARTED + 1}: its requests for seen prompts, sent once /ready answers\n")
    print(
        "| sharing | start to /ready, s | requests | agreed, sent within 2 s of start | agreed, sent within 2 s "
        "of /ready | agreed, all |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for rep in reports:
        s = rep["restart"]
        print(
            f"| {rep['mode']} | {s['ready_s']:.2f} | {s['probes']} | "
            f"{_share(s['agreed_within_2s_of_start'], s['within_2s_of_start'])} | "
            f"{_share(s['agreed_within_2s_of_ready'], s['within_2s_of_ready'])} | {_share(s['agreed'], s['probes'])} |"
        )
    for rep in reports:
        o = rep["outage"]
        if not o:
            continue
        up = f"{o['up_again_s']:.2f}" if o["up_again_s"] is not None else "not within 30 s"
        print(
            f"\n## Redis outage ({rep['mode']}): SIGSTOP {args.pause_s:g} s, SIGCONT, {args.pause_s:g} s later "
            f"stopped, started again (empty) {args.down_s:g} s later\n"
        )
        print("| what | value |")
        print("| --- | --- |")
        for name in ("stopped (SIGSTOP)", "down", "SIGSTOP to restart"):
            sent, failed, seconds = o[name]
            print(f"| requests sent while {name} ({seconds:.1f} s), failed | {sent}, {failed} |")
        print(f"| every router's redis_up back to 1, s after restart | {up} |")
        print(f"| outages each router counted | {', '.join(map(str, o['outages']))} |")
        print(f"| batches applied by each router since the outage began | {', '.join(map(str, o['applied_since']))} |")
    failed = [r for rep in reports for r in rep["results"] if not r.is_ok]
    for r in failed[:10]:
        print(f"failed: {r.mode} {r.phase} router {r.router + 1}: {r.error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--routers", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=24, help="system prompts of 1-2 KB")
    parser.add_argument("--warm-rounds", type=int, default=3)
    parser.add_argument("--outage-rounds", type=int, default=24, help="enough to outlast the Redis outage")
    parser.add_argument("--after-rounds", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=256, help="KV blocks of 16 tokens per replica")
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--outage-delay-s", type=float, default=1.0, help="into the outage phase, SIGSTOP")
    parser.add_argument("--pause-s", type=float, default=3.0, help="seconds stopped, then seconds before stopping")
    parser.add_argument("--down-s", type=float, default=3.0, help="seconds Redis is down before it starts again")
    parser.add_argument("--max-phase-s", type=float, default=300.0, help="no request starts past this, per phase")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODES)}")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.routers <= RESTARTED:
        parser.error(f"--routers must be at least {RESTARTED + 1}")
    args.rounds = args.warm_rounds + 1 + args.outage_rounds + args.after_rounds
    args.load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    systems, questions = workload(args.prompts, args.rounds, args.seed)
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        fleet = Fleet(Path(tmp), args)
        fleet.start_redis()
        try:
            for mode in args.modes.split(","):
                if mode not in MODES:
                    parser.error(f"unknown mode {mode!r}")
                print(f"running sharing {mode} ...", file=sys.stderr, flush=True)
                reports.append(asyncio.run(run_mode(mode, fleet, systems, questions, args)))
        finally:
            with contextlib.suppress(subprocess.TimeoutExpired):
                fleet.stop_all()
                fleet.stop_redis()
    print_tables(reports, args)
    out = ROOT / "benchmarks" / "out"
    out.mkdir(exist_ok=True)
    for rep in reports:
        rep["results"] = [dataclasses.asdict(r) for r in rep["results"]]
    (out / "bench_fleet_live.json").write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
