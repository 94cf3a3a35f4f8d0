"""A stand-in for Prometheus' HTTP API, as kmock stands in for Kubernetes: `GET /api/v1/query` on loopback.

It answers each instant query with what the test set for that exact query string: a vector of series, a scalar,
an error in Prometheus' envelope (`status: error`, `errorType`, `error`, with Prometheus' HTTP status for that
type), or any other body; a query nobody set gets an empty vector, as Prometheus answers for a metric it does not
have. Samples are stamped with the fake's clock (Prometheus stamps an instant query's samples with its evaluation
time) minus the age the test asks for, and values are rendered as Prometheus renders them: strings, "NaN" and
"+Inf" included. Every request is kept (query, parameters, headers) for assertions.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

_ERROR_STATUS = {"bad_data": 400, "execution": 422, "timeout": 503, "canceled": 503, "internal": 500}
"""HTTP status of each Prometheus `errorType` (web/api/v1's mapping)."""


@dataclass(frozen=True)
class Answer:
    """What the fake answers for one query."""

    result_type: str = "vector"
    values: tuple[tuple[Mapping[str, str], float], ...] = ()
    """(labels, value) per series; for a scalar, one entry with empty labels."""
    age_s: float = 0.0
    """Seconds before the fake's now at which the samples are stamped."""
    error_type: str | None = None
    error: str = ""
    http_status: int | None = None
    """Overrides the status: a proxy's 502 with Prometheus' body, or a 500 around a success."""
    raw_body: str | None = None
    """Sent as is instead of a JSON envelope (a proxy's HTML error page)."""
    delay_s: float = 0.0
    """Seconds before answering: a slow or hung Prometheus."""


def vector(*values: float, age_s: float = 0.0) -> Answer:
    """One series per value, each labelled with its router (as a query without `sum()` answers)."""
    return Answer("vector", tuple(({"instance": f"router-{i}"}, v) for i, v in enumerate(values)), age_s)


def scalar(value: float, age_s: float = 0.0) -> Answer:
    return Answer("scalar", (({}, value),), age_s)


def error(error_type: str, message: str) -> Answer:
    return Answer(error_type=error_type, error=message)


@dataclass(frozen=True)
class Received:
    query: str
    params: Mapping[str, str]
    headers: Mapping[str, str]


@dataclass
class FakePrometheus:
    clock: Callable[[], float] = time.time
    """The fake's Unix clock, for sample stamps."""
    answers: dict[str, Answer] = field(default_factory=dict)
    received: list[Received] = field(default_factory=list)
    port: int = 0
    _runner: web.AppRunner | None = None

    def set(self, answers: Mapping[str, Answer]) -> None:
        self.answers.update(answers)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> None:
        """Listen on `port` (0: any free one; the port of an earlier start brings a stopped fake back)."""
        app = web.Application()
        app.router.add_get("/api/v1/query", self._query)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def _query(self, request: web.Request) -> web.Response:
        query = request.query.get("query", "")
        self.received.append(Received(query, dict(request.query), dict(request.headers)))
        answer = self.answers.get(query, Answer())
        if answer.delay_s:
            await asyncio.sleep(answer.delay_s)
        if answer.raw_body is not None:
            return web.Response(status=answer.http_status or 200, text=answer.raw_body, content_type="text/html")
        body: dict[str, Any]
        if answer.error_type is not None:
            body = {"status": "error", "errorType": answer.error_type, "error": answer.error}
            status = _ERROR_STATUS.get(answer.error_type, 400)
        else:
            stamp = round(self.clock() - answer.age_s, 3)
            if answer.result_type == "scalar":
                result: Any = [stamp, _render(answer.values[0][1])]
            else:
                result = [{"metric": dict(labels), "value": [stamp, _render(v)]} for labels, v in answer.values]
            body = {"status": "success", "data": {"resultType": answer.result_type, "result": result}}
            status = 200
        return web.json_response(body, status=answer.http_status or status)


def _render(value: float) -> str:
    """A sample value as Prometheus writes it."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)
