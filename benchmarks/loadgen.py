"""Closed-loop HTTP load generator for the proxy benchmark: N connections, each sending its next request as soon as
the previous answer is complete, until a request count or a time bound is reached.

The default client is a minimal HTTP/1.1 keep-alive client on `asyncio.Protocol` (one pre-encoded write per
request; Content-Length, chunked and close-delimited bodies), because a general client such as aiohttp's costs a
few hundred microseconds of CPU per request and would measure itself rather than the router once the router is
fast. `--client aiohttp` cross-checks it. Latency is from the request's write to the last byte of its answer.

`--stream` instead sends requests one at a time and reports, per request, the time to the first body byte and to
the end of the stream: a router that leaves Nagle's algorithm on (no TCP_NODELAY) shows ~40 ms stalls there.

Run by bench_proxy.py under `taskset`; prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit


@dataclass
class Answer:
    status: int
    first_body_s: float  # perf_counter() when the first body byte arrived
    end_s: float


class HttpConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection with at most one request outstanding."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.is_closed = False
        self._buffer = bytearray()
        self._waiter: asyncio.Future[Answer] | None = None
        self._reset()

    def _reset(self) -> None:
        self._header_end = -1
        self._status = 0
        self._content_length: int | None = None
        self._is_chunked = False
        self._chunk_pos = 0  # chunked: where the next chunk-size line starts
        self._first_body_s = 0.0
        self._wants_close = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_closed = True
        if self._waiter is not None and not self._waiter.done():
            if self._header_end >= 0 and self._content_length is None and not self._is_chunked:
                self._finish(len(self._buffer))  # close-delimited body
            else:
                self._waiter.set_exception(ConnectionError(f"connection lost: {exc}"))

    async def request(self, data: bytes) -> Answer:
        assert self.transport is not None and self._waiter is None
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        try:
            return await self._waiter
        finally:
            self._waiter = None

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._waiter is None or self._waiter.done():
            return
        if self._header_end < 0:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            self._parse_head(end)
        if len(self._buffer) > self._header_end and not self._first_body_s:
            self._first_body_s = time.perf_counter()
        if self._content_length is not None:
            if len(self._buffer) >= self._header_end + self._content_length:
                self._finish(self._header_end + self._content_length)
        elif self._is_chunked:
            self._scan_chunks()

    def _parse_head(self, end: int) -> None:
        lines = bytes(self._buffer[:end]).split(b"\r\n")
        self._status = int(lines[0].split(b" ", 2)[1])
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"content-length":
                self._content_length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value:
                self._is_chunked = True
            elif name == b"connection" and value == b"close":
                self._wants_close = True
        self._header_end = self._chunk_pos = end + 4
        if self._status in (204, 304):
            self._content_length = 0

    def _scan_chunks(self) -> None:
        buffer = self._buffer
        while True:
            line_end = buffer.find(b"\r\n", self._chunk_pos)
            if line_end < 0:
                return
            size = int(bytes(buffer[self._chunk_pos : line_end]).split(b";")[0], 16)
            if size == 0:
                trailer_end = buffer.find(b"\r\n\r\n", line_end)
                if trailer_end >= 0:
                    self._finish(trailer_end + 4)
                return
            next_pos = line_end + 2 + size + 2
            if len(buffer) < next_pos:
                return
            self._chunk_pos = next_pos

    def _finish(self, consumed: int) -> None:
        answer = Answer(self._status, self._first_body_s or time.perf_counter(), time.perf_counter())
        del self._buffer[:consumed]
        if self._wants_close and self.transport is not None:
            self.is_closed = True
            self.transport.close()
        self._reset()
        assert self._waiter is not None
        self._waiter.set_result(answer)


@dataclass
class LoadResult:
    url: str
    concurrency: int
    num_ok: int = 0
    num_errors: int = 0
    elapsed_s: float = 0.0
    requests_per_s: float = 0.0
    p50_ms: float = 0.0
    p90_ms: float = 0.0
    p99_ms: float = 0.0
    mean_ms: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time during the run: near elapsed_s means the load generator saturates
    status_counts: dict[str, int] = field(default_factory=dict)
    first_error: str = ""


def encode_request(url: str, body: bytes) -> bytes:
    parts = urlsplit(url)
    head = (
        f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Accept: */*\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def percentile(sorted_values: list[float], fraction: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(fraction * len(sorted_values)))]


def summarize(result: LoadResult, latencies_s: list[float], cpu_start_s: float) -> LoadResult:
    result.cpu_s = time.process_time() - cpu_start_s
    latencies_s.sort()
    result.num_ok = sum(n for s, n in result.status_counts.items() if s == "200")
    result.requests_per_s = len(latencies_s) / result.elapsed_s if result.elapsed_s else 0.0
    result.p50_ms = percentile(latencies_s, 0.50) * 1e3
    result.p90_ms = percentile(latencies_s, 0.90) * 1e3
    result.p99_ms = percentile(latencies_s, 0.99) * 1e3
    result.mean_ms = statistics.fmean(latencies_s) * 1e3 if latencies_s else 0.0
    return result


async def _connect(host: str, port: int) -> HttpConnection:
    _, conn = await asyncio.get_running_loop().create_connection(HttpConnection, host, port)
    return conn


async def run_raw(url: str, bodies: list[bytes], concurrency: int, num_requests: int, duration_s: float) -> LoadResult:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    requests = [encode_request(url, b) for b in bodies]
    result, latencies_s = LoadResult(url, concurrency), []
    next_index = 0
    cpu_start_s = time.process_time()
    start = time.perf_counter()
    deadline = start + duration_s
    last_end = start

    async def worker() -> None:
        nonlocal next_index, last_end
        conn = await _connect(host, port)
        while next_index < num_requests and time.perf_counter() < deadline:
            data = requests[next_index % len(requests)]
            next_index += 1
            sent = time.perf_counter()
            try:
                if conn.is_closed:
                    conn = await _connect(host, port)
                answer = await asyncio.wait_for(conn.request(data), timeout=max(0.1, deadline - sent + 1.0))
            except (OSError, TimeoutError, ValueError, IndexError) as exc:
                result.num_errors += 1
                result.first_error = result.first_error or repr(exc)
                if conn.transport is not None:
                    conn.transport.abort()
                conn = await _connect(host, port)
                continue
            key = str(answer.status)
            result.status_counts[key] = result.status_counts.get(key, 0) + 1
            if answer.status != 200:
                result.num_errors += 1
            latencies_s.append(answer.end_s - sent)
            last_end = max(last_end, answer.end_s)
        if conn.transport is not None:
            conn.transport.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.elapsed_s = last_end - start
    return summarize(result, latencies_s, cpu_start_s)


async def run_aiohttp(
    url: str, bodies: list[bytes], concurrency: int, num_requests: int, duration_s: float
) -> LoadResult:
    import aiohttp

    result, latencies_s = LoadResult(url, concurrency), []
    next_index = 0
    cpu_start_s = time.process_time()
    start = time.perf_counter()
    deadline = start + duration_s
    last_end = start
    connector = aiohttp.TCPConnector(limit=concurrency)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=duration_s + 1)) as s:

        async def worker() -> None:
            nonlocal next_index, last_end
            while next_index < num_requests and time.perf_counter() < deadline:
                body = bodies[next_index % len(bodies)]
                next_index += 1
                sent = time.perf_counter()
                try:
                    async with s.post(url, data=body, headers=headers) as resp:
                        await resp.read()
                        status = resp.status
                except (aiohttp.ClientError, TimeoutError) as exc:
                    result.num_errors += 1
                    result.first_error = result.first_error or repr(exc)
                    continue
                end = time.perf_counter()
                result.status_counts[str(status)] = result.status_counts.get(str(status), 0) + 1
                result.num_errors += status != 200
                latencies_s.append(end - sent)
                last_end = max(last_end, end)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.elapsed_s = last_end - start
    return summarize(result, latencies_s, cpu_start_s)


async def run_stream_probe(url: str, body: bytes, num_requests: int, duration_s: float) -> dict[str, float]:
    """Sequential streamed requests: median and max time to the first body byte and to the end, in ms."""
    parts = urlsplit(url)
    conn = await _connect(parts.hostname or "127.0.0.1", parts.port or 80)
    data = encode_request(url, body)
    first_ms, end_ms, num_errors = [], [], 0
    deadline = time.perf_counter() + duration_s
    for _ in range(num_requests):
        if time.perf_counter() > deadline:
            break
        if conn.is_closed:
            conn = await _connect(parts.hostname or "127.0.0.1", parts.port or 80)
        sent = time.perf_counter()
        answer = await asyncio.wait_for(conn.request(data), timeout=max(0.1, deadline - sent + 1.0))
        if answer.status != 200:
            num_errors += 1
            continue
        first_ms.append((answer.first_body_s - sent) * 1e3)
        end_ms.append((answer.end_s - sent) * 1e3)
    if conn.transport is not None:
        conn.transport.close()
    return {
        "num_ok": len(end_ms),
        "num_errors": num_errors,
        "first_byte_p50_ms": statistics.median(first_ms) if first_ms else 0.0,
        "first_byte_max_ms": max(first_ms, default=0.0),
        "end_p50_ms": statistics.median(end_ms) if end_ms else 0.0,
        "end_max_ms": max(end_ms, default=0.0),
    }


def make_bodies(num_prompts: int, prompt_bytes: int, model: str, stream: bool = False) -> list[bytes]:
    """Chat requests whose prompts share a system prefix and differ after it, as a cache-aware router expects."""
    system = ("You are a helpful assistant. " * 64)[: prompt_bytes // 2]
    bodies = []
    for i in range(num_prompts):
        question = (f"Question {i}: what is {i} times {i + 7}? " * 64)[: prompt_bytes - len(system)]
        request = {
            "model": model,
            "max_tokens": 8,
            "stream": stream,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        }
        bodies.append(json.dumps(request).encode())
    return bodies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="e.g. http://127.0.0.1:8000/v1/chat/completions")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=2000, help="requests to send (upper bound)")
    parser.add_argument("--duration-s", type=float, default=20.0, help="time bound of the run")
    parser.add_argument("--prompt-bytes", type=int, default=1024)
    parser.add_argument("--num-prompts", type=int, default=64, help="distinct request bodies, sent in turn")
    parser.add_argument("--model", default="shoal-demo")
    parser.add_argument("--client", choices=("raw", "aiohttp"), default="raw")
    parser.add_argument("--stream", action="store_true", help="sequential streamed requests: first byte and end")
    args = parser.parse_args(argv)
    if args.requests <= 0 or args.duration_s <= 0 or args.concurrency <= 0:
        parser.error("--requests, --duration-s and --concurrency must be positive")

    bodies = make_bodies(args.num_prompts, args.prompt_bytes, args.model, stream=args.stream)
    if args.stream:
        report: object = asyncio.run(run_stream_probe(args.url, bodies[0], args.requests, args.duration_s))
    else:
        run = run_raw if args.client == "raw" else run_aiohttp
        report = asdict(asyncio.run(run(args.url, bodies, args.concurrency, args.requests, args.duration_s)))
    json.dump(report, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
