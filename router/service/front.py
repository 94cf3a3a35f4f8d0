"""The router's HTTP/1.1 server: `asyncio` protocols with httptools (llhttp, uvicorn's parser) doing the parsing.

Every endpoint is served here, inference and admin alike, so one parser, one set of limits and one set of timeouts
guard the router's port; there is no second server to hand a connection to. `FrontServer` takes `routes`
((method, path) -> handler) and a `fallback` handler for every other request (the app answers /v1/* passthrough,
/admin/* and 404 there). A handler gets the request and its whole body, already de-chunked and decoded.

What the server does:
- Framing and hostile input are llhttp's, in its strict mode: Content-Length or chunked (never both, never a
  repeated length), no obs-fold, bare CR or LF, or invalid characters. One Host header, as RFC 9112 3.2 asks: none
  in an HTTP/1.1 request, or two in any, is a 400. A request it rejects is answered 400 (or 413, 415, 417, 431, 505
  by the rule it broke) with `Connection: close` at once, after the answers to every valid request pipelined before
  it; no malformed request waits for a timeout, and none logs more than one line.
- Bodies: at most `limits.max_body_bytes` (413 beyond, before the body is read when a length says so); gzip and
  deflate content codings are decoded within the same bound; `Expect: 100-continue` gets its interim answer.
- Keep-alive, with pipelined requests answered in order; reading pauses while one is served and more than
  `_HIGH_WATER_BYTES` or `_MAX_PIPELINED` requests wait behind it.
- A client that goes away cancels its request's task, which aborts the upstream request, so the replica stops
  generating for nobody.
- Timeouts without a timer per request: a sweep once a second closes idle connections after
  `limits.keepalive_timeout_s`, and answers 408 to a head not complete within `limits.header_read_timeout_s` or a
  body not complete within `limits.body_read_timeout_s`.
- Answers: a whole body with Content-Length, or a stream (SSE) in chunked transfer coding, each chunk written as it
  arrives; writes wait while the client's socket buffer is full.
- Shutdown: stop accepting, close idle connections, let requests in flight finish within the grace period.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import zlib
from collections.abc import Awaitable, Iterable, Mapping
from http import HTTPStatus
from typing import Protocol, TypeAlias

import httptools
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from router.service.errors import error_response
from router.service.settings import LimitSettings

log = logging.getLogger("shoal.router")

_MAX_HEAD_BYTES = 64 * 1024
"""Bytes a request head may take (431 beyond): far above what OpenAI clients send, far below memory trouble."""
_RAISE_BODY_LIMIT = " (limits.max_body_bytes, SHOAL_ROUTER_LIMITS__MAX_BODY_BYTES, raises it)"
_HEAD_TOO_LARGE = f"request head larger than {_MAX_HEAD_BYTES} bytes (a fixed limit)"


def _framing_refusal() -> _Refusal:
    return _Refusal(431, f"chunk framing and trailers larger than {_MAX_HEAD_BYTES} bytes", "head_too_large")


_LINGER_S = 2.0
"""Seconds a refused connection is read and discarded after its answer, so that the answer is not reset away."""
_HIGH_WATER_BYTES = 1024 * 1024
"""Bytes of following requests buffered while one is served, past which reading pauses."""
_MAX_PIPELINED = 32
"""Complete requests queued behind the one being served, past which reading pauses."""
_SWEEP_INTERVAL_S = 1.0
"""How often connections are checked for timeouts; more often when a timeout is shorter than 4 s."""
_NO_BODY_STATUS = frozenset({204, 304})
_REASONS = {status.value: status.phrase for status in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# zlib's window bits: gzip only, or zlib (deflate as RFC 9110 names it) and raw deflate, which some clients send.
_DECODERS = {"gzip": (16 + zlib.MAX_WBITS,), "x-gzip": (16 + zlib.MAX_WBITS,), "deflate": (zlib.MAX_WBITS, -15)}

# Where the request being read stands: between requests, in its head, in its body; and a closed connection.
_IDLE, _HEAD, _BODY, _CLOSED = range(4)

Answer: TypeAlias = "web.StreamResponse | WholeAnswer | FrontStream"
Body: TypeAlias = bytes | bytearray
"""A request body as read: its one chunk, or the bytearray its chunks were appended to. Never changed once read."""


class Handler(Protocol):
    """What serves a parsed request. Returns a whole answer, or the stream it has written."""

    def __call__(self, request: FrontRequest, body: Body, /) -> Awaitable[Answer]: ...


class FrontRequest:
    """A request with the attributes of `aiohttp.web.Request` that the proxy and the admin API read."""

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
        """Header values decoded from UTF-8 with surrogateescape, so any byte survives a round trip upstream."""
        self.content_type = content_type
        """The media type, lower case, without parameters; application/octet-stream when absent (as aiohttp)."""
        self.keep_alive = keep_alive
        self._conn = conn

    async def start_stream(self, status: int, headers: CIMultiDict[str]) -> FrontStream:
        """An answer whose body follows in pieces: chunked transfer coding. The head goes out with the first piece."""
        return FrontStream(self._conn, status, headers, self.keep_alive)

    def deliver(self, answer: WholeAnswer) -> None:
        """Write a whole answer now, before the handler returns, so that its bookkeeping after the answer (metrics,
        the request's log line) does not delay the client; the server does not write it again."""
        conn = self._conn
        if conn.state != _CLOSED:
            conn._send(encode_response(answer, not conn._must_close()))
            conn.has_written = True


class WholeAnswer:
    """A complete answer for the server to write: status, end-to-end header pairs and body. The proxy hands a
    replica's whole answer on in this form, since a `web.Response` would only be built to be taken apart again."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body


class FrontStream:
    """A streamed answer on a connection: `write` each piece, then `write_eof`."""

    __slots__ = ("_conn", "_head", "status")

    def __init__(self, conn: _Connection, status: int, headers: CIMultiDict[str], keep_alive: bool) -> None:
        self.status = status
        self._conn = conn
        head = _encode_head(status, headers.items(), keep_alive and not conn._must_close())
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


def _encode_head(status: int, headers: Iterable[tuple[str, str]], keep_alive: bool) -> bytes:
    """The status line and `headers`, which must be end-to-end ones: the server frames the answer itself (the
    proxy drops a replica's hop-by-hop headers before they get here)."""
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"]
    for name, value in headers:
        lines.append(f"{name}: {value}\r\n")
    if not keep_alive:
        lines.append("Connection: close\r\n")
    return "".join(lines).encode("utf-8", "surrogateescape")


def encode_response(response: web.StreamResponse | WholeAnswer, keep_alive: bool, *, is_head: bool = False) -> bytes:
    """A whole answer (a `WholeAnswer`, or a `web.Response` with bytes for its body), framed by Content-Length;
    without its body for a HEAD request."""
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
    head += b"Content-Length: %d\r\n\r\n" % len(body)
    return head if is_head else head + body


class _Refusal(Exception):
    """A request the server answers itself with an error."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code

    def answer(self) -> web.Response:
        return error_response(self.status, self.message, code=self.code)


class _StopParsing(Exception):
    """Raised by a parser callback to stop at a request after which nothing is read (Connection: close)."""


class _Pending:
    """A complete request waiting its turn: a handler to run, or the error answer the server already chose."""

    __slots__ = ("body", "coding", "handler", "refusal", "request")

    def __init__(
        self,
        request: FrontRequest,
        body: Body,
        handler: Handler | None,
        refusal: _Refusal | None = None,
        coding: str | None = None,
    ) -> None:
        self.request = request
        self.body = body
        self.handler = handler
        self.refusal = refusal
        self.coding = coding
        """The Content-Encoding of a body still to be decoded (on a thread, when its turn comes); None: decoded."""


class _Connection(asyncio.Protocol):
    def __init__(self, server: FrontServer) -> None:
        self.server = server
        self.loop = server.loop
        self.limits = server.limits
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.state = _IDLE
        self.since = self.loop.time()
        """When the current state began: idle or head (keep-alive and header timeouts), or body (body timeout)."""
        self.pending: collections.deque[_Pending] = collections.deque()
        self.pending_bytes = 0
        self.task: asyncio.Task[None] | None = None
        self.refusal: _Refusal | None = None
        """The error that ends the connection, answered once every request before it is."""
        self.is_reading_done = False
        """Nothing more is parsed: a refusal, a request that asked to close, or an upgrade."""
        self.close_after = False
        """Close once the answer in progress is written (the client asked for it)."""
        self.has_written = False
        """Bytes of the current answer have gone out: a failure now can only close the connection."""
        self._is_reading_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._is_writing_paused = False
        # The request being read.
        self._url = b""
        self._fields: list[tuple[bytes, bytes]] = []
        self._body: Body = b""
        """The body read so far: its one chunk, or a bytearray the chunks are appended to (glibc grows a large one in
        place with mremap, where joining a list of chunks at the end copied 20 MB in one go)."""
        self._body_bytes = 0
        self._head_bytes = 0
        self._framing_bytes = 0
        """Bytes read while in a message's body beyond the body itself: chunk sizes and, after the last chunk, the
        trailer fields, which neither the head's nor the body's limit covers (llhttp's parser accumulates a field
        by concatenation, so an unbounded trailer costs quadratic time)."""
        self._num_completed = 0
        self._request: FrontRequest | None = None
        self._handler: Handler | None = None
        self._coding: str | None = None
        self._is_continue_due = False

    # --- asyncio.Protocol ---------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports do not subclass asyncio's
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self.state == _CLOSED or self.is_reading_done:
            return
        was_in_body, num_completed = self.state == _BODY, self._num_completed
        body_bytes_before = self._body_bytes
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _Refusal):
                self._end_reading(cause)
            elif isinstance(cause, _StopParsing):
                self._end_reading(None)
            else:  # a bug in the callbacks below: one error line, and the client still gets its answer
                log.error("error parsing a request: %r", cause)
                self._end_reading(_Refusal(500, "internal error in the router", "internal_error"))
        except httptools.HttpParserUpgrade:
            self._end_reading(None)  # the request asking to switch protocols is answered in HTTP/1.1, then closed
        except httptools.HttpParserError as exc:
            self._end_reading(_Refusal(400, f"malformed request: {exc}", "invalid_request"))
        else:
            if self._num_completed != num_completed:
                pass  # a message ended in `data`: the next head's bytes in it are not told apart; the next read counts
            elif self.state == _HEAD:
                self._check_partial_head(data)
            elif was_in_body and self.state == _BODY:
                self._check_framing(len(data) - (self._body_bytes - body_bytes_before))
        if self.task is None:
            self._serve_next()
        elif not self._is_reading_paused and (
            len(self.pending) >= _MAX_PIPELINED or self.pending_bytes + self._body_bytes > _HIGH_WATER_BYTES
        ):
            self._is_reading_paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]

    def eof_received(self) -> bool:
        return False  # as with aiohttp, a client that shuts down its side has gone: close, cancelling its request

    def connection_lost(self, exc: Exception | None) -> None:
        self.state = _CLOSED
        self.pending.clear()
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

    # --- httptools callbacks ------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.state = _HEAD
        self.since = self.loop.time()
        self._url = b""
        self._fields = []
        self._body = b""
        self._body_bytes = 0
        self._head_bytes = 0
        self._framing_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.state == _BODY:  # a trailer field (after the last chunk): counted as framing, never kept
            if self._framing_exceeds(len(name) + len(value) + 4):
                raise _framing_refusal()
            return
        self._fields.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self.parser
        version = parser.get_http_version()
        if version not in ("1.1", "1.0"):
            raise _Refusal(505, f"HTTP/{version} is not supported; use HTTP/1.1", "http_version_not_supported")
        method = parser.get_method().decode("ascii")
        target = self._url.decode("latin-1")  # llhttp lets no byte above 0x7f into a target
        if not target.startswith("/"):
            raise _Refusal(400, "the request target must be a path (origin-form)", "invalid_request")
        # llhttp strips the whitespace before a value, not after it (RFC 9110 5.5: both are not part of it).
        headers = CIMultiDictProxy(
            CIMultiDict(
                (name.decode("latin-1"), value.decode("utf-8", "surrogateescape").rstrip(" \t"))
                for name, value in self._fields
            )
        )
        if len(self._url) + sum(len(name) + len(value) + 4 for name, value in self._fields) > _MAX_HEAD_BYTES:
            raise _Refusal(431, _HEAD_TOO_LARGE, "head_too_large")
        num_hosts = len(headers.getall("Host", ()))
        if num_hosts > 1 or (num_hosts == 0 and version == "1.1"):  # RFC 9112 3.2: 400 to either
            detail = "several Host headers" if num_hosts else "no Host header"
            raise _Refusal(400, f"{detail}: an HTTP/1.1 request carries exactly one", "invalid_request")
        self._fields = []
        limit = self.limits.max_body_bytes
        length = headers.get("Content-Length")
        # llhttp has checked that it is digits of a value within 64 bits; leading zeros can still make the digits
        # more than int() converts (4,300), so they go first.
        if length is not None and int(length.strip().lstrip("0") or "0") > limit:
            raise _Refusal(413, f"request body is larger than {limit} bytes{_RAISE_BODY_LIMIT}", "request_too_large")
        transfer_coding = headers.get("Transfer-Encoding")
        if transfer_coding is not None and transfer_coding.strip().lower() != "chunked":  # llhttp: chunked is last
            raise _Refusal(501, f"Transfer-Encoding {transfer_coding!r} is not supported (chunked)", "not_implemented")
        coding = headers.get("Content-Encoding")
        if coding is not None:
            coding = coding.strip().lower()
            if coding == "identity":
                coding = None
            elif coding not in _DECODERS:
                raise _Refusal(
                    415, f"Content-Encoding {coding!r} is not supported (gzip, deflate)", "unsupported_encoding"
                )
        expect = headers.get("Expect")
        if expect is not None:
            if expect.strip().lower() != "100-continue":
                raise _Refusal(417, "the only expectation supported is 100-continue", "expectation_failed")
            self._is_continue_due = length != "0"
        self._coding = coding
        content_type = headers.get("Content-Type")
        content_type = content_type.partition(";")[0].strip().lower() if content_type else "application/octet-stream"
        keep_alive = parser.should_keep_alive()
        self._request = FrontRequest(method, target, headers, content_type, keep_alive, self)
        self._handler = self.server.routes.get((method, self._request.path), self.server.fallback)
        self.state = _BODY
        self.since = self.loop.time()
        if self._is_continue_due and self.task is None and not self.pending:
            self._send_continue()

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self.limits.max_body_bytes:
            raise _Refusal(
                413,
                f"request body is larger than {self.limits.max_body_bytes} bytes{_RAISE_BODY_LIMIT}",
                "request_too_large",
            )
        if not self._body:
            self._body = body
        else:
            if type(self._body) is bytes:
                self._body = bytearray(self._body)
            self._body += body

    def on_message_complete(self) -> None:
        request = self._request
        assert request is not None
        body = self._body
        self._body = b""
        self._body_bytes = 0
        self._is_continue_due = False
        refusal = None
        coding = self._coding if body else None
        if coding is not None and len(body) < _DECODE_ON_LOOP_MAX_BYTES:
            try:
                body = _decode(body, coding, self.limits.max_body_bytes)
            except _Refusal as exc:
                refusal = exc
            coding = None  # decoded here, not on a thread
        self._num_completed += 1
        self.pending.append(_Pending(request, body, self._handler, refusal, coding))
        self.pending_bytes += len(body)
        self.state = _IDLE
        self.since = self.loop.time()
        self._request = None
        if not request.keep_alive:
            raise _StopParsing

    # --- requests -----------------------------------------------------------------------------------------

    def _check_partial_head(self, data: bytes) -> None:
        """A head still incomplete after `data`: refuse one that is too large, or an HTTP/0.9 request line (a path
        and a line end, no version), which llhttp would wait on for ever."""
        self._head_bytes += len(data)
        if self._head_bytes > _MAX_HEAD_BYTES:
            self._end_reading(_Refusal(431, _HEAD_TOO_LARGE, "head_too_large"))
        elif self._url and self.parser.get_http_version() == "0.0" and data.rfind(b"\n") > data.rfind(b" "):
            self._end_reading(_Refusal(400, "malformed request: HTTP/0.9 is not supported", "invalid_request"))

    def _check_framing(self, num_bytes: int) -> None:
        """Refuse a body whose chunk framing and trailers outgrow a head's limit plus the body itself (honest
        clients send chunks of kilobytes, whose size lines are a few bytes each, and few trailers if any)."""
        if self._framing_exceeds(num_bytes):
            self._end_reading(_framing_refusal())

    def _framing_exceeds(self, num_bytes: int) -> bool:
        """Count `num_bytes` more of framing or trailers; whether they now outgrow a head's limit plus the body."""
        self._framing_bytes += num_bytes
        return self._framing_bytes > _MAX_HEAD_BYTES + self._body_bytes

    def _end_reading(self, refusal: _Refusal | None) -> None:
        """Parse nothing more; answer the requests already complete, then `refusal` if any, then close."""
        self.is_reading_done = True
        self.refusal = refusal
        if refusal is not None and refusal.status >= 500:
            log.warning("refused a request: %s", refusal.message)
        elif refusal is not None:
            log.info("refused a request: %d %s", refusal.status, refusal.message)
        if not self._is_reading_paused and self.transport is not None:
            self._is_reading_paused = True
            self.transport.pause_reading()

    def _serve_next(self) -> None:
        """Starts the next complete request, or, with none left, ends a connection that reads no more."""
        if self.state == _CLOSED or self.task is not None:
            return
        if self.pending:
            item = self.pending.popleft()
            self.pending_bytes -= len(item.body)
            self.task = self.loop.create_task(self._serve(item))
            return
        if self.is_reading_done:
            if self.refusal is not None:
                self._send(encode_response(self.refusal.answer(), keep_alive=False))
            self._close()
            return
        if self._is_reading_paused:
            self._is_reading_paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]
        if self._is_continue_due:
            self._send_continue()

    async def _serve(self, item: _Pending) -> None:
        server = self.server
        request = item.request
        server.num_busy += 1
        server.num_served += 1
        if not request.keep_alive or (self.is_reading_done and not self.pending and self.refusal is None):
            self.close_after = True  # the client asked to close, or the request asked for an upgrade
        is_head = request.method == "HEAD"
        try:
            body, refusal = item.body, item.refusal
            if item.coding is not None:
                try:  # zlib releases the GIL: the loop serves other requests meanwhile
                    body = await asyncio.to_thread(_decode, body, item.coding, self.limits.max_body_bytes)
                except _Refusal as exc:
                    refusal = exc
            if refusal is not None:
                response: Answer = refusal.answer()
            else:
                assert item.handler is not None
                response = await item.handler(request, body)
            if not isinstance(response, FrontStream) and self.state != _CLOSED and not self.has_written:
                self._send(encode_response(response, not self._must_close(), is_head=is_head))
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
        self.has_written = False
        if self.state != _IDLE:
            self.since = self.loop.time()  # the next request's head or body: its timeout starts now
        self._serve_next()

    def _must_close(self) -> bool:
        return self.close_after or self.server.is_closing

    def _send_continue(self) -> None:
        self._is_continue_due = False
        self._send(_CONTINUE)

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

    # --- the sweep ----------------------------------------------------------------------------------------

    def check_timeouts(self, now: float, limits: LimitSettings) -> None:
        if self.task is not None or self.pending or self.is_reading_done:
            return
        if self.state == _IDLE:
            if now - self.since > limits.keepalive_timeout_s or self.server.is_closing:
                self._close()
        elif self.state == _HEAD and now - self.since > limits.header_read_timeout_s:
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
        transport = self.transport
        assert transport is not None
        if self.refusal is None or not transport.can_write_eof():
            transport.close()
            return
        # A refused request may leave bytes the client is still sending: closing over unread bytes makes the kernel
        # reset the connection, which can destroy the refusal before the client reads it. So, as nginx's lingering
        # close: end the answer (FIN), read on and discard (data_received ignores a closed connection), and close
        # when the client does or after _LINGER_S.
        transport.write_eof()
        if self._is_reading_paused:
            self._is_reading_paused = False
            transport.resume_reading()
        self.loop.call_later(_LINGER_S, transport.close)

    def _abort(self) -> None:
        self.state = _CLOSED
        self.transport.abort()  # type: ignore[union-attr]


