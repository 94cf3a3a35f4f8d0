"""The router's HTTP/1.1 front door: the inference endpoints on `asyncio` protocols, everything else by aiohttp.

aiohttp's server spends much of a proxied request's CPU on request and response objects, its parser's Python side
and payload writers: with this front the router uses 48-135 µs less CPU per request under load (`bench_proxy.py`'s
`shoal` against `shoal-aiohttp` rows, README). `FrontServer` listens in its place: every connection starts as a
`_Connection`, which parses each request head itself. A request it serves
- is one of its `routes`: for the router `POST /v1/chat/completions`, `POST /v1/completions` and
  `GET /v1/models`, what OpenAI clients send on their connections (origin-form, a query string allowed), over
  HTTP/1.1;
- frames its body with one Content-Length no larger than `limits.max_body_bytes` (a GET may have none);
- carries no Transfer-Encoding, Content-Encoding, Expect or Upgrade, and has a well-formed head.

Any other request hands the connection, with every byte buffered so far, to aiohttp's `RequestHandler` for the
rest of its life. So the other endpoints, and the answers to oversized, chunked, compressed, 100-continue or
malformed requests, are exactly aiohttp's. A handover happens only between requests: aiohttp starts at the first
byte of a request.

What the front does for the requests it serves:
- Keep-alive, with pipelined requests answered in order: the next head is parsed once an answer is written, and
  reading pauses while a request is served and more than `_HIGH_WATER_BYTES` wait behind it.
- A client that goes away cancels its request's task, as aiohttp's handler cancellation does, which aborts the
  upstream request, so the replica stops generating for nobody.
- Timeouts without a timer per request: a sweep once a second closes idle connections after
  `limits.keepalive_timeout_s`, and answers 408 to a head not complete within `limits.header_read_timeout_s` or
  a body not complete within `limits.body_read_timeout_s`.
- Answers: a whole body with Content-Length, or a stream (SSE) in chunked transfer coding, each chunk written as
  it arrives; writes wait while the client's socket buffer is full.
- Shutdown: stop accepting, close idle connections, let requests in flight finish within the grace period.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping
from http import HTTPStatus
from typing import Protocol

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from router.service.errors import error_response
from router.service.settings import LimitSettings

log = logging.getLogger("shoal.router")

_MAX_HEAD_BYTES = 64 * 1024
"""A head without its end in this many bytes goes to aiohttp, which refuses it (431 or 400)."""
_HIGH_WATER_BYTES = 1024 * 1024
"""Bytes of following requests buffered while one is served, past which reading pauses."""
_SWEEP_INTERVAL_S = 1.0
"""How often connections are checked for timeouts; more often when a timeout is shorter than 4 s."""

# A request line and header fields as RFC 9110/9112 allow them (no obs-fold, no bare CR or LF, no CTLs but tab
# in values); a head that does not match is aiohttp's to answer.
_REQUEST_LINE = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+) (/[^\x00-\x20\x7f]*) HTTP/1\.1")
_FIELDS = re.compile(rb"(?:\r\n[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[\t\x20-\x7e\x80-\xff]*)*")
# Header fields the front looks at; a request that repeats one of them goes to aiohttp.
_SPECIAL = frozenset(
    {"content-length", "transfer-encoding", "content-encoding", "expect", "upgrade", "connection", "content-type"}
)
_NO_BODY_STATUS = frozenset({204, 304})
_REASONS = {status.value: status.phrase for status in HTTPStatus}

# Where a connection stands.
_HEAD, _BODY, _BUSY, _CLOSED = range(4)


class Handler(Protocol):
    """What serves a parsed request: the proxy. Returns a whole answer, or the stream it has written."""

    def __call__(
        self, request: FrontRequest, body: bytes, /
    ) -> Awaitable[web.StreamResponse | WholeAnswer | FrontStream]: ...


class FrontRequest:
    """A request the front serves, with the attributes of `aiohttp.web.Request` the proxy reads."""

    __slots__ = ("_conn", "content_type", "headers", "keep_alive", "method", "path", "path_qs")

    def __init__(
        self,
        method: str,
        path_qs: str,
        headers: CIMultiDictProxy[str],
        content_type: str,
        keep_alive: bool,
        conn: _Connection,
    ) -> None:
        self.method = method
        self.path_qs = path_qs
        self.path = path_qs.partition("?")[0]
        self.headers = headers
        self.content_type = content_type
        """The media type, lower case, without parameters; application/octet-stream when absent (as aiohttp)."""
        self.keep_alive = keep_alive
        self._conn = conn

    async def start_stream(self, status: int, headers: CIMultiDict[str]) -> FrontStream:
        """An answer whose body follows in pieces: chunked transfer coding. The head goes out with the first piece."""
        return FrontStream(self._conn, status, headers, self.keep_alive)

    def deliver(self, answer: WholeAnswer) -> None:
        """Write a whole answer now, before the handler returns, so that its bookkeeping after the answer (metrics,
        the request's log line) does not delay the client; the front does not write it again."""
        conn = self._conn
        if conn.state != _CLOSED:
            conn._send(encode_response(answer, not conn._must_close()))
            conn.has_written = True


class WholeAnswer:
    """A complete answer for the front to write: status, end-to-end header pairs and body. The proxy hands a
    replica's whole answer on in this form, since a `web.Response` would only be built to be taken apart again."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body


class FrontStream:
    """A streamed answer on a front connection: `write` each piece, then `write_eof`."""

    __slots__ = ("_conn", "_head", "status")

    def __init__(self, conn: _Connection, status: int, headers: CIMultiDict[str], keep_alive: bool) -> None:
        self.status = status
        self._conn = conn
        head = _encode_head(status, headers.items(), keep_alive and not conn.server.is_closing)
        self._head: bytes | None = head + b"Transfer-Encoding: chunked\r\n\r\n"

    async def write(self, data: bytes) -> None:
        if not data:
            return
        piece = b"%x\r\n%b\r\n" % (len(data), data)
        await self._conn.write(self._take_head() + piece if self._head is not None else piece)

    async def write_eof(self) -> None:
        await self._conn.write(self._take_head() + b"0\r\n\r\n" if self._head is not None else b"0\r\n\r\n")

    def _take_head(self) -> bytes:
        head, self._head = self._head, None
        assert head is not None
        return head


class _Head:
    __slots__ = ("content_length", "content_type", "end", "handler", "headers", "keep_alive", "method", "target")

    def __init__(
        self,
        handler: Handler,
        method: str,
        target: str,
        headers: CIMultiDictProxy[str],
        content_length: int,
        content_type: str,
        keep_alive: bool,
        end: int,
    ) -> None:
        self.handler = handler
        self.method = method
        self.target = target
        self.headers = headers
        self.content_length = content_length
        self.content_type = content_type
        self.keep_alive = keep_alive
        self.end = end
        """Offset of the body's first byte in the buffer."""


def parse_head(
    buffer: bytes | bytearray, end: int, routes: Mapping[tuple[str, str], Handler], max_body_bytes: int
) -> _Head | None:
    """The head ending at `buffer[end:end + 4]` ("\\r\\n\\r\\n"), or None when the front does not serve it."""
    line_end = buffer.find(b"\r\n", 0, end + 2)
    line = _REQUEST_LINE.fullmatch(buffer, 0, line_end)
    if line is None:
        return None
    method = line.group(1).decode("ascii")
    target = line.group(2).decode("ascii")
    handler = routes.get((method, target.partition("?")[0]))
    if handler is None:
        return None
    if _FIELDS.fullmatch(buffer, line_end, end) is None:
        return None
    fields: list[tuple[str, str]] = []
    special: dict[str, str] = {}
    text = bytes(buffer[line_end + 2 : end]).decode("utf-8", "surrogateescape")
    for field in text.split("\r\n") if text else ():
        name, _, value = field.partition(":")
        value = value.strip(" \t")
        lower = name.lower()
        if lower in _SPECIAL:
            if lower in special:
                return None
            special[lower] = value
        fields.append((name, value))
    if "transfer-encoding" in special or "content-encoding" in special or "expect" in special or "upgrade" in special:
        return None
    length_text = special.get("content-length")
    if length_text is None:
        if method == "POST":
            return None  # aiohttp answers a POST without a length (411 or an empty body) as it always has
        length_text = "0"
    if not length_text.isdigit() or not length_text.isascii():
        return None
    content_length = int(length_text)
    if content_length > max_body_bytes:
        return None
    connection = special.get("connection")
    keep_alive = connection is None or "close" not in {t.strip().lower() for t in connection.split(",")}
    content_type = special.get("content-type")
    content_type = content_type.partition(";")[0].strip().lower() if content_type else "application/octet-stream"
    headers = CIMultiDictProxy(CIMultiDict(fields))
    return _Head(handler, method, target, headers, content_length, content_type, keep_alive, end + 4)


def _encode_head(status: int, headers: Iterable[tuple[str, str]], keep_alive: bool) -> bytes:
    """The status line and `headers`, which must be end-to-end ones: the front frames the answer itself (the
    proxy drops a replica's hop-by-hop headers before they get here)."""
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"]
    for name, value in headers:
        lines.append(f"{name}: {value}\r\n")
    if not keep_alive:
        lines.append("Connection: close\r\n")
    return "".join(lines).encode("utf-8", "surrogateescape")


def encode_response(response: web.StreamResponse | WholeAnswer, keep_alive: bool) -> bytes:
    """A whole answer (a `WholeAnswer`, or a `web.Response` with bytes for its body), framed by Content-Length."""
    if isinstance(response, WholeAnswer):
        body: bytes | None = response.body
        head = _encode_head(response.status, response.headers, keep_alive)
    else:
        assert isinstance(response, web.Response)
        assert response.body is None or isinstance(response.body, bytes)
        body = response.body
        head = _encode_head(response.status, response.headers.items(), keep_alive)
    if response.status in _NO_BODY_STATUS:
        return head + b"\r\n"
    body = body or b""
    return head + b"Content-Length: %d\r\n\r\n%b" % (len(body), body)


class _Connection(asyncio.Protocol):
    def __init__(self, server: FrontServer) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.state = _HEAD
        self.since = self.loop.time()
        """When the current state began: idle or head (keep-alive and header timeouts), or body (body timeout)."""
        self.buffer = bytearray()
        self.head: _Head | None = None
        self.scanned = 0
        """The head's end is not before this offset of the buffer."""
        self.task: asyncio.Task[None] | None = None
        self.close_after = False
        """Close once the answer in progress is written (the client asked for it)."""
        self.has_written = False
        """Bytes of the current answer have gone out: a failure now can only close the connection."""
        self._is_reading_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._is_writing_paused = False

    # --- asyncio.Protocol ---------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports do not subclass asyncio's
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self.state == _CLOSED:
            return
        if self.state == _BUSY:
            self.buffer += data
            if len(self.buffer) > _HIGH_WATER_BYTES and not self._is_reading_paused:
                self._is_reading_paused = True
                self.transport.pause_reading()  # type: ignore[union-attr]
            return
        if not self.buffer and self.state == _HEAD:
            self.since = self.loop.time()  # the head's first byte: the header timeout starts now
        self.buffer += data
        self._advance()

    def eof_received(self) -> bool:
        return False  # as with aiohttp, a client that shuts down its side has gone: close, cancelling its request

    def connection_lost(self, exc: Exception | None) -> None:
        self.state = _CLOSED
        self.server.connections.discard(self)
        if self.task is not None:
            self.task.cancel()  # the client went away: the upstream request is aborted
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("the client closed the connection"))
        self.server.connection_done()

    def pause_writing(self) -> None:
        self._is_writing_paused = True

    def resume_writing(self) -> None:
        self._is_writing_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    # --- requests -----------------------------------------------------------------------------------------

    def _advance(self) -> None:
        """Parses as far as the buffer allows; starts serving a request whose body is complete."""
        if self.state == _HEAD:
            end = self.buffer.find(b"\r\n\r\n", self.scanned)
            if end < 0:
                if len(self.buffer) > _MAX_HEAD_BYTES:
                    self._hand_over()
                else:
                    self.scanned = max(0, len(self.buffer) - 3)  # a head sent byte by byte is searched once
                return
            self.scanned = 0
            head = parse_head(self.buffer, end, self.server.routes, self.server.limits.max_body_bytes)
            if head is None:
                self._hand_over()
                return
            self.head = head
            self.state = _BODY
            if len(self.buffer) < head.end + head.content_length:
                self.since = self.loop.time()  # the body timeout starts once the head is complete
                return
        head = self.head
        assert head is not None
        need = head.end + head.content_length
        if len(self.buffer) < need:
            return
        body = bytes(self.buffer[head.end : need])
        del self.buffer[:need]
        self.head = None
        self.state = _BUSY
        if not head.keep_alive:
            self.close_after = True
        request = FrontRequest(head.method, head.target, head.headers, head.content_type, head.keep_alive, self)
        self.task = self.loop.create_task(self._serve(head.handler, request, body))

    async def _serve(self, handler: Handler, request: FrontRequest, body: bytes) -> None:
        server = self.server
        server.num_busy += 1
        server.num_served += 1
        try:
            response = await handler(request, body)
            if not isinstance(response, FrontStream) and self.state != _CLOSED and not self.has_written:
                self._send(encode_response(response, not self._must_close()))
        except asyncio.CancelledError:
            if self.state != _CLOSED:  # cancelled by the shutdown, not by the client going away
                self._abort()
            raise
        except ConnectionResetError:
            pass
        except Exception:
            log.exception("error serving %s %s", request.method, request.path)
            if self.state != _CLOSED:
                if self.has_written:  # half an answer is out: only closing the connection can tell the client
                    self._abort()
                else:
                    self._send(encode_response(error_response(500, "internal error in the router"), False))
                    self._close()
        finally:
            self.task = None
            server.num_busy -= 1
            server.connection_done()
        if self.state == _CLOSED:
            return
        if self._must_close():
            self._close()
            return
        self.state = _HEAD
        self.since = self.loop.time()
        self.has_written = False
        if self._is_reading_paused:
            self._is_reading_paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]
        if self.buffer:
            self._advance()

    def _must_close(self) -> bool:
        return self.close_after or self.server.is_closing

    async def write(self, data: bytes) -> None:
        transport = self.transport
        if self.state == _CLOSED or transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        transport.write(data)
        self.has_written = True
        if self._is_writing_paused:
            if self._drain is None:
                self._drain = self.loop.create_future()
            await self._drain

    def _hand_over(self) -> None:
        """From now on aiohttp serves this connection, starting with what is buffered."""
        transport = self.transport
        assert transport is not None
        self.state = _CLOSED
        self.server.connections.discard(self)
        self.server.num_handed_over += 1
        handler = self.server.aiohttp_protocol()
        if self._is_reading_paused:
            transport.resume_reading()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if self.buffer:
            buffered, self.buffer = bytes(self.buffer), bytearray()
            handler.data_received(buffered)

    # --- the sweep ----------------------------------------------------------------------------------------

    def check_timeouts(self, now: float, limits: LimitSettings) -> None:
        if self.state == _HEAD:
            if not self.buffer:
                if now - self.since > limits.keepalive_timeout_s or self.server.is_closing:
                    self._close()
            elif now - self.since > limits.header_read_timeout_s:
                self._refuse(408, f"request head not received within {limits.header_read_timeout_s} s")
        elif self.state == _BODY and now - self.since > limits.body_read_timeout_s:
            self._refuse(408, f"request body not received within {limits.body_read_timeout_s} s")

    def _refuse(self, status: int, message: str) -> None:
        self._send(encode_response(error_response(status, message, code="request_timeout"), keep_alive=False))
        self._close()

    def _send(self, data: bytes) -> None:
        self.transport.write(data)  # type: ignore[union-attr]

    def _close(self) -> None:
        self.state = _CLOSED
        self.transport.close()  # type: ignore[union-attr]

    def _abort(self) -> None:
        self.state = _CLOSED
        self.transport.abort()  # type: ignore[union-attr]


