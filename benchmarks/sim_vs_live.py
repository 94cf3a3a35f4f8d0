"""The simulator against the real stack: one workload replayed through `shoal up` (a router and 2 CPU replicas of
the demo model) and through `shoal simulate`'s engine with a step model fitted to `shoal replica profile`.

1. Profile: `shoal replica profile --threads 1` (what `shoal up --replicas 2` gives each replica on 2 cores),
   unless `--profile FILE` names one already made on this machine.
2. Workload: independent requests sharing Zipf-popular system prompts, Poisson arrivals, seeded. Prompts are real
   token ids of the demo model's vocabulary, so the live router and replicas hash the very blocks the simulator
   hashes; outputs have exactly their planned length (`ignore_eos`).
3. Live: `shoal up --replicas 2` on loopback; each request is sent at its arrival time (open loop) as a streamed
   completion of token ids; TTFT is the first streamed token at the client, cached tokens come from `usage`.
4. Simulated: the same requests, the router's default policy (`estimated_ttft`, approximate index, 2 s scrapes),
   2 replicas with the profiled engine's blocks, batch limits and fitted step times. The profile times
   `LLMEngine.step()` alone; what the live stack adds is measured apart, on the idle stack before the first
   replay, and never fitted to a replayed workload:
   - the replica's serving loop between steps: streamed requests of `--probe-tokens` tokens sent straight to one
     replica, 1 and then 4 at once; their time between tokens beyond the fitted decode step gives a cost per step
     and one per sequence that samples (the engine's `step_overhead_s` and `output_overhead_s`);
   - the serving path (two HTTP hops, the router's event loop): 24 one-token requests of 16 fresh tokens through
     the router, and 24 of 1024 tokens each sent twice (the second a cache hit but for its last block); their
     TTFT p50s beyond the fitted steps and those two costs give the simulator's `router.overhead_s` and its
     `overhead_s_per_prompt_token`;
   - waking an idle stack: the 16-token one-token requests again, each 0.5 s after the previous answer; their TTFT
     p50 beyond the back-to-back one is the engine's `wake_s`, added to a step that starts an idle engine (a
     profile of back-to-back steps never sees it, and at a low load most first tokens come from such a step);
   - jitter: 32 one-token requests of 256 fresh tokens, one at a time; each TTFT over their median is a factor
     the simulated engine draws for a step (`step_jitter`): the same work takes 0.6-1.6x its median on the live
     stack (p10-p90, benchmarks/results/sim_vs_live_fresh_seeds.txt), and the profile's median of repeats is the
     low end of a tail the replays' p90 and p99 sit in;
   - a busy peer: the jitter probe's requests again while a stream of 64 tokens runs through the router back to
     back (those sent to the streaming replica left out); the TTFT they gain, over the engine's part of it, is
     how much longer a step lasts beside a busy replica (`busy_peer_slowdown`): the router, the client and the
     two replicas share the machine's cores (two replicas prefilling at once, each sent its requests straight,
     slow each other by 0-10%: the same file).
   Both simulations are shown, without those terms and with them. The terms are measured before each seed, on a
   stack of their own started just before the replay's: a VM's speed drifts by more than the tolerance within
   minutes (the serving loop measured 0.00 to 4.57 ms a step on stacks minutes apart, the same file), so terms
   measured once for all seeds (`--terms-once`) judge the later replays against a machine that has changed.

Each seed of `--seeds` is a workload replayed on a freshly started stack (cold caches, as the simulator starts),
`--live-repeats` times: live is the median of those replays, and their spread (largest over smallest) is printed,
since a VM's speed can drift between replays by more than the tolerance (benchmarks/results/sim_vs_live_amd.txt:
up to 19% on TTFT p99 between two replays of one seed).
Prints live and simulated side by side per seed with the first replay's requests grouped by what the stack was
doing when each arrived (`by_request`), then every seed's relative differences, and exits 1 when TTFT
p50, p90, p99, end-to-end p50 or the hit ratio of any seed differ by more than `--tolerance` (15%, the
simulator's validation target). Not part of `make test`: it needs a quiet machine.

    .venv/bin/python -m benchmarks.sim_vs_live [--profile FILE] [--requests 150] [--rate 1.5] [--seeds 1,2,3]
        [--live-repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from router.policy.hashing import namespace_seed
from simulations.metrics import percentile
from simulations.scenario import FleetConfig, Scenario, policy_entry
from simulations.simulation import Simulation
from simulations.step_model import load_preset
from simulations.synthetic import Zipf
from simulations.workload import ChainState, ListWorkload, Request

ROOT = Path(__file__).resolve().parent.parent
MODEL = "shoal-demo"
BLOCK_SIZE = 16


@dataclass(frozen=True)
class ListTokens:
    """Token ids of one prompt, by block (the simulator's TokenSource)."""

    ids: tuple[int, ...]

    def block_tokens(self, index: int) -> list[int]:
        return list(self.ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE])


