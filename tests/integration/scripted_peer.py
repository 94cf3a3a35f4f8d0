"""A real HTTP peer on loopback that answers each path with the answers it was given, in turn, the last one again
and again: the replica (or router) that answers garbage once, then well, at a moment the test chooses.
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import orjson
from aiohttp import web

from tests.integration.conftest import MODEL


@dataclass(frozen=True)
class Answer:
    body: bytes
    status: int = 200
    content_type: str = "application/json"


def json_answer(value: object, status: int = 200) -> Answer:
    return Answer(orjson.dumps(value), status)


REPLICA_ANSWERS: dict[str, Sequence[Answer]] = {
    "/health": [json_answer({"status": "ok"})],
    "/v1/models": [json_answer({"object": "list", "data": [{"id": MODEL, "object": "model"}]})],
}
"""What a healthy replica answers on the paths the router probes."""


class ScriptedPeer:
    def __init__(self, answers: Mapping[str, Sequence[Answer]]) -> None:
        self.answers = {path: collections.deque(given) for path, given in answers.items()}
        self.num_requests: collections.Counter[str] = collections.Counter()
        self.after: dict[str, Callable[[], None]] = {}
        """Path -> what to do once a request to it has its answer (say, change another path's answers)."""
        self.url = ""

    def then(self, path: str, *answers: Answer) -> None:
        """Answer `path` with these from now on (the last again and again)."""
        self.answers[path] = collections.deque(answers)

    async def _handle(self, request: web.Request) -> web.Response:
        queue = self.answers.get(request.path)
        self.num_requests[request.path] += 1
        if not queue:
            return web.Response(status=404)
        answer = queue.popleft() if len(queue) > 1 else queue[0]
        if request.path in self.after:
            self.after[request.path]()
        return web.Response(body=answer.body, status=answer.status, content_type=answer.content_type)

    @property
    def host_port(self) -> str:
        return self.url.removeprefix("http://")


@asynccontextmanager
async def scripted_peer(answers: Mapping[str, Sequence[Answer]]) -> AsyncIterator[ScriptedPeer]:
    peer = ScriptedPeer(answers)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", peer._handle)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    peer.url = f"http://{host}:{port}"
    try:
        yield peer
    finally:
        await runner.cleanup()
