"""Shoal's replica against vLLM's CPU build: the same checkpoint, machine and cores, in one interleaved run.

Each row is an engine setting on a checkpoint, served over HTTP on 127.0.0.1 by a server started alone for its turn
of a round and stopped (by process group) after it; rounds run the settings in an order that alternates, so the
machine's drift over minutes falls on every row alike. Both engines get the same cores (`--cores`: vLLM binds its
OpenMP threads to them, `VLLM_CPU_OMP_THREADS_BIND`; Shoal owns them the same way, `--cpus`),
float32 and prefix caching; otherwise each runs as it ships (Shoal prefills 512 tokens a step, vLLM's CPU build
2048; KV events on, as Shoal's stack runs both).

- TTFT: token-id prompts through `/v1/completions`, max_tokens 1, one at a time. Cold: a fresh random 1,024-token
  prompt. Cached: the first 896 tokens of the prompt just served plus 128 new ones (87.5%: whole blocks for both
  engines, vLLM's 128-token CPU blocks and Shoal's 16-token ones). `hit` is the cached tokens the engine reported.
- Decode: demo chat prompts (no tools, 20-250 tokens), greedy, `ignore_eos`, max_tokens 128; b1 is one request,
  b16 sixteen at once; tokens/s = completion tokens over the wall time of the batch, prefill included.
- Answers (trained checkpoints only): other demo chat prompts answered greedily to their natural end (max_tokens
  192), as the model is used; b1 is eight requests one after another, b16 sixteen at once. Both engines write the
  same greedy answers (tests/integration/test_vllm.py), so `ans tok` (completion tokens of the b16 batch) should
  match between rows; where it does not, the rows answered differently.
- Settings: `shoal` (speculation off), `shoal-spec` (its default: the checkpoint's drafter, adaptive k; only where
  the checkpoint has one), `vllm`, `vllm-ngram` (vLLM's prompt-lookup speculation, k = 4). `accept` is
  1 + accepted / drafts from the engine's `vllm:spec_decode_*` counters over its turn.
- Checkpoints: `demo` (the packaged demo model) and `large` (its architecture at ~109M parameters, 32 experts top-4,
  random weights, built with Shoal's own code into the run's temporary folder), where compute outweighs per-step
  overhead. Random weights make its outputs meaningless and its drafts rarely accepted; it times the engines.

TTFT columns are p50/p90 over every request of every round; tokens/s the median round; `x vLLM` the median over rounds
of the ratio to the `vllm` row of the same checkpoint in the same round (above 1: faster than vLLM).

    .venv/bin/python -m benchmarks.bench_engines                              # both checkpoints, 5 rounds
    .venv/bin/python -m benchmarks.bench_engines --checkpoint large --rounds 3 --settings shoal,vllm
    .venv/bin/python -m benchmarks.bench_engines --smoke --checkpoint demo    # a few requests: does it all run?

Raw per-round figures go to `benchmarks/results/engines_<date>.json` (not with `--smoke`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import command_argv, command_line, machine_description
from replica.demo.build import PACKAGED_DIR
from replica.settings import parse_cpus
from replica.vllm_engine import VllmServer, find_vllm_python, stop, wait_ready
from router.common.child_processes import parent_death_signal

ROOT = Path(__file__).resolve().parent.parent

MODEL = "bench"
SHOAL_MAIN = "import sys; from router.cli import main; sys.exit(main())"
"""`shoal` from this source tree (run with the repository root as the working directory)."""
SETTINGS = ("shoal", "shoal-spec", "vllm", "vllm-ngram")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
LARGE_SHAPE: dict[str, Any] = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "moe_intermediate_size": 256,
    "num_experts": 32,
    "num_experts_per_tok": 4,
}
"""Qwen3-MoE (q/k norm, no shared expert): 100.7M of its 109.2M parameters in routed experts, ~20M active a token."""
PROMPT_TOKENS = 1024
CACHED_TOKENS = 896
"""Whole blocks for both engines: 7 of vLLM's 128 tokens (its CPU default), 56 of Shoal's 16."""
ANSWERS_B1 = 8
"""Answers measured one after another (a single answer of ~40 tokens is too short to time)."""
FIRST_PLAIN_ID = 5
"""Random prompts draw ids from here on: 0-4 are the demo tokenizer's special and tool-call tokens."""