def make_workload(args: argparse.Namespace, vocab_size: int) -> tuple[ListWorkload, list[list[int]]]:
    """Requests (for the simulator) and their prompts' token ids (for the live replay)."""
    rng = random.Random(args.seed)
    low = 16  # above the tokenizer's special tokens

    def ids(n: int) -> list[int]:
        return [rng.randrange(low, vocab_size) for _ in range(n)]

    systems = [ids(rng.randint(*args.system_tokens)) for _ in range(args.system_prompts)]
    zipf = Zipf(args.system_prompts, 1.0)
    seed_bytes = namespace_seed(MODEL)
    requests, prompts = [], []
    now = 0.0
    for i in range(args.requests):
        now += rng.expovariate(args.rate)
        prompt = systems[zipf.draw(rng)] + ids(rng.randint(*args.user_tokens))
        chain = ChainState(seed_bytes, BLOCK_SIZE)
        chain.extend(prompt)
        requests.append(
            Request(
                id=i,
                arrival_s=now,
                prompt_tokens=len(prompt),
                output_tokens=rng.randint(*args.output_tokens),
                hashes=chain.hashes,
                tokens=ListTokens(tuple(prompt)),
            )
        )
        prompts.append(prompt)
    return ListWorkload(requests, block_size=BLOCK_SIZE, seed_bytes=seed_bytes, name="shared_prefix_live"), prompts


@dataclass(frozen=True)
class LiveTerms:
    """What the live stack adds to the profiled steps, measured on the idle stack (module docstring)."""

    step_overhead_s: float = 0.0
    output_overhead_s: float = 0.0
    path_s: float = 0.0
    path_s_per_prompt_token: float = 0.0
    wake_s: float = 0.0
    step_jitter: tuple[float, ...] = ()
    busy_peer_slowdown: float = 0.0


def simulate(workload: ListWorkload, profile: Path, seed: int, terms: LiveTerms) -> list[Answer]:
    """The workload through the simulator; the answers in the workload's order."""
    engine = {
        "step_overhead_s": terms.step_overhead_s,
        "output_overhead_s": terms.output_overhead_s,
        "wake_s": terms.wake_s,
        "step_jitter": list(terms.step_jitter),
        "busy_peer_slowdown": terms.busy_peer_slowdown,
    }
    scenario = Scenario.model_validate(
        {
            "name": "sim_vs_live",
            "fleet": FleetConfig(preset=str(profile), num_replicas=2, engine=engine),
            "router": {"overhead_s": terms.path_s, "overhead_s_per_prompt_token": terms.path_s_per_prompt_token},
            "policies": [policy_entry("estimated_ttft")],
            "seed": seed,
            "decode_steps_per_event": 1,
        }
    )
    routed: dict[int, str] = {}
    simulation = Simulation(
        scenario,
        scenario.policies[0],
        workload,
        on_routed=lambda request, decision: routed.__setitem__(request.id, decision.replica),
    )
    rec = simulation.run().recorder
    by_arrival = {
        arrival: Answer(ttft, e2e, hit, prompt, None)
        for arrival, ttft, e2e, hit, prompt in zip(
            rec.arrival_s, rec.ttft_s, rec.e2e_s, rec.hit_tokens, rec.prompt_tokens, strict=True
        )
    }
    return [dataclasses.replace(by_arrival[r.arrival_s], replica=routed[r.id]) for r in workload.requests()]


