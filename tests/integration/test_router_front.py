"""The router's front (router/service/front.py) on raw sockets: every endpoint on one connection, keep-alive,
pipelining, framings other than Content-Length, malformed heads and timeouts."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web

from router.service.front import FrontRequest, FrontServer
from router.service.settings import LimitSettings
from tests.integration.conftest import MODEL, RouterHandle, StartFakes, StartRouter

pytestmark = pytest.mark.integration


def post(path: str, body: dict[str, Any], *, extra: str = "") -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n{extra}\r\n"
    )
    return head.encode() + data


def completion(prompt: str, max_tokens: int = 4) -> bytes:
    return post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer: status, headers (lower-case names), body (Content-Length or chunked)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                return status, headers, body
            body += chunk[:-2]
    return status, headers, await reader.readexactly(int(headers.get("content-length", "0")))


async def connect(router: RouterHandle) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = router.server.address
    return await asyncio.open_connection(host, port)


def num_served(router: RouterHandle) -> int:
    front = router.server.front
    assert front is not None
    return front.num_served


async def test_pipelined_requests_are_answered_in_order_on_one_connection(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    router = await start_router(await start_fakes(2))
    served = num_served(router)
    reader, writer = await connect(router)
    try:
        # Three requests in one write: each answer says how many tokens it generated.
        writer.write(completion("first", 1) + completion("second", 2) + completion("third", 3))
        for max_tokens in (1, 2, 3):
            status, headers, body = await read_answer(reader)
            assert status == 200, body
            assert headers["x-shoal-replica"] and headers["x-shoal-route-branch"]
            assert json.loads(body)["usage"]["completion_tokens"] == max_tokens
        # A streamed answer on the same connection comes chunked, and the connection is still usable after it.
        writer.write(
            post(
                "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
            )
        )
        status, headers, body = await read_answer(reader)
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        assert body.endswith(b"data: [DONE]\n\n")
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: router\r\n\r\n")
        status, _, body = await read_answer(reader)
        assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == [MODEL]
    finally:
        writer.close()
    assert num_served(router) == served + 5


async def test_a_request_arriving_in_pieces_is_served(start_fakes: StartFakes, start_router: StartRouter) -> None:
    router = await start_router(await start_fakes(1))
    served = num_served(router)
    reader, writer = await connect(router)
    try:
        request = completion("sent a few bytes at a time")
        for start in range(0, len(request), 7):  # the head's end, too, is split across writes
            writer.write(request[start : start + 7])
            await writer.drain()
        status, _, body = await read_answer(reader)
        assert status == 200, body
    finally:
        writer.close()
    assert num_served(router) == served + 1


async def test_every_endpoint_is_served_on_one_kept_alive_connection(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    router = await start_router(await start_fakes(1))
    served = num_served(router)
    reader, writer = await connect(router)
    try:
        writer.write(completion("first"))
        assert (await read_answer(reader))[0] == 200
        for path in ("/health", "/ready", "/metrics", "/admin/replicas", "/nope"):
            writer.write(f"GET {path} HTTP/1.1\r\nHost: router\r\nAuthorization: Bearer t\r\n\r\n".encode())
            status, headers, body = await read_answer(reader)
            assert status == (404 if path == "/nope" else 200), (path, body)
            assert "connection" not in headers
        writer.write(b"HEAD /health HTTP/1.1\r\nHost: router\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: 16" in head  # and no body follows
        writer.write(completion("after them"))
        status, headers, _ = await read_answer(reader)
        assert status == 200 and headers["x-shoal-replica"]
    finally:
        writer.close()
    assert num_served(router) == served + 8


CHUNKED = json.dumps({"model": MODEL, "prompt": "chunked"}).encode()
EXPECT = json.dumps({"model": MODEL, "prompt": "expect"}).encode()


@pytest.mark.parametrize(
    "request_bytes",
    [
        # A chunked body, and one announced with 100-continue: the front reads them, then the proxy routes them.
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked"
        b"\r\n\r\n%x\r\n%b\r\n0\r\n\r\n" % (len(CHUNKED), CHUNKED),
        b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nExpect: 100-continue"
        b"\r\nContent-Length: %d\r\n\r\n%b" % (len(EXPECT), EXPECT),
    ],
    ids=["chunked", "expect"],
)
async def test_chunked_and_expect_continue_bodies_are_routed(
    start_fakes: StartFakes, start_router: StartRouter, request_bytes: bytes
) -> None:
    router = await start_router(await start_fakes(1))
    reader, writer = await connect(router)
    try:
        writer.write(request_bytes)
        status, headers, body = await read_answer(reader)
        if status == 100:  # Expect: 100-continue is answered before the final answer
            status, headers, body = await read_answer(reader)
        assert status == 200, body
        assert headers["x-shoal-replica"]
    finally:
        writer.close()


@pytest.mark.parametrize(
    "head",
    [
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: abc\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nBad Header: x\r\n\r\n",
    ],
    ids=["length-not-a-number", "two-lengths", "space-in-a-name"],
)
async def test_malformed_heads_get_400_and_close(
    start_fakes: StartFakes, start_router: StartRouter, head: bytes
) -> None:
    (fake,) = await start_fakes(1)
    router = await start_router([fake])
    reader, writer = await connect(router)
    try:
        writer.write(head)
        status, headers, _ = await read_answer(reader)
        assert status == 400 and headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 5) == b""
    finally:
        writer.close()
    assert "/v1/completions" not in fake.requests_by_path


async def test_slow_heads_get_408_and_idle_connections_close(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    limits = LimitSettings(header_read_timeout_s=0.2, keepalive_timeout_s=0.3, shutdown_grace_s=2.0)
    router = await start_router(await start_fakes(1), limits=limits)
    loop = asyncio.get_running_loop()
    reader, writer = await connect(router)
    try:
        started = loop.time()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: rou")
        status, _, body = await read_answer(reader)
        assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
        assert 0.2 <= loop.time() - started < 2.0
        assert await asyncio.wait_for(reader.read(), 5) == b""  # and the connection is closed
    finally:
        writer.close()
    reader, writer = await connect(router)
    try:
        started = loop.time()  # the idle clock starts once the answer is written, after this
        writer.write(completion("then idle"))
        assert (await read_answer(reader))[0] == 200
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert 0.3 <= loop.time() - started < 2.0
    finally:
        writer.close()


async def test_connection_close_is_honoured(start_fakes: StartFakes, start_router: StartRouter) -> None:
    router = await start_router(await start_fakes(1))
    reader, writer = await connect(router)
    try:
        writer.write(post("/v1/completions", {"model": MODEL, "prompt": "last"}, extra="Connection: close\r\n"))
        status, headers, _ = await read_answer(reader)
        assert status == 200 and headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 5) == b""
    finally:
        writer.close()


async def test_a_handler_that_fails_answers_500_and_closes_the_connection() -> None:
    async def failing(request: FrontRequest, body: bytes) -> web.StreamResponse:
        raise RuntimeError("a bug in the handler")

    async def other(request: FrontRequest, body: bytes) -> web.Response:
        return web.Response(text="other")

    front = FrontServer({("POST", "/v1/completions"): failing}, other, LimitSettings())
    await front.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection(*front.addresses[0])
        try:
            writer.write(completion("fails") + completion("never read"))
            status, headers, body = await read_answer(reader)
            assert status == 500 and headers["connection"] == "close"
            assert json.loads(body)["error"]["type"] == "server_error"
            assert await asyncio.wait_for(reader.read(), 5) == b""
        finally:
            writer.close()
    finally:
        await front.shutdown(1.0)
    assert front.num_served == 1
