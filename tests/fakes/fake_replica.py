"""A fake OpenAI-compatible serving replica: a real aiohttp server on loopback, for the router's tests and demo.

It answers what the router needs from vLLM, SGLang or Shoal's replica: `/v1/completions` and
`/v1/chat/completions` (JSON, or an SSE stream with one chunk per token), `/v1/models`, `/v1/embeddings`, an echo of
any other `/v1/*` path, `/health`, and `/metrics` under vLLM's or SGLang's metric names. Every answer names the
replica (header `x-fake-replica`, `system_fingerprint`, and each token reads `<name>/tok<i> `), so a test can tell
which replica served it.

Timing is configurable (first byte, per token, and prefill per uncached prompt token, where the fake keeps an LRU of
the chained hashes of the prompt's 64-byte blocks to emulate a prefix cache), and so are faults: an error status for
the next N requests or at a seeded rate, a connection dropped mid-stream, a request that never gets an answer, an
unhealthy `/health`, and `kill()` / `restart()` on the same port to emulate a crash. Counters (`requests_total`,
`in_flight`, `cancelled`, ...) let tests assert on what reached the replica; `wait_until` awaits a condition on them.

`FakeReplica.config` is read on every request, so a test may change it (faults, delays, health) while the replica
runs.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import math
import random
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

INFERENCE_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class FakeReplicaConfig:
    """How a fake replica behaves; delays in seconds. Read anew for every request, except `seed` and the prefix
    cache's shape (read by the constructor) and `max_num_running` (read by `start()`)."""

    name: str = "fake"
    models: tuple[str, ...] = ("shoal-demo",)
    first_byte_delay_s: float = 0.0
    """Delay before the first token (after the response headers when streaming, as vLLM sends them at once)."""
    per_token_delay_s: float = 0.0
    """Delay between two streamed chunks, and per token of a non-streamed answer."""
    num_output_tokens: int = 8
    """Tokens per answer; a smaller `max_tokens` (or `max_completion_tokens`) wins."""
    prefill_s_per_token: float = 0.0
    """Added delay per uncached prompt token; a token is taken as `bytes_per_token` bytes of the prompt's UTF-8."""
    bytes_per_token: int = 4
    prefix_block_bytes: int = 64
    prefix_cache_blocks: int = 4096
    """Capacity of the emulated prefix cache in blocks; `kv_cache_usage_perc` is its fill fraction."""
    max_num_running: int = 256
    """Batch slots: requests served at once; more wait (FIFO) for a slot, and count as `num_requests_waiting` in
    `/metrics`. With `first_byte_delay_s` as a fixed per-request time, a small value makes a batch-slot-bound
    engine, whose latency the queue for slots decides rather than prefill tokens."""
    max_num_waiting: int | None = None
    """Requests that may wait for a slot; past them an inference request is answered 503 at once. None: no limit."""
    exports_batch_limit: bool = False
    """Export `max_num_running` in `/metrics` (as SGLang's `sglang:max_running_requests`, under either flavor:
    vLLM has no such gauge)."""
    exports_cache_size: bool = False
    """Export the emulated cache's size in tokens (`prefix_cache_blocks` blocks of `prefix_block_bytes /
    bytes_per_token` tokens): vLLM's `vllm:cache_config_info` labels, or SGLang's `sglang:max_total_num_tokens`."""
    is_healthy: bool = True
    fail_status: int = 500
    fail_next_n: int = 0
    """The next N inference requests get `fail_status`; decremented per failure."""
    fail_rate: float = 0.0
    """Probability that an inference request gets `fail_status`, drawn from an RNG seeded with `seed`."""
    seed: int = 0
    drop_connection_after_chunks: int | None = None
    """Abort the TCP connection after this many SSE chunks; a non-streamed request is dropped before any byte."""
    hang: bool = False
    """Never answer inference requests (until the client goes away or the replica stops)."""
    metrics_flavor: Literal["vllm", "sglang"] = "vllm"
    metric_overrides: dict[str, float] = field(default_factory=dict)
    """Force a gauge: keys `running`, `waiting`, `kv_usage`."""
    max_recorded: int = 100
    """How many request bodies and headers are kept in `received_bodies` / `received_headers`."""
    extra_response_headers: dict[str, str] = field(default_factory=dict)
    """Headers added to every answer, say those another router in front of this replica would add."""