class FrontServer:
    """Listens for the router: serves the requests `routes` names ((method, path) -> handler) and hands the rest to
    aiohttp (`aiohttp_protocol`, a `web.Server`)."""

    def __init__(
        self,
        routes: Mapping[tuple[str, str], Handler],
        aiohttp_protocol: Callable[[], asyncio.Protocol],
        limits: LimitSettings,
    ) -> None:
        self.routes = routes
        self.aiohttp_protocol = aiohttp_protocol
        self.limits = limits
        self.loop = asyncio.get_running_loop()
        self.connections: set[_Connection] = set()
        self.num_busy = 0
        """Requests being served (their bodies complete) by the front now."""
        self.num_served = 0
        """Requests the front has served since it started."""
        self.num_handed_over = 0
        """Connections handed to aiohttp since the front started."""
        self.is_closing = False
        self._server: asyncio.Server | None = None
        self._sweep: asyncio.TimerHandle | None = None
        self._sweep_interval_s = min(
            _SWEEP_INTERVAL_S,
            limits.header_read_timeout_s / 4,
            limits.body_read_timeout_s / 4,
            limits.keepalive_timeout_s / 4,
        )
        self._idle: asyncio.Future[None] | None = None

    async def start(self, host: str, port: int, *, reuse_port: bool | None = None, backlog: int = 1024) -> None:
        self._server = await self.loop.create_server(
            lambda: _Connection(self), host, port, backlog=backlog, reuse_address=True, reuse_port=reuse_port
        )
        self._sweep = self.loop.call_later(self._sweep_interval_s, self._run_sweep)

    @property
    def addresses(self) -> list[tuple[str, int]]:
        assert self._server is not None
        return [sock.getsockname()[:2] for sock in self._server.sockets]

    async def shutdown(self, grace_s: float) -> None:
        """Stops accepting, closes idle connections, and waits up to `grace_s` for requests being served."""
        self.is_closing = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if conn.state == _HEAD and not conn.buffer:
                conn._close()
        if self._busy_or_reading():
            self._idle = self.loop.create_future()
            try:
                await asyncio.wait_for(asyncio.shield(self._idle), grace_s)
            except TimeoutError:
                log.warning("shutdown: %d requests still in flight after %.0f s, cancelled", self.num_busy, grace_s)
        for conn in list(self.connections):
            if conn.task is not None:
                conn.task.cancel()
            if conn.transport is not None and conn.state != _CLOSED:
                conn._abort()
        if self._sweep is not None:
            self._sweep.cancel()

    def connection_done(self) -> None:
        if self._idle is not None and not self._idle.done() and not self._busy_or_reading():
            self._idle.set_result(None)

    def _busy_or_reading(self) -> bool:
        return self.num_busy > 0 or any(conn.state == _BODY for conn in self.connections)

    def _run_sweep(self) -> None:
        now = self.loop.time()
        for conn in list(self.connections):
            conn.check_timeouts(now, self.limits)
        self.connection_done()
        self._sweep = self.loop.call_later(self._sweep_interval_s, self._run_sweep)
