"""Every malformed request gets an OpenAI-style 4xx error body, never a 500, and never reaches a replica."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from router.service.settings import LimitSettings
from tests.fakes import FakeReplica
from tests.integration.conftest import MODEL, Reply, RouterHandle, StartFakes, StartRouter

pytestmark = pytest.mark.integration


JSON = {"Content-Type": "application/json"}


def assert_openai_error(reply: Reply, status: int, code: str | None = None, param: str | None = None) -> None:
    assert reply.status == status, (reply.status, reply.body)
    assert reply.headers["Content-Type"].startswith("application/json")
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param


@pytest.fixture
async def fake_and_router(start_fakes: StartFakes, start_router: StartRouter) -> tuple[FakeReplica, RouterHandle]:
    (fake,) = await start_fakes(1)
    router = await start_router(
        [fake], limits=LimitSettings(max_body_bytes=4096, body_read_timeout_s=0.3, shutdown_grace_s=2.0)
    )
    return fake, router


def _inference_count(fake: FakeReplica) -> int:
    return sum(n for path, n in fake.requests_by_path.items() if path.startswith("/v1/") and path != "/v1/models")


BAD_BODIES: list[tuple[str, str, bytes, str | None, str | None]] = [
    # (name, path, raw body, expected code, expected param)
    ("malformed json", "/v1/completions", b'{"model": "shoal-demo", "prompt": ', "invalid_json", None),
    ("empty body", "/v1/completions", b"", "invalid_json", None),
    ("not utf-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', "invalid_json", None),
    ("json array", "/v1/completions", b'["prompt"]', "invalid_json", None),
    ("json string", "/v1/chat/completions", b'"hello"', "invalid_json", None),
    ("json null", "/v1/chat/completions", b"null", "invalid_json", None),
    ("deeply nested", "/v1/completions", b'{"prompt": ' + b"[" * 2000 + b"]" * 2000 + b"}", "invalid_json", None),
]

BAD_FIELDS: list[tuple[str, str, dict[str, Any], str | None]] = [
    # (name, path, body, expected param)
    ("missing prompt", "/v1/completions", {"model": MODEL}, "prompt"),
    ("prompt number", "/v1/completions", {"model": MODEL, "prompt": 42}, "prompt"),
    ("prompt object", "/v1/completions", {"model": MODEL, "prompt": {"text": "x"}}, "prompt"),
    ("prompt empty list", "/v1/completions", {"model": MODEL, "prompt": []}, "prompt"),
    ("prompt mixed list", "/v1/completions", {"model": MODEL, "prompt": ["a", 1]}, "prompt"),
    ("prompt float tokens", "/v1/completions", {"model": MODEL, "prompt": [1.5, 2]}, "prompt"),
    ("prompt bool tokens", "/v1/completions", {"model": MODEL, "prompt": [True, False]}, "prompt"),
    ("prompt negative token", "/v1/completions", {"model": MODEL, "prompt": [5, -1]}, "prompt"),
    ("prompt huge token", "/v1/completions", {"model": MODEL, "prompt": [2**40]}, "prompt"),
    ("prompt null", "/v1/completions", {"model": MODEL, "prompt": None}, "prompt"),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, "messages"),
    ("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("messages string", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, "messages"),
    ("message not object", "/v1/chat/completions", {"model": MODEL, "messages": ["hi"]}, "messages[0]"),
    ("message without role", "/v1/chat/completions", {"model": MODEL, "messages": [{"content": "x"}]}, None),
    ("role number", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": 1, "content": "x"}]}, None),
    ("content number", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, None),
    (
        "content part not object",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": [7]}]},
        None,
    ),
    ("model number", "/v1/completions", {"model": 7, "prompt": "x"}, "model"),
    ("model list", "/v1/chat/completions", {"model": ["a"], "messages": [{"role": "user", "content": "x"}]}, "model"),
]


async def test_malformed_bodies(fake_and_router: tuple[FakeReplica, RouterHandle]) -> None:
    fake, router = fake_and_router
    for name, path, raw, code, param in BAD_BODIES:
        reply = await router.request("POST", path, data=raw, headers=JSON)
        assert reply.status == 400, name
        assert_openai_error(reply, 400, code, param)
    assert _inference_count(fake) == 0


async def test_bad_fields(fake_and_router: tuple[FakeReplica, RouterHandle]) -> None:
    fake, router = fake_and_router
    for name, path, body, param in BAD_FIELDS:
        reply = await router.request("POST", path, json_body=body)
        assert reply.status == 400, (name, reply.body)
        assert_openai_error(reply, 400, param=param)
    assert _inference_count(fake) == 0


async def test_message_name_of_wrong_type(fake_and_router: tuple[FakeReplica, RouterHandle]) -> None:
    _, router = fake_and_router
    reply = await router.chat([{"role": "user", "name": 5, "content": "x"}])
    assert_openai_error(reply, 400)


async def test_wrong_content_type(fake_and_router: tuple[FakeReplica, RouterHandle]) -> None:
    fake, router = fake_and_router
    body = json.dumps({"model": MODEL, "prompt": "x"})
    for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}, {}):
        reply = await router.request("POST", "/v1/completions", data=body, headers=headers)
        assert_openai_error(reply, 400, "invalid_content_type")
    reply = await router.request(
        "POST", "/v1/completions", data=body, headers={"Content-Type": "application/json; charset=utf-8"}
    )
    assert reply.status == 200
    assert _inference_count(fake) == 1


async def test_unknown_model_is_404(fake_and_router: tuple[FakeReplica, RouterHandle]) -> None:
    fake, router = fake_and_router
    reply = await router.complete("x", model="no-such-model")
    assert_openai_error(reply, 404, "model_not_found", "model")
    reply = await router.chat([{"role": "user", "content": "x"}], model="no-such-model")
    assert_openai_error(reply, 404, "model_not_found", "model")
    assert _inference_count(fake) == 0


async def test_body_too_large_is_413(fake_and_router: tuple[FakeReplica, RouterHandle]) -> None:
    fake, router = fake_and_router
    big = json.dumps({"model": MODEL, "prompt": "x" * 5000}).encode()
    reply = await router.request("POST", "/v1/completions", data=big, headers=JSON)
    assert_openai_error(reply, 413, "request_too_large")
    message = reply.json()["error"]["message"]
    assert "SHOAL_ROUTER_LIMITS__MAX_BODY_BYTES" in message, message  # the setting that raises the limit

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the limit bites while reading
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    async with router.http.post(router.url + "/v1/chat/completions", data=chunked(), headers=JSON) as resp:
        reply = Reply(resp.status, dict(resp.headers), await resp.read())
    assert_openai_error(reply, 413, "request_too_large")
    reply = await router.request("POST", "/v1/embeddings", data=big, headers=JSON)
    assert_openai_error(reply, 413, "request_too_large")
    assert _inference_count(fake) == 0
    # Just under the limit is fine.
    reply = await router.complete("x" * 3000)
    assert reply.status == 200


async def raw_exchange(
    router: RouterHandle, head: bytes, first_bytes: bytes, timeout_s: float = 5.0
) -> tuple[int, Any]:
    """Send request headers and part of a body, then stall; return the status and JSON body of the answer."""
    port = int(router.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + first_bytes)
        await writer.drain()
        async with asyncio.timeout(timeout_s):
            status_line = await reader.readline()
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers["content-length"]))
        return int(status_line.split()[1]), json.loads(body)
    finally:
        writer.close()


async def test_slow_body_is_408(fake_and_router: tuple[FakeReplica, RouterHandle]) -> None:
    fake, router = fake_and_router
    loop = asyncio.get_running_loop()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings"):
        head = (
            f"POST {path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n"
        ).encode()
        started = loop.time()
        status, body = await raw_exchange(router, head, b'{"model": "shoal-demo", "prompt": "')
        elapsed_s = loop.time() - started
        assert status == 408, path
        assert body["error"]["code"] == "request_timeout"
        assert body["error"]["type"] == "invalid_request_error"
        assert 0.25 <= elapsed_s < 2.0, elapsed_s
    assert _inference_count(fake) == 0
    # The router still serves everyone else.
    assert (await router.complete("after the slow bodies")).status == 200


async def test_gzip_request_body_is_forwarded_decoded(fake_and_router: tuple[FakeReplica, RouterHandle]) -> None:
    fake, router = fake_and_router
    body = gzip.compress(json.dumps({"model": MODEL, "prompt": "zipped"}).encode())
    reply = await router.request("POST", "/v1/completions", data=body, headers={**JSON, "Content-Encoding": "gzip"})
    assert reply.status == 200, reply.body
    assert fake.received_bodies[-1] == {"model": MODEL, "prompt": "zipped"}
    assert "content-encoding" not in {k.lower() for k in fake.received_headers[-1]}


async def test_unknown_routes_and_admin_without_token(start_fakes: StartFakes, start_router: StartRouter) -> None:
    fakes = await start_fakes(1)
    router = await start_router(fakes, admin_token=None)
    for method, path in (("GET", "/nope"), ("POST", "/v2/completions"), ("GET", "/admin/replicas")):
        reply = await router.request(method, path)
        assert reply.status == 404, (method, path)
        assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
    reply = await router.request("POST", "/admin/replicas", json_body={"url": "http://127.0.0.1:1"})
    assert reply.status == 404
