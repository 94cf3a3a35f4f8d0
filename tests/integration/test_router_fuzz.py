"""Fuzzed request heads and bodies (hypothesis) against a running router in front of a fake replica.

Each example sends one generated request, then a `GET /health` with `Connection: close`, on a fresh connection, and
reads until the router closes it. Held for every example: at least one answer before the close (no connection
dropped without an answer), every answer well-framed (parsed by llhttp), no 5xx that the router made itself (a 5xx
carrying `x-shoal-replica` is the replica's, 501 and 505 are refusals of what HTTP/1.1 lets a server refuse), and
the close within a deadline (the router's head and body timeouts are short here, so even a request that stops
midway is answered, with a 408). After all examples the router still serves, and holds no connection open.
"""

from __future__ import annotations

import asyncio
import json

import httptools
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.service.settings import LimitSettings
from tests.integration.conftest import MODEL, RouterHandle, StartFakes, StartRouter, eventually

pytestmark = pytest.mark.integration

MAX_EXAMPLES = 300
EXAMPLE_DEADLINE_S = 4.0
"""Per example: the router's timeouts below (0.3 s) plus a wide margin for a loaded machine."""
ROUTER_OWN_5XX_ALLOWED = frozenset({501, 505})
SENTINEL = b"GET /health HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n"

