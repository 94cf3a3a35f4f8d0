"""The OpenAI-compatible proxy: `/v1/completions`, `/v1/chat/completions`, `/v1/models`, other `/v1/*`.

A request, read by the front under its size and time limits, is validated (400s in OpenAI's error shape, never a
500), routed by `RoutingCore`, and forwarded. Until a byte has reached the client, a refused connection or a 5xx
moves the request to another replica (never the one that just failed), within `retry.max_attempts` and
`retry.total_timeout_s`. Once bytes flow, a replica failure ends the stream with an SSE error event, never a
hang. A client that goes away cancels the handler (the front cancels its task), which closes the upstream
connection at once, so the replica stops generating for nobody.

Streams are relayed chunk by chunk as they arrive; TCP_NODELAY is on for both sockets (the front sets it on the
client side, `UpstreamPool` on the replica side), so no chunk waits on Nagle's algorithm. Requests that no
replica can serve yet are held (`hold` settings) until one joins the rotation; with an in-flight limit per replica
(`hold.max_in_flight_per_replica`), so are requests that find every replica at it, until a slot frees. Held
requests leave in arrival order, and a new request lines up behind them.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from aiohttp import web
from multidict import CIMultiDict

from router.policy.routing_text import RoutingInputError, RoutingKey, chat_routing_key, completion_routing_key
from router.service.errors import error_response, sse_error_event
from router.service.front import FrontRequest, FrontStream, WholeAnswer
from router.service.metrics import RouterMetrics
from router.service.pool import Replica, ReplicaPool
from router.service.routing import Prepared, RoutingCore, Ticket
from router.service.settings import RouterSettings
from router.service.upstream import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamPool,
    UpstreamProtocolError,
    UpstreamResponse,
)

log = logging.getLogger("shoal.router")
request_log = logging.getLogger("shoal.router.requests")

# RFC 9110 7.6.1 hop-by-hop headers, plus the framing headers each side sets for itself.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
    }
)
# Host is the replica's; the front has already decoded a compressed request body.
_REQUEST_DROP = _HOP_BY_HOP | {"host", "content-encoding"}
# A replica behind another Shoal router answers with that router's tags: this router's own replace them.
_RESPONSE_DROP = _HOP_BY_HOP | {"x-shoal-replica", "x-shoal-route-branch"}
_DECODER = json.JSONDecoder()
_RETRYABLE_STATUS = frozenset({500, 502, 503, 504})
_ROUTED_PATHS = {"/v1/completions": completion_routing_key, "/v1/chat/completions": chat_routing_key}


class _Stream(Protocol):
    """A streamed answer being written (the front's `FrontStream`)."""

    @property
    def status(self) -> int: ...

    async def write(self, data: bytes) -> None: ...

    async def write_eof(self) -> None: ...


class _Inbound(Protocol):
    """A request being proxied: what the proxy reads of it, and how it starts a streamed answer."""

    @property
    def method(self) -> str: ...

    @property
    def path(self) -> str: ...

    @property
    def path_qs(self) -> str: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    async def start_stream(self, status: int, headers: CIMultiDict[str]) -> _Stream: ...

    def deliver(self, answer: WholeAnswer) -> None:
        """Write a whole answer now, before the proxy's bookkeeping; the handler's return value is not written
        again."""
        ...


class _Retry(Exception):
    """An attempt failed before any byte reached the client."""

    def __init__(self, reason: str, status: int | None = None, body: bytes = b"", headers: Any = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.body = body
        self.headers = headers


def _end_to_end(
    headers: Iterable[tuple[str, str]], connection: str | None, drop: frozenset[str]
) -> list[tuple[str, str]]:
    """Headers without the hop-by-hop ones (RFC 9110 7.6.1), including those the Connection header names."""
    tokens = {t.strip().lower() for t in connection.split(",")} if connection else ()
    return [(name, value) for name, value in headers if (lower := name.lower()) not in drop and lower not in tokens]


@dataclass(slots=True)
class _Held:
    """A request waiting at the router for a replica with room."""

    model: str | None
    released: asyncio.Future[None]


class Proxy:
    def __init__(
        self,
        settings: RouterSettings,
        pool: ReplicaPool,
        core: RoutingCore,
        metrics: RouterMetrics,
        upstream: UpstreamPool,
        on_unreachable: Callable[[Replica], None] = lambda replica: None,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.core = core
        self.metrics = metrics
        self.upstream = upstream
        self.on_unreachable = on_unreachable
        """Called when passive marking takes a replica out, so the prober checks it now, not at its next tick."""
        # CLOCK_MONOTONIC at full resolution: uvloop's loop.time() ticks in milliseconds, too coarse for TTFT.
        self._clock = time.monotonic
        self._held: collections.deque[_Held] = collections.deque()
        """Requests waiting for a replica with room, in arrival order (`_hold`)."""

    # --- entry points -----------------------------------------------------------------------------------

    async def handle_front(self, request: FrontRequest, raw: bytes) -> web.StreamResponse | WholeAnswer | FrontStream:
        """A routed request the front parsed, its body read: a whole answer to write, or the stream it wrote."""
        started = self._clock()
        if request.content_type != "application/json":
            return _wrong_content_type(request.content_type)
        answer = await self._route_json(request, raw, started)
        assert isinstance(answer, (web.StreamResponse, WholeAnswer, FrontStream))  # its streams are the front's
        return answer

    async def _route_json(
        self, request: _Inbound, raw: bytes, started: float
    ) -> web.StreamResponse | WholeAnswer | _Stream:
        try:
            body = orjson.loads(raw)
        except (ValueError, RecursionError) as exc:  # RecursionError: nesting too deep for the decoder
            return error_response(400, f"request body is not valid JSON: {exc}", code="invalid_json")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object", code="invalid_json")
        try:
            key = _ROUTED_PATHS[request.path](body)
        except RoutingInputError as exc:
            return error_response(400, str(exc), param=exc.param)
        return await self._route_and_forward(request, body, raw, key, started)

    async def handle_passthrough(
        self, request: FrontRequest, raw: bytes
    ) -> web.StreamResponse | WholeAnswer | FrontStream:
        """Any other /v1/* path: no prefix to route on, so the policy balances load alone."""
        started = self._clock()
        body: dict[str, Any] = {}
        if request.content_type == "application/json" and raw:
            try:
                decoded = orjson.loads(raw)
            except (ValueError, RecursionError):  # RecursionError: nesting too deep for the decoder
                return error_response(400, "request body is not valid JSON", code="invalid_json")
            if isinstance(decoded, dict):
                body = decoded
        answer = await self._route_and_forward(request, body, raw, RoutingKey(text=b""), started)
        assert isinstance(answer, (web.StreamResponse, WholeAnswer, FrontStream))  # its streams are the front's
        return answer

    async def handle_models(self, request: FrontRequest) -> web.Response:
        seen: dict[str, dict[str, Any]] = {}
        for replica in self.pool:
            if replica.is_healthy:
                for model_id, card in replica.model_cards.items():
                    seen.setdefault(model_id, card)
        return web.json_response({"object": "list", "data": list(seen.values())})

    # --- routing and forwarding ---------------------------------------------------------------------------

    async def _route_and_forward(
        self, request: _Inbound, body: dict[str, Any], raw: bytes, key: RoutingKey, started: float
    ) -> web.StreamResponse | WholeAnswer | _Stream:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            return error_response(400, "'model' must be a string", param="model")
        if model is not None and len(self.pool) and not self.pool.is_model_known(model):
            return error_response(
                404,
                f"The model `{model}` does not exist.",
                type_="invalid_request_error",
                code="model_not_found",
                param="model",
            )
        header = self.settings.session_header
        session_key = request.headers.get(header) if header else None
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        decide_start = time.perf_counter()
        prepared = self.core.prepare(key, model, session_key, max_tokens if isinstance(max_tokens, int) else None)
        # The front has already decoded a compressed body, so `raw` goes on without Content-Encoding.
        headers = _end_to_end(request.headers.items(), request.headers.get("Connection"), _REQUEST_DROP)
        tried: list[str] = []
        decision_s = 0.0
        deadline = started + self.settings.retry.total_timeout_s
        last_failure: _Retry | None = None
        was_held = False
        while len(tried) < self.settings.retry.max_attempts and (not tried or self._clock() < deadline):
            now = self._clock()
            # A first attempt keeps the in-flight limit and, unless just released, lines up behind held requests.
            is_first = not tried
            if is_first and self._held and not was_held:
                decision = None
            else:
                decision = self.core.choose(prepared, tried, now, within_limit=is_first)
            if decision is None:
                if is_first and await self._hold(model, started):
                    was_held = True
                    decide_start = time.perf_counter()  # the decision's latency leaves the wait out
                    continue
                break
            if not tried:
                decision_s = time.perf_counter() - decide_start
                self.metrics.decision_seconds.observe(decision_s)
            replica = self.pool.get(decision.replica)
            assert replica is not None
            tried.append(replica.id)
            ticket = self.core.begin(replica, decision, prepared, now)
            commit = functools.partial(self.core.commit, prepared, decision, now)
            try:
                response = await self._attempt(request, ticket, headers, raw, commit)
                if isinstance(response, WholeAnswer):
                    request.deliver(response)  # the client has its answer before the bookkeeping below
            except _Retry as failure:
                last_failure = failure
                self.metrics.retries.inc((failure.reason,))
                continue
            finally:
                self.core.finish(ticket)
                if self._held:
                    self._release_held()
            self.metrics.request_seconds.observe(self._clock() - started)
            self._log(request, ticket, prepared, response.status, started, len(tried), decision_s)
            return response
        self.metrics.request_seconds.observe(self._clock() - started)
        return self._give_up(request, model, last_failure, tried, started)

    def replica_ready(self) -> None:
        """A replica joined the rotation (first good probe, recovery, undrain): release the held requests it can
        take."""
        self._release_held()

    async def _hold(self, model: str | None, started: float) -> bool:
        """No replica can take the request yet (none serves its model, or all are at the in-flight limit, or
        older requests are held): wait in line, within `hold` limits. False when the wait is over."""
        hold = self.settings.hold
        remaining_s = started + hold.max_wait_s - self._clock()
        if self.metrics.held_requests >= hold.max_requests or remaining_s <= 0:
            return False
        held = _Held(model, asyncio.get_running_loop().create_future())
        self._held.append(held)
        self.metrics.held_requests += 1
        is_through = False
        try:
            self._release_held()  # there may be room already: another model's request was first in line
            async with asyncio.timeout(remaining_s):
                await held.released
            is_through = True
        except TimeoutError:
            return False
        finally:
            self.metrics.held_requests -= 1
            if held.released.cancelled() or not held.released.done():  # timed out or cancelled in line: leave
                held.released.cancel()
                self._held.remove(held)
            elif not is_through:  # released, then timed out or cancelled before choosing: pass the slot on
                self._release_held()
        return True

    def _release_held(self) -> None:
        """Release held requests in arrival order, each whose model has a free slot, as many as there are free
        slots. A released request chooses at once (nothing awaits between its wake-up and `begin`), so the
        slots it was counted against are still free then."""
        room: dict[str | None, int] = {}
        kept: collections.deque[_Held] = collections.deque()
        for held in self._held:
            free = room.get(held.model)
            if free is None:
                free = self.core.free_slots(held.model)
            if free > 0:
                held.released.set_result(None)
                free -= 1
            else:
                kept.append(held)
            room[held.model] = free
        self._held = kept

    def _give_up(
        self, request: _Inbound, model: str | None, failure: _Retry | None, tried: list[str], started: float
    ) -> web.Response:
        branch = "none"
        if failure is not None and failure.status is not None:
            # Every attempt got a 5xx: pass the last replica's answer on as it was.
            response = web.Response(status=failure.status, body=failure.body, headers=failure.headers)
            response.headers["x-shoal-replica"] = tried[-1]
            self.metrics.requests.inc((str(failure.status), branch, tried[-1]))
            return response
        limit = self.settings.hold.max_in_flight_per_replica
        if failure is None and limit and self.pool.eligible(model):
            message = f"every replica is busy ({limit} requests in flight each); retry later"
            code = "replicas_busy"
        elif failure is None:
            message, code = "no replica is available to serve this request", "no_replica_available"
        else:
            message, code = f"all replicas tried failed ({', '.join(tried)}): {failure}", "upstream_unavailable"
        self.metrics.requests.inc(("503", branch, "none"))
        self._log_line(request, 503, "none", branch, started, len(tried), error=message)
        return error_response(503, message, type_="server_error", code=code, headers={"Retry-After": "1"})

    async def _attempt(
        self,
        request: _Inbound,
        ticket: Ticket,
        headers: list[tuple[str, str]],
        raw: bytes,
        on_sent: Callable[[], object],
    ) -> web.StreamResponse | WholeAnswer | _Stream:
        replica = ticket.replica
        limits = self.settings.limits
        deadline = ticket.started + limits.request_timeout_s
        upstream: UpstreamResponse | None = None
        try:
            async with self.upstream.deadlines.timeout(limits.request_timeout_s):
                upstream = await self.upstream.request(
                    request.method,
                    replica.host,
                    replica.port,
                    replica.base_path + request.path_qs,
                    headers,
                    raw,
                    on_sent,
                )
                if upstream.status in _RETRYABLE_STATUS:
                    body = await upstream.read()
                    self._request_failed(ticket, f"HTTP {upstream.status}")
                    raise _Retry(f"http_{upstream.status}", upstream.status, body, _response_headers(upstream))
                if upstream.content_type != "text/event-stream":
                    body = await upstream.read()
            replica.request_succeeded()
            if upstream.content_type == "text/event-stream":
                return await self._relay_stream(request, ticket, upstream, deadline)
            self._first_byte(ticket, is_stream=False)
            self._observe_cached_tokens(upstream, body)
            return WholeAnswer(upstream.status, _answer_headers(upstream) + self._tag(ticket, upstream.status), body)
        except UpstreamConnectError as exc:
            if replica.mark_unreachable(str(exc)):
                log.warning("replica %s unreachable, out of rotation: %s", replica.id, exc)
                self.core.drop_cache(replica.id)
                self.on_unreachable(replica)
            raise _Retry("connect_error") from exc
        except TimeoutError as exc:  # UpstreamTimeout (silent replica) or the request's total time
            self._request_failed(ticket, "timeout")
            raise _Retry("timeout") from exc
        except UpstreamProtocolError as exc:
            self._request_failed(ticket, f"invalid response: {exc}")
            raise _Retry("invalid_response") from exc
        except UpstreamError as exc:  # disconnected before the answer was complete: nothing reached the client
            self._request_failed(ticket, str(exc) or type(exc).__name__)
            raise _Retry("disconnected") from exc
        finally:
            if upstream is not None:
                upstream.close()  # back to the pool when complete; otherwise aborted, which stops the replica

    async def _relay_stream(
        self, request: _Inbound, ticket: Ticket, upstream: UpstreamResponse, deadline: float
    ) -> _Stream:
        headers = _response_headers(upstream)
        headers.extend(self._tag(ticket, upstream.status))
        chunks = upstream.iter_chunks()
        # Wait for the first chunk before answering: a replica that dies before it can still be retried.
        try:
            async with self.upstream.deadlines.timeout(max(0.0, deadline - self._clock())):
                first = await anext(chunks, b"")
        except TimeoutError as exc:
            self._request_failed(ticket, "timeout")
            raise _Retry("timeout") from exc
        except UpstreamError as exc:
            self._request_failed(ticket, str(exc) or type(exc).__name__)
            raise _Retry("disconnected") from exc
        self._first_byte(ticket, is_stream=True)
        response = await request.start_stream(upstream.status, headers)
        try:
            if first:
                await response.write(first)
            try:
                async for chunk in chunks:
                    await response.write(chunk)
                    if self._clock() > deadline:
                        raise TimeoutError(f"request took longer than {self.settings.limits.request_timeout_s} s")
            except (UpstreamError, TimeoutError) as exc:
                self._request_failed(ticket, str(exc) or type(exc).__name__)
                log.warning("replica %s failed mid-stream: %s", ticket.replica.id, exc)
                await response.write(sse_error_event(f"replica {ticket.replica.id} failed mid-stream: {exc}"))
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away; `finally` in _attempt aborts the upstream connection
        return response

    # --- bookkeeping -------------------------------------------------------------------------------------

    def _first_byte(self, ticket: Ticket, *, is_stream: bool) -> None:
        ttfb_s = self.core.first_byte(ticket, self._clock(), is_stream=is_stream)
        if is_stream:
            self.metrics.ttft_seconds.observe(ttfb_s)
            if ticket.decision.predicted_ttft_s is not None:
                self.metrics.predicted_ttft_seconds.observe(ticket.decision.predicted_ttft_s)

    def _request_failed(self, ticket: Ticket, error: str) -> None:
        if ticket.replica.request_failed(self.settings.breaker, self._clock(), error):
            log.warning("circuit opened for replica %s after repeated failures: %s", ticket.replica.id, error)

    def _tag(self, ticket: Ticket, status: int) -> list[tuple[str, str]]:
        """Count the answer; the headers that tell the client which replica answered and why."""
        decision = ticket.decision
        branch = decision.branch.value
        self.metrics.requests.inc((str(status), branch, ticket.replica.id))
        if decision.predicted_cached_tokens:
            self.metrics.predicted_cached_tokens.inc(amount=decision.predicted_cached_tokens)
        return [("x-shoal-replica", ticket.replica.id), ("x-shoal-route-branch", branch)]

    def _observe_cached_tokens(self, upstream: UpstreamResponse, body: bytes) -> None:
        if upstream.content_type != "application/json" or upstream.header("Content-Encoding"):
            return
        # Decode only the `usage` object (answers can be long): it is the last key engines write.
        start = body.rfind(b'"usage"')
        if start < 0:
            return
        start = body.find(b"{", start)
        try:
            usage, _ = _DECODER.raw_decode(body[start:].decode())
            if not isinstance(usage, dict):
                return
            prompt = usage.get("prompt_tokens") or 0
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        except (ValueError, AttributeError, RecursionError):  # includes UnicodeDecodeError
            return
        # A replica's figures are not trusted to be sane: counters only go up.
        if isinstance(prompt, int) and isinstance(cached, int) and 0 <= cached <= prompt:
            self.metrics.prompt_tokens.inc(amount=prompt)
            self.metrics.observed_cached_tokens.inc(amount=cached)

    def _log(
        self,
        request: _Inbound,
        ticket: Ticket,
        prepared: Prepared,
        status: int,
        started: float,
        attempts: int,
        decision_s: float,
    ) -> None:
        if self.settings.log_requests:
            self._log_line(
                request,
                status,
                ticket.replica.id,
                ticket.decision.branch.value,
                started,
                attempts,
                matched_blocks=ticket.decision.matched_blocks,
                prompt_tokens=prepared.prompt_tokens,
                predicted_cached_tokens=ticket.decision.predicted_cached_tokens,
                predicted_ttft_ms=_ms(ticket.decision.predicted_ttft_s),
                ttfb_ms=_ms(ticket.ttfb_s),
                decision_us=round(decision_s * 1e6, 1),
            )

    def _log_line(
        self,
        request: _Inbound,
        status: int,
        replica: str,
        branch: str,
        started: float,
        attempts: int,
        **extra: Any,
    ) -> None:
        if not self.settings.log_requests:
            return
        record = {
            "event": "request",
            "method": request.method,
            "path": request.path,
            "status": status,
            "replica": replica,
            "branch": branch,
            "attempts": attempts,
            "ms": round((self._clock() - started) * 1000, 3),
            **extra,
        }
        request_log.info(json.dumps(record))


def _wrong_content_type(content_type: str) -> web.Response:
    return error_response(
        400, f"Content-Type must be application/json, got {content_type!r}", code="invalid_content_type"
    )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def _answer_headers(upstream: UpstreamResponse) -> list[tuple[str, str]]:
    """The replica's end-to-end answer headers, to pass on."""
    return _end_to_end(upstream.headers, upstream.header("Connection"), _RESPONSE_DROP)


def _response_headers(upstream: UpstreamResponse) -> CIMultiDict[str]:
    return CIMultiDict(_answer_headers(upstream))
