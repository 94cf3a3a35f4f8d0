"""What the router's HTTP server (router/service/front.py) parses and what it refuses, on a real socket, with a
handler that records what it was given."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from router.service.front import FrontRequest, FrontServer
from router.service.settings import LimitSettings

MAX_BODY = 1000


class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[FrontRequest, bytes]] = []

    async def __call__(self, request: FrontRequest, body: bytes) -> web.Response:
        self.seen.append((request, body))
        return web.json_response({"path": request.path, "bytes": len(body)})


@pytest.fixture
async def served() -> AsyncIterator[tuple[FrontServer, Recorder]]:
    recorder = Recorder()
    server = FrontServer({("POST", "/v1/completions"): recorder}, recorder, LimitSettings(max_body_bytes=MAX_BODY))
    await server.start("127.0.0.1", 0)
    yield server, recorder
    await server.shutdown(1.0)


async def exchange(server: FrontServer, data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Every answer to `data` until the server closes the connection (or 0.5 s of silence after the last)."""
    reader, writer = await asyncio.open_connection(*server.addresses[0])
    answers = []
    try:
        writer.write(data)
        while True:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.5)
            except (asyncio.IncompleteReadError, TimeoutError):
                return answers
            lines = head.decode("latin-1").split("\r\n")
            headers = {}
            for line in lines[1:]:
                if line:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            answers.append((int(lines[0].split()[1]), headers, body))
            if headers.get("connection") == "close":
                assert await asyncio.wait_for(reader.read(), 2) == b""
                return answers
    finally:
        writer.close()


async def test_a_plain_request_is_parsed(served: tuple[FrontServer, Recorder]) -> None:
    server, recorder = served
    answers = await exchange(
        server,
        b"POST /v1/completions?a=1 HTTP/1.1\r\nHost: router\r\nContent-Type: Application/JSON; charset=utf-8\r\n"
        b"content-length: 2\r\nX-Tabbed:\tvalue with\ttabs \r\nX-Empty:\r\nX-Bytes: caf\xc3\xa9\r\n"
        b"Authorization: \xff\xfe\r\n\r\n{}",
    )
    assert [status for status, _, _ in answers] == [200]
    ((request, body),) = recorder.seen
    assert (request.method, request.path_qs, request.path, request.content_type) == (
        "POST",
        "/v1/completions?a=1",
        "/v1/completions",
        "application/json",
    )
    assert request.keep_alive and body == b"{}"
    assert request.headers["x-tabbed"] == "value with\ttabs" and request.headers["X-Empty"] == ""
    assert request.headers["x-bytes"] == "café"
    assert request.headers["authorization"].encode("utf-8", "surrogateescape") == b"\xff\xfe"
    assert list(request.headers) == [
        "Host",
        "Content-Type",
        "content-length",
        "X-Tabbed",
        "X-Empty",
        "X-Bytes",
        "Authorization",
    ]


async def test_connection_close_and_defaults(served: tuple[FrontServer, Recorder]) -> None:
    server, recorder = served
    answers = await exchange(
        server,
        b"GET /v1/models HTTP/1.1\r\nHost: r\r\n\r\n"
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 0\r\nConnection: keep-alive, Close\r\n\r\n"
        b"GET /never HTTP/1.1\r\nHost: r\r\n\r\n",
    )
    assert [(status, headers.get("connection")) for status, headers, _ in answers] == [(200, None), (200, "close")]
    (get, _), (post, _) = recorder.seen
    assert get.keep_alive and get.content_type == "application/octet-stream"  # as aiohttp reports a missing one
    assert not post.keep_alive


CHUNKED = (
    b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
)


