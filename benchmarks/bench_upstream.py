"""The router -> replica client alone: `UpstreamPool` against `aiohttp.ClientSession`, under uvloop.

Each client sends small POSTs (a ~250-byte JSON body, three headers) to a canned server and reads the whole answer
(a 200 with Content-Length and a ~300-byte OpenAI-style JSON body), `--requests` times after a warm-up, one at a
time (`conc 1`) and from 16 tasks at once. The session is configured as the router configures its own (no
connection limit, no decompression, no User-Agent). The server is a raw `asyncio.Protocol` under uvloop in a
separate process pinned with `taskset` to another core, far cheaper per request than either client, so CPU µs per
request (`time.process_time` of the client process, pinned alone to its own core) is the client's cost. Its user
part is Python and event-loop work; the rest is the kernel's (on loopback the sender's system calls run much of the
receiving TCP stack), which is noisy on a busy machine. Rounds alternate between the clients; the table shows the
median of `--rounds`.

    .venv/bin/python -m benchmarks.bench_upstream
    .venv/bin/python -m benchmarks.bench_upstream --requests 20000 --rounds 5 --client-core 2 --server-core 3

Not a test: it prints a table and writes JSON under benchmarks/out/. Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import uvloop

from router.service.upstream import UpstreamPool

REPO = Path(__file__).resolve().parent.parent

HOST = "127.0.0.1"
TARGET = "/v1/completions"
REQUEST_HEADERS = [("Content-Type", "application/json"), ("Accept", "application/json"), ("X-Request-Id", "bench")]
ANSWER_BODY = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 1700000000,
        "model": "shoal-demo",
        "choices": [{"index": 0, "text": " hello world", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 64, "completion_tokens": 2, "total_tokens": 66},
    }
).encode()
ANSWER = (
    b"HTTP/1.1 200 OK\r\ndate: Mon, 30 Nov 2026 00:00:00 GMT\r\nserver: uvicorn\r\n"
    b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(ANSWER_BODY)
) + ANSWER_BODY


# --- the server process --------------------------------------------------------------------------------------


class CannedServer(asyncio.Protocol):
    """Answers every complete request (head plus Content-Length body) with ANSWER."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        while True:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buffer[:end]).lower()
            at = head.find(b"\r\ncontent-length:")
            length = 0
            if at >= 0:
                line_end = head.find(b"\r\n", at + 2)
                length = int(head[at + 17 : line_end if line_end > 0 else len(head)])
            if len(buffer) < end + 4 + length:
                return
            del buffer[: end + 4 + length]
            assert self.transport is not None
            self.transport.write(ANSWER)


