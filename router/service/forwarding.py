"""Forwarding: one attempt of a request on one replica, its answer relayed whole or as a stream.

An attempt that fails before any byte reached the client raises `Retry` (the proxy tries another replica); once
bytes flow, a replica failure ends the stream with an SSE error event, never a hang. Streams are relayed chunk by
chunk as they arrive; TCP_NODELAY is on for both sockets (the front sets it on the client side, `UpstreamPool` on
the replica side), so no chunk waits on Nagle's algorithm. Hop-by-hop headers (RFC 9110 7.6.1) are dropped both
ways.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

from multidict import CIMultiDict

from router.service.errors import sse_error_event
from router.service.front import Body, FrontRequest, FrontStream, WholeAnswer
from router.service.metrics import RouterMetrics
from router.service.pool import Replica
from router.service.routing import PoolRouting, ReplicaTicket
from router.service.settings import RouterSettings
from router.service.upstream import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamPool,
    UpstreamProtocolError,
    UpstreamResponse,
)

log = logging.getLogger("shoal.router")

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


class Retry(Exception):
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


def request_headers(headers: Iterable[tuple[str, str]], connection: str | None) -> list[tuple[str, str]]:
    """The client's end-to-end headers, to forward. The front has already decoded a compressed body, so the body
    goes on without Content-Encoding."""
    return _end_to_end(headers, connection, _REQUEST_DROP)


class Forwarder:
    def __init__(
        self,
        settings: RouterSettings,
        routing: PoolRouting,
        metrics: RouterMetrics,
        upstream: UpstreamPool,
        clock: Callable[[], float],
        on_unreachable: Callable[[Replica], None],
    ) -> None:
        self.settings = settings
        self.routing = routing
        self.metrics = metrics
        self.upstream = upstream
        self._clock = clock
        self.on_unreachable = on_unreachable
        """Called when passive marking takes a replica out, so the prober checks it now, not at its next tick."""

    async def attempt(
        self,
        request: FrontRequest,
        ticket: ReplicaTicket,
        headers: list[tuple[str, str]],
        raw: Body,
        on_sent: Callable[[], object],
    ) -> WholeAnswer | FrontStream:
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
                    self.request_failed(ticket, f"HTTP {upstream.status}")
                    raise Retry(f"http_{upstream.status}", upstream.status, body, _response_headers(upstream))
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
                self.routing.drop_cache(replica.id)
                self.on_unreachable(replica)
            raise Retry("connect_error") from exc
        except TimeoutError as exc:  # UpstreamTimeout (silent replica) or the request's total time
            self.request_failed(ticket, "timeout")
            raise Retry("timeout") from exc
        except UpstreamProtocolError as exc:
            self.request_failed(ticket, f"invalid response: {exc}")
            raise Retry("invalid_response") from exc
        except UpstreamError as exc:  # disconnected before the answer was complete: nothing reached the client
            self.request_failed(ticket, str(exc) or type(exc).__name__)
            raise Retry("disconnected") from exc
        finally:
            if upstream is not None:
                upstream.close()  # back to the pool when complete; otherwise aborted, which stops the replica

    async def _relay_stream(
        self, request: FrontRequest, ticket: ReplicaTicket, upstream: UpstreamResponse, deadline: float
    ) -> FrontStream:
        headers = _response_headers(upstream)
        headers.extend(self._tag(ticket, upstream.status))
        chunks = upstream.iter_chunks()
        # Wait for the first chunk before answering: a replica that dies before it can still be retried.
        try:
            async with self.upstream.deadlines.timeout(max(0.0, deadline - self._clock())):
                first = await anext(chunks, b"")
        except TimeoutError as exc:
            self.request_failed(ticket, "timeout")
            raise Retry("timeout") from exc
        except UpstreamError as exc:
            self.request_failed(ticket, str(exc) or type(exc).__name__)
            raise Retry("disconnected") from exc
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
                self.request_failed(ticket, str(exc) or type(exc).__name__)
                log.warning("replica %s failed mid-stream: %s", ticket.replica.id, exc)
                await response.write(sse_error_event(f"replica {ticket.replica.id} failed mid-stream: {exc}"))
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away; `finally` in _attempt aborts the upstream connection
        return response

    # --- bookkeeping -------------------------------------------------------------------------------------

    def _first_byte(self, ticket: ReplicaTicket, *, is_stream: bool) -> None:
        ttfb_s = self.routing.first_byte(ticket, self._clock(), is_stream=is_stream)
        if is_stream:
            self.metrics.ttft_seconds.observe(ttfb_s)
            if ticket.decision.predicted_ttft_s is not None:
                self.metrics.predicted_ttft_seconds.observe(ticket.decision.predicted_ttft_s)

    def request_failed(self, ticket: ReplicaTicket, error: str) -> None:
        if ticket.replica.request_failed(self.settings.breaker, self._clock(), error):
            log.warning("circuit opened for replica %s after repeated failures: %s", ticket.replica.id, error)

    def _tag(self, ticket: ReplicaTicket, status: int) -> list[tuple[str, str]]:
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


def _answer_headers(upstream: UpstreamResponse) -> list[tuple[str, str]]:
    """The replica's end-to-end answer headers, to pass on."""
    return _end_to_end(upstream.headers, upstream.header("Connection"), _RESPONSE_DROP)


def _response_headers(upstream: UpstreamResponse) -> CIMultiDict[str]:
    return CIMultiDict(_answer_headers(upstream))
