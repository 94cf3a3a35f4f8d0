"""Inputs that once dropped a connection, answered 500 or waited for a timeout, against a running router over a real
socket: each gets a clean 4xx at once, reaches no replica, logs one line, and leaves the router serving."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
from typing import Any

import pytest

from router.service.settings import LimitSettings
from tests.fakes import FakeReplica
from tests.integration.conftest import MODEL, RouterHandle, StartFakes, StartRouter, unique_text

pytestmark = pytest.mark.integration


Answer = tuple[int, dict[str, str], Any]


async def answers(router: RouterHandle, data: bytes, *, timeout_s: float = 3.0) -> list[Answer]:
    """Every answer to `data` on one connection, until the router closes it; fails on silence past `timeout_s`."""
    host, port = router.server.address
    reader, writer = await asyncio.open_connection(host, port)
    got: list[Answer] = []
    try:
        writer.write(data)
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError as exc:
                    assert exc.partial == b"", exc.partial
                    return got
                lines = head.decode("latin-1").split("\r\n")
                headers = {}
                for line in lines[1:]:
                    if line:
                        name, _, value = line.partition(":")
                        headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                got.append((int(lines[0].split()[1]), headers, json.loads(body) if body else None))
    finally:
        writer.close()


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return b"POST %b HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%b\r\n%b" % (
        path.encode(),
        len(body),
        extra,
        body,
    )


@pytest.fixture
async def fake_and_router(start_fakes: StartFakes, start_router: StartRouter) -> tuple[FakeReplica, RouterHandle]:
    (fake,) = await start_fakes(1)
    router = await start_router([fake], limits=LimitSettings(header_read_timeout_s=30.0, shutdown_grace_s=2.0))
    return fake, router


def inference_count(fake: FakeReplica) -> int:
    return sum(n for path, n in fake.requests_by_path.items() if path.startswith("/v1/") and path != "/v1/models")


CLOSE_AT_ONCE = [
    ("non-ascii-path", b"GET /v1/mod\xc3\xa9ls HTTP/1.1\r\nHost: r\r\n\r\n", 400),
    ("long-length", b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: " + b"7" * 4000 + b"\r\n\r\n{}", 400),
    ("bare-lf", b"POST /v1/completions HTTP/1.1\nHost: r\nContent-Length: 2\n\n{}", 400),
    ("tls-hello", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64), 400),
    ("http-0.9", b"GET /v1/models\r\n", 400),
    ("expect-not-utf8", post("/v1/completions", b"{}", b"Expect: \xc3\x28\xa0\r\n"), 417),
]


@pytest.mark.parametrize(("name", "data", "status"), CLOSE_AT_ONCE, ids=[c[0] for c in CLOSE_AT_ONCE])
async def test_broken_heads_are_answered_at_once_and_closed(
    fake_and_router: tuple[FakeReplica, RouterHandle], name: str, data: bytes, status: int
) -> None:
    fake, router = fake_and_router
    loop = asyncio.get_running_loop()
    started = loop.time()
    got = await answers(router, data)  # a header timeout of 30 s: an answer within 3 s is not the timeout's
    assert loop.time() - started < 2.0
    assert [(s, h.get("connection")) for s, h, _ in got] == [(status, "close")], name
    assert set(got[0][2]["error"]) == {"message", "type", "param", "code"}
    assert inference_count(fake) == 0
    assert (await router.complete("still serving")).status == 200


def chat_body(kind: str, value: Any) -> bytes:
    message: dict[str, Any] = {"role": "user", "content": "hi"}
    body: dict[str, Any] = {"model": MODEL, "messages": [message]}
    if kind == "tools":
        body["tools"] = value
    elif kind == "content_part":
        message["content"] = [{"type": "image_url", "image_url": value}]
    else:
        message["role"] = "assistant"
        message["tool_calls"] = value
    return json.dumps(body).encode()


def deep_json(kind: str, depth: int) -> bytes:
    """A chat body with a list nested `depth` deep in `kind`, written by hand (json.dumps would recurse)."""
    return chat_body(kind, "__deep__").replace(b'"__deep__"', b"[" * depth + b'"x"' + b"]" * depth)


@pytest.mark.parametrize("kind", ["tools", "content_part", "tool_calls"])
async def test_json_nested_a_thousand_deep_is_400(fake_and_router: tuple[FakeReplica, RouterHandle], kind: str) -> None:
    fake, router = fake_and_router
    got = await answers(router, post("/v1/chat/completions", deep_json(kind, 1000), b"Connection: close\r\n"))
    assert [s for s, _, _ in got] == [400]
    assert got[0][2]["error"]["type"] == "invalid_request_error"
    assert inference_count(fake) == 0


@pytest.mark.parametrize("size", ["small", "decoded on a thread"])
async def test_a_body_labelled_gzip_that_is_not_is_400(
    fake_and_router: tuple[FakeReplica, RouterHandle], size: str
) -> None:
    fake, router = fake_and_router
    not_gzip = b"{not gzip}" * (1 if size == "small" else 4000)  # 40 KB: past the 16 KiB decoded on the loop
    prompt = "zipped" if size == "small" else unique_text(200_000)
    good = gzip.compress(json.dumps({"model": MODEL, "prompt": prompt}).encode())
    data = post("/v1/completions", not_gzip, b"Content-Encoding: gzip\r\n") + post(
        "/v1/completions", good, b"Content-Encoding: gzip\r\nConnection: close\r\n"
    )
    got = await answers(router, data)
    assert [s for s, _, _ in got] == [400, 200]  # and the connection served the next request
    assert got[0][2]["error"]["code"] == "invalid_encoding"
    assert inference_count(fake) == 1


async def test_a_gzip_bomb_decoded_on_a_thread_is_413_at_the_body_limit(
    fake_and_router: tuple[FakeReplica, RouterHandle],
) -> None:
    fake, router = fake_and_router
    bomb = gzip.compress(b" " * (40 * 1024 * 1024))  # 40 KB that decode to 40 MiB, past the 32 MiB body limit
    assert len(bomb) > 16 * 1024
    got = await answers(router, post("/v1/completions", bomb, b"Content-Encoding: gzip\r\nConnection: close\r\n"))
    assert [s for s, _, _ in got] == [413]
    assert "SHOAL_ROUTER_LIMITS__MAX_BODY_BYTES" in got[0][2]["error"]["message"]
    assert inference_count(fake) == 0


async def test_a_non_utf8_authorization_is_401(fake_and_router: tuple[FakeReplica, RouterHandle]) -> None:
    _, router = fake_and_router
    data = b"GET /admin/replicas HTTP/1.1\r\nHost: r\r\nAuthorization: Bearer \xff\xfe\r\nConnection: close\r\n\r\n"
    got = await answers(router, data)
    assert [s for s, _, _ in got] == [401]
    assert got[0][2]["error"]["type"] == "authentication_error"


async def test_a_valid_request_pipelined_before_a_malformed_one_is_answered(
    fake_and_router: tuple[FakeReplica, RouterHandle],
) -> None:
    fake, router = fake_and_router
    good = post("/v1/completions", json.dumps({"model": MODEL, "prompt": "first"}).encode())
    got = await answers(router, good + b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 1 2\r\n\r\n")
    assert [(s, h.get("connection")) for s, h, _ in got] == [(200, None), (400, "close")]
    assert inference_count(fake) == 1


async def test_a_slow_head_gets_408_within_the_header_timeout(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    router = await start_router(await start_fakes(1), limits=LimitSettings(header_read_timeout_s=0.3))
    loop = asyncio.get_running_loop()
    started = loop.time()
    got = await answers(router, b"GET /health HTTP/1.1\r\nHost: r")
    assert [(s, h.get("connection")) for s, h, _ in got] == [(408, "close")]
    assert 0.3 <= loop.time() - started < 2.0


async def test_malformed_requests_log_one_line_each(
    fake_and_router: tuple[FakeReplica, RouterHandle], caplog: pytest.LogCaptureFixture
) -> None:
    _, router = fake_and_router
    with caplog.at_level(logging.DEBUG, logger="shoal"):
        for _, data, _ in CLOSE_AT_ONCE:
            await answers(router, data)
    records = [r for r in caplog.records if r.name.startswith("shoal")]
    assert len(records) == len(CLOSE_AT_ONCE)
    assert all(r.exc_info is None and "\n" not in r.getMessage() for r in records)


async def test_chunked_trailers_are_bounded_as_a_head_is(fake_and_router: tuple[FakeReplica, RouterHandle]) -> None:
    fake, router = fake_and_router
    body = json.dumps({"model": MODEL, "prompt": "x"}).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    chunked = b"%x\r\n%b\r\n0\r\n" % (len(body), body)
    # One small trailer is legal and served; 8 MB of them is refused at the head's limit, long before its end.
    got = await answers(router, head + chunked + b"X-Check: 1\r\n\r\n" + head + chunked + b"X-Pad: " + b"a" * (8 << 20))
    assert [(s, h.get("connection")) for s, h, _ in got] == [(200, None), (431, "close")]
    assert inference_count(fake) == 1
    # Many small trailer lines arriving with the end of the message in the same read are counted too.
    for lines in (7_000, 9_000, 16_000, 20_000, 40_000):  # 83 KB to 520 KB
        many = b"".join(b"X-T%d: v\r\n" % i for i in range(lines))
        got = await answers(router, head + chunked + many + b"\r\n")
        assert [s for s, _, _ in got] == [431], lines
    assert inference_count(fake) == 1


async def test_a_request_after_a_large_body_in_the_same_read_is_no_431(
    fake_and_router: tuple[FakeReplica, RouterHandle],
) -> None:
    fake, router = fake_and_router
    big = post("/v1/completions", json.dumps({"model": MODEL, "prompt": "y" * 100_000}).encode())
    small = post("/v1/completions", json.dumps({"model": MODEL, "prompt": "z"}).encode(), b"Connection: close\r\n")
    got = await answers(router, big + small, timeout_s=10)
    assert [s for s, _, _ in got] == [200, 200]
    assert inference_count(fake) == 2


async def test_a_zero_padded_content_length_is_read_as_its_value(
    fake_and_router: tuple[FakeReplica, RouterHandle],
) -> None:
    fake, router = fake_and_router
    body = json.dumps({"model": MODEL, "prompt": "padded"}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nConnection: close\r\n"
    got = await answers(router, head + b"Content-Length: %b%d\r\n\r\n%b" % (b"0" * 5000, len(body), body))
    assert [s for s, _, _ in got] == [200]  # 5,000 zeros once made int() refuse the digits: a 500
    assert inference_count(fake) == 1