@dataclass(frozen=True)
class Checkpoint:
    name: str
    path: Path
    num_params: int
    description: str

    trained: bool
    """Whether its answers mean anything (random weights: no natural end to answer to)."""

    @property
    def has_drafter(self) -> bool:
        return (self.path / "drafter").is_dir()


@dataclass(frozen=True)
class Workload:
    decode_prompts: list[list[int]]
    """Prompt 0: batch 1; 1-16: batch 16; the rest: warm-up."""
    answer_prompts: list[list[int]]
    """Answered to their natural end: the first ANSWERS_B1 one after another, the next 16 at once."""
    ttft_pairs: int
    decode_tokens: int
    answer_tokens: int
    warmup_requests: int
    request_timeout_s: float


class SettingFailed(Exception):
    """A setting that did not start or did not answer; its message's first line goes in the table."""


# --- Checkpoints -------------------------------------------------------------------------------------------------


def count_params(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is no mapping
                total += math.prod(f.get_slice(key).get_shape())
    return total


def describe(path: Path) -> str:
    raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    experts = raw.get("num_experts") or raw.get("num_local_experts")
    shared = raw.get("shared_expert_intermediate_size") or 0
    return (
        f"{raw.get('model_type')}, hidden {raw['hidden_size']}, {raw['num_hidden_layers']} layers, {experts} experts "
        f"top-{raw['num_experts_per_tok']} of width {raw['moe_intermediate_size']}"
        + (f", shared expert {shared}" if shared else "")
    )


def build_large(demo: Path, out: Path) -> None:
    """LARGE_SHAPE with the demo tokenizer, random weights, float32, written by Shoal's own checkpoint code."""
    import torch

    from replica.model.config import ModelConfig
    from replica.model.loader import init_weights, save_checkpoint
    from replica.model.model import MoEForCausalLM
    from replica.tokenizer import Tokenizer

    demo_config = json.loads((demo / "config.json").read_text(encoding="utf-8"))
    config = ModelConfig(
        vocab_size=Tokenizer.from_file(demo / "tokenizer.json").vocab_size,
        qk_norm=True,
        shared_expert_intermediate_size=0,
        max_position_embeddings=4096,
        eos_token_id=demo_config.get("eos_token_id"),
        **LARGE_SHAPE,
    )
    model = MoEForCausalLM(config).to(torch.float32)
    init_weights(model, seed=0)
    save_checkpoint(model, out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, out / name)


def checkpoints(which: str, workdir: Path) -> list[Checkpoint]:
    found = []
    if which in ("demo", "both"):
        found.append(Checkpoint("demo", PACKAGED_DIR, count_params(PACKAGED_DIR), describe(PACKAGED_DIR), True))
    if which in ("large", "both"):
        path = workdir / "large"
        started = time.monotonic()
        build_large(PACKAGED_DIR, path)
        print(f"built the large checkpoint in {time.monotonic() - started:.0f} s", flush=True)
        found.append(Checkpoint("large", path, count_params(path), describe(path) + ", random weights", False))
    return found


def decode_prompts(count: int) -> list[list[int]]:
    """Chat prompts of the demo corpus without tools, 20-250 tokens, rendered with the demo tokenizer."""
    from replica.demo.corpus import chat_requests
    from replica.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_file(PACKAGED_DIR / "tokenizer.json")
    prompts: list[list[int]] = []
    for body in chat_requests(4 * count, seed=4242, tool_fraction=0.0):
        ids = tokenizer.encode(tokenizer.apply_chat_template(body["messages"]))
        if 20 <= len(ids) <= 250:
            prompts.append(ids)
    return prompts[:count]


def random_prompt(rng: random.Random, vocab_size: int, length: int) -> list[int]:
    return [rng.randrange(FIRST_PLAIN_ID, vocab_size) for _ in range(length)]


# --- Servers -----------------------------------------------------------------------------------------------------


def free_ports(count: int) -> int:
    """A port p with p .. p + count - 1 free on 127.0.0.1 (vLLM's KV events take two in a row)."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = int(probe.getsockname()[1])
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return base
    raise RuntimeError(f"no {count} consecutive free ports")


def start_shoal(checkpoint: Checkpoint, setting: str, cores: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_ports(1)
    command = [sys.executable, "-c", SHOAL_MAIN, "replica", "--model", str(checkpoint.path), "--cpus", cores]
    command += ["--served-model-name", MODEL, "--port", str(port)]
    command += ["--dtype", "float32"]
    if setting == "shoal":
        command += ["--num-speculative-tokens", "0"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: `stop` ends it by its id
            preexec_fn=parent_death_signal(),
        )
    return proc, f"http://127.0.0.1:{port}"


def wait_shoal(proc: subprocess.Popen[bytes], url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"Shoal's replica exited with status {proc.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url + "/v1/models", timeout=2) as resp:
            if resp.status == 200 and MODEL in resp.read().decode():
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"Shoal's replica did not start within {timeout_s:.0f} s")
        time.sleep(0.5)  # polling a process that is starting, with a deadline


def start_vllm(
    checkpoint: Checkpoint, setting: str, cores: str, python: Path, env: dict[str, str], log: Path
) -> tuple[subprocess.Popen[bytes], VllmServer]:
    extra = ["--enable-prompt-tokens-details"]  # usage.prompt_tokens_details.cached_tokens, as Shoal reports it
    if setting == "vllm-ngram":
        extra += ["--speculative-config", json.dumps(NGRAM)]
    base = free_ports(3)
    server = VllmServer(
        checkpoint.path, MODEL, port=base, events_port=base + 1, dtype="float32", cpus=cores, extra_args=tuple(extra)
    )
    with open(log, "ab") as out:
        proc = subprocess.Popen(  # VllmServer.start, with `--vllm-env` added to its environment
            server.command(python),
            env=server.environment({**os.environ, **env}),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=parent_death_signal(),
        )
    return proc, server


def error_line(log: Path) -> str:
    """The last `SomethingError: ...` line of a server's log, else its last line."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):
        if re.search(r"\b\w*(Error|Exception)\b:", line):
            return line[-300:]
    return lines[-1][-300:] if lines else "(empty log)"


# --- Measurement -------------------------------------------------------------------------------------------------


async def complete(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    async with session.post(url + "/v1/completions", json={"model": MODEL, "temperature": 0, **body}) as resp:
        text = await resp.text()
        elapsed = time.perf_counter() - started
        if resp.status != 200:
            raise SettingFailed(f"HTTP {resp.status}: {text[:300]}")
    return elapsed, json.loads(text)


def cached_tokens(answer: dict[str, Any]) -> int | None:
    details = answer.get("usage", {}).get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    return int(value) if value is not None else None


async def decode_batch(
    session: aiohttp.ClientSession, url: str, prompts: list[list[int]], max_tokens: int
) -> dict[str, Any]:
    """All requests at once, each to `max_tokens` whatever it writes (`ignore_eos`)."""
    return await answer_batch(session, url, prompts, max_tokens, at_once=True, ignore_eos=True)


async def answer_batch(
    session: aiohttp.ClientSession,
    url: str,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    at_once: bool,
    ignore_eos: bool = False,
) -> dict[str, Any]:
    """Greedy answers, all at once or one after another: tokens/s = completion tokens over the wall time."""
    body = {"max_tokens": max_tokens, "ignore_eos": ignore_eos}
    started = time.perf_counter()
    if at_once:
        answers = await asyncio.gather(*(complete(session, url, {**body, "prompt": p}) for p in prompts))
    else:
        answers = [await complete(session, url, {**body, "prompt": p}) for p in prompts]
    wall_s = time.perf_counter() - started
    counts = [int(answer["usage"]["completion_tokens"]) for _, answer in answers]
    return {"tokens": sum(counts), "per_answer": counts, "wall_s": wall_s, "tokens_per_s": sum(counts) / wall_s}


async def spec_counters(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The engine's speculative counters (vLLM's names, which Shoal's replica also exports), summed over labels."""
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total"):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


async def measure(url: str, workload: Workload, vocab_size: int, seed: int, *, answers: bool) -> dict[str, Any]:
    """One setting's turn of a round: warm-up, TTFT pairs, decode at batch 1 and 16, answers at batch 1 and 16 if
    `answers`, speculative counters."""
    timeout = aiohttp.ClientTimeout(total=workload.request_timeout_s)
    prompts = workload.decode_prompts
    async with aiohttp.ClientSession(timeout=timeout) as session:
        warm_rng = random.Random(seed - 1)
        for i in range(workload.warmup_requests):  # first-request costs: allocation, kernel selection, batch shapes
            warm_prompt = random_prompt(warm_rng, vocab_size, PROMPT_TOKENS)
            await complete(session, url, {"prompt": warm_prompt, "max_tokens": 1})
            await decode_batch(session, url, prompts[17 + i : 17 + i + 16], 8)
        rng = random.Random(seed)  # the same prompts for every setting of a round, new ones every round
        result: dict[str, Any] = {"ttft_cold_s": [], "ttft_cached_s": [], "cold_cached_tokens": [], "hit_tokens": []}
        for _ in range(workload.ttft_pairs):
            prompt = random_prompt(rng, vocab_size, PROMPT_TOKENS)
            elapsed, answer = await complete(session, url, {"prompt": prompt, "max_tokens": 1})
            result["ttft_cold_s"].append(elapsed)
            result["cold_cached_tokens"].append(cached_tokens(answer))
            shared = [*prompt[:CACHED_TOKENS], *random_prompt(rng, vocab_size, PROMPT_TOKENS - CACHED_TOKENS)]
            elapsed, answer = await complete(session, url, {"prompt": shared, "max_tokens": 1})
            result["ttft_cached_s"].append(elapsed)
            result["hit_tokens"].append(cached_tokens(answer))
        result["decode_b1"] = await decode_batch(session, url, prompts[:1], workload.decode_tokens)
        result["decode_b16"] = await decode_batch(session, url, prompts[1:17], workload.decode_tokens)
        if answers:
            asked, most = workload.answer_prompts, workload.answer_tokens
            result["answers_b1"] = await answer_batch(session, url, asked[:ANSWERS_B1], most, at_once=False)
            result["answers_b16"] = await answer_batch(session, url, asked[ANSWERS_B1:], most, at_once=True)
        result["spec"] = await spec_counters(session, url)
    return result


def run_turn(
    checkpoint: Checkpoint, setting: str, args: argparse.Namespace, workload: Workload, seed: int, workdir: Path
) -> dict[str, Any]:
    """Start the setting's server alone on the cores, measure, stop it by its process group; SettingFailed with the
    first line of the reason when it does not start or answer."""
    log = workdir / f"{checkpoint.name}-{setting}-{seed}.log"
    started = time.monotonic()
    if setting.startswith("shoal"):
        proc, url = start_shoal(checkpoint, setting, args.cores, log)
    else:
        proc, server = start_vllm(checkpoint, setting, args.cores, args.vllm_python, args.vllm_env, log)
        url = server.url
    try:
        try:
            if setting.startswith("shoal"):
                wait_shoal(proc, url, args.start_timeout_s)
            else:
                wait_ready(server, proc, timeout_s=args.start_timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            raise SettingFailed(f"{exc}: {error_line(log)}") from exc
        start_s = time.monotonic() - started
        vocab_size = json.loads((checkpoint.path / "config.json").read_text(encoding="utf-8"))["vocab_size"]
        try:
            result = asyncio.run(measure(url, workload, vocab_size, seed, answers=checkpoint.trained))
        except (TimeoutError, aiohttp.ClientError, KeyError) as exc:
            raise SettingFailed(f"{type(exc).__name__}: {exc}; log: {error_line(log)}") from exc
        bound = re.findall(r"core ids=(\[[^\]]*\])", log.read_text(errors="replace"))  # vLLM logs its binding
        return {"start_s": start_s, "bound_cores": bound[-1] if bound else None, **result}
    finally:
        stop(proc)


# --- Report ------------------------------------------------------------------------------------------------------


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def ratio(turns: list[dict[str, Any]], reference: list[dict[str, Any]], metric: str) -> str:
    """Median over rounds both ran of this setting's speed over the reference's (TTFT: reference / this)."""
    by_round = {t["round"]: t for t in reference}
    ratios = []
    for turn in turns:
        other = by_round.get(turn["round"])
        if other is None or metric not in turn or metric not in other:
            continue
        if metric.startswith("ttft"):
            ratios.append(statistics.median(other[metric]) / statistics.median(turn[metric]))
        else:
            ratios.append(turn[metric]["tokens_per_s"] / other[metric]["tokens_per_s"])
    return f"{statistics.median(ratios):.2f}x" if ratios else "-"


def table(checkpoint: Checkpoint, turns: dict[str, list[dict[str, Any]]], failed: dict[str, str]) -> list[str]:
    head = (
        f"{'setting':<11} {'cold p50':>9} {'p90':>7} {'cached p50':>10} {'p90':>7} {'hit':>5} {'b1 tok/s':>9} "
        f"{'b16 tok/s':>10} {'ans b1':>7} {'ans b16':>8} {'ans tok':>7} {'accept':>6} | {'x vLLM: cold':>12} "
        f"{'cached':>7} {'b1':>6} {'b16':>6} {'ans b1':>7} {'ans b16':>7}"
    )
    lines = [f"\n## {checkpoint.name}: {checkpoint.num_params / 1e6:.1f}M parameters ({checkpoint.description})", head]
    reference = turns.get("vllm", [])
    for setting in SETTINGS:
        rows = turns.get(setting)
        if setting in failed:
            ran = f"ran {len(rows)} round(s), then failed" if rows else "does not run"
            lines.append(f"{setting:<11} {ran}: {failed[setting]}")
        if not rows:
            continue
        cold = [s * 1000 for t in rows for s in t["ttft_cold_s"]]
        warm = [s * 1000 for t in rows for s in t["ttft_cached_s"]]
        hits = [h for t in rows for h in t["hit_tokens"] if h is not None]
        b1 = statistics.median(t["decode_b1"]["tokens_per_s"] for t in rows)
        b16 = statistics.median(t["decode_b16"]["tokens_per_s"] for t in rows)
        answered = [t for t in rows if "answers_b1" in t]
        ans_b1 = f"{statistics.median(t['answers_b1']['tokens_per_s'] for t in answered):.0f}" if answered else "-"
        ans_b16 = f"{statistics.median(t['answers_b16']['tokens_per_s'] for t in answered):.0f}" if answered else "-"
        ans_tok = "/".join(sorted({str(t["answers_b16"]["tokens"]) for t in answered})) or "-"
        drafts = sum(t["spec"].get("vllm:spec_decode_num_drafts_total", 0.0) for t in rows)
        accepted = sum(t["spec"].get("vllm:spec_decode_num_accepted_tokens_total", 0.0) for t in rows)
        accept = f"{1 + accepted / drafts:.2f}" if drafts else "-"
        hit = f"{statistics.median(hits):.0f}" if hits else "?"
        metrics = ("ttft_cold_s", "ttft_cached_s", "decode_b1", "decode_b16", "answers_b1", "answers_b16")
        speedups = [ratio(rows, reference, m) for m in metrics]
        lines.append(
            f"{setting:<11} {statistics.median(cold):>9.1f} {p90(cold):>7.1f} {statistics.median(warm):>10.1f} "
            f"{p90(warm):>7.1f} {hit:>5} {b1:>9.0f} {b16:>10.0f} {ans_b1:>7} {ans_b16:>8} {ans_tok:>7} {accept:>6} | "
            f"{speedups[0]:>12} {speedups[1]:>7} {speedups[2]:>6} {speedups[3]:>6} {speedups[4]:>7} {speedups[5]:>7}"
        )
    return lines


def format_cores(cores: list[int]) -> str:
    """[0, 1, 4] -> "0-1,4"."""
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][-1] + 1:
            runs[-1].append(core)
        else:
            runs.append([core])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def vllm_version(python: Path) -> str:
    code = (
        "import importlib.metadata as m\nfor d in ('vllm', 'vllm-cpu'):\n    try: print(m.version(d)); break\n"
        "    except m.PackageNotFoundError: pass"
    )
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60).stdout.strip()
        return out or "unknown"
    return "unknown"


def shoal_revision() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "replica"], capture_output=True)
        return rev.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
    return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="rounds; each starts every setting once (default 5)")
    parser.add_argument("--checkpoint", choices=["demo", "large", "both"], default="both")
    parser.add_argument(
        "--cores",
        default=format_cores(sorted(os.sched_getaffinity(0))),
        help="cores for every engine, e.g. 0-1 (default: all this process may use)",
    )
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument("--ttft-pairs", type=int, default=5, help="cold + cached requests per setting per round (5)")
    parser.add_argument("--decode-tokens", type=int, default=128, help="max_tokens of the decode requests (128)")
    parser.add_argument("--answer-tokens", type=int, default=192, help="max_tokens of the answers (192)")
    parser.add_argument("--smoke", action="store_true", help="1 round, 1 TTFT pair, 16 decode tokens, no JSON")
    parser.add_argument("--out", type=Path, help="JSON of per-round figures (default results/engines_<date>.json)")
    parser.add_argument("--vllm-python", type=Path, help="vLLM's interpreter (default: .venv-vllm's)")
    parser.add_argument(
        "--vllm-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment for vLLM only, repeatable (e.g. LD_PRELOAD=.venv-vllm/lib/libiomp5.so, per its CPU docs)",
    )
    parser.add_argument("--start-timeout-s", type=float, default=600.0, help="a server's start, at most (600)")
    parser.add_argument("--request-timeout-s", type=float, default=600.0, help="one request or batch, at most (600)")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.ttft_pairs, args.decode_tokens = 1, 1, 16
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    if unknown := set(settings) - set(SETTINGS):
        parser.error(f"unknown settings {sorted(unknown)}; known: {', '.join(SETTINGS)}")
    if args.rounds < 1 or args.ttft_pairs < 1:
        parser.error("--rounds and --ttft-pairs must be at least 1")
    args.vllm_env = dict(item.partition("=")[::2] for item in args.vllm_env)
    args.vllm_python = find_vllm_python(args.vllm_python)
    if args.vllm_python is None and any(s.startswith("vllm") for s in settings):
        parser.error("vLLM's CPU build is not installed: `make vllm` builds .venv-vllm (or pass --vllm-python)")

    now = datetime.datetime.now(datetime.UTC)
    print(command_line())
    print(f"date: {now:%Y-%m-%d %H:%M} UTC; machine: {machine_description()}")
    threads = len(parse_cpus(args.cores))
    vllm = vllm_version(args.vllm_python) if args.vllm_python else "-"
    revision = shoal_revision()
    print(
        f"Shoal {revision}, vLLM {vllm} (CPU build{', env ' + str(args.vllm_env) if args.vllm_env else ''}); "
        f"cores {args.cores}, {threads} threads per engine, float32, prefix caching on; {args.rounds} round(s)"
    )
    num_decode = 17 + 16 * (0 if args.smoke else 1)
    chats = decode_prompts(num_decode + ANSWERS_B1 + 16)
    workload = Workload(
        decode_prompts=chats[:num_decode],
        answer_prompts=chats[num_decode:],
        ttft_pairs=args.ttft_pairs,
        decode_tokens=args.decode_tokens,
        answer_tokens=args.answer_tokens,
        warmup_requests=0 if args.smoke else 1,
        request_timeout_s=args.request_timeout_s,
    )
    lengths = [len(p) for p in workload.decode_prompts]
    print(
        f"TTFT: {args.ttft_pairs} cold {PROMPT_TOKENS}-token prompts per round, each then with its first "
        f"{CACHED_TOKENS} tokens cached; decode: max_tokens {args.decode_tokens}, prompts of {min(lengths)}-"
        f"{max(lengths)} tokens; answers: max_tokens {args.answer_tokens}, {ANSWERS_B1} one by one, 16 at once",
        flush=True,
    )

    record: dict[str, Any] = {"date": now.isoformat(), "command": command_argv(), "machine": machine_description()}
    record |= {"cores": args.cores, "vllm": vllm, "shoal": revision, "turns": [], "failed": {}}
    with tempfile.TemporaryDirectory(prefix="shoal-bench-engines-") as tmp:
        workdir = Path(tmp)
        found = checkpoints(args.checkpoint, workdir)
        turns: dict[str, dict[str, list[dict[str, Any]]]] = {c.name: {} for c in found}
        failed: dict[str, dict[str, str]] = {c.name: {} for c in found}
        for c in found:
            if "shoal-spec" in settings and not c.has_drafter:
                failed[c.name]["shoal-spec"] = "the checkpoint has no drafter/"
        for round_index in range(args.rounds):
            order = settings if round_index % 2 == 0 else settings[::-1]
            for c in found:
                for setting in order:
                    if setting in failed[c.name]:
                        continue
                    seed = 1000 * (round_index + 1)
                    began = time.monotonic()
                    try:
                        turn = run_turn(c, setting, args, workload, seed, workdir)
                    except SettingFailed as exc:
                        failed[c.name][setting] = str(exc).splitlines()[0]
                        print(f"round {round_index + 1}: {c.name} {setting} failed: {failed[c.name][setting]}")
                        continue
                    turn |= {"round": round_index, "checkpoint": c.name, "setting": setting}
                    turns[c.name].setdefault(setting, []).append(turn)
                    record["turns"].append(turn)
                    bound = f", OpenMP threads on cores {turn['bound_cores']}" if turn["bound_cores"] else ""
                    print(
                        f"round {round_index + 1}: {c.name} {setting} in {time.monotonic() - began:.0f} s "
                        f"(start {turn['start_s']:.0f} s{bound})",
                        flush=True,
                    )
        lines = []
        for c in found:
            lines += table(c, turns[c.name], failed[c.name])
    print("\n".join(lines))
    print(
        "\nms: TTFT p50/p90 over all requests; hit: cached prompt tokens reported; tok/s: median round; accept: mean "
        "accepted length per speculative step; ans: answers to their natural end (ans tok: completion tokens of the "
        "b16 batch); x vLLM: median over rounds of the ratio to the vllm row (>1: faster)"
    )
    record["failed"] = failed
    record["checkpoints"] = {c.name: {"params": c.num_params, "description": c.description} for c in found}
    if not args.smoke:
        out = args.out or ROOT / "benchmarks" / "results" / f"engines_{now:%Y-%m-%d}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        shown = out.resolve().relative_to(ROOT) if out.resolve().is_relative_to(ROOT) else out
        print(f"raw figures: {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
