"""Speculative decoding on the demo model: tokens/s with it against without, drafters compared, where time goes.

Every run answers held-out demo chat requests (the demo model's own answers, stopping at its end of turn) with the
engine in-process, in waves of `batch` requests, so a wave's steps after its first decode only. Reported per cell:
decode tokens/s (output tokens over the time of steps that ran no prompt token) with speculation off and on, and
their ratio; the mean acceptance length (1 + accepted / drafts). Cells are interleaved round by round (off, on,
off, on, ...) and the median round is printed, since the machines these numbers come from drift by 10-30% over
minutes.

    .venv/bin/python -m benchmarks.bench_speculative              # the grid: threads x temperature x batch x experts
    .venv/bin/python -m benchmarks.bench_speculative --drafters --dense DIR --k 2,4,8   # block against dense
    .venv/bin/python -m benchmarks.bench_speculative --breakdown  # per-step time by part, batch 1 and 16
    .venv/bin/python -m benchmarks.bench_speculative --adaptive --batches 1,4,16,32   # adaptive k, fixed k, off
    .venv/bin/python -m benchmarks.bench_speculative --adaptive --untrained-drafter   # ... with a useless drafter
    .venv/bin/python -m benchmarks.bench_speculative --http     # as a client sees it: two `shoal replica` servers

`--http` starts `shoal replica` twice on the demo model, as it ships (speculating at its defaults) and with
`--num-speculative-tokens 0`, and sends both the same held-out chats through `/v1/chat/completions` (greedy,
max_tokens 96, stopping at the end of the answer), alternating request by request at batch 1 and wave by wave at
batch 16 (16 at once). Tokens/s is completion tokens over the client's wall time, prefill and HTTP included.

The grid's `on` is what `shoal replica` serves by default: the demo model's block drafter, k = its block size (8),
adaptive.
`--dense PATH` names a dense drafter (made by `shoal replica train-drafter --kind dense`) for `--drafters`.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `shoal replica` serves: replica.loading.sleeping_omp_threads

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

import replica.engine.engine as engine_module
from replica.demo.build import ensure_demo_model
from replica.demo.corpus import chat_requests
from replica.drafters.block import BlockDrafterModel
from replica.drafters.checkpoint import DrafterModel, default_num_speculative_tokens, drafter_runtime, load_drafter
from replica.drafters.train import DrafterRecipe, new_drafter
from replica.engine.engine import EngineConfig, LLMEngine
from replica.engine.sampling import SamplingParams
from replica.model.loader import load_model
from replica.model.model import MoEForCausalLM
from replica.quant.experts import quantize_model_experts
from replica.tokenizer import Tokenizer
from router.common.ports import free_port

BENCH_SEED = 777
"""Requests drawn from the corpus generator with a seed of their own: neither training nor drafter traffic."""


@dataclass
class Measured:
    decode_tokens: int = 0
    decode_s: float = 0.0
    drafts: int = 0
    accepted: int = 0
    parts_s: dict[str, float] = field(default_factory=dict)
    steps: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def acceptance_length(self) -> float:
        return 1 + self.accepted / self.drafts if self.drafts else 1.0


def shown(path: Path) -> str:
    """`path` relative to the working directory when it is inside it (tables name no machine's folders)."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return path.name


def prompts_for(tokenizer: Tokenizer, n: int) -> list[list[int]]:
    bodies = chat_requests(n, seed=BENCH_SEED)
    return [tokenizer.encode(tokenizer.apply_chat_template(b["messages"], tools=b.get("tools"))) for b in bodies]


def run_waves(
    model: MoEForCausalLM,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    *,
    batch: int,
    temperature: float,
    drafter: DrafterModel | None,
    k: int,
    adaptive: bool = True,
    max_tokens: int = 256,
    breakdown: bool = False,
) -> Measured:
    num_blocks = batch * ((max(len(p) for p in prompts) + max_tokens) // 16 + 3) + 16
    config = EngineConfig(
        num_blocks=num_blocks,
        max_num_seqs=batch,
        max_num_batched_tokens=4096,
        num_speculative_tokens=k if drafter is not None else 0,
        adaptive_speculation=adaptive,
    )
    runtime = (
        drafter_runtime(drafter, num_blocks=num_blocks, block_size=16, num_speculative_tokens=k) if drafter else None
    )
    engine = LLMEngine(model, config, eos_token_ids=tokenizer.eos_token_ids, drafter=runtime)
    measured = Measured()
    step_parts: dict[str, float] = {}
    with timed_parts(engine, step_parts, enabled=breakdown):
        for start in range(0, len(prompts), batch):
            for i, prompt in enumerate(prompts[start : start + batch]):
                engine.add_request(
                    prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=start + i)
                )
            while engine.has_work:
                step_parts.clear()
                began = time.perf_counter()
                result = engine.step()
                elapsed = time.perf_counter() - began
                # Decode steps: every scheduled sequence ran its last token (and drafts), no prompt token.
                if (
                    result.num_batched_tokens
                    and all(o.num_output_tokens > len(o.new_token_ids) for o in result.outputs)
                    and result.outputs
                ):
                    measured.decode_tokens += sum(len(o.new_token_ids) for o in result.outputs)
                    measured.decode_s += elapsed
                    measured.steps += 1
                    for name, seconds in step_parts.items():
                        measured.parts_s[name] = measured.parts_s.get(name, 0.0) + seconds
                measured.drafts += result.speculation.num_drafts
                measured.accepted += result.speculation.num_accepted_tokens
    return measured


@contextmanager
def timed_parts(engine: LLMEngine, parts: dict[str, float], *, enabled: bool) -> Iterator[None]:
    """Time the target's forward pass, the drafter's ingest and propose, and token decisions, per step."""
    if not enabled:
        yield
        return
    patches: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                parts[label] = parts.get(label, 0.0) + time.perf_counter() - began

        patches.append((owner, name, original))
        setattr(owner, name, timed)

    wrap(engine.runner, "run", "target forward")
    wrap(engine, "step", "whole step")
    wrap(engine_module, "decide", "decide (verify + propose + transfer)")
    if engine.drafter is not None:
        wrap(engine.drafter, "ingest", "drafter ingest")
        wrap(engine.drafter, "propose", "drafter propose")
    try:
        yield
    finally:
        for owner, name, original in reversed(patches):
            setattr(owner, name, original)


def interleaved(rounds: int, cells: list[tuple[str, Callable[[], Measured]]]) -> dict[str, list[Measured]]:
    out: dict[str, list[Measured]] = {name: [] for name, _ in cells}
    for r in range(rounds):
        order = cells if r % 2 == 0 else list(reversed(cells))
        for name, fn in order:
            out[name].append(fn())
    return out


def median_rate(runs: list[Measured]) -> Measured:
    return sorted(runs, key=lambda m: m.tokens_per_s)[len(runs) // 2]


def grid(args: argparse.Namespace, path: Path, tokenizer: Tokenizer, drafter_path: Path) -> None:
    print(f"\n## Tokens/s, speculation off against on (block drafter, k = {args.k_default}, adaptive)")
    print(f"{'threads':>7} {'experts':>7} {'temp':>5} {'batch':>5} {'off tok/s':>10} {'on tok/s':>9} "
          f"{'x':>6} {'accept len':>10}")  # fmt: skip
    for threads in args.threads:
        torch.set_num_threads(threads)
        for experts in args.experts:
            model = load_model(path)
            if experts == "nvfp4":
                quantize_model_experts(model, mode="w4a16")
            drafter = load_drafter(drafter_path, model)
            for temperature in (0.0, 0.7):
                for batch in args.batches:
                    prompts = prompts_for(tokenizer, max(args.prompts, batch * args.waves))
                    run = partial(run_waves, model, tokenizer, prompts, batch=batch, temperature=temperature)
                    runs = interleaved(
                        args.rounds,
                        [
                            ("off", partial(run, drafter=None, k=0)),
                            ("on", partial(run, drafter=drafter, k=args.k_default)),
                        ],
                    )
                    off, on = median_rate(runs["off"]), median_rate(runs["on"])
                    ratios = [b.tokens_per_s / a.tokens_per_s for a, b in zip(runs["off"], runs["on"], strict=True)]
                    print(
                        f"{threads:>7} {experts:>7} {temperature:>5} {batch:>5} {off.tokens_per_s:>10.0f} "
                        f"{on.tokens_per_s:>9.0f} {statistics.median(ratios):>5.2f}x {on.acceptance_length:>10.2f}",
                        flush=True,
                    )


def drafters(args: argparse.Namespace, path: Path, tokenizer: Tokenizer, drafter_path: Path) -> None:
    torch.set_num_threads(args.threads[0])
    model = load_model(path)
    available = {"block": load_drafter(drafter_path, model)}
    if args.dense:
        available["dense"] = load_drafter(args.dense, model)
    print(f"\n## Drafters on the demo model: mean acceptance length and tokens/s, batch 1, "
          f"{args.threads[0]} thread(s), fixed k (not adaptive)")  # fmt: skip
    print(f"{'drafter':>8} {'k':>3} {'temp':>5} {'accept len':>10} {'tok/s':>8} {'off tok/s':>10} {'x':>6}")
    prompts = prompts_for(tokenizer, args.prompts)
    for k in args.k:
        for temperature in (0.0, 0.7):
            run = partial(run_waves, model, tokenizer, prompts, batch=1, temperature=temperature)
            cells: list[tuple[str, Callable[[], Measured]]] = [("off", partial(run, drafter=None, k=0))]
            for name, d in available.items():
                if not isinstance(d, BlockDrafterModel) or k <= d.config.block_size:
                    cells.append((name, partial(run, drafter=d, k=k, adaptive=False)))
            runs = interleaved(args.rounds, cells)
            off = median_rate(runs["off"])
            for name in available:
                if name in runs:
                    m = median_rate(runs[name])
                    print(
                        f"{name:>8} {k:>3} {temperature:>5} {m.acceptance_length:>10.2f} {m.tokens_per_s:>8.0f} "
                        f"{off.tokens_per_s:>10.0f} {m.tokens_per_s / off.tokens_per_s:>5.2f}x",
                        flush=True,
                    )


def breakdown(args: argparse.Namespace, path: Path, tokenizer: Tokenizer, drafter_path: Path) -> None:
    torch.set_num_threads(args.threads[0])
    model = load_model(path)
    drafter = load_drafter(drafter_path, model)
    print(f"\n## Where a decode step's time goes (ms per decode step, greedy, {args.threads[0]} thread(s))")
    for batch in (1, 16):
        prompts = prompts_for(tokenizer, max(args.prompts, batch * args.waves))
        for label, d, k in (("off", None, 0), (f"block k={args.k_default}", drafter, args.k_default)):
            m = run_waves(
                model, tokenizer, prompts, batch=batch, temperature=0.0, drafter=d, k=k, adaptive=False, breakdown=True
            )
            steps = max(1, m.steps)
            total = m.parts_s.get("whole step", 0.0)
            parts = {name: s for name, s in m.parts_s.items() if name != "whole step"}
            if "decide (verify + propose + transfer)" in parts:
                parts["decide (verify + propose + transfer)"] -= parts.get("drafter propose", 0.0)
            parts["scheduler and bookkeeping"] = total - sum(parts.values())
            print(f"batch {batch}, {label}: {total / steps * 1000:.2f} ms per step, {m.tokens_per_s:.0f} tokens/s, "
                  f"{m.acceptance_length:.2f} tokens per sequence per step")  # fmt: skip
            for name, seconds in parts.items():
                print(f"    {name:<40} {seconds / steps * 1000:>7.2f} ms  {seconds / total:>5.0%}")


def adaptive_sweep(args: argparse.Namespace, path: Path, tokenizer: Tokenizer, drafter_path: Path) -> None:
    torch.set_num_threads(args.threads[0])
    model = load_model(path)
    drafter = load_drafter(drafter_path, model)
    which = "the demo's drafter"
    if args.untrained_drafter:
        drafter = new_drafter(model, DrafterRecipe(kind="block", block_size=args.k_default))
        which = "an untrained block drafter (its drafts are almost never accepted)"
    print(f"\n## Adaptive k against off and fixed k = {args.k_default} (tokens/s, greedy, {args.threads[0]} thread(s), "
          f"{which})")  # fmt: skip
    print(f"{'batch':>5} {'off':>8} {'fixed':>8} {'adaptive':>9} {'fixed x':>8} {'adaptive x':>10}")
    for batch in args.batches:
        prompts = prompts_for(tokenizer, max(args.prompts, batch * args.waves))
        run = partial(run_waves, model, tokenizer, prompts, batch=batch, temperature=0.0)
        cells: list[tuple[str, Callable[[], Measured]]] = [
            ("off", partial(run, drafter=None, k=0)),
            ("fixed", partial(run, drafter=drafter, k=args.k_default, adaptive=False)),
            ("adaptive", partial(run, drafter=drafter, k=args.k_default, adaptive=True)),
        ]
        runs = interleaved(args.rounds, cells)
        off, fixed, adaptive = (median_rate(runs[n]).tokens_per_s for n in ("off", "fixed", "adaptive"))
        print(
            f"{batch:>5} {off:>8.0f} {fixed:>8.0f} {adaptive:>9.0f} {fixed / off:>7.2f}x {adaptive / off:>9.2f}x",
            flush=True,
        )


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    url: str
    log: Path


def start_server(name: str, options: list[str], threads: int | None, cpus: str | None, logs: Path) -> Server:
    port = free_port()
    log = logs / f"{name}.log"
    cores = [f"--cpus={cpus}"] if cpus else [f"--threads={threads}"] if threads else []
    command = [sys.executable, "-c", "from router.cli import main; raise SystemExit(main())", "replica",
               f"--port={port}", *options, *cores]  # fmt: skip
    env = dict(os.environ)
    if cpus:  # this process sleeps its threads (above); servers that own their cores spin theirs
        env.pop("OMP_WAIT_POLICY", None)
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    server = Server(process, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + 300
    while '"event": "ready"' not in log.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{name} did not start:\n{log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.2)
    return server


def post_chat(server: Server, body: dict[str, Any]) -> int:
    """-> completion tokens of one greedy chat request."""
    data = json.dumps({**body, "model": "shoal-demo", "max_tokens": 96, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"{server.url}/v1/chat/completions", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return int(json.loads(response.read())["usage"]["completion_tokens"])


def spec_counters(server: Server) -> tuple[float, float]:
    """(drafts, accepted draft tokens) so far, from the replica's vLLM-named counters."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
        text = response.read().decode()

    def total(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    return total("vllm:spec_decode_num_drafts_total"), total("vllm:spec_decode_num_accepted_tokens_total")


def http(args: argparse.Namespace) -> None:
    bodies = [{"messages": b["messages"]} for b in chat_requests(max(args.prompts, 16 * args.waves), seed=BENCH_SEED)]
    threads = args.threads[0] if args.threads != [1, 2] else None  # default: what `shoal replica` picks
    with tempfile.TemporaryDirectory() as tmp:
        servers = {
            "on": start_server("on", [], threads, args.cpus, Path(tmp)),
            "off": start_server("off", ["--num-speculative-tokens=0"], threads, args.cpus, Path(tmp)),
        }
        try:
            for server in servers.values():  # warm both: first requests pay allocations
                for body in bodies[:2]:
                    post_chat(server, body)
            cores = f"cpus {args.cpus}" if args.cpus else f"threads {threads or 'default'}"
            print(f"\n## Speculation through HTTP, as a client sees it (demo model, greedy chats, max_tokens 96, "
                  f"{cores}, {args.rounds} rounds, median)")  # fmt: skip
            print(f"{'batch':>5} {'off tok/s':>10} {'on tok/s':>9} {'x':>6} {'accept len':>10} {'tokens':>7}")
            for batch in args.batches:
                rates: dict[str, list[float]] = {"on": [], "off": []}
                drafts_before = spec_counters(servers["on"])
                tokens = 0
                for r in range(args.rounds):
                    seconds = {"on": 0.0, "off": 0.0}
                    counts = {"on": 0, "off": 0}
                    for start in range(0, len(bodies) - batch + 1, batch):
                        wave = bodies[start : start + batch]
                        order = ("on", "off") if (r + start // batch) % 2 == 0 else ("off", "on")
                        for name in order:
                            began = time.perf_counter()
                            with ThreadPoolExecutor(batch) as pool:
                                counts[name] += sum(pool.map(partial(post_chat, servers[name]), wave))
                            seconds[name] += time.perf_counter() - began
                    for name in rates:
                        rates[name].append(counts[name] / seconds[name])
                    tokens = counts["on"]
                drafts, accepted = (b - a for a, b in zip(drafts_before, spec_counters(servers["on"]), strict=True))
                ratios = [on / off for on, off in zip(rates["on"], rates["off"], strict=True)]
                print(
                    f"{batch:>5} {statistics.median(rates['off']):>10.0f} {statistics.median(rates['on']):>9.0f} "
                    f"{statistics.median(ratios):>5.2f}x {1 + accepted / drafts if drafts else 1.0:>10.2f} {tokens:>7}",
                    flush=True,
                )
        finally:
            for server in servers.values():
                os.killpg(server.process.pid, signal.SIGTERM)
                server.process.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="checkpoint folder (default: the demo model)")
    parser.add_argument("--drafter", type=Path, help="block drafter folder (default: the checkpoint's drafter/)")
    parser.add_argument("--dense", type=Path, help="a dense drafter folder, for --drafters")
    parser.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    parser.add_argument("--cpus", help="--http: the servers own these cores (`shoal replica --cpus`), e.g. 0-1")
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    parser.add_argument("--experts", type=lambda s: s.split(","), default=["fp32", "nvfp4"])
    parser.add_argument("--k", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8])
    parser.add_argument("--k-default", type=int, help="k of the `on` runs (default: the drafter's own, as served)")
    parser.add_argument("--prompts", type=int, default=24, help="requests per run, at least (default 24)")
    parser.add_argument("--waves", type=int, default=2, help="waves of `batch` requests per run, at least (2)")
    parser.add_argument("--rounds", type=int, default=3)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--drafters", action="store_true", help="compare drafters at each --k")
    mode.add_argument("--breakdown", action="store_true", help="time the parts of a step")
    mode.add_argument("--adaptive", action="store_true", help="adaptive k against fixed k and off, by batch")
    mode.add_argument("--http", action="store_true", help="`shoal replica` with and without speculation, over HTTP")
    parser.add_argument(
        "--untrained-drafter", action="store_true", help="--adaptive with a drafter whose drafts are rejected"
    )
    args = parser.parse_args()
    if args.http:
        print(f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs")
        http(args)
        return
    path = args.model or ensure_demo_model()
    drafter_path = args.drafter or path / "drafter"
    tokenizer = Tokenizer.from_file(path / "tokenizer.json")
    if args.k_default is None:
        args.k_default = default_num_speculative_tokens(load_drafter(drafter_path, load_model(path)))
    print(f"model {shown(path)}, drafter {shown(drafter_path)}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs")  # fmt: skip
    if args.drafters:
        drafters(args, path, tokenizer, drafter_path)
    elif args.breakdown:
        breakdown(args, path, tokenizer, drafter_path)
    elif args.adaptive:
        adaptive_sweep(args, path, tokenizer, drafter_path)
    else:
        grid(args, path, tokenizer, drafter_path)


if __name__ == "__main__":
    main()
