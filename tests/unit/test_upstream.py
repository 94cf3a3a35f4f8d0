"""UpstreamPool against real servers on 127.0.0.1: aiohttp apps for well-behaved peers, raw asyncio servers for
malformed, slow and dying ones. Framing, keep-alive reuse, the stale-connection retry, timeouts, cancellation and
flow control; the last test runs the main paths again under uvloop, the router's event loop."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import uvloop
from aiohttp import web
from aiohttp.test_utils import TestServer

from router.service.upstream import (
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamPool,
    UpstreamProtocolError,
    UpstreamResponse,
    UpstreamTimeout,
)
from tests.fakes import FakeReplica, FakeReplicaConfig

HOST = "127.0.0.1"
Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]
AiohttpServer = Callable[..., Awaitable[TestServer]]


async def read_request(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes] | None:
    """(request line, lower-cased headers, body), or None when the client closed the connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head.decode().split("\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return lines[0], headers, body


async def wait_for_eof(reader: asyncio.StreamReader) -> bool:
    """True once the peer closed or reset the connection."""
    try:
        return await reader.read(1) == b""
    except ConnectionError:
        return True


async def poll(predicate: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        await asyncio.sleep(0.005)


def ok(body: bytes = b"ok", extra: str = "") -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


class RawServer:
    """`asyncio.start_server` on 127.0.0.1; `serve(reader, writer, connection_number)` runs per connection."""

    def __init__(self, serve: Serve) -> None:
        self.serve = serve
        self.num_connections = 0
        self.port = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._handle, HOST, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.num_connections += 1
        try:
            await self.serve(reader, writer, self.num_connections)
        except (ConnectionError, asyncio.CancelledError):
            pass  # a handler task that ends cancelled trips a logging bug of Python 3.11's asyncio.streams
        finally:
            writer.close()
            self._tasks.discard(task)


def serve_forever(answer: bytes) -> Serve:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while await read_request(reader) is not None:
            writer.write(answer)
            await writer.drain()

    return serve


async def start_app(aiohttp_server: AiohttpServer, app: web.Application) -> int:
    server = await aiohttp_server(app)
    assert server.port is not None
    return server.port


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    upstream = UpstreamPool(read_timeout_s=5.0)
    yield upstream
    await upstream.close()


async def get(pool: UpstreamPool, port: int, method: str = "GET", target: str = "/") -> UpstreamResponse:
    return await pool.request(method, HOST, port, target, [], b"")


# --- well-behaved peers --------------------------------------------------------------------------------------


async def test_json_with_content_length(pool: UpstreamPool, aiohttp_server: AiohttpServer) -> None:
    seen: list[web.Request] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(request)
        return web.json_response({"echo": await request.json()}, headers={"X-Replica": "a"})

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    port = await start_app(aiohttp_server, app)
    body = json.dumps({"prompt": "héllo"}).encode()
    headers = [("Content-Type", "application/json"), ("X-Trace", "t1")]
    response = await pool.request("POST", HOST, port, "/v1/completions?x=1", headers, body)
    assert (response.status, response.reason) == (200, "OK")
    assert response.content_type == "application/json"
    assert response.header("x-replica") == "a" and response.header("X-Missing") is None
    assert ("X-Replica", "a") in response.headers
    assert json.loads(await response.read()) == {"echo": {"prompt": "héllo"}}
    assert response.is_complete and await response.read() == b""
    request = seen[0]
    assert (request.method, request.path_qs, request.headers["X-Trace"]) == ("POST", "/v1/completions?x=1", "t1")
    assert request.headers["Host"] == f"{HOST}:{port}"
    assert request.content_length == len(body)
    assert pool.stats() == {"open": 1, "idle": 1, "created": 1, "reused": 0, "retried": 0}


async def test_chunked_stream_arrives_incrementally(pool: UpstreamPool, aiohttp_server: AiohttpServer) -> None:
    got_first = asyncio.Event()
    sent_second = False

    async def handler(request: web.Request) -> web.StreamResponse:
        nonlocal sent_second
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        await response.write(b"data: 1\n\n")
        await asyncio.wait_for(got_first.wait(), 5)
        sent_second = True
        await response.write(b"data: 2\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/stream", handler)
    port = await start_app(aiohttp_server, app)
    response = await pool.request("POST", HOST, port, "/stream", [], b"{}")
    assert response.header("Transfer-Encoding") == "chunked"
    assert response.content_type == "text/event-stream"
    chunks = response.iter_chunks()
    assert await anext(chunks) == b"data: 1\n\n"
    assert not sent_second
    got_first.set()
    assert b"".join([chunk async for chunk in chunks]) == b"data: 2\n\n"
    assert response.is_complete
    assert pool.stats()["idle"] == 1


async def test_fake_replica_sse_stream_and_drop(pool: UpstreamPool) -> None:
    body = json.dumps({"model": "shoal-demo", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    headers = [("Content-Type", "application/json")]
    async with FakeReplica(FakeReplicaConfig(name="a", num_output_tokens=3)) as replica:
        async with await pool.request("POST", HOST, replica.port, "/v1/chat/completions", headers, body.encode()) as r:
            text = b"".join([chunk async for chunk in r]).decode()
        events = [line for line in text.split("\n") if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 4
        replica.config.drop_connection_after_chunks = 1
        response = await pool.request("POST", HOST, replica.port, "/v1/chat/completions", headers, body.encode())
        with pytest.raises(UpstreamDisconnected):
            async for _ in response:
                pass
    assert pool.stats()["open"] == 0


async def test_sequential_requests_reuse_one_connection(pool: UpstreamPool, aiohttp_server: AiohttpServer) -> None:
    peers: set[Any] = set()

    async def handler(request: web.Request) -> web.Response:
        assert request.transport is not None
        peers.add(request.transport.get_extra_info("peername"))
        return web.Response(body=b"x" * 10)

    app = web.Application()
    app.router.add_get("/", handler)
    port = await start_app(aiohttp_server, app)
    for _ in range(5):
        assert await (await get(pool, port)).read() == b"x" * 10
    assert len(peers) == 1
    assert pool.stats() == {"open": 1, "idle": 1, "created": 1, "reused": 4, "retried": 0}


async def test_thousand_sequential_requests_keep_one_connection(
    pool: UpstreamPool, aiohttp_server: AiohttpServer
) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    app = web.Application()
    app.router.add_post("/", handler)
    port = await start_app(aiohttp_server, app)
    for i in range(1000):
        response = await pool.request("POST", HOST, port, "/", [], b"%d" % i)
        assert await response.read() == b"%d" % i
        response.close()
        assert pool.stats()["open"] == 1
    assert pool.stats() == {"open": 1, "idle": 1, "created": 1, "reused": 999, "retried": 0}


async def test_concurrent_requests_and_max_idle(aiohttp_server: AiohttpServer) -> None:
    arrived = 0
    all_arrived = asyncio.Event()

    async def handler(request: web.Request) -> web.Response:
        nonlocal arrived
        arrived += 1
        if arrived == 5:
            all_arrived.set()
        await asyncio.wait_for(all_arrived.wait(), 5)
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", handler)
    port = await start_app(aiohttp_server, app)
    pool = UpstreamPool(max_idle_per_host=2)
    try:
        responses = await asyncio.gather(*(get(pool, port) for _ in range(5)))
        assert [await r.read() for r in responses] == [b"ok"] * 5
        assert pool.stats() == {"open": 2, "idle": 2, "created": 5, "reused": 0, "retried": 0}
    finally:
        await pool.close()
    assert pool.stats()["open"] == 0


# --- framing edge cases (raw servers) ------------------------------------------------------------------------


@pytest.mark.parametrize("is_bytewise", [False, True], ids=["whole", "bytewise"])
async def test_chunk_extensions_and_trailers(pool: UpstreamPool, is_bytewise: bool) -> None:
    answer = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Checksum\r\n\r\n"
        # llhttp, strict, takes no whitespace around an extension's ";", which servers do not send.
        b"5;name=value\r\nhello\r\n6;ext\r\n world\r\n0;last\r\nX-Checksum: abc\r\nX-Other: 1\r\n\r\n"
    )

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while await read_request(reader) is not None:
            for piece in [answer[i : i + 1] for i in range(len(answer))] if is_bytewise else [answer]:
                writer.write(piece)
                await writer.drain()

    async with RawServer(serve) as server:
        for _ in range(2):
            response = await get(pool, server.port)
            assert await response.read() == b"hello world"
            assert response.trailers == [("X-Checksum", "abc"), ("X-Other", "1")]
        assert pool.stats()["created"] == 1 and server.num_connections == 1


async def test_no_body_responses_keep_the_connection(pool: UpstreamPool) -> None:
    answers = [
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 304 Not Modified\r\nContent-Length: 10\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n",  # to HEAD
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + ok(b"final"),
        ok(b""),
    ]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        for answer in answers:
            assert await read_request(reader) is not None
            writer.write(answer)
        await wait_for_eof(reader)

    async with RawServer(serve) as server:
        statuses = []
        for method, body in [("GET", b""), ("GET", b""), ("HEAD", b""), ("GET", b"final"), ("GET", b"")]:
            response = await get(pool, server.port, method)
            statuses.append(response.status)
            assert response.is_complete or body
            assert await response.read() == body
        assert statuses == [204, 304, 200, 200, 200]
        assert pool.stats()["created"] == 1 and server.num_connections == 1


async def test_body_until_eof_and_http10(pool: UpstreamPool) -> None:
    answers = {1: b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end", 2: b"HTTP/1.0 200 OK\r\n\r\nold"}

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        await read_request(reader)
        writer.write(answers[number])

    async with RawServer(serve) as server:
        assert await (await get(pool, server.port)).read() == b"until the end"
        assert await (await get(pool, server.port)).read() == b"old"
        assert pool.stats()["created"] == 2
        await poll(lambda: pool.stats()["open"] == 0)


async def test_connection_close_response_is_not_reused(pool: UpstreamPool) -> None:
    client_closed = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(ok(b"bye", "Connection: close\r\n"))  # the server leaves the socket open: the client must close
        if await wait_for_eof(reader):
            client_closed.set()

    async with RawServer(serve) as server:
        assert await (await get(pool, server.port)).read() == b"bye"
        assert pool.stats()["open"] == 0
        await asyncio.wait_for(client_closed.wait(), 3)
        assert await (await get(pool, server.port)).read() == b"bye"
        assert pool.stats()["created"] == 2 and server.num_connections == 2


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 70_000,  # no end of head in sight
        b"HTTP/2 200 OK\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-Folded: a\r\n b\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: " + b"9" * 3000 + b"\r\n\r\n",
    ],
    ids=[
        "huge-head",
        "endless-head",
        "version",
        "status",
        "two-lengths",
        "negative-length",
        "obs-fold",
        "no-colon",
        "hex-prefix",
        "chunk-no-crlf",
        "upgrade",
        "length-and-chunked",
        "endless-length",
    ],
)
async def test_malformed_responses_abort(pool: UpstreamPool, answer: bytes) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(answer)
        await wait_for_eof(reader)

    async with RawServer(serve) as server:
        with pytest.raises(UpstreamProtocolError):
            response = await get(pool, server.port)
            await response.read()
        assert pool.stats()["open"] == 0


async def test_flow_control_bounds_the_buffer(pool: UpstreamPool) -> None:
    body_bytes = 32 * 1024 * 1024  # more than loopback socket buffers hold, so the server must wait for the client
    piece = bytes(range(256)) * 1024
    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writers.append(writer)
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {body_bytes}\r\n\r\n".encode())
        for _ in range(body_bytes // len(piece)):
            writer.write(piece)
        await writer.drain()
        await read_request(reader)

    async with RawServer(serve) as server:
        response = await get(pool, server.port)
        (conn,) = pool._open
        await poll(lambda: conn.is_paused)
        assert len(conn.buffer) <= 1024 * 1024 + 256 * 1024
        assert writers[0].transport.get_write_buffer_size() > 0  # the rest waits in the server, not in the router
        total = 0
        async for chunk in response:
            assert chunk[:1] in (b"", bytes([total % 256]))
            total += len(chunk)
        assert total == body_bytes and pool.stats()["idle"] == 1


# --- failures ------------------------------------------------------------------------------------------------


async def test_connect_refused_fails_fast(pool: UpstreamPool) -> None:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(UpstreamConnectError):
        await get(pool, port)
    assert time.monotonic() - started < 1.0
    assert pool.stats()["open"] == 0


async def test_idle_connection_closed_by_server_is_replaced(pool: UpstreamPool) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(ok())  # keep-alive, as far as the client knows; then the server's idle timeout strikes

    async with RawServer(serve) as server:
        assert await (await get(pool, server.port)).read() == b"ok"
        await poll(lambda: pool.stats()["open"] == 0)  # the client noticed the close while the connection was idle
        assert await (await get(pool, server.port)).read() == b"ok"
        stats = pool.stats()
        assert (stats["created"], stats["reused"], stats["retried"]) == (2, 0, 0)


def linger_reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST instead of FIN."""
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@pytest.mark.parametrize("is_reset", [False, True], ids=["eof", "reset"])
async def test_stale_reused_connection_is_retried_once(pool: UpstreamPool, is_reset: bool) -> None:
    requests_seen: list[tuple[int, bytes]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        while (request := await read_request(reader)) is not None:
            requests_seen.append((number, request[2]))
            if number == 1 and len(requests_seen) == 2:  # closed while idle, as the request was on its way
                if is_reset:
                    linger_reset(writer)
                return
            writer.write(ok(request[2]))

    async with RawServer(serve) as server:
        for body in (b"one", b"two", b"three"):
            response = await pool.request("POST", HOST, server.port, "/", [], body)
            assert await response.read() == body
        assert requests_seen == [(1, b"one"), (1, b"two"), (2, b"two"), (2, b"three")]
        assert pool.stats() == {"open": 1, "idle": 1, "created": 2, "reused": 2, "retried": 1}


async def test_on_sent_runs_once_before_the_loop_moves_on(pool: UpstreamPool) -> None:
    """`on_sent` runs once per request: after the write on a kept-alive connection, before connecting on a new
    one, and not again when a stale connection's request is retried; always before another task runs."""
    events: list[str] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        while (request := await read_request(reader)) is not None:
            events.append(f"served {request[2].decode()}")
            if number == 1 and request[2] == b"two":
                return  # the kept-alive connection dies with the second request on it: a stale retry
            writer.write(ok(request[2]))

    async def other_task() -> None:
        events.append("other task")

    async with RawServer(serve) as server:
        for body in (b"one", b"two", b"three"):
            other = asyncio.ensure_future(other_task())  # runs at the request's first suspension
            sent = f"sent {body.decode()}"
            response = await pool.request(
                "POST", HOST, server.port, "/", [], body, on_sent=lambda s=sent: events.append(s)
            )
            assert await response.read() == body
            await other
    assert events == [
        "sent one",  # a new connection: before connecting
        "other task",
        "served one",
        "sent two",  # written on the kept-alive connection, which dies
        "other task",
        "served two",
        "served two",  # retried on a fresh connection, without a second `on_sent`
        "sent three",
        "other task",
        "served three",
    ]
    assert pool.stats()["retried"] == 1


async def test_fresh_connection_dying_is_not_retried(pool: UpstreamPool) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        if number == 1:
            await read_request(reader)
            writer.write(ok())
        await read_request(reader)  # then close without an answer

    async with RawServer(serve) as server:
        assert await (await get(pool, server.port)).read() == b"ok"
        with pytest.raises(UpstreamDisconnected):
            await get(pool, server.port)  # stale on connection 1, retried once on connection 2, which dies too
        assert server.num_connections == 2 and pool.stats()["retried"] == 1
        with pytest.raises(UpstreamDisconnected):
            await get(pool, server.port)  # a fresh connection: no retry
        assert server.num_connections == 3 and pool.stats()["retried"] == 1
        assert pool.stats()["open"] == 0


async def test_server_closes_mid_body(pool: UpstreamPool) -> None:
    answers = {
        1: b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789",
        2: b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
        3: b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n",
    }

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        await read_request(reader)
        writer.write(answers[number])
        await writer.drain()
        if number == 3:
            linger_reset(writer)

    async with RawServer(serve) as server:
        with pytest.raises(UpstreamDisconnected):
            await (await get(pool, server.port)).read()
        chunks = []
        with pytest.raises(UpstreamDisconnected):
            async for chunk in await get(pool, server.port):
                chunks.append(chunk)
        assert chunks == [b"hello"]
        with pytest.raises(UpstreamDisconnected):
            await (await get(pool, server.port)).read()
        assert pool.stats()["open"] == 0


async def test_read_timeouts(pool: UpstreamPool) -> None:
    pool.read_timeout_s = 0.1
    client_gone = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        await read_request(reader)
        if number == 2:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01234")  # then stalls mid-body
        if await wait_for_eof(reader):
            client_gone.set()

    async with RawServer(serve) as server:
        with pytest.raises(UpstreamTimeout) as raised:
            await get(pool, server.port)
        assert isinstance(raised.value, TimeoutError)
        await asyncio.wait_for(client_gone.wait(), 3)
        response = await get(pool, server.port)
        with pytest.raises(UpstreamTimeout):
            await response.read()
        assert pool.stats()["open"] == 0


async def hello(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def test_cancel_mid_stream_aborts_the_connection(pool: UpstreamPool, aiohttp_server: AiohttpServer) -> None:
    got_first = asyncio.Event()
    handler_cancelled = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: 1\n\n")
        try:
            await asyncio.wait_for(asyncio.Event().wait(), 5)
        except asyncio.CancelledError:
            handler_cancelled.set()
            raise
        return response

    responses: list[UpstreamResponse] = []  # held, so that the abort is iter_chunks' doing and not the GC's

    async def consume(port: int) -> None:
        responses.append(await pool.request("POST", HOST, port, "/stream", [], b"{}"))
        async for _ in responses[0]:
            got_first.set()

    app = web.Application()
    app.router.add_post("/stream", handler)
    app.router.add_get("/", hello)
    port = await start_app(aiohttp_server, app)
    task = asyncio.create_task(consume(port))
    await asyncio.wait_for(got_first.wait(), 3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(handler_cancelled.wait(), 3)
    assert pool.stats()["open"] == 0 and pool.stats()["idle"] == 0
    assert await (await get(pool, port)).read() == b"ok"
    assert pool.stats()["created"] == 2 and pool.stats()["reused"] == 0


async def test_cancel_before_the_head_and_dropped_response(pool: UpstreamPool) -> None:
    eofs = 0
    eof_seen = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        nonlocal eofs
        await read_request(reader)
        if number == 2:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01234")
        if await wait_for_eof(reader):
            eofs += 1
            eof_seen.set()

    async with RawServer(serve) as server:
        task = asyncio.create_task(get(pool, server.port))
        await poll(lambda: server.num_connections == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(eof_seen.wait(), 3)
        response: UpstreamResponse | None = await get(pool, server.port)
        del response  # never read nor closed: the connection must not outlive it
        gc.collect()
        await poll(lambda: eofs == 2)
        assert pool.stats()["open"] == 0


async def test_idle_timeout_closes_idle_connections() -> None:
    pool = UpstreamPool(idle_timeout_s=0.05)
    async with RawServer(serve_forever(ok())) as server:
        try:
            assert await (await get(pool, server.port)).read() == b"ok"
            assert pool.stats()["idle"] == 1
            await poll(lambda: pool.stats()["open"] == 0)
        finally:
            await pool.close()


async def test_request_headers_are_framed_by_the_pool(pool: UpstreamPool) -> None:
    heads: list[tuple[str, dict[str, str], bytes]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while (request := await read_request(reader)) is not None:
            heads.append(request)
            writer.write(ok())

    async with RawServer(serve) as server:
        headers = [("Host", "evil"), ("content-length", "999"), ("Transfer-Encoding", "chunked"), ("X-A", "1")]
        await (await pool.request("POST", HOST, server.port, "/p", headers, b"abc")).read()
        line, seen, body = heads[0]
        assert line == "POST /p HTTP/1.1" and body == b"abc"
        assert seen == {"host": f"{HOST}:{server.port}", "content-length": "3", "x-a": "1"}
        await (await get(pool, server.port)).read()
        assert "content-length" not in heads[1][1]
        for bad in ([("X-A", "1\r\nX-Injected: 1")], [("X-A\r\n", "1")]):
            with pytest.raises(ValueError):
                await pool.request("GET", HOST, server.port, "/", bad, b"")
        with pytest.raises(ValueError):
            await pool.request("GET", HOST, server.port, "/ HTTP/1.1\r\nX: y", [], b"")
        assert pool.stats()["created"] == 1


async def test_close_pool_fails_in_flight_requests() -> None:
    pool = UpstreamPool()
    received = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        received.set()
        await wait_for_eof(reader)

    async with RawServer(serve) as server:
        task = asyncio.create_task(get(pool, server.port))
        # In flight means sent: with the connection merely open, the request may still be on its way into the pool,
        # and a closed pool refuses it (UpstreamError) rather than cutting it off.
        await asyncio.wait_for(received.wait(), timeout=5)
        await pool.close()
        with pytest.raises(UpstreamDisconnected):
            await task
        with pytest.raises(UpstreamError):
            await get(pool, server.port)
        assert pool.stats()["open"] == 0


async def test_close_at_any_point_of_a_request_fails_it_cleanly_under_a_busy_loop() -> None:
    """Close races every stage of a request (entering the pool, connecting, writing, waiting for the head, reading
    the body) while other tasks keep the loop busy: each request either completes or fails with an UpstreamError,
    none hangs, and no connection outlives close."""
    outcomes: dict[str, int] = {}

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while (request := await read_request(reader)) is not None:
            await asyncio.sleep(0)
            writer.write(ok(request[2]))

    async def busy(stop: asyncio.Event) -> None:
        while not stop.is_set():
            held_until = time.perf_counter() + 0.0002
            while time.perf_counter() < held_until:  # holds the loop, as a parse or a decision does
                pass
            await asyncio.sleep(0)

    async with RawServer(serve) as server:
        stop = asyncio.Event()
        busy_tasks = [asyncio.create_task(busy(stop)) for _ in range(2)]
        try:
            for i in range(150):
                pool = UpstreamPool()
                if i % 2:
                    await (await get(pool, server.port)).read()  # a kept-alive connection to reuse
                tasks = [asyncio.create_task(get(pool, server.port)) for _ in range(3)]
                for _ in range(i % 12):  # close after a varying number of loop turns
                    await asyncio.sleep(0)
                await pool.close()
                for task in tasks:
                    try:
                        response = await asyncio.wait_for(task, timeout=5)
                        await asyncio.wait_for(response.read(), timeout=5)
                        kind = "completed"
                    except UpstreamError as exc:
                        kind = type(exc).__name__
                    outcomes[kind] = outcomes.get(kind, 0) + 1
                assert pool.stats()["open"] == 0, f"iteration {i}: a connection outlived close"
                with pytest.raises(UpstreamError):
                    await get(pool, server.port)
        finally:
            stop.set()
            await asyncio.gather(*busy_tasks)
    assert outcomes.get("UpstreamError", 0) and outcomes.get("UpstreamDisconnected", 0), outcomes  # both stages raced


# --- uvloop --------------------------------------------------------------------------------------------------


def test_main_paths_under_uvloop() -> None:
    async def main() -> None:
        release_second = asyncio.Event()
        big_bytes = 32 * 1024 * 1024
        piece = bytes(range(256)) * 1024
        chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
            while (request := await read_request(reader)) is not None:
                if request[0].startswith("POST /stream"):
                    writer.write(chunked + b"3\r\none\r\n")
                    await release_second.wait()
                    writer.write(b"3\r\ntwo\r\n0\r\n\r\n")
                elif request[0].startswith("GET /die") and number == 1:
                    return  # the stale keep-alive connection
                elif request[0].startswith("GET /big"):
                    writer.write(b"HTTP/1.1 200 OK\r\n\r\n")  # until EOF
                    for _ in range(big_bytes // len(piece)):
                        writer.write(piece)
                    await writer.drain()
                    return
                else:
                    writer.write(ok(request[2]))

        pool = UpstreamPool(read_timeout_s=5.0)
        async with RawServer(serve) as server:
            try:
                for i in range(100):
                    response = await pool.request("POST", HOST, server.port, "/", [], b"%d" % i)
                    assert await response.read() == b"%d" % i
                response = await pool.request("POST", HOST, server.port, "/stream", [], b"")
                chunks = response.iter_chunks()
                assert await anext(chunks) == b"one"
                release_second.set()
                assert [chunk async for chunk in chunks] == [b"two"]
                assert await (await get(pool, server.port, target="/die")).read() == b""
                assert pool.stats() == {"open": 1, "idle": 1, "created": 2, "reused": 101, "retried": 1}
                response = await get(pool, server.port, target="/big")
                conn = next(c for c in pool._open if not c.is_idle)
                await poll(lambda: conn.is_paused)
                assert len(conn.buffer) <= 1024 * 1024 + 256 * 1024
                assert await response.read() == piece * (big_bytes // len(piece))
                assert pool.stats()["open"] == 0  # a body delimited by EOF ends its connection
            finally:
                await pool.close()

    uvloop.run(main())
