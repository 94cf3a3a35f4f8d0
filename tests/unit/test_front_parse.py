"""What the router's front accepts to serve itself: everything else is aiohttp's (router/service/front.py)."""

from __future__ import annotations

from typing import Any

import pytest

from router.service.front import parse_head

MAX_BODY = 1000


async def _handler(request: Any, body: bytes) -> Any:  # pragma: no cover - never called here
    raise AssertionError


ROUTES = {("POST", "/v1/completions"): _handler, ("GET", "/v1/models"): _handler}


def parse(head: bytes) -> Any:
    buffer = head + b"\r\n\r\n"
    return parse_head(buffer, len(head), ROUTES, MAX_BODY)


def test_a_plain_request_is_parsed() -> None:
    head = parse(
        b"POST /v1/completions?a=1 HTTP/1.1\r\nHost: router\r\nContent-Type: Application/JSON; charset=utf-8\r\n"
        b"content-length: 12\r\nX-Tabbed:\tvalue with\ttabs \r\nX-Empty:\r\nX-Bytes: caf\xc3\xa9"
    )
    assert head is not None
    assert (head.method, head.target, head.content_length, head.content_type) == (
        "POST",
        "/v1/completions?a=1",
        12,
        "application/json",
    )
    assert head.keep_alive and head.handler is _handler
    assert head.headers["x-tabbed"] == "value with\ttabs" and head.headers["X-Empty"] == ""
    assert head.headers["x-bytes"] == "café"
    assert list(head.headers) == ["Host", "Content-Type", "content-length", "X-Tabbed", "X-Empty", "X-Bytes"]
    assert head.end == len(b"POST /v1/completions?a=1 HTTP/1.1") + 4 + len(
        b"\r\nHost: router\r\nContent-Type: Application/JSON; charset=utf-8\r\ncontent-length: 12\r\n"
        b"X-Tabbed:\tvalue with\ttabs \r\nX-Empty:\r\nX-Bytes: caf\xc3\xa9"
    )


def test_connection_close_and_defaults() -> None:
    head = parse(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 0\r\nConnection: keep-alive, Close")
    assert head is not None and not head.keep_alive
    assert head.content_type == "application/octet-stream"  # as aiohttp reports a missing Content-Type
    get = parse(b"GET /v1/models HTTP/1.1\r\nHost: r")
    assert get is not None and get.content_length == 0


@pytest.mark.parametrize(
    "head",
    [
        b"POST /v1/completions HTTP/1.0\r\nContent-Length: 2",  # HTTP/1.0 keep-alive rules: aiohttp's
        b"post /v1/completions HTTP/1.1\r\nContent-Length: 2",  # methods are case-sensitive
        b"POST /v1/embeddings HTTP/1.1\r\nContent-Length: 2",  # not a front route
        b"GET /v1/completions HTTP/1.1",
        b"POST http://router/v1/completions HTTP/1.1\r\nContent-Length: 2",  # absolute-form
        b"POST  /v1/completions HTTP/1.1\r\nContent-Length: 2",
        b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nContent-Encoding: gzip",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nExpect: 100-continue",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nUpgrade: websocket",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: +2",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2 3",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: \xef\xbc\x92",  # a full-width digit
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 1001",  # over max_body_bytes
        b"POST /v1/completions HTTP/1.1\r\nHost: r",  # a POST without a length
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nBad Name: x",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length : 2",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nX: folded\r\n continued",  # obs-fold
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nX: bare\nLF",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nX: bare\rCR",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nX: nul\x00",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nno colon",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\n: no name",
    ],
)
def test_everything_else_is_left_to_aiohttp(head: bytes) -> None:
    assert parse(head) is None