_DECODE_ON_LOOP_MAX_BYTES = 16 * 1024
"""Compressed bodies of this size and more are decoded on a thread when their turn comes: 8.6 MB of gzipped token
ids decode to 19 MB in about 90 ms. A smaller one inflates to 16 MB at most (deflate's ratio is at most 1032:1),
some 20 ms of work even as a bomb of zeros."""


def _decode(body: Body, coding: str, limit: int) -> bytes:
    """A gzip or deflate body, decoded to at most `limit` bytes (so a small bomb cannot fill memory)."""
    for wbits in _DECODERS[coding]:
        decoder = zlib.decompressobj(wbits)
        try:
            decoded = decoder.decompress(body, limit + 1)
        except zlib.error:
            continue
        if len(decoded) > limit or decoder.unconsumed_tail:
            raise _Refusal(
                413, f"decoded request body is larger than {limit} bytes{_RAISE_BODY_LIMIT}", "request_too_large"
            )
        if decoder.eof:
            return decoded
    raise _Refusal(400, f"request body is not valid {coding} data", "invalid_encoding")


class FrontServer:
    """Listens for the router: serves the requests `routes` names ((method, path) -> handler) and the rest with
    `fallback`."""

    def __init__(self, routes: Mapping[tuple[str, str], Handler], fallback: Handler, limits: LimitSettings) -> None:
        self.routes = routes
        self.fallback = fallback
        self.limits = limits
        self.loop = asyncio.get_running_loop()
        self.connections: set[_Connection] = set()
        self.num_busy = 0
        """Requests being served (their bodies complete) now."""
        self.num_served = 0
        """Requests answered since the server started, refused ones included."""
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
            if conn.state == _IDLE and conn.task is None and not conn.pending:
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
        return self.num_busy > 0 or any(conn.state == _BODY or conn.pending for conn in self.connections)

    def _run_sweep(self) -> None:
        now = self.loop.time()
        for conn in list(self.connections):
            conn.check_timeouts(now, self.limits)
        self.connection_done()
        self._sweep = self.loop.call_later(self._sweep_interval_s, self._run_sweep)
