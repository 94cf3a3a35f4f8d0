"""A request of any legal size moves no other request's latency by more than 50 ms.

`shoal router` runs as a user runs it, in a process of its own, in front of two replicas: a fake replica in this
process's event loop takes a stream of small completions, one every 5 ms, each timed from when it was due
(`latency.py`); a plain HTTP server on a thread takes one large request (20 MB of token ids, 20 MB of chat text,
200,000 tools, 19 MB of token ids gzipped), sent from another thread, reads it whole and answers without parsing
it. The threads spend their time in socket calls that release the GIL, so what the small requests measure is the
router. Their p99 while the large request is in flight must stay within 50 ms of their p99 before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import random
import signal
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import aiohttp
import orjson
import pytest

from router.common.ports import free_port
from tests.integration.conftest import MODEL, StartFakes, eventually
from tests.integration.latency import latencies_around, p99
from tests.integration.test_autoscaler_local_orphans import is_running

pytestmark = pytest.mark.integration

BIG_MODEL = "big"
JSON = {"Content-Type": "application/json"}
ALLOWED_S = 0.050


def token_id_body() -> bytes:
    return b'{"model":"big","max_tokens":1,"prompt":[' + b"0," * 9_999_999 + b"0]}"


def chat_text_body() -> bytes:
    content = "lorem ipsum dolor sit amet " * (20_000_000 // 27)
    return orjson.dumps({"model": BIG_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": content}]})


def tools_body() -> bytes:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "hi"}]
    return orjson.dumps({"model": BIG_MODEL, "max_tokens": 1, "tools": [tool] * 200_000, "messages": messages})


def gzipped_token_id_body() -> bytes:
    ids = random.Random(0).choices(range(150_000), k=3_000_000)  # 19 MB of ids, 8.6 MB gzipped
    return gzip.compress(b'{"model":"big","max_tokens":1,"prompt":[' + ",".join(map(str, ids)).encode() + b"]}", 6)


LARGE = {
    "token-ids": ("/v1/completions", token_id_body, {}),
    "chat-text": ("/v1/chat/completions", chat_text_body, {}),
    "tools": ("/v1/chat/completions", tools_body, {}),
    "gzipped-token-ids": ("/v1/completions", gzipped_token_id_body, {"Content-Encoding": "gzip"}),
}


class _BigReplica(BaseHTTPRequestHandler):
    """Serves model `big`: reads each body whole and answers without parsing it."""

    protocol_version = "HTTP/1.1"

    def _answer(self, value: object, status: int = 200) -> None:
        data = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._answer({"object": "list", "data": [{"id": BIG_MODEL, "object": "model"}]})
        elif self.path == "/health":
            self._answer({"status": "ok"})
        else:
            self._answer({"error": "not found"}, 404)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._answer({"object": "text_completion", "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def big_replica() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _BigReplica)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class Router:
    def __init__(self, process: asyncio.subprocess.Process, port: int) -> None:
        self.process = process
        self.port = port
        self.url = f"http://127.0.0.1:{port}"


async def ready_with(session: aiohttp.ClientSession, router: Router, num_replicas: int) -> bool:
    with contextlib.suppress(aiohttp.ClientError):
        async with session.get(router.url + "/ready") as resp:
            return resp.status == 200 and (await resp.json()).get("replicas") == num_replicas
    return False


@pytest.fixture
async def start_router(tmp_path: Path) -> AsyncIterator[StartShoalRouter]:
    """`shoal router` with the given replicas, ready; killed at the end."""
    started: list[Router] = []

    async def start(*replicas: str) -> Router:
        port = free_port()
        argv = [sys.executable, "-c", "import sys; from router.cli import main; sys.exit(main())", "router"]
        argv += ["--port", str(port)] + [arg for url in replicas for arg in ("--replica", url)]
        with (tmp_path / f"router-{port}.log").open("wb") as log:
            process = await asyncio.create_subprocess_exec(*argv, stdout=log, stderr=log)
        router = Router(process, port)
        started.append(router)
        async with aiohttp.ClientSession() as session:
            await eventually(
                lambda: ready_with(session, router, len(replicas)), timeout_s=60.0, what="the router ready"
            )
        return router

    yield start
    for router in started:
        if router.process.returncode is None:
            router.process.kill()
            await router.process.wait()


StartShoalRouter = Callable[..., Awaitable[Router]]


@pytest.mark.parametrize("kind", list(LARGE))
async def test_a_large_request_moves_small_ones_by_at_most_50_ms(
    kind: str, big_replica: str, start_fakes: StartFakes, start_router: StartShoalRouter
) -> None:
    (small,) = await start_fakes(1)
    router: Router = await start_router(small.url, big_replica)
    path, build, headers = LARGE[kind]
    body = build()
    small_body = orjson.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1})

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60), headers=JSON) as session:

        async def small() -> None:
            async with session.post(router.url + "/v1/completions", data=small_body) as resp:
                await resp.read()
                assert resp.status == 200

        before, during, (status, answer) = await latencies_around(small, router.url + path, body, headers=headers)
    assert status == 200, answer[:300]
    assert len(during) >= 10, f"only {len(during)} small requests while the large one was in flight"
    assert p99(during) <= p99(before) + ALLOWED_S, (
        f"{kind}: small requests' p99 {p99(during) * 1e3:.1f} ms during the large one, "
        f"{p99(before) * 1e3:.1f} ms before (worst {max(during) * 1e3:.1f} ms, {len(during)} requests)"
    )


def children_of(pid: int) -> set[int]:
    """The processes `pid` started, from any of its threads."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            found.update(int(child) for child in (task / "children").read_text().split())
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
async def test_the_parser_process_ends_with_a_router_killed_outright(
    start_fakes: StartFakes, start_router: StartShoalRouter
) -> None:
    (fake,) = await start_fakes(1)
    router: Router = await start_router(fake.url)
    pid = router.process.pid
    body = b'{"model":"%s","max_tokens":1,"prompt":[' % MODEL.encode() + b"7," * 200_000 + b"7]}"
    before = children_of(pid)
    async with (
        aiohttp.ClientSession() as session,
        session.post(router.url + "/v1/completions", data=body, headers=JSON) as resp,
    ):
        assert resp.status == 200, await resp.text()
    parser = children_of(pid) - before
    assert parser, "no child process parsed the 400 KB body"
    os.kill(pid, signal.SIGKILL)
    await router.process.wait()
    await eventually(lambda: not any(map(is_running, parser)), timeout_s=10.0, what="the parser process to end")