@pytest.mark.parametrize(
    ("request_bytes", "body"),
    [
        (CHUNKED, b"abcde"),
        (b"POST /v1/completions HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}", b"{}"),
        (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n\r\n", b""),  # no length: an empty body (RFC 9112 6.3)
        (b"POST /v1/embeddings HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\n\r\nhi", b"hi"),  # the fallback's
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%b"
            % (len(gzip.compress(b"zipped")), gzip.compress(b"zipped")),
            b"zipped",
        ),
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Encoding: deflate\r\nContent-Length: %d\r\n\r\n%b"
            % (len(zlib.compress(b"deflated")), zlib.compress(b"deflated")),
            b"deflated",
        ),
        (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nUpgrade: websocket\r\nContent-Length: 2\r\n\r\n{}", b"{}"),
    ],
    ids=["chunked", "http-1.0", "no-length", "fallback", "gzip", "deflate", "upgrade-ignored"],
)
async def test_bodies_are_framed_and_decoded(
    served: tuple[FrontServer, Recorder], request_bytes: bytes, body: bytes
) -> None:
    server, recorder = served
    answers = await exchange(server, request_bytes)
    assert [status for status, _, _ in answers] == [200]
    assert [seen_body for _, seen_body in recorder.seen] == [body]


async def test_expect_100_continue_gets_its_interim_answer(served: tuple[FrontServer, Recorder]) -> None:
    server, recorder = served
    reader, writer = await asyncio.open_connection(*server.addresses[0])
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"{}")
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n"), 2)).startswith(b"HTTP/1.1 200")
    finally:
        writer.close()
    assert recorder.seen[0][1] == b"{}"


