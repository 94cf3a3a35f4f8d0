"""Real routers in front of real fake replicas, all on loopback, on the test's own event loop.

`start_fakes(n, ...)` starts `FakeReplica`s; `start_router(fakes, ...)` builds the router with `create_app` and runs
it as `shoal router` does (`RouterServer`: every endpoint on the front, a client's disconnect cancelling its
request, graceful shutdown), then waits on `GET /ready` until the expected replicas are in rotation. Everything
is torn down by the fixtures. State is awaited by polling with a deadline (`eventually`), never by a bare sleep.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import pytest
from aiohttp import web

from router.service.app import create_app
from router.service.server import RouterServer
from router.service.settings import HealthSettings, LimitSettings, RouterSettings, ScrapeSettings
from tests.fakes import FakeReplica, FakeReplicaConfig

ADMIN_TOKEN = "t"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
MODEL = "shoal-demo"
# A prompt of this many bytes is ~1,000 estimated tokens: at the default 10k tokens/s prior its uncached prefill
# (~0.1 s) dwarfs the policy's tie epsilon (5 ms + 2%), so a cache hit decides.
LONG_PREFIX_BYTES = 4000


def replica_id(fake: FakeReplica) -> str:
    """The id the router gives a replica added by URL: host:port."""
    return f"{fake.host}:{fake.port}"


def unique_text(num_bytes: int, tag: str = "") -> str:
    """Text of `num_bytes` ASCII bytes that shares no 64-byte block with any other call's (a random head)."""
    head = f"{uuid.uuid4().hex} {tag} "
    filler = "lorem ipsum dolor sit amet consectetur adipiscing elit "
    text = head + filler * (num_bytes // len(filler) + 1)
    return text[:num_bytes]


async def eventually(
    predicate: Callable[[], Awaitable[bool]] | Callable[[], bool],
    *,
    timeout_s: float = 5.0,
    interval_s: float = 0.02,
    what: str = "condition",
    detail: Callable[[], object] | None = None,
) -> None:
    """Poll `predicate` (sync or async) until it holds; fail the test after `timeout_s`, with `detail()` (what the
    polls saw, say) in the message."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            seen = f"; {detail()}" if detail is not None else ""
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}{seen}")
        await asyncio.sleep(interval_s)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def replica(self) -> str | None:
        return self.headers.get("x-shoal-replica")

    @property
    def branch(self) -> str | None:
        return self.headers.get("x-shoal-route-branch")

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class RouterHandle:
    """A running router: its URL, app (for its state), server and a client session to talk to it."""

    app: web.Application
    server: RouterServer
    settings: RouterSettings
    url: str
    http: aiohttp.ClientSession
    is_cleaned_up: bool = field(default=False)

    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        data: bytes | str | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float = 10.0,
    ) -> Reply:
        kwargs: dict[str, Any] = {"headers": headers, "timeout": aiohttp.ClientTimeout(total=timeout_s)}
        if json_body is not None:
            kwargs["json"] = json_body
        elif data is not None:
            kwargs["data"] = data
        async with self.http.request(method, self.url + path, **kwargs) as resp:
            body = await resp.read()
            return Reply(resp.status, dict(resp.headers), body)

    async def complete(self, prompt: Any, **extra: Any) -> Reply:
        headers = extra.pop("headers", None)
        return await self.request(
            "POST", "/v1/completions", json_body={"model": MODEL, "prompt": prompt, **extra}, headers=headers
        )

    async def chat(self, messages: list[dict[str, Any]], **extra: Any) -> Reply:
        headers = extra.pop("headers", None)
        return await self.request(
            "POST", "/v1/chat/completions", json_body={"model": MODEL, "messages": messages, **extra}, headers=headers
        )

    async def admin(self, method: str, path: str, json_body: Any = None) -> Reply:
        return await self.request(method, "/admin" + path, json_body=json_body, headers=ADMIN_HEADERS)

    async def replicas(self) -> dict[str, dict[str, Any]]:
        reply = await self.admin("GET", "/replicas")
        assert reply.status == 200, reply.body
        return {r["id"]: r for r in reply.json()["replicas"]}

    async def metrics(self) -> str:
        reply = await self.request("GET", "/metrics")
        assert reply.status == 200
        return reply.body.decode()

    async def num_ready(self) -> int:
        reply = await self.request("GET", "/ready")
        return reply.json().get("replicas", 0) if reply.status == 200 else 0

    async def wait_eligible(self, ids: Sequence[str], *, timeout_s: float = 5.0) -> None:
        async def check() -> bool:
            views = await self.replicas()
            return all(views.get(i, {}).get("eligible") for i in ids)

        await eventually(check, timeout_s=timeout_s, what=f"replicas {list(ids)} eligible")

    async def cleanup(self) -> None:
        if not self.is_cleaned_up:
            self.is_cleaned_up = True
            await self.server.stop()


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The value of one sample in Prometheus text, matched by name and a subset of its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                return float(sample.value)
    return None


def router_settings(replicas: Sequence[str], **overrides: Any) -> RouterSettings:
    """Settings for tests: fast probes and scrapes, an admin token, a short shutdown grace."""
    values: dict[str, Any] = {
        "replicas": list(replicas),
        "admin_token": ADMIN_TOKEN,
        "health": HealthSettings(interval_s=0.2, unhealthy_interval_s=0.05, timeout_s=1.0),
        "scrape": ScrapeSettings(interval_s=0.2, timeout_s=1.0),
        "limits": LimitSettings(shutdown_grace_s=5.0),
        "log_requests": False,
    }
    values.update(overrides)
    return RouterSettings(**values)


class StartFakes(Protocol):
    async def __call__(self, num: int = 1, **config: Any) -> list[FakeReplica]: ...


class StartRouter(Protocol):
    async def __call__(
        self, fakes: Sequence[FakeReplica] = (), *, num_ready: int | None = None, **overrides: Any
    ) -> RouterHandle: ...


@pytest.fixture(autouse=True)
def _no_router_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings come from the test alone, not from a developer's SHOAL_ROUTER_* environment."""
    for name in list(os.environ):
        if name.startswith("SHOAL_ROUTER_"):
            monkeypatch.delenv(name)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def start_fakes() -> AsyncIterator[StartFakes]:
    started: list[FakeReplica] = []

    async def start(num: int = 1, **config: Any) -> list[FakeReplica]:
        fakes = []
        for _ in range(num):
            fake = FakeReplica(FakeReplicaConfig(**{"name": f"f{len(started)}", **config}))
            await fake.start()
            started.append(fake)
            fakes.append(fake)
        return fakes

    yield start
    for fake in started:
        await fake.stop()


@pytest.fixture
async def start_router(http: aiohttp.ClientSession) -> AsyncIterator[StartRouter]:
    handles: list[RouterHandle] = []

    async def start(
        fakes: Sequence[FakeReplica] = (), *, num_ready: int | None = None, **overrides: Any
    ) -> RouterHandle:
        settings = router_settings(overrides.pop("replicas", [f.url for f in fakes]), **overrides)
        app = create_app(settings)
        server = RouterServer(app, settings)
        await server.start("127.0.0.1", 0)
        host, port = server.address
        handle = RouterHandle(app, server, settings, f"http://{host}:{port}", http)
        handles.append(handle)
        expected = len(settings.replicas) if num_ready is None else num_ready
        if expected:
            await eventually(
                lambda: _at_least(handle, expected), timeout_s=5.0, what=f"/ready with {expected} replicas"
            )
        return handle

    yield start
    for handle in handles:
        await handle.cleanup()


async def _at_least(handle: RouterHandle, expected: int) -> bool:
    return await handle.num_ready() >= expected


from tests.integration.redis_server import (  # noqa: E402, F401 - fixtures
    redis_cluster,
    redis_process,
    redis_sentinel,
    redis_url,
)
from tests.integration.replica_support import start_any_replica, start_replica, tiny_checkpoint  # noqa: E402, F401
from tests.integration.vllm_support import vllm_servers  # noqa: E402, F401 - fixtures