class PrefixCache:
    """LRU of chained block hashes over a prompt's bytes; `lookup_and_insert` returns the number of cached bytes."""

    def __init__(self, block_bytes: int, capacity_blocks: int) -> None:
        self.block_bytes = block_bytes
        self.capacity_blocks = capacity_blocks
        self._blocks: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def clear(self) -> None:
        self._blocks.clear()

    def lookup_and_insert(self, data: bytes) -> int:
        num_hit_blocks, is_walking_hits, prev = 0, True, 0
        for start in range(0, len(data) - self.block_bytes + 1, self.block_bytes):
            prev = hash((prev, data[start : start + self.block_bytes]))  # names the whole prefix
            if prev in self._blocks:
                self._blocks.move_to_end(prev)
                num_hit_blocks += is_walking_hits
            else:
                is_walking_hits = False
                self._blocks[prev] = None
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
        return num_hit_blocks * self.block_bytes


def _prompt_of(path: str, body: dict[str, Any]) -> tuple[bytes, int | None]:
    """The prompt's bytes for the prefix cache, and its token count when the prompt is token ids."""
    if path == "/v1/chat/completions":
        lines = []
        for message in body.get("messages") or []:
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
            lines.append(f"{message.get('role')}: {content or ''}")
        return "\n".join(lines).encode(), None
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt):
        return b"".join(p.to_bytes(4, "little") for p in prompt), len(prompt)
    if isinstance(prompt, list):
        prompt = "".join(str(p) for p in prompt)
    return str(prompt).encode(), None


