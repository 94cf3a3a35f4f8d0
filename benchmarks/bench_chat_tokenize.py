"""What the router's tokenizer costs per chat request: routing key and block hashes, with and without it.

Chats are the demo corpus's conversations strung together behind one system prompt until they render to about
1k or 8k tokens (demo tokenizer, ~3 bytes per token on this bilingual text). Per chat size and template (the
demo's, and the Qwen2.5-style one of tests/data/chat_templates with the same tokenizer):

- `text`: what the router does without a tokenizer: `chat_routing_key` and the text block hashes (64-byte blocks);
- `tokens`: what it does with one (`tokenizer.models`): `chat_routing_key` (validation, and the fallback key), the
  template, the encode, and the token block hashes (16-token blocks).

Each iteration times both, alternating which goes first, so both see the same machine state; `+p50`/`+p99` are the
percentiles of the per-iteration difference. Then the event loop: `--concurrency` tasks tokenize 8k-token chats
(inline on the loop, or on worker threads with `asyncio.to_thread`) while a ticker sleeps 1 ms at a time; its
lateness is what every other request on the loop waits. Run it pinned, as the README's figures were:

    taskset -c 0,1 .venv/bin/python -m benchmarks.bench_chat_tokenize
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from replica.demo.build import PACKAGED_DIR
from replica.demo.corpus import generate_conversations
from router.policy.hashing import hash_text, hash_tokens, namespace_seed
from router.policy.routing_text import chat_routing_key
from router.service.chat_template import ChatTemplate
from router.service.chat_tokenizer import ChatTokenizer

ROOT = Path(__file__).resolve().parent.parent
SEED = namespace_seed("shoal-demo")
QWEN_TEMPLATE = ROOT / "tests" / "data" / "chat_templates" / "qwen2.5_tool_chat.jinja"
CHAT = "/v1/chat/completions"


def chat_of(tokenizer: ChatTokenizer, num_tokens: int, seed: int) -> dict[str, Any]:
    """A chat body that renders to at least `num_tokens` tokens: one system prompt, then whole conversations."""
    messages: list[dict[str, Any]] = []
    for conversation in generate_conversations(400, seed=seed):
        if not messages:
            messages.append(conversation[0])
        messages += [
            {"role": m["role"], "content": m["content"]} for m in conversation[1:] if m["role"] in ("user", "assistant")
        ]
        body = {"model": "shoal-demo", "messages": messages}
        if len(tokenizer.chat_ids(body)) >= num_tokens:
            return body
    raise ValueError(f"the corpus is too short for {num_tokens} tokens")


def text_route(body: dict[str, Any]) -> int:
    key = chat_routing_key(body)
    return len(hash_text(key.text or b"", SEED, 64))


def token_route(tokenizer: ChatTokenizer, body: dict[str, Any]) -> int:
    chat_routing_key(body)
    key = tokenizer.routing_key(CHAT, body)
    return len(hash_tokens(key.token_ids or [], SEED, 16))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def key_latency(tokenizer: ChatTokenizer, body: dict[str, Any], iterations: int) -> dict[str, float]:
    text_s, token_s, added_s = [], [], []
    for i in range(iterations):
        if i % 2:
            t = timed(lambda: text_route(body))
            k = timed(lambda: token_route(tokenizer, body))
        else:
            k = timed(lambda: token_route(tokenizer, body))
            t = timed(lambda: text_route(body))
        text_s.append(t)
        token_s.append(k)
        added_s.append(k - t)
    ms = 1e3
    return {
        "text_p50_ms": percentile(text_s, 0.5) * ms,
        "text_p99_ms": percentile(text_s, 0.99) * ms,
        "tokens_p50_ms": percentile(token_s, 0.5) * ms,
        "tokens_p99_ms": percentile(token_s, 0.99) * ms,
        "added_p50_ms": percentile(added_s, 0.5) * ms,
        "added_p99_ms": percentile(added_s, 0.99) * ms,
    }


async def loop_lag(
    tokenizer: ChatTokenizer, body: dict[str, Any], *, concurrency: int, per_task: int, off_loop: bool
) -> dict[str, float]:
    """Tokenize `concurrency` x `per_task` chats while a 1 ms ticker measures how late the loop runs it."""
    lags: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - start - 0.001)

    async def worker() -> None:
        for _ in range(per_task):
            if off_loop:
                await asyncio.to_thread(tokenizer.routing_key, CHAT, body)
            else:
                tokenizer.routing_key(CHAT, body)
                await asyncio.sleep(0)

    tick = asyncio.create_task(ticker())
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    done.set()
    await tick
    return {
        "requests_per_s": concurrency * per_task / elapsed,
        "lag_p50_ms": percentile(lags, 0.5) * 1e3,
        "lag_p99_ms": percentile(lags, 0.99) * 1e3,
        "lag_max_ms": max(lags) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=400, help="timed chats per size and template (bounded)")
    parser.add_argument("--concurrency", type=int, default=4, help="tasks tokenizing at once in the loop test")
    parser.add_argument("--per-task", type=int, default=25, help="chats each task tokenizes in the loop test")
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    args = parser.parse_args()
    demo = ChatTokenizer.from_dir(PACKAGED_DIR)
    qwen = ChatTokenizer(demo.tokenizer, ChatTemplate(QWEN_TEMPLATE.read_text(encoding="utf-8")))
    print(f"{platform.node()}: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.iterations} chats per row\n")
    results: dict[str, Any] = {"keys": [], "loop": []}
    print("| template | chat tokens | body KiB | text p50 / p99 ms | tokens p50 / p99 ms | added p50 / p99 ms |")
    print("| --- | ---: | ---: | --- | --- | --- |")
    for name, tokenizer in (("demo", demo), ("qwen2.5-style", qwen)):
        for target in (1000, 8000):
            body = chat_of(tokenizer, target, seed=target)
            num_tokens = len(tokenizer.chat_ids(body))
            num_kib = len(json.dumps(body, ensure_ascii=False).encode()) / 1024
            row = key_latency(tokenizer, body, args.iterations if target < 8000 else max(1, args.iterations // 4))
            results["keys"].append({"template": name, "tokens": num_tokens, "body_kib": num_kib, **row})
            print(
                f"| {name} | {num_tokens:,} | {num_kib:.1f} | {row['text_p50_ms']:.3f} / {row['text_p99_ms']:.3f} "
                f"| {row['tokens_p50_ms']:.3f} / {row['tokens_p99_ms']:.3f} "
                f"| {row['added_p50_ms']:.3f} / {row['added_p99_ms']:.3f} |"
            )
    print(f"\nevent loop, {args.concurrency} tasks x {args.per_task} demo chats each, 1 ms ticker:\n")
    print("| chat tokens | where | chats/s | ticker lateness p50 / p99 / max ms |")
    print("| ---: | --- | ---: | --- |")
    for target in (1000, 8000):
        body = chat_of(demo, target, seed=target)
        for off_loop in (False, True):
            row = asyncio.run(
                loop_lag(demo, body, concurrency=args.concurrency, per_task=args.per_task, off_loop=off_loop)
            )
            where = "worker threads" if off_loop else "event loop"
            results["loop"].append({"tokens": target, "where": where, **row})
            print(
                f"| {len(demo.chat_ids(body)):,} | {where} | {row['requests_per_s']:.0f} "
                f"| {row['lag_p50_ms']:.2f} / {row['lag_p99_ms']:.2f} / {row['lag_max_ms']:.2f} |"
            )
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
