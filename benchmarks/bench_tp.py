"""Tensor parallelism on the demo model: TP=2 (two gloo ranks on loopback) against TP=1.

1. Equality: greedy outputs of `--prompts` held-out demo prompts at TP=2 and TP=1, token for token; for a prompt that
   differs, the TP=1 logit margin (top-1 minus top-2) at the first differing position, which says whether a near tie
   flipped under the ranks' different summation order.
2. Speed: decode tokens/s at batch 1 and 16 (prompts of 32 tokens, 64 new tokens each, prefill included), and where
   rank 0's time goes: in all-reduces (two per layer per step), in the step broadcast, and the rest (compute, host).

TP=1 runs with `--threads` threads, each TP=2 rank with `--threads` / 2, so both use the same cores. Rank 0 runs the
engine; rank 1 follows its steps (`replica.engine.parallel`).

    .venv/bin/python -m benchmarks.bench_tp                  # both tables, 50 prompts, 2 threads
    .venv/bin/python -m benchmarks.bench_tp --prompts 10     # quicker
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `shoal replica` serves: replica.loading.sleeping_omp_threads

import argparse
import datetime
import json
import multiprocessing
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import command_argv
from replica.demo.build import ensure_demo_model, held_out_texts
from replica.engine.engine import EngineConfig, LLMEngine
from replica.engine.sampling import SamplingParams
from replica.model.loader import load_model
from replica.model.model import MoEForCausalLM
from replica.tokenizer import Tokenizer

ENGINE = EngineConfig(num_blocks=2048, block_size=16, max_num_seqs=16, max_num_batched_tokens=512)
PROMPT_TOKENS = 48
"""Held-out prompts are cut to their first this many tokens (a chat's system prompt and part of its question)."""
EQUALITY_NEW_TOKENS = 32
SPEED_PROMPT_TOKENS = 32
SPEED_NEW_TOKENS = 64
BATCHES = (1, 16)


def _prompts(path: Path, count: int) -> list[list[int]]:
    tokenizer = Tokenizer.from_file(path / "tokenizer.json")
    texts = held_out_texts(path)[:count]
    return [tokenizer.encode(text)[:PROMPT_TOKENS] for text in texts]


def _generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    for _ in range(100_000):
        if not engine.has_work:
            break
        for out in engine.step().outputs:
            tokens[out.seq_id].extend(out.new_token_ids)
    return [tokens[i] for i in ids]


def _speed(engine: LLMEngine, group: Any) -> list[dict[str, float]]:
    rows = []
    prompt = list(range(10, 10 + SPEED_PROMPT_TOKENS))
    _generate(engine, [prompt], 8)  # warm-up
    for batch in BATCHES:
        prompts = [[(t + 7 * i) % 2000 + 3 for t in prompt] for i in range(batch)]  # distinct: no prefix hits
        before = None if group is None else (group.stats.all_reduce_s, group.stats.step_message_s)
        started = time.perf_counter()
        outputs = _generate(engine, prompts, SPEED_NEW_TOKENS)
        wall = time.perf_counter() - started
        reduce_s = message_s = 0.0
        if group is not None and before is not None:
            reduce_s = group.stats.all_reduce_s - before[0]
            message_s = group.stats.step_message_s - before[1]
        rows.append(
            {
                "batch": batch,
                "tokens_per_s": sum(len(o) for o in outputs) / wall,
                "wall_s": wall,
                "all_reduce_s": reduce_s,
                "step_message_s": message_s,
            }
        )
    return rows


def _run(model: MoEForCausalLM, prompts: list[list[int]], group: Any) -> dict[str, Any]:
    engine = LLMEngine(model, ENGINE)
    outputs = _generate(engine, prompts, EQUALITY_NEW_TOKENS)
    return {"outputs": outputs, "speed": _speed(engine, group)}


def _rank(rank: int, port: int, path: str, threads: int, count: int, out: str) -> None:
    from replica.engine.parallel import TensorParallel, initial_capacity
    from replica.engine.runner import ModelRunner, follow_steps
    from replica.model.shard import shard_model

    torch.set_num_threads(threads)
    model = load_model(Path(path))
    group = TensorParallel.join(
        rank=rank,
        world_size=2,
        master_port=port,
        device=torch.device("cpu"),
        timeout_s=120,
        capacity=initial_capacity(ENGINE.max_num_batched_tokens, ENGINE.max_num_seqs),
    )
    shard_model(model, group)
    if rank == 0:
        result = _run(model, _prompts(Path(path), count), group)
        group.send_stop()
        Path(out).write_text(json.dumps(result))
    else:
        follow_steps(ModelRunner(model, num_blocks=ENGINE.num_blocks, block_size=ENGINE.block_size), group)
    group.close()


def _tp2(path: Path, threads: int, count: int) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        ranks = [
            context.Process(target=_rank, args=(r, port, str(path), max(1, threads // 2), count, str(out)))
            for r in (0, 1)
        ]
        for p in ranks:
            p.start()
        for p in ranks:
            p.join(timeout=1800)
            if p.is_alive():
                p.kill()
                raise SystemExit("a rank did not finish within 30 minutes")
        if any(p.exitcode for p in ranks):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in ranks]}")
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def _margin(model: MoEForCausalLM, tokens: list[int]) -> float:
    """TP=1 logit margin (top-1 minus top-2) of the token after `tokens`."""
    engine = LLMEngine(model, ENGINE)
    seen: list[torch.Tensor] = []
    handle = model.lm_head.register_forward_hook(lambda _m, _a, out: seen.append(out.detach().clone()))
    try:
        _generate(engine, [tokens], 1)
    finally:
        handle.remove()
    top = seen[-1][-1].float().topk(2).values
    return float(top[0] - top[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2, help="TP=1's threads; each TP=2 rank gets half")
    args = parser.parse_args()
    path = ensure_demo_model()
    prompts = _prompts(path, args.prompts)

    tp2 = _tp2(path, args.threads, args.prompts)
    torch.set_num_threads(args.threads)
    model = load_model(path)
    tp1 = _run(model, prompts, None)

    print(f"command: {' '.join([Path(sys.executable).name, *command_argv()])}")
    print(f"date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {platform.platform()}")
    per_rank = max(1, args.threads // 2)
    print(f"model: demo (packaged weights), float32; TP=1 {args.threads} threads, TP=2 {per_rank} per rank")
    print()
    same = [a == b for a, b in zip(tp1["outputs"], tp2["outputs"], strict=True)]
    print(f"## Greedy equality, {len(prompts)} held-out prompts x {EQUALITY_NEW_TOKENS} tokens")
    print(f"identical to the token: {sum(same)} / {len(same)}")
    for i, (a, b) in enumerate(zip(tp1["outputs"], tp2["outputs"], strict=True)):
        if a != b:
            j = next(k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
            margin = _margin(model, prompts[i] + a[:j])
            print(f"  prompt {i}: first difference at token {j}; TP=1 top-1 - top-2 logit margin there {margin:.2e}")
    print()
    print(f"## Decode speed (prompts {SPEED_PROMPT_TOKENS} tokens, {SPEED_NEW_TOKENS} new each, prefill included)")
    print("| batch | TP=1 tok/s | TP=2 tok/s | TP=2/TP=1 | TP=2 rank 0: all-reduce | step broadcast | rest |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for one, two in zip(tp1["speed"], tp2["speed"], strict=True):
        wall = two["wall_s"]
        rest = wall - two["all_reduce_s"] - two["step_message_s"]
        print(
            f"| {one['batch']} | {one['tokens_per_s']:.0f} | {two['tokens_per_s']:.0f} | "
            f"{two['tokens_per_s'] / one['tokens_per_s']:.2f} | {100 * two['all_reduce_s'] / wall:.0f}% | "
            f"{100 * two['step_message_s'] / wall:.0f}% | {100 * rest / wall:.0f}% |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