token = st.text(alphabet="!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", min_size=1)
raw_bytes = st.binary(max_size=40)
# Each part is valid most of the time (a branch repeated weighs more), so that most examples get past the parser
# and reach the proxy, the admin API and the replica, while every part is sometimes broken.
methods = st.one_of(
    st.just("POST"),
    st.just("POST"),
    st.just("POST"),
    st.just("GET"),
    st.sampled_from(["PUT", "DELETE", "OPTIONS", "PATCH", "CONNECT"]),
    token,
)
url_text = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-._~%/:@!$&'()*+,;=", max_size=12)
known_paths = st.sampled_from(
    [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/embeddings",
        "/health",
        "/ready",
        "/metrics",
        "/admin/replicas",
        "/admin/replicas/x/drain",
        "/admin/index",
        "/",
        "*",
        "http://router/v1/models",
    ]
)
paths = st.one_of(
    known_paths,
    known_paths,
    known_paths,
    st.builds(lambda p, q: "/" + p + q, url_text, st.sampled_from(["", "?a=1", "?%zz", "#f"])),
    st.builds(lambda p: "/" + p, st.text(max_size=8)),
)
versions = st.one_of(
    st.just("HTTP/1.1"),
    st.just("HTTP/1.1"),
    st.just("HTTP/1.1"),
    st.just("HTTP/1.1"),
    st.just("HTTP/1.0"),
    st.sampled_from(["HTTP/2.0", "HTTP/0.9", "HTTP/1.2", "http/1.1", ""]),
)
known_names = st.sampled_from(
    [
        "Content-Length",
        "Transfer-Encoding",
        "Content-Encoding",
        "Content-Type",
        "Expect",
        "Connection",
        "Upgrade",
        "Authorization",
        "Host",
        "X-Session-Id",
    ]
)
header_names = st.one_of(known_names, known_names, token)
known_values = st.sampled_from(
    [
        "0",
        "2",
        "99999999999999999999999",
        "chunked",
        "gzip",
        "gzip, chunked",
        "deflate",
        "br",
        "application/json",
        "text/plain",
        "100-continue",
        "close",
        "keep-alive",
        "upgrade",
        "websocket",
        "Bearer t",
        "Bearer wrong",
    ]
)
header_values = st.one_of(
    known_values,
    known_values,
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20),
    st.text(max_size=20),
)
json_leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=10))
json_values = st.recursive(
    json_leaves,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"])},
        optional={"content": st.one_of(st.text(max_size=30), json_values), "tool_calls": json_values},
    ),
    max_size=3,
)
json_bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.one_of(st.just(MODEL), st.just(MODEL), st.just(MODEL), json_values),
        "messages": st.one_of(messages, messages, messages, json_values),
        "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(), max_size=4), json_values),
        "max_tokens": st.one_of(st.integers(-1, 3), json_values),
        "stream": st.booleans(),
        "tools": json_values,
    },
).map(lambda body: json.dumps(body).encode())
bodies = st.one_of(json_bodies, raw_bytes, st.just(b""))
line_ends = st.sampled_from([b"\r\n"] * 8 + [b"\n", b"\r"])


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    """A request assembled from parts, each part valid or not, framed correctly or not."""
    end = draw(line_ends)
    version = draw(versions)
    line = f"{draw(methods)} {draw(paths)}{' ' + version if version else ''}".encode("utf-8", "surrogateescape")
    body = draw(bodies)
    fields = [
        (draw(header_names).encode(), draw(header_values).encode("utf-8", "surrogateescape"))
        for _ in range(draw(st.integers(0, 4)))
    ]
    if draw(st.sampled_from([True] * 9 + [False])):  # mostly the one Host an HTTP/1.1 request needs
        fields.insert(0, (b"Host", b"r"))
    framing = draw(st.sampled_from(["length", "length", "chunked", "none", "as-drawn"]))
    if framing == "length":
        fields.append((b"Content-Length", str(len(body)).encode()))
    elif framing == "chunked":
        fields.append((b"Transfer-Encoding", b"chunked"))
        body = (b"%x\r\n%b\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
    if draw(st.booleans()):
        fields.append((b"Content-Type", b"application/json"))
    head = line + end + b"".join(name + b": " + value + end for name, value in fields) + end
    if draw(st.sampled_from([False] * 19 + [True])):  # now and then, a stray byte anywhere
        at = draw(st.integers(0, len(head)))
        head = head[:at] + draw(st.binary(min_size=1, max_size=2)) + head[at:]
    return head + body


class _Answers:
    """httptools callbacks collecting each answer's status and headers."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[tuple[int, dict[str, str]]] = []
        self._headers: dict[str, str] = {}

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_message_complete(self) -> None:
        self.done.append((self.parser.get_status_code(), self._headers))
        self._headers = {}


async def exchange(router: RouterHandle, request: bytes) -> list[tuple[int, dict[str, str]]]:
    host, port = router.server.address
    reader, writer = await asyncio.open_connection(host, port)
    answers = _Answers()
    try:
        writer.write(request + SENTINEL)
        async with asyncio.timeout(EXAMPLE_DEADLINE_S):
            while data := await reader.read(65536):
                answers.parser.feed_data(data)  # raises on a badly framed answer
    except ConnectionResetError:
        pass  # the router closed with unread request bytes: answers already read still count
    finally:
        writer.close()
    return answers.done


@pytest.fixture
async def router(start_fakes: StartFakes, start_router: StartRouter) -> RouterHandle:
    limits = LimitSettings(
        max_body_bytes=64 * 1024, header_read_timeout_s=0.3, body_read_timeout_s=0.3, shutdown_grace_s=2.0
    )
    return await start_router(await start_fakes(1, num_output_tokens=2), limits=limits)


async def test_fuzzed_requests_are_answered_and_never_a_router_5xx(router: RouterHandle) -> None:
    loop = asyncio.get_running_loop()
    front = router.server.front
    assert front is not None
    num_before = len(front.connections)  # the test session's kept-alive ones

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,  # each example bounds itself (EXAMPLE_DEADLINE_S)
        derandomize=True,  # the same examples on every run, so `make test` is reproducible
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(request=requests())
    def check(request: bytes) -> None:
        # Hypothesis drives from a worker thread; each exchange runs on the router's own event loop.
        answers = asyncio.run_coroutine_threadsafe(exchange(router, request), loop).result(EXAMPLE_DEADLINE_S + 1)
        assert answers, f"connection closed without an answer to {request!r}"
        for status, headers in answers:
            is_own_5xx = status >= 500 and "x-shoal-replica" not in headers and status not in ROUTER_OWN_5XX_ALLOWED
            assert not is_own_5xx, (status, request)

    await asyncio.to_thread(check)
    await eventually(
        lambda: len(front.connections) <= num_before and front.num_busy == 0, what="every fuzzing connection closed"
    )
    reply = await router.complete("after the fuzz", max_tokens=2)
    assert reply.status == 200 and reply.replica
    assert (await router.request("GET", "/health")).status == 200