# ---- live ---------------------------------------------------------------------------------------------------------


def start_stack(port: int, replica_port: int) -> subprocess.Popen[str]:
    cmd = [
        str(ROOT / ".venv/bin/shoal"),
        "up",
        "--replicas",
        "2",
        "--port",
        str(port),
        "--replica-base-port",
        str(replica_port),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True, cwd=ROOT
    )
    deadline = time.monotonic() + 600
    assert proc.stdout is not None
    for line in proc.stdout:
        if "Shoal is up" in line:
            return proc
        if time.monotonic() > deadline:
            break
    stop_stack(proc)
    raise RuntimeError("shoal up did not come up")


def stop_stack(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@dataclass(frozen=True)
class Answer:
    """One streamed completion as the client saw it."""

    ttft_s: float
    e2e_s: float
    cached_tokens: int
    prompt_tokens: int
    replica: str | None
    """The router's `x-shoal-replica` header (None straight to a replica)."""


async def one(
    session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int, start: float, arrival_s: float
) -> Answer:
    await asyncio.sleep(max(0.0, start + arrival_s - time.perf_counter()))
    sent = time.perf_counter()
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first = None
    usage: dict[str, object] = {}
    async with session.post(url, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"request failed: {response.status} {await response.text()}")
        replica = response.headers.get("x-shoal-replica")
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                first = time.perf_counter()
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter()
    assert first is not None, "no token streamed"
    details = usage.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens", 0)) if isinstance(details, dict) else 0
    prompt_tokens = int(usage.get("prompt_tokens", len(prompt)))  # type: ignore[call-overload]
    return Answer(first - sent, end - sent, cached, prompt_tokens, replica)


async def overhead_probe(
    url: str, vocab_size: int, length: int, count: int = 24, gap_s: float = 0.0, *, fresh: bool = False
) -> list[float]:
    """TTFTs of one-token requests, one at a time on an idle stack, sorted: with `length` 16 or `fresh`, a fresh
    prompt (one engine step each, plus everything else on the path); longer, a fresh prompt sent twice and the
    second TTFT kept (a cache hit but for its last block, so the path's cost per prompt token shows beside a short
    step). Each request goes `gap_s` after the previous one's answer (0: at once, the engine and the CPU still
    awake)."""
    rng = random.Random(12345 + length)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        ttfts = []
        for _ in range(count):
            await asyncio.sleep(gap_s)  # paces the probe's arrivals, as a workload's gaps would; no state awaited
            prompt = [rng.randrange(16, vocab_size) for _ in range(length)]
            if length > BLOCK_SIZE and not fresh:
                await one(session, url, prompt, 1, time.perf_counter(), 0.0)
            ttfts.append((await one(session, url, prompt, 1, time.perf_counter(), 0.0)).ttft_s)
    return sorted(ttfts)


async def busy_peer_probe(router_url: str, vocab_size: int, length: int, count: int) -> tuple[list[float], int]:
    """TTFTs (sorted) of one-token requests of `length` fresh tokens sent one at a time through the router while a
    stream of 64 tokens runs through it back to back, as a replay's requests arrive beside another one's decode;
    and how many the router sent to the streaming replica (left out: beside, not behind, is what is measured)."""
    rng = random.Random(777 + length)
    stop = asyncio.Event()
    streaming: str | None = None
    """The replica the background stream is on now, from its `x-shoal-replica` header; None between two."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def keep_busy() -> None:
            nonlocal streaming
            while not stop.is_set():
                prompt = [rng.randrange(16, vocab_size) for _ in range(BLOCK_SIZE)]
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 64, "ignore_eos": True, "stream": True}
                async with session.post(router_url, json=body) as response:
                    streaming = response.headers.get("x-shoal-replica")
                    async for _ in response.content:
                        pass
                streaming = None

        background = asyncio.create_task(keep_busy())
        ttfts, behind = [], 0
        try:
            for _ in range(count):
                prompt = [rng.randrange(16, vocab_size) for _ in range(length)]
                busy = streaming
                answer = await one(session, router_url, prompt, 1, time.perf_counter(), 0.0)
                if busy is None or answer.replica == busy:
                    behind += 1
                else:
                    ttfts.append(answer.ttft_s)
        finally:
            stop.set()
            await background
    return sorted(ttfts), behind


async def decode_probe(url: str, vocab_size: int, batch: int, tokens: int, rounds: int = 3) -> float:
    """Median seconds between streamed tokens of `batch` requests of `tokens` output tokens sent at once, with fresh
    16-token prompts, to one idle replica."""
    rng = random.Random(54321 + batch)
    gaps = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for _ in range(rounds):
            prompts = [[rng.randrange(16, vocab_size) for _ in range(16)] for _ in range(batch)]
            start = time.perf_counter()
            results = await asyncio.gather(*(one(session, url, p, tokens, start, 0.0) for p in prompts))
            gaps += [(a.e2e_s - a.ttft_s) / (tokens - 1) for a in results]
    return percentile(sorted(gaps), 0.5)


def measure_terms(router_url: str, replica_url: str, vocab_size: int, preset: Any, tokens: int) -> LiveTerms:
    """The serving loop's costs and the serving path's latency (module docstring), printed as they are found."""
    m = preset.step_model
    context = 16 + tokens // 2  # a probe request's mean context while it decodes

    def fitted(batch: int) -> float:
        return float(m.step_time_s(0, batch, batch * context, 0.0))

    live = {b: asyncio.run(decode_probe(replica_url, vocab_size, b, tokens)) for b in (1, 4)}
    beyond = {b: live[b] - fitted(b) for b in live}
    output_s = max(0.0, (beyond[4] - beyond[1]) / 3)
    step_s = max(0.0, beyond[1] - output_s)
    for b in live:
        print(
            f"serving loop: {b} decoding, {live[b] * 1e3:.2f} ms between tokens against a fitted step of "
            f"{fitted(b) * 1e3:.2f} ms"
        )
    print(f"  -> {step_s * 1e3:.2f} ms a step and {output_s * 1e3:.2f} ms a sampling sequence outside LLMEngine.step()")
    loop_s = step_s + output_s
    long = 1024
    short_ttft = percentile(asyncio.run(overhead_probe(router_url, vocab_size, BLOCK_SIZE)), 0.5)
    long_ttft = percentile(asyncio.run(overhead_probe(router_url, vocab_size, long)), 0.5)
    short_engine_s = m.step_time_s(BLOCK_SIZE, 0, 0, BLOCK_SIZE * (BLOCK_SIZE + 1) / 2) + loop_s
    cached = long - BLOCK_SIZE
    long_engine_s = m.step_time_s(BLOCK_SIZE, 0, cached, BLOCK_SIZE * (cached + (BLOCK_SIZE + 1) / 2)) + loop_s
    per_token_s = max(0.0, (long_ttft - long_engine_s - (short_ttft - short_engine_s)) / (long - BLOCK_SIZE))
    path_s = max(0.0, short_ttft - short_engine_s - BLOCK_SIZE * per_token_s)
    print(
        f"serving path: one-token TTFT p50 {short_ttft * 1e3:.1f} ms through the router (engine "
        f"{short_engine_s * 1e3:.1f} ms), {long_ttft * 1e3:.1f} ms for a {long}-token prompt cached but its last "
        f"block (engine {long_engine_s * 1e3:.1f} ms): {path_s * 1e3:.1f} ms and {per_token_s * 1e6:.2f} us a "
        "prompt token on the path"
    )
    rested_ttft = percentile(asyncio.run(overhead_probe(router_url, vocab_size, BLOCK_SIZE, gap_s=WAKE_GAP_S)), 0.5)
    wake_s = max(0.0, rested_ttft - short_ttft)
    print(
        f"waking: one-token TTFT p50 {rested_ttft * 1e3:.1f} ms {WAKE_GAP_S} s after the previous answer, against "
        f"{short_ttft * 1e3:.1f} ms at once: {wake_s * 1e3:.1f} ms to wake an idle stack"
    )
    jitter_ttfts = asyncio.run(overhead_probe(router_url, vocab_size, JITTER_TOKENS, count=JITTER_REQUESTS, fresh=True))
    median_s = percentile(jitter_ttfts, 0.5)
    jitter = tuple(t / median_s for t in jitter_ttfts)
    p10_s, p90_s = percentile(jitter_ttfts, 0.1), percentile(jitter_ttfts, 0.9)
    print(
        f"jitter: {JITTER_REQUESTS} one-token requests of {JITTER_TOKENS} fresh tokens, TTFT p10 / p50 / p90 "
        f"{p10_s * 1e3:.1f} / {median_s * 1e3:.1f} / {p90_s * 1e3:.1f} ms: a step takes {p10_s / median_s:.2f}-"
        f"{p90_s / median_s:.2f}x its median (p10-p90)"
    )
    busy, behind = asyncio.run(busy_peer_probe(router_url, vocab_size, JITTER_TOKENS, JITTER_REQUESTS))
    busy_s = percentile(busy, 0.5) if busy else median_s
    slowdown = max(0.0, (busy_s - median_s) / max(median_s - path_s, 1e-6))
    print(
        f"busy peer: the jitter probe's requests while another streams through the router, TTFT p50 "
        f"{busy_s * 1e3:.1f} ms against {median_s * 1e3:.1f} ms ({len(busy)} kept, {behind} left out: sent behind the "
        f"stream or between two): a step lasts {slowdown:.0%} longer beside a busy peer"
    )
    return LiveTerms(step_s, output_s, path_s, per_token_s, wake_s, jitter, slowdown)


JITTER_TOKENS = 256
"""Prompt tokens of the jitter probe's requests: one step of the size most of a replay's cache misses take."""
JITTER_REQUESTS = 32


async def replay(url: str, workload: ListWorkload, prompts: list[list[int]], timeout_s: float) -> list[Answer]:
    """Each request sent at its arrival time; the answers in the workload's order."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()
        return await asyncio.gather(
            *(
                one(session, url, p, r.output_tokens, start, r.arrival_s)
                for r, p in zip(workload.requests(), prompts, strict=True)
            )
        )


def summarize(answers: list[Answer]) -> dict[str, float]:
    ttft = sorted(a.ttft_s for a in answers)
    e2e = sorted(a.e2e_s for a in answers)
    return {
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p90_s": percentile(ttft, 0.9),
        "ttft_p99_s": percentile(ttft, 0.99),
        "e2e_p50_s": percentile(e2e, 0.5),
        "hit_ratio": sum(a.cached_tokens for a in answers) / sum(a.prompt_tokens for a in answers),
    }


COLD_TOKENS = 512
"""Uncached prompt tokens from which a request counts as a cold prefill in `by_request` (one full step's budget on
the demo replica)."""


def by_request(workload: ListWorkload, live: list[Answer], sim: list[Answer]) -> list[str]:
    """Lines of a table: the requests of one replay grouped by what the live stack was doing when each arrived
    (from the answers' own times and replicas), with live and simulated TTFT and time per output token, so that a
    gap shows where it comes from: cold prefills, requests alone on the stack, requests behind others on their
    replica, or beside requests on the other replica only."""
    requests = list(workload.requests())
    spans = [(r.arrival_s, r.arrival_s + a.e2e_s, a.replica) for r, a in zip(requests, live, strict=True)]
    groups: dict[str, list[int]] = {}
    for i, (r, a) in enumerate(zip(requests, live, strict=True)):
        busy = {rep for j, (t0, t1, rep) in enumerate(spans) if j != i and t0 < r.arrival_s < t1}
        if r.prompt_tokens - a.cached_tokens >= COLD_TOKENS:
            group = f"cold prefill (>= {COLD_TOKENS} uncached)"
        elif not busy:
            group = "alone on the stack"
        elif a.replica in busy:
            group = "behind others on its replica"
        else:
            group = "others on the other replica only"
        groups.setdefault(group, []).append(i)

    def tpot(a: Answer, r: Request) -> float:
        return (a.e2e_s - a.ttft_s) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0

    lines = [f"{'live, at arrival':<36} {'n':>4} {'TTFT live':>10} {'sim':>8} {'diff':>7} {'TPOT live':>10} {'sim':>6}"]
    for group, idx in sorted(groups.items()):
        lt = statistics.median(live[i].ttft_s for i in idx)
        st = statistics.median(sim[i].ttft_s for i in idx)
        lp = statistics.median(tpot(live[i], requests[i]) for i in idx)
        sp = statistics.median(tpot(sim[i], requests[i]) for i in idx)
        lines.append(
            f"{group:<36} {len(idx):>4} {lt * 1e3:>8.1f}ms {st * 1e3:>6.1f}ms {st / lt - 1:>+7.1%} "
            f"{lp * 1e3:>8.2f}ms {sp * 1e3:>4.2f}ms"
        )
    return lines


WAKE_GAP_S = 0.5
"""Idle seconds before each request of the waking probe: longer than the gap after which TTFT stops rising (0.1-0.3
s on the development VM), shorter than the replays' mean gap between two requests to one replica (1.3 s)."""

METRICS = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_p50_s", "hit_ratio")


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds takes comma-separated integers, got {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError("--seeds needs at least one seed")
    return seeds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", type=Path, help="a `shoal replica profile` file (default: profile now)")
    parser.add_argument("--requests", type=int, default=150)
    parser.add_argument("--rate", type=float, default=1.5, help="mean arrivals per second (Poisson)")
    parser.add_argument("--system-prompts", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, nargs=2, default=(256, 1024))
    parser.add_argument("--user-tokens", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--output-tokens", type=int, nargs=2, default=(8, 48))
    parser.add_argument("--seeds", type=_seeds, default=[0], help="comma-separated workload seeds (default 0)")
    parser.add_argument(
        "--live-repeats",
        type=int,
        default=1,
        help="replays of each seed, each on a fresh stack; live is their median, and their spread is printed",
    )
    parser.add_argument("--probe-tokens", type=int, default=32, help="output tokens of the serving-loop probe")
    parser.add_argument(
        "--terms-once",
        action="store_true",
        help="measure the live terms once, before the first seed (default: before each seed, on a stack of its own)",
    )
    parser.add_argument("--port", type=int, default=18300)
    parser.add_argument("--tolerance", type=float, default=0.15)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/out", help="folder for the JSON record")
    args = parser.parse_args()
    if args.requests < 1 or args.rate <= 0 or args.probe_tokens < 2 or args.live_repeats < 1:
        parser.error("--requests, --rate and --live-repeats must be positive, --probe-tokens at least 2")

    args.out.mkdir(parents=True, exist_ok=True)
    profile = args.profile
    if profile is None:
        profile = args.out / "demo-profile.json"
        print(f"profiling the demo model (1 thread) into {profile} ...", file=sys.stderr)
        subprocess.run(
            [str(ROOT / ".venv/bin/shoal"), "replica", "profile", "--threads", "1", "--out", str(profile)],
            check=True,
            cwd=ROOT,
        )
    preset = load_preset(str(profile))
    print(f"step model: {preset.description}")
    vocab_size = _demo_vocab_size()
    url = f"http://127.0.0.1:{args.port}/v1/completions"
    replica_url = f"http://127.0.0.1:{args.port + 1}/v1/completions"

    def probe() -> LiveTerms:
        proc = start_stack(args.port, args.port + 1)  # the probes' own stack: their prompts stay out of the replays'
        try:
            return measure_terms(url, replica_url, vocab_size, preset, args.probe_tokens)
        finally:
            stop_stack(proc)

    terms = probe() if args.terms_once else None
    runs = []
    for seed in args.seeds:
        workload, prompts = make_workload(argparse.Namespace(**{**vars(args), "seed": seed}), vocab_size)
        total_prompt = sum(r.prompt_tokens for r in workload.requests())
        print(
            f"\nseed {seed}: {len(prompts)} requests over {list(workload.requests())[-1].arrival_s:.0f} s, "
            f"{total_prompt / len(prompts):.0f} prompt tokens on average"
        )
        seed_terms = terms if terms is not None else probe()
        answers = []
        for _ in range(args.live_repeats):
            proc = start_stack(args.port, args.port + 1)
            try:
                answers.append(asyncio.run(replay(url, workload, prompts, 600.0)))
            finally:
                stop_stack(proc)
        replays = [summarize(a) for a in answers]
        live = {k: statistics.median(r[k] for r in replays) for k in METRICS}
        if len(replays) > 1:
            spread = {k: max(r[k] for r in replays) / min(r[k] for r in replays) - 1 for k in METRICS}
            print(
                f"live over {len(replays)} replays (the median below): "
                + ", ".join(f"{k.removesuffix('_s')} spread {spread[k]:.1%}" for k in METRICS)
            )
        bare = summarize(simulate(workload, profile, seed, LiveTerms()))
        sim_answers = simulate(workload, profile, seed, seed_terms)
        sim = summarize(sim_answers)
        print(f"{'metric':<15} {'live':>9} {'sim':>9} {'diff':>8} {'sim, live':>10} {'diff':>8}")
        for key in METRICS:
            scale, name = (1.0, key) if key == "hit_ratio" else (1e3, key.removesuffix("_s") + " (ms)")
            print(
                f"{name:<15} {live[key] * scale:>9.3f} {bare[key] * scale:>9.3f} {bare[key] / live[key] - 1:>+8.1%} "
                f"{sim[key] * scale:>10.3f} {sim[key] / live[key] - 1:>+8.1%}"
            )
        print("\n".join(by_request(workload, answers[0], sim_answers)))
        runs.append(
            {
                "seed": seed,
                "live": live,
                "live_replays": replays,
                "simulated_without_live_terms": bare,
                "simulated": sim,
                "live_terms": dataclasses.asdict(seed_terms),
                "requests": {
                    "live": [[dataclasses.asdict(a) for a in replay_answers] for replay_answers in answers],
                    "simulated": [dataclasses.asdict(a) for a in sim_answers],
                },
            }
        )

    print(f"\nsimulated with the live terms against live, per seed (tolerance {args.tolerance:.0%})")
    print(f"{'seed':>5} " + " ".join(f"{k.removesuffix('_s'):>10}" for k in METRICS))
    failed = []
    for run in runs:
        diffs = {k: run["simulated"][k] / run["live"][k] - 1.0 for k in METRICS}
        print(f"{run['seed']:>5} " + " ".join(f"{diffs[k]:>+10.1%}" for k in METRICS))
        failed += [f"seed {run['seed']} {k}" for k in METRICS if abs(diffs[k]) > args.tolerance]
    record = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "step_model": preset.step_model.model_dump(),
        "fit": preset.description,
        "runs": runs,
    }
    path = args.out / f"sim_vs_live-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    if failed:
        print(f"\nbeyond the {args.tolerance:.0%} tolerance: {', '.join(failed)}")
        return 1
    print(f"\nevery metric of every seed within {args.tolerance:.0%}")
    return 0


def _demo_vocab_size() -> int:
    from replica.demo.build import ensure_demo_model

    config = json.loads((ensure_demo_model() / "config.json").read_text())
    return int(config["vocab_size"])


if __name__ == "__main__":
    raise SystemExit(main())