def _error_body(message: str, status: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": "FakeReplicaError", "param": None, "code": status}}


class FakeReplica:
    """One fake replica; start it with `await start()` or `async with FakeReplica(...) as fake:`."""

    def __init__(self, config: FakeReplicaConfig | None = None) -> None:
        self.config = config or FakeReplicaConfig()
        self.host = "127.0.0.1"
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._slots: asyncio.Semaphore | None = None
        self._release_hung: asyncio.Event | None = None
        self._changed: asyncio.Event | None = None
        self._is_killing = False
        self._rng = random.Random(self.config.seed)
        self.prefix_cache = PrefixCache(self.config.prefix_block_bytes, self.config.prefix_cache_blocks)
        self.reset_counters()

    def reset_counters(self) -> None:
        self.requests_total = 0
        self.requests_by_path: collections.Counter[str] = collections.Counter()
        self.in_flight = 0
        self.running = 0
        self.completed = 0
        self.cancelled = 0
        self.failed = 0
        self.dropped = 0
        self.prefix_query_bytes = 0
        self.prefix_hit_bytes = 0
        self.received_bodies: collections.deque[dict[str, Any]] = collections.deque(maxlen=self.config.max_recorded)
        self.received_headers: collections.deque[dict[str, str]] = collections.deque(maxlen=self.config.max_recorded)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def name(self) -> str:
        return self.config.name

    async def __aenter__(self) -> FakeReplica:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host, self._is_killing = host, False
        self._slots = asyncio.Semaphore(self.config.max_num_running)
        self._release_hung = asyncio.Event()
        self._changed = asyncio.Event()
        runner = web.AppRunner(self._make_app(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, host, port, reuse_address=True)
        await site.start()
        self._runner = runner
        self.port = runner.addresses[0][1]

    async def stop(self) -> None:
        """Graceful stop: hung requests are released (answered 503) and open streams get up to 1 s to finish."""
        if self._runner is None:
            return
        assert self._release_hung is not None
        self._release_hung.set()
        runner, self._runner = self._runner, None
        await runner.cleanup()

    async def kill(self) -> None:
        """Crash: stop listening and abort every open connection at once; the prefix cache is lost."""
        if self._runner is None:
            return
        runner, self._runner = self._runner, None
        self._is_killing = True
        for site in list(runner.sites):
            await site.stop()
        assert runner.server is not None
        for handler in runner.server.connections:
            if handler.transport is not None:
                handler.transport.abort()
        await asyncio.sleep(0)  # let connection_lost cancel the handlers
        await runner.cleanup()
        self.prefix_cache.clear()
        self._notify()

    async def restart(self) -> None:
        """Start again on the same port (after `kill()` or `stop()`); counters are kept."""
        if self._runner is not None:
            await self.kill()
        await self.start(self.host, self.port)

    def set_healthy(self, is_healthy: bool) -> None:
        self.config.is_healthy = is_healthy

    def fail_next(self, num_requests: int, status: int = 503) -> None:
        self.config.fail_status, self.config.fail_next_n = status, num_requests

    async def wait_until(self, predicate: Callable[[FakeReplica], bool], timeout_s: float = 5.0) -> None:
        """Wait until `predicate(self)` holds, re-checked on every change of a counter; TimeoutError after timeout_s."""
        async with asyncio.timeout(timeout_s):
            while not predicate(self):
                assert self._changed is not None, "start() the replica first"
                await self._changed.wait()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    # -- HTTP ------------------------------------------------------------------------------------------------------

    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        for path in INFERENCE_PATHS:
            app.router.add_post(path, self._inference)
        app.router.add_post("/v1/embeddings", self._inference)
        app.router.add_route("*", "/v1/{tail:.*}", self._inference)
        return app

    def _headers(self) -> dict[str, str]:
        return {"x-fake-replica": self.name, **self.config.extra_response_headers}

    def _count(self, request: web.Request) -> None:
        self.requests_total += 1
        self.requests_by_path[request.path] += 1
        self.received_headers.append(dict(request.headers))
        self._notify()

    async def _health(self, request: web.Request) -> web.Response:
        self._count(request)
        status = 200 if self.config.is_healthy else 503
        return web.json_response(
            {"status": "ok" if status == 200 else "unhealthy"}, status=status, headers=self._headers()
        )

    async def _models(self, request: web.Request) -> web.Response:
        self._count(request)
        created = int(time.time())
        data = [{"id": m, "object": "model", "created": created, "owned_by": "fake"} for m in self.config.models]
        return web.json_response({"object": "list", "data": data}, headers=self._headers())

    async def _metrics(self, request: web.Request) -> web.Response:
        self._count(request)
        overrides = self.config.metric_overrides
        running = overrides.get("running", self.running)
        waiting = overrides.get("waiting", self.in_flight - self.running)
        kv_usage = overrides.get("kv_usage", len(self.prefix_cache) / max(1, self.prefix_cache.capacity_blocks))
        if self.config.metrics_flavor == "vllm":
            gauges = {
                "vllm:num_requests_running": running,
                "vllm:num_requests_waiting": waiting,
                "vllm:kv_cache_usage_perc": kv_usage,
            }
            counters = {
                "vllm:prefix_cache_queries_total": self.prefix_query_bytes,
                "vllm:prefix_cache_hits_total": self.prefix_hit_bytes,
            }
            labels = 'engine="0",model_name="{}"'
        else:
            gauges = {
                "sglang:num_running_reqs": running,
                "sglang:num_queue_reqs": waiting,
                "sglang:token_usage": kv_usage,
            }
            counters = {}
            labels = 'model_name="{}"'
        if self.config.exports_batch_limit:
            gauges["sglang:max_running_requests"] = self.config.max_num_running
        block_tokens = self.config.prefix_block_bytes // self.config.bytes_per_token
        if self.config.exports_cache_size and self.config.metrics_flavor == "sglang":
            gauges["sglang:max_total_num_tokens"] = self.config.prefix_cache_blocks * block_tokens
        lines = []
        for kind, values in (("gauge", gauges), ("counter", counters)):
            for metric, value in values.items():
                lines += [f"# HELP {metric} Fake replica {self.name}.", f"# TYPE {metric} {kind}"]
                lines += [f"{metric}{{{labels.format(m)}}} {float(value)}" for m in self.config.models]
        if self.config.exports_cache_size and self.config.metrics_flavor == "vllm":
            info = f'block_size="{block_tokens}",num_gpu_blocks="{self.config.prefix_cache_blocks}"'
            lines += ["# HELP vllm:cache_config_info KV cache configuration", "# TYPE vllm:cache_config_info gauge"]
            lines += [f"vllm:cache_config_info{{{labels.format(m)},{info}}} 1.0" for m in self.config.models]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", headers=self._headers())

    async def _inference(self, request: web.Request) -> web.StreamResponse:
        self._count(request)
        self.in_flight += 1
        state = {"is_dropped": False}
        try:
            return await self._serve(request, state)
        except asyncio.CancelledError:
            if not (self._is_killing or state["is_dropped"]):
                self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1
            self._notify()

    async def _serve(self, request: web.Request, state: dict[str, bool]) -> web.StreamResponse:
        config = self.config
        body: dict[str, Any] = {}
        if request.can_read_body:
            try:
                body = await request.json()
            except json.JSONDecodeError:
                return web.json_response(_error_body("body is not JSON", 400), status=400, headers=self._headers())
            self.received_bodies.append(body)
        if config.hang:
            assert self._release_hung is not None
            await self._release_hung.wait()
            return web.json_response(_error_body("replica stopped", 503), status=503, headers=self._headers())
        if config.fail_next_n > 0 or (config.fail_rate > 0 and self._rng.random() < config.fail_rate):
            config.fail_next_n = max(0, config.fail_next_n - 1)
            self.failed += 1
            return web.json_response(
                _error_body("injected failure", config.fail_status), status=config.fail_status, headers=self._headers()
            )
        model = body.get("model") or config.models[0]
        if model not in config.models:
            return web.json_response(
                _error_body(f"The model `{model}` does not exist.", 404), status=404, headers=self._headers()
            )
        if request.path == "/v1/embeddings":
            data = [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2, 0.3, 0.4]}]
            return web.json_response(
                {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": 1, "total_tokens": 1}},
                headers=self._headers(),
            )
        if request.path not in INFERENCE_PATHS:
            return web.json_response(
                {
                    "object": "echo",
                    "replica": self.name,
                    "method": request.method,
                    "path": request.path,
                    "query": dict(request.query),
                    "body": body or None,
                },
                headers=self._headers(),
            )
        if config.drop_connection_after_chunks is not None and not body.get("stream"):
            await self._drop(request, state)
        if config.max_num_waiting is not None and self.in_flight - self.running > config.max_num_waiting:
            self.failed += 1
            return web.json_response(_error_body("queue full", 503), status=503, headers=self._headers())

        assert self._slots is not None
        async with self._slots:
            self.running += 1
            self._notify()
            try:
                response = await self._generate(request, body, model, state)
            finally:
                self.running -= 1
        self.completed += 1
        return response

    async def _drop(self, request: web.Request, state: dict[str, bool]) -> None:
        state["is_dropped"] = True
        self.dropped += 1
        assert request.transport is not None
        request.transport.abort()
        await asyncio.Event().wait()  # connection_lost cancels this handler

    async def _generate(
        self, request: web.Request, body: dict[str, Any], model: str, state: dict[str, bool]
    ) -> web.StreamResponse:
        config = self.config
        prompt, num_prompt_tokens = _prompt_of(request.path, body)
        num_cached_bytes = self.prefix_cache.lookup_and_insert(prompt)
        self.prefix_query_bytes += len(prompt)
        self.prefix_hit_bytes += num_cached_bytes
        if num_prompt_tokens is None:
            num_prompt_tokens = math.ceil(len(prompt) / config.bytes_per_token)
        num_uncached_tokens = math.ceil((len(prompt) - num_cached_bytes) / config.bytes_per_token)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or config.num_output_tokens
        num_tokens = min(config.num_output_tokens, int(max_tokens))
        finish_reason = "length" if num_tokens < config.num_output_tokens else "stop"
        pieces = [f"{self.name}/tok{i} " for i in range(num_tokens)]
        usage = {
            "prompt_tokens": num_prompt_tokens,
            "completion_tokens": num_tokens,
            "total_tokens": num_prompt_tokens + num_tokens,
        }
        is_chat = request.path == "/v1/chat/completions"
        head = {
            "id": f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": f"fake-{self.name}",
        }
        prefill_s = config.first_byte_delay_s + num_uncached_tokens * config.prefill_s_per_token

        if not body.get("stream"):
            await asyncio.sleep(prefill_s + config.per_token_delay_s * num_tokens)
            text = "".join(pieces)
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
            if is_chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            return web.json_response(
                {
                    **head,
                    "object": "chat.completion" if is_chat else "text_completion",
                    "choices": [choice],
                    "usage": usage,
                },
                headers=self._headers(),
            )

        response = web.StreamResponse(
            headers={**self._headers(), "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        chunk_object = "chat.completion.chunk" if is_chat else "text_completion"

        def chunk(piece: str | None, finish: str | None, role: bool = False) -> bytes:
            if is_chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
                if piece is not None:
                    delta["content"] = piece
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
            return f"data: {json.dumps({**head, 'object': chunk_object, 'choices': [choice]})}\n\n".encode()

        chunks = [chunk(None, None, role=True)] if is_chat else []
        chunks += [chunk(p, finish_reason if i == num_tokens - 1 else None) for i, p in enumerate(pieces)]
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append(
                f"data: {json.dumps({**head, 'object': chunk_object, 'choices': [], 'usage': usage})}\n\n".encode()
            )
        chunks.append(b"data: [DONE]\n\n")
        await asyncio.sleep(prefill_s)
        try:
            for i, data in enumerate(chunks):
                if i == config.drop_connection_after_chunks:
                    await self._drop(request, state)
                if i > 0 and config.per_token_delay_s > 0:
                    await asyncio.sleep(config.per_token_delay_s)
                await response.write(data)
            await response.write_eof()
        except ConnectionResetError:  # the client went away between two chunks
            self.cancelled += 1
        return response


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run one fake OpenAI-compatible replica on loopback.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--name", default="fake")
    parser.add_argument("--model", action="append", help="model name served (repeatable); default shoal-demo")
    parser.add_argument("--first-byte-delay-s", type=float, default=0.0)
    parser.add_argument("--per-token-delay-s", type=float, default=0.0)
    parser.add_argument("--prefill-s-per-token", type=float, default=0.0)
    parser.add_argument("--num-output-tokens", type=int, default=8)
    parser.add_argument("--metrics-flavor", choices=("vllm", "sglang"), default="vllm")
    parser.add_argument("--max-num-running", type=int, default=256, help="batch slots (requests served at once)")
    args = parser.parse_args(argv)
    config = FakeReplicaConfig(
        name=args.name,
        models=tuple(args.model or ("shoal-demo",)),
        first_byte_delay_s=args.first_byte_delay_s,
        per_token_delay_s=args.per_token_delay_s,
        prefill_s_per_token=args.prefill_s_per_token,
        num_output_tokens=args.num_output_tokens,
        metrics_flavor=args.metrics_flavor,
        max_num_running=args.max_num_running,
    )

    async def serve() -> None:
        replica = FakeReplica(config)
        await replica.start(args.host, args.port)
        print(f"fake replica {args.name} on {replica.url}", flush=True)
        is_stopping = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, is_stopping.set)
        try:
            await is_stopping.wait()
        finally:
            await replica.stop()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    main()