async def serve() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(CannedServer, HOST, 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    stop = asyncio.Event()
    loop.add_reader(sys.stdin.fileno(), stop.set)  # the parent closes our stdin (or dies): stop
    await stop.wait()
    server.close()


def start_server(core: int) -> tuple[subprocess.Popen[str], int]:
    argv = ["taskset", "-c", str(core), sys.executable, "-m", "benchmarks.bench_upstream", "--serve"]
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.strip().isdigit():
        process.kill()
        raise RuntimeError(f"server did not start: {line!r}")
    return process, int(line)


# --- the clients ---------------------------------------------------------------------------------------------


@dataclass
class Result:
    client: str
    concurrency: int
    num_requests: int
    requests_per_s: float
    cpu_us_per_request: float
    user_us_per_request: float
    p50_us: float
    p99_us: float


Send = Callable[[], Awaitable[bytes]]


async def measure(send: Send, concurrency: int, num_requests: int) -> tuple[float, float, float, list[float]]:
    """(wall s, CPU s, user CPU s, per-request latencies in s) for `num_requests` sends from `concurrency` tasks."""
    latencies: list[float] = []
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < num_requests:
            next_index += 1
            started = time.perf_counter()
            body = await send()
            latencies.append(time.perf_counter() - started)
            assert len(body) == len(ANSWER_BODY)

    cpu_start, user_start, wall_start = time.process_time(), os.times().user, time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall_s, cpu_s, user_s = (
        time.perf_counter() - wall_start,
        time.process_time() - cpu_start,
        os.times().user - user_start,
    )
    return wall_s, cpu_s, user_s, latencies


async def run_round(client: str, port: int, concurrency: int, num_requests: int, num_warmup: int) -> Result:
    body = json.dumps({"model": "shoal-demo", "prompt": "x" * 200, "max_tokens": 2}).encode()
    send: Send
    if client == "UpstreamPool":
        pool = UpstreamPool()

        async def send_upstream() -> bytes:
            response = await pool.request("POST", HOST, port, TARGET, REQUEST_HEADERS, body)
            try:
                return await response.read()
            finally:
                response.close()

        send, close = send_upstream, pool.close
    else:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300)
        session = aiohttp.ClientSession(connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",))
        url = f"http://{HOST}:{port}{TARGET}"

        async def send_aiohttp() -> bytes:
            async with session.request("POST", url, data=body, headers=REQUEST_HEADERS) as response:
                return await response.read()

        send, close = send_aiohttp, session.close
    try:
        await measure(send, concurrency, num_warmup)
        wall_s, cpu_s, user_s, latencies = await measure(send, concurrency, num_requests)
    finally:
        await close()
    latencies.sort()
    return Result(
        client=client,
        concurrency=concurrency,
        num_requests=num_requests,
        requests_per_s=num_requests / wall_s,
        cpu_us_per_request=cpu_s / num_requests * 1e6,
        user_us_per_request=user_s / num_requests * 1e6,
        p50_us=latencies[len(latencies) // 2] * 1e6,
        p99_us=latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1e6,
    )


def median_result(rounds: list[Result]) -> Result:
    first = rounds[0]
    return Result(
        client=first.client,
        concurrency=first.concurrency,
        num_requests=first.num_requests,
        requests_per_s=statistics.median(r.requests_per_s for r in rounds),
        cpu_us_per_request=statistics.median(r.cpu_us_per_request for r in rounds),
        user_us_per_request=statistics.median(r.user_us_per_request for r in rounds),
        p50_us=statistics.median(r.p50_us for r in rounds),
        p99_us=statistics.median(r.p99_us for r in rounds),
    )


def print_table(results: list[Result]) -> None:
    print(
        f"{'client':<22} {'conc':>4} {'requests':>8} {'req/s':>7} {'CPU µs/req':>10} {'user µs/req':>11} "
        f"{'p50 µs':>7} {'p99 µs':>7}"
    )
    for r in results:
        print(
            f"{r.client:<22} {r.concurrency:>4} {r.num_requests:>8} {r.requests_per_s:>7.0f} "
            f"{r.cpu_us_per_request:>10.1f} {r.user_us_per_request:>11.1f} {r.p50_us:>7.0f} {r.p99_us:>7.0f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000, help="timed requests per round")
    parser.add_argument("--warmup", type=int, default=500, help="untimed requests before each round")
    parser.add_argument("--concurrency", default="1,16", help="comma-separated task counts")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per (client, concurrency); the median is shown")
    parser.add_argument("--client-core", type=int, default=0)
    parser.add_argument("--server-core", type=int, default=1)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        uvloop.run(serve())
        return 0

    os.sched_setaffinity(0, {args.client_core})
    server, port = start_server(args.server_core)
    results: list[Result] = []
    try:
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            rounds: dict[str, list[Result]] = {"UpstreamPool": [], "aiohttp.ClientSession": []}
            for _ in range(args.rounds):
                for client, done in rounds.items():
                    done.append(uvloop.run(run_round(client, port, concurrency, args.requests, args.warmup)))
            results.extend(median_result(done) for done in rounds.values())
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(timeout=10)
    print(
        f"uvloop {importlib.metadata.version('uvloop')}, aiohttp {aiohttp.__version__}, "
        f"Python {sys.version.split()[0]}; client on core {args.client_core}, server on core {args.server_core}; "
        f"median of {args.rounds} rounds"
    )
    print_table(results)
    out = REPO / "benchmarks" / "out" / f"bench_upstream-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