REFUSED = [
    # (request, status): each is refused at once, with Connection: close, and reaches no handler.
    (b"post /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\n\r\n{}", 400),  # methods are case-sensitive
    (b"POST http://router/v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\n\r\n{}", 400),  # absolute-form
    (
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        400,
    ),
    (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", 501),
    (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked, identity\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: +2\r\n\r\n{}", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2 3\r\n\r\n{}", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: \xef\xbc\x92\r\n\r\n{}", 400),  # a full-width digit
    (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: " + b"9" * 3000 + b"\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 1001\r\n\r\n", 413),  # over max_body_bytes
    (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\nBad Name: x\r\n\r\n{}", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length : 2\r\n\r\n{}", 400),
    (
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\nX: folded\r\n continued\r\n\r\n{}",
        400,
    ),  # obs-fold
    (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\nX: bare\nLF\r\n\r\n{}", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\nX: bare\rCR\r\n\r\n{}", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\nX: nul\x00\r\n\r\n{}", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\nno colon\r\n\r\n{}", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\n: no name\r\n\r\n{}", 400),
    (b"POST /v1/completions HTTP/1.1\nHost: r\nContent-Length: 2\n\n{}", 400),  # bare LF line ends
    (b"GET /v1/caf\xc3\xa9 HTTP/1.1\r\nHost: r\r\n\r\n", 400),  # a non-ASCII byte in the path
    (b"GET /\r\n", 400),  # HTTP/0.9
    (b"GET / HTTP/2.0\r\n\r\n", 505),
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400),  # an HTTP/2 preface
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 400),  # a TLS ClientHello
    (b"CONNECT router:443 HTTP/1.1\r\nHost: r\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\nExpect: 200-ok\r\n\r\n{}", 417),
    (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\nExpect: \xff\r\n\r\n{}", 417),
    (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\nContent-Encoding: br\r\n\r\n{}", 415),
    (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431),
]


@pytest.mark.parametrize(("request_bytes", "status"), REFUSED, ids=[str(i) for i in range(len(REFUSED))])
async def test_malformed_requests_are_refused_at_once(
    served: tuple[FrontServer, Recorder], request_bytes: bytes, status: int
) -> None:
    server, recorder = served
    loop = asyncio.get_running_loop()
    started = loop.time()
    answers = await exchange(server, request_bytes)
    assert loop.time() - started < 1.5  # not a timeout's answer
    assert [(answer[0], answer[1].get("connection")) for answer in answers] == [(status, "close")]
    error = json.loads(answers[0][2])["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert recorder.seen == []


@pytest.mark.parametrize(
    ("request_bytes", "message"),
    [
        (b"GET /v1/models HTTP/1.1\r\n\r\n", "no Host header"),
        (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", "no Host header"),
        (b"GET /v1/models HTTP/1.1\r\nHost: r\r\nHost: r\r\n\r\n", "several Host headers"),
        (b"GET /v1/models HTTP/1.1\r\nHost: a\r\nX: y\r\nhost: b\r\n\r\n", "several Host headers"),
        (b"GET /v1/models HTTP/1.0\r\nHost: a\r\nHost: b\r\n\r\n", "several Host headers"),
    ],
)
async def test_a_host_header_is_required_once(
    served: tuple[FrontServer, Recorder], request_bytes: bytes, message: str
) -> None:
    """RFC 9112 3.2: a server answers 400 to an HTTP/1.1 request without Host, and to any request with two."""
    server, recorder = served
    answers = await exchange(server, request_bytes)
    assert [(answer[0], answer[1].get("connection")) for answer in answers] == [(400, "close")]
    assert json.loads(answers[0][2])["error"]["message"].startswith(message)
    assert recorder.seen == []


async def test_one_host_even_empty_or_none_in_http_1_0_is_served(served: tuple[FrontServer, Recorder]) -> None:
    server, recorder = served
    requests = [
        b"GET /a HTTP/1.1\r\nHost: router.example:8000\r\n\r\n",
        b"GET /b HTTP/1.1\r\nHost:\r\n\r\n",  # empty: a target with no authority (RFC 9112 3.2)
        b"GET /c HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
        b"GET /d HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n",
    ]
    answers = await exchange(server, b"".join(requests))
    assert [answer[0] for answer in answers] == [200, 200, 200, 200]
    assert [request.path for request, _ in recorder.seen] == ["/a", "/b", "/c", "/d"]


@pytest.mark.parametrize(
    ("body", "status"),
    [(b"not gzip at all", 400), (gzip.compress(b"x")[:-6], 400), (gzip.compress(b"x" * (MAX_BODY + 1)), 413)],
    ids=["not-gzip", "truncated", "bomb"],
)
async def test_bad_encoded_bodies_are_refused_and_the_connection_kept(
    served: tuple[FrontServer, Recorder], body: bytes, status: int
) -> None:
    server, recorder = served
    request = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%b" % (
        len(body),
        body,
    )
    answers = await exchange(server, request + b"GET /after HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n")
    assert [answer[0] for answer in answers] == [status, 200]
    assert [request.path for request, _ in recorder.seen] == ["/after"]


async def test_valid_requests_before_a_malformed_one_are_answered(served: tuple[FrontServer, Recorder]) -> None:
    server, recorder = served
    good = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\n\r\n{}"
    answers = await exchange(
        server, good + good + b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: x\r\n\r\n"
    )
    assert [(answer[0], answer[1].get("connection")) for answer in answers] == [
        (200, None),
        (200, None),
        (400, "close"),
    ]
    assert len(recorder.seen) == 2


async def test_a_body_over_the_limit_while_chunked_is_413(served: tuple[FrontServer, Recorder]) -> None:
    server, recorder = served
    piece = b"%x\r\n%b\r\n" % (600, b"x" * 600)
    answers = await exchange(
        server, b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n" + piece * 2
    )
    assert [answer[0] for answer in answers] == [413]
    assert recorder.seen == []


def test_a_request_log_line_is_not_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        server = FrontServer({}, Recorder(), LimitSettings())
        await server.start("127.0.0.1", 0)
        try:
            for _ in range(3):
                await exchange(server, b"GET / HTTP/1.1\r\nHost: r\r\nContent-Length: x\r\n\r\n")
        finally:
            await server.shutdown(1.0)

    with caplog.at_level("DEBUG", logger="shoal.router"):
        asyncio.run(run())
    records = [r for r in caplog.records if r.name == "shoal.router"]
    assert len(records) == 3 and all(r.exc_info is None and "\n" not in r.getMessage() for r in records)
