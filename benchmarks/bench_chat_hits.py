"""What the router's tokenizer buys: prefix-cache hits of chat traffic on replicas that evict, live.

Two Shoal replicas of the demo model on the CPU, each with a small KV cache (`--num-blocks` blocks of 16 tokens),
behind one router, all in this process on loopback. Traffic: `--sessions` demo conversations (a system prompt, then
user and assistant turns, half of them Japanese), taken a turn at a time in rotation, each request the session's
history up to its next user turn, `--concurrency` requests at a time (the official openai client, `max_tokens` 4).
Together the sessions need more KV than the replicas hold, so the replicas evict, and a router that believes a
replica still holds a prefix it evicted sends the session to a cold cache. Per router mode, on fresh replicas:

- `approximate`: no KV events; the index holds the router's own decisions (text keys, estimated capacity);
- `exact, text`: the replicas' KV events on (SSE), no tokenizer: chat keys are routing text no event names;
- `exact, tokens`: KV events and the demo tokenizer (`tokenizer.models`): chats hash on the prefilled token ids.

`hit` is the replicas' cached prompt tokens over all prompt tokens (`usage.prompt_tokens_details`); `predicted`
what the router expected cached, over the same total; latency is the whole request at the client; branches are
the router's reasons (`shoal_router_requests_total`). The `ceiling` is the hit ratio of one replica with an
unbounded cache: the prefix the traffic shares at all.

    .venv/bin/python -m benchmarks.bench_chat_hits [--sessions 12] [--num-blocks 192] [--turns 4] [--concurrency 1]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import time
from typing import Any

import openai
from aiohttp import web

from replica.demo.build import PACKAGED_DIR
from replica.demo.corpus import generate_conversations
from router.service.app import METRICS, create_app
from router.service.server import RouterServer
from router.service.settings import KVEventSettings, RouterSettings, TokenizerSettings

MODEL = "shoal-demo"
MODES = ("approximate", "exact, text", "exact, tokens")


def requests_of(num_sessions: int, num_turns: int, seed: int) -> list[list[list[dict[str, Any]]]]:
    """Chat histories in waves: turn t of every session, then (next wave) turn t + 1 of every session."""
    sessions = []
    for conversation in generate_conversations(num_sessions * 4, seed=seed):
        turns = [i for i, m in enumerate(conversation) if m["role"] == "user"]
        plain = [{"role": m["role"], "content": m.get("content") or ""} for m in conversation]
        if len(turns) >= 2 and all(m["role"] in ("system", "user", "assistant") for m in conversation):
            sessions.append([plain[: i + 1] for i in turns][:num_turns])
        if len(sessions) == num_sessions:
            break
    if len(sessions) < num_sessions:
        raise ValueError("not enough multi-turn plain conversations in the corpus for --sessions")
    return [[s[t] for s in sessions if t < len(s)] for t in range(num_turns)]


async def start_replica(num_blocks: int) -> tuple[web.AppRunner, str]:
    from replica.loading import load_for_serving
    from replica.server.app import create_app as create_replica
    from replica.settings import ReplicaSettings

    settings = ReplicaSettings(
        model=str(PACKAGED_DIR), served_model_name=MODEL, port=0, num_blocks=num_blocks, num_speculative_tokens=0
    )
    model, tokenizer = load_for_serving(settings)
    app = create_replica(settings, model, tokenizer, checkpoint_dir=PACKAGED_DIR)  # type: ignore[arg-type]
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


async def run_mode(
    mode: str, waves: list[list[list[dict[str, Any]]]], num_blocks: int, num_replicas: int, concurrency: int
) -> dict[str, Any]:
    replicas = [await start_replica(num_blocks) for _ in range(num_replicas)]
    overrides: dict[str, Any] = {"log_requests": False}
    if mode != "approximate":
        overrides["kv_events"] = KVEventSettings(source="sse")
    if mode == "exact, tokens":
        overrides["tokenizer"] = TokenizerSettings(models={MODEL: PACKAGED_DIR})
    settings = RouterSettings(replicas=[url for _, url in replicas], **overrides)
    app = create_app(settings)
    server = RouterServer(app, settings)
    await server.start("127.0.0.1", 0)
    host, port = server.address
    prompt_tokens = cached_tokens = 0
    started = time.perf_counter()
    try:
        async with openai.AsyncOpenAI(base_url=f"http://{host}:{port}/v1", api_key="unused", max_retries=2) as c:
            await _wait_ready(app, num_replicas, mode != "approximate")
            lanes = asyncio.Semaphore(concurrency)
            latencies_s: list[float] = []

            async def send(messages: list[dict[str, Any]]) -> tuple[int, int]:
                async with lanes:
                    sent = time.perf_counter()
                    reply = await c.chat.completions.create(
                        model=MODEL,
                        messages=messages,  # type: ignore[arg-type]
                        max_tokens=4,
                        temperature=0,
                    )
                    latencies_s.append(time.perf_counter() - sent)
                assert reply.usage is not None
                details = reply.usage.prompt_tokens_details
                return reply.usage.prompt_tokens, (details.cached_tokens or 0) if details is not None else 0

            for wave in waves:  # a session's next turn only after its previous one
                for prompt, cached in await asyncio.gather(*(send(m) for m in wave)):
                    prompt_tokens += prompt
                    cached_tokens += cached
        predicted = sum(app[METRICS].predicted_cached_tokens.values.values())
        branches: dict[str, int] = {}
        for (_, branch, _), count in app[METRICS].requests.values.items():
            branches[branch] = branches.get(branch, 0) + int(count)
    finally:
        await server.stop()
        for runner, _ in replicas:
            await runner.cleanup()
    return {
        "mode": mode,
        "requests": sum(len(wave) for wave in waves),
        "prompt_tokens": prompt_tokens,
        "hit": cached_tokens / prompt_tokens,
        "predicted": predicted / prompt_tokens,
        "seconds": time.perf_counter() - started,
        "latency_p50_ms": sorted(latencies_s)[len(latencies_s) // 2] * 1e3,
        "latency_p99_ms": sorted(latencies_s)[min(len(latencies_s) - 1, int(0.99 * len(latencies_s)))] * 1e3,
        "branches": ", ".join(f"{b} {n}" for b, n in sorted(branches.items())),
    }


async def _wait_ready(app: web.Application, num_replicas: int, needs_events: bool, timeout_s: float = 60.0) -> None:
    from router.service.app import POOL

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pool = app[POOL]
        ready = len(pool.eligible(None)) == num_replicas
        live = not needs_events or sum(r.has_live_kv_events for r in pool) == num_replicas
        if ready and live:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError("the replicas did not come into rotation")


async def ceiling(chats: list[list[dict[str, Any]]]) -> float:
    """Hit ratio of one replica with a cache large enough to keep everything."""
    runner, url = await start_replica(num_blocks=16384)
    prompt_tokens = cached_tokens = 0
    try:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=2) as c:
            for messages in chats:
                reply = await c.chat.completions.create(
                    model=MODEL,
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=4,
                    temperature=0,
                )
                assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
                prompt_tokens += reply.usage.prompt_tokens
                cached_tokens += reply.usage.prompt_tokens_details.cached_tokens or 0
    finally:
        await runner.cleanup()
    return cached_tokens / prompt_tokens


async def main_async(args: argparse.Namespace) -> None:
    waves = requests_of(args.sessions, args.turns, args.seed)
    chats = [messages for wave in waves for messages in wave]
    print(f"{platform.node()}: {platform.machine()}, python {platform.python_version()}")
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {len(chats)} chat requests, {args.sessions} sessions, "
        f"{args.replicas} replicas x {args.num_blocks} KV blocks of 16 tokens, {args.concurrency} at a time\n"
    )
    print(f"ceiling (one replica, unbounded cache): hit {await ceiling(chats):.3f}\n")
    print("| router | requests | prompt tokens | hit | predicted | latency p50 / p99 ms | branches |")
    print("| --- | ---: | ---: | ---: | ---: | --- | --- |")
    for mode in MODES:
        row = await run_mode(mode, waves, args.num_blocks, args.replicas, args.concurrency)
        print(
            f"| {mode} | {row['requests']} | {row['prompt_tokens']:,} | {row['hit']:.3f} | {row['predicted']:.3f} "
            f"| {row['latency_p50_ms']:.0f} / {row['latency_p99_ms']:.0f} | {row['branches']} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=12, help="conversations sent in rotation")
    parser.add_argument("--turns", type=int, default=4, help="user turns sent per conversation, at most")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--num-blocks", type=int, default=192, help="KV blocks (16 tokens) per replica")
    parser.add_argument(
        "--concurrency", type=int, default=1, help="requests in flight at once, each of its own session"
    )
    parser.add_argument("--seed", type=int, default=1)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
