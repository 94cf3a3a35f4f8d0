"""A lean HTTP/1.1 client for the router -> replica hop: `UpstreamPool` hands out `UpstreamResponse`s.

Why not aiohttp's ClientSession: most of its CPU per proxied request goes to layers this hop never uses (URL
objects, cookies, tracing, multidict headers, StreamReader); `python -m benchmarks.bench_upstream` compares the two.
Here each connection carries one request at a time (no pipelining) and idle keep-alive connections are pooled per
(host, port), newest reused first.

- `_Connection` is an `asyncio.Protocol` (plain asyncio or uvloop): `data_received` feeds httptools' response
  parser (llhttp, strict), whose callbacks collect the head and append de-chunked body bytes to one bytearray, and
  wakes the one coroutine reading it through a Future.
- Framing is llhttp's (RFC 9112 6.3): no body after 1xx, 204 or 304; chunked when it is the final transfer coding;
  otherwise Content-Length, or, with neither, until EOF. Both at once, a repeated or malformed length, a bad chunk
  or a head over `_MAX_HEAD_BYTES` is a protocol error. After HEAD the body is skipped here (httptools cannot be told
  to), with a fresh parser for the connection's next response.
- Flow control: reading pauses once more than `_HIGH_WATER_BYTES` of body sit unconsumed. A reader always takes every
  body byte that is buffered, so it resumes reading before it waits, and the buffer stays bounded however slow it is.
- A connection goes back to the pool only when its response was framed to the last byte, nothing extra arrived, and
  both sides keep it alive. Any other end (an error, a timeout, a cancelled task, a response closed mid-body) aborts
  it, so the replica sees the router gone at once and stops generating for nobody.
- A reused idle connection that ends before any response byte (the server closed it while idle) is retried once on a
  fresh connection; the server never began an answer. Every HTTP client does this, for POSTs too.
- `read_timeout_s` bounds each wait for bytes (the head, or the next body bytes), like aiohttp's `sock_read`; a
  bound on the whole request is the caller's. Long ones are swept, not timed one by one (`Deadlines`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import deque
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import cast

import httptools

from router.service.deadlines import Deadlines

_MAX_HEAD_BYTES = 64 * 1024
"""Status line plus headers (and, separately, chunked trailers): a larger head is a protocol error."""
_HIGH_WATER_BYTES = 1024 * 1024
"""Unconsumed bytes at which reading from the socket pauses."""
_LOW_WATER_BYTES = 256 * 1024
"""Unconsumed bytes under which a paused connection reads again."""
_SMALL_BODY_BYTES = 64 * 1024
"""Bodies up to this size are joined to the head for a single write; larger ones are written after it."""

_MANAGED_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})
_NO_BODY_METHODS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS", "TRACE"})


class UpstreamError(Exception):
    """Any failure of an upstream request."""


class UpstreamConnectError(UpstreamError):
    """No connection could be made (refused, unreachable, connect timeout): safe to retry elsewhere."""


class UpstreamDisconnected(UpstreamError):
    """The connection closed or was reset before the response was complete."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """No bytes arrived within the read timeout."""


class UpstreamProtocolError(UpstreamError):
    """The response broke HTTP/1.1 framing or a size limit."""


class _StaleConnection(UpstreamDisconnected):
    """A reused connection ended before any byte of the response: the server closed it while it was idle."""


class _Stop(Exception):
    """Raised by a parser callback to stop parsing (a HEAD answer's head, bytes past the end of a response)."""


class _Connection(asyncio.Protocol):
    """One TCP connection. States: in use (a request is on it), idle (in the pool), ended (no more bytes).

    The parser's callbacks fill the exchange in progress: `response` once its head is in (1xx heads are skipped),
    body bytes in `buffer`, `is_message_done` once llhttp saw its end, `error` once it broke framing."""

    __slots__ = (
        "_fields",
        "buffer",
        "end_error",
        "error",
        "has_data",
        "has_extra",
        "head_bytes",
        "idle_since",
        "is_closed",
        "is_ended",
        "is_head_done",
        "is_head_request",
        "is_idle",
        "is_interim",
        "is_keep_alive",
        "is_message_done",
        "is_paused",
        "is_reused",
        "is_until_eof",
        "key",
        "loop",
        "lost",
        "parser",
        "pool",
        "reason",
        "response",
        "trailers",
        "transport",
        "waiter",
    )

    def __init__(self, pool: UpstreamPool, key: tuple[str, int], loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.key = key
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.buffer = bytearray()
        """Body bytes received and not yet handed out."""
        self.is_closed = False  # given up by us: no longer counted by the pool
        self.is_ended = False  # no more bytes will arrive
        self.end_error: str | None = None  # why it ended; None: a clean EOF from the server
        self.is_idle = False
        self.is_paused = False
        self.is_reused = False
        self.has_data = False  # a byte arrived since the current request was sent
        self.idle_since = 0.0
        self.waiter: asyncio.Future[None] | None = None
        self.lost: asyncio.Future[None] | None = None  # made by UpstreamPool.close to await connection_lost
        self.begin_exchange(False)

    def begin_exchange(self, is_head_request: bool) -> None:
        """A request is about to be written: forget the previous exchange."""
        self.is_head_request = is_head_request
        self.response: UpstreamResponse | None = None
        """Set once the head is parsed, until `_exchange` hands it out (it must not outlive its caller's use)."""
        self.is_head_done = False
        self.trailers: list[tuple[str, str]] = []
        self.error: UpstreamProtocolError | None = None
        self.is_message_done = False
        self.is_interim = False
        self.is_keep_alive = False
        self.is_until_eof = False
        self.has_extra = False
        self.head_bytes = 0
        self.reason = b""
        self._fields: list[tuple[str, str]] = []

    # --- asyncio.Protocol ---------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.pool._opened(self)

    def data_received(self, data: bytes) -> None:
        if self.is_idle:
            self.abort("data arrived on an idle connection")  # no request asked for it: the stream is out of step
            return
        self.has_data = True
        if self.error is None and not self.has_extra:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserCallbackError as exc:
                cause = exc.__context__
                if isinstance(cause, UpstreamProtocolError):
                    self.error = cause
                elif not isinstance(cause, _Stop):
                    self.error = UpstreamProtocolError(f"invalid response: {cause!r}")
                elif self.is_head_request and not data.endswith(b"\r\n\r\n"):
                    self.has_extra = True  # a body after a HEAD answer: the stream is out of step
            except httptools.HttpParserUpgrade:
                self.error = UpstreamProtocolError("101 Switching Protocols to a request that asked for no upgrade")
            except httptools.HttpParserError as exc:
                self.error = UpstreamProtocolError(f"invalid response: {exc}")
            if not self.is_head_done and self.error is None:
                self.head_bytes += len(data)
                if self.head_bytes > _MAX_HEAD_BYTES:
                    self.error = UpstreamProtocolError(f"response head larger than {_MAX_HEAD_BYTES} bytes")
        if len(self.buffer) > _HIGH_WATER_BYTES and not self.is_paused and self.transport is not None:
            self.is_paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool | None:
        return None  # the transport closes itself; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.is_ended:
            self.is_ended = True
            self.end_error = None if exc is None else f"{type(exc).__name__}: {exc}"
        if self.is_until_eof and self.end_error is None:
            self.is_message_done = True  # a body framed by the connection's end is complete
        self._give_up()
        self._wake()
        if self.lost is not None and not self.lost.done():
            self.lost.set_result(None)

    # --- httptools callbacks ------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.is_message_done:
            self.has_extra = True  # bytes past the end of the response: the stream is out of step
            raise _Stop

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_bytes += len(name) + len(value)
        if self.head_bytes > _MAX_HEAD_BYTES:
            raise UpstreamProtocolError(f"response head or trailers larger than {_MAX_HEAD_BYTES} bytes")
        field = (name.decode("latin-1"), value.decode("utf-8", "surrogateescape").rstrip(" \t"))
        if self.is_head_done:
            self.trailers.append(field)
        else:
            self._fields.append(field)

    def on_headers_complete(self) -> None:
        parser = self.parser
        status = parser.get_status_code()
        fields, self._fields = self._fields, []
        reason, self.reason = self.reason.decode("latin-1"), b""
        if status < 200:
            if status == 101:
                raise UpstreamProtocolError("101 Switching Protocols to a request that asked for no upgrade")
            self.is_interim = True  # 100 Continue, 103 Early Hints: the final response follows
            self.head_bytes = 0
            return
        content_type = ""
        has_length = has_coding = is_chunked = False
        for name, value in fields:
            lower = name.lower()
            if lower == "content-type" and not content_type:
                content_type = value.partition(";")[0].strip(" \t").lower()
            elif lower == "content-length":
                has_length = True
            elif lower == "transfer-encoding":
                has_coding = True
                is_chunked = value.rpartition(",")[2].strip(" \t").lower() == "chunked"
        self.response = UpstreamResponse(status, reason, fields, content_type)
        self.is_head_done = True
        self.is_keep_alive = parser.should_keep_alive()
        self.head_bytes = 0
        if self.is_head_request:
            self.is_message_done = True
            self.parser = httptools.HttpResponseParser(self)  # this one would wait for the body a HEAD answer lacks
            raise _Stop
        # llhttp reads until EOF unless chunked is the last transfer coding, or a length is given (RFC 9112 6.3).
        self.is_until_eof = not is_chunked and (has_coding or not has_length) and status not in (204, 304)
        if self.is_until_eof:
            self.is_keep_alive = False

    def on_body(self, body: bytes) -> None:
        self.buffer += body

    def on_message_complete(self) -> None:
        if self.is_interim:
            self.is_interim = False
            return
        self.is_message_done = True

    # --- used by the pool and responses -------------------------------------------------------------------

    async def wait_for_data(self, timeout_s: float | None) -> None:
        """Returns once more bytes arrived or the connection ended; raises UpstreamTimeout after `timeout_s`."""
        if self.is_ended:
            return
        if self.is_paused:
            self.resume()
        waiter = self.loop.create_future()
        self.waiter = waiter
        timer = None if timeout_s is None else self.pool.deadlines.call_later(timeout_s, _expire, waiter, timeout_s)
        try:
            await waiter
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()

    def resume(self) -> None:
        if self.is_paused:
            self.is_paused = False
            if self.transport is not None and not self.is_ended:
                self.transport.resume_reading()

    def close(self) -> None:
        """Closes gracefully (FIN): for a connection whose exchange is complete."""
        if not self.is_ended:
            self.is_ended = True
            self.end_error = "closed by the client"
        self._give_up()
        if self.transport is not None:
            self.transport.close()

    def abort(self, reason: str = "aborted by the client") -> None:
        """Drops the connection at once, unsent bytes included: the server sees it gone on its next read or write."""
        if not self.is_ended:
            self.is_ended = True
            self.end_error = reason
        self._give_up()
        self._wake()
        if self.transport is not None:
            self.transport.abort()

    def _give_up(self) -> None:
        if not self.is_closed:
            self.is_closed = True
            self.pool._forget(self)

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _expire(waiter: asyncio.Future[None], timeout_s: float) -> None:
    if not waiter.done():
        waiter.set_exception(UpstreamTimeout(f"no response bytes within {timeout_s} s"))


class UpstreamResponse:
    """A response whose status line and headers are parsed; the body is read with `read` or `iter_chunks`.

    The connection is released when the body is complete (back to the pool if both sides keep it alive) and
    aborted by `close` before that. Use `async with`, or call `close` in a `finally`.
    """

    __slots__ = (
        "_conn",
        "_is_done",
        "_pending",
        "_read_timeout_s",
        "content_type",
        "headers",
        "reason",
        "status",
        "trailers",
    )

    def __init__(self, status: int, reason: str, headers: list[tuple[str, str]], content_type: str) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        """As received, in order, names as the server sent them."""
        self.content_type = content_type
        """Lower-cased media type without parameters; "" when there is none."""
        self.trailers: list[tuple[str, str]] = []
        """Trailer fields of a chunked body, once it has been read to the end."""
        self._conn: _Connection | None = None
        self._is_done = True
        self._pending = b""  # a body read in full along with the head, not yet handed out
        self._read_timeout_s: float | None = None

    def __repr__(self) -> str:
        return f"<UpstreamResponse {self.status} {self.reason!r}>"

    def header(self, name: str) -> str | None:
        """The first value of a header, matched case-insensitively."""
        lower = name.lower()
        for key, value in self.headers:
            if key.lower() == lower:
                return value
        return None

    @property
    def is_complete(self) -> bool:
        """True once the body was received to the end and the connection released."""
        return self._conn is None and self._is_done

    async def read(self) -> bytes:
        """The rest of the body (all of it, unless `iter_chunks` already handed some out)."""
        if self._conn is None:
            return self._take()
        parts: list[bytes] = []
        try:
            while True:
                data = self._take()
                if data:
                    parts.append(data)
                conn = self._conn
                if conn is None:
                    return b"".join(parts)
                if not data:
                    await conn.wait_for_data(self._read_timeout_s)
        except BaseException:
            self._abort()
            raise

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive, de-chunked; each item is everything buffered at that moment."""
        try:
            while True:
                data = self._take()
                if data:
                    yield data
                conn = self._conn
                if conn is None:
                    return
                if not data:
                    await conn.wait_for_data(self._read_timeout_s)
        except BaseException:
            self._abort()  # includes GeneratorExit: the consumer stopped before the end of the body
            raise

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self.iter_chunks()

    def close(self) -> None:
        """Releases the connection: to the pool if the whole body is in (read or buffered), else aborts it."""
        self._pending = b""
        if self._conn is None:
            return
        with contextlib.suppress(UpstreamError):
            self._take()  # a body already in the buffer lets the connection go back to the pool
        self._pending = b""
        self._abort()

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:
        conn = self._conn
        if conn is not None and not conn.is_ended:
            with contextlib.suppress(RuntimeError):  # the event loop is already closed
                conn.abort("response dropped without close()")

    # --- body framing -------------------------------------------------------------------------------------

    def _start(self, conn: _Connection, timeout_s: float | None) -> None:
        self._conn = conn
        self._is_done = False
        self._read_timeout_s = timeout_s
        if conn.is_message_done:
            self._pending = self._take()  # the usual small answer: it came with its head

    def _take(self) -> bytes:
        """Consumes every body byte buffered now; finishes the body when its end is among them."""
        pending = self._pending
        if pending:
            self._pending = b""
            return pending
        conn = self._conn
        if conn is None:
            return b""
        buffer = conn.buffer
        data = bytes(buffer)
        buffer.clear()
        if conn.is_paused:
            conn.resume()
        if conn.error is not None and not data:
            self._abort()
            raise conn.error
        if conn.is_message_done:
            self.trailers = conn.trailers
            self._finish(conn)
        elif conn.is_ended and not data:
            self._abort()
            raise UpstreamDisconnected(f"connection ended before the body was complete ({conn.end_error or 'EOF'})")
        return data

    def _finish(self, conn: _Connection) -> None:
        self._conn = None
        self._is_done = True
        if conn.is_keep_alive and not conn.has_extra and not conn.is_ended:
            conn.pool._release(conn)
        elif conn.has_extra:
            conn.abort("bytes beyond the end of the response")
        else:
            conn.close()

    def _abort(self) -> None:
        conn = self._conn
        if conn is not None:
            self._conn = None
            conn.abort()


class UpstreamPool:
    """HTTP/1.1 keep-alive connections to replicas, pooled per (host, port). One per event loop."""

    def __init__(
        self,
        *,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float | None = None,
        max_idle_per_host: int = 256,
        idle_timeout_s: float = 30.0,
        deadlines: Deadlines | None = None,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        """Seconds to open a TCP connection; past it, UpstreamConnectError."""
        self.read_timeout_s = read_timeout_s
        """Seconds any one wait for response bytes may take (None: unbounded); past it, UpstreamTimeout."""
        self.max_idle_per_host = max_idle_per_host
        """Idle connections kept per (host, port); more are closed when released. In-use ones are not limited."""
        self.idle_timeout_s = idle_timeout_s
        """Seconds an idle connection is kept. Servers' own keep-alive timeouts (uvicorn: 5 s) are usually shorter;
        the transparent retry covers the race with those."""
        self._idle: dict[tuple[str, int], deque[_Connection]] = {}  # newest last
        self._open: set[_Connection] = set()
        self._host_headers: dict[tuple[str, int], str] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deadlines = deadlines
        self._sweep: asyncio.TimerHandle | None = None
        self._is_closed = False
        self._num_created = 0
        self._num_reused = 0
        self._num_retried = 0

    async def request(
        self,
        method: str,
        host: str,
        port: int,
        target: str,
        headers: list[tuple[str, str]],
        body: bytes | bytearray,
        on_sent: Callable[[], object] | None = None,
    ) -> UpstreamResponse:
        """Sends a request and returns once the response's head is parsed.

        `headers` must not carry hop-by-hop fields; Host, Content-Length, Transfer-Encoding and Connection among
        them are ignored, since the pool frames the request itself. Raises ValueError for a CR or LF in the request
        line or a header (they would let a caller inject headers or requests).

        `on_sent` runs once, before the event loop runs anything else: right after the request is written to a
        kept-alive connection, or before a new connection is opened. The router records its routing decision
        there, off the request's path but before the next decision.
        """
        if self._is_closed:
            raise UpstreamError("the upstream pool is closed")
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        key = (host, port)
        head = self._encode_head(method, key, target, headers, body)
        conn = self._pop_idle(key)
        if conn is not None:
            try:
                return await self._exchange(conn, method, head, body, on_sent)
            except _StaleConnection:
                self._num_retried += 1
                on_sent = None  # it ran when the request was first written
        if on_sent is not None:
            on_sent()
        conn = await self._connect(key)
        return await self._exchange(conn, method, head, body, None)

    @property
    def deadlines(self) -> Deadlines:
        """Where the waits for response bytes keep their timeouts (created on first use unless given)."""
        if self._deadlines is None:
            self._deadlines = Deadlines(self._loop or asyncio.get_running_loop())
        return self._deadlines

    async def close(self) -> None:
        """Closes every connection, idle or in use (their responses fail with UpstreamDisconnected)."""
        self._is_closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        waits = []
        for conn in list(self._open):
            if conn.transport is not None and conn.lost is None:
                conn.lost = conn.loop.create_future()
                waits.append(conn.lost)
            if conn.is_idle:
                conn.close()
            else:
                conn.abort("the upstream pool was closed")
        if waits:
            await asyncio.wait(waits, timeout=1.0)

    def stats(self) -> dict[str, int]:
        """open: connections open now; idle: of which in the pool; created, reused: since start; retried: stale
        reused connections whose request went to a fresh connection."""
        return {
            "open": len(self._open),
            "idle": sum(len(stack) for stack in self._idle.values()),
            "created": self._num_created,
            "reused": self._num_reused,
            "retried": self._num_retried,
        }

    # --- one exchange -------------------------------------------------------------------------------------

    def _encode_head(
        self, method: str, key: tuple[str, int], target: str, headers: list[tuple[str, str]], body: bytes | bytearray
    ) -> bytes:
        host = self._host_headers.get(key)
        if host is None:
            name = f"[{key[0]}]" if ":" in key[0] else key[0]
            host = self._host_headers[key] = name if key[1] == 80 else f"{name}:{key[1]}"
        if " " in method or " " in target or not target:
            raise ValueError(f"bad request line {method!r} {target!r}")
        lines = [f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n"]
        for name, value in headers:
            if name.lower() not in _MANAGED_HEADERS:
                lines.append(f"{name}: {value}\r\n")
        if body or method not in _NO_BODY_METHODS:
            lines.append(f"Content-Length: {len(body)}\r\n")
        lines.append("\r\n")
        head = "".join(lines)
        num_line_ends = len(lines) + 1  # the first element holds two
        if head.count("\n") != num_line_ends or head.count("\r") != num_line_ends:
            raise ValueError("CR or LF in the request line or a header")
        return head.encode("utf-8", "surrogateescape")

    async def _exchange(
        self, conn: _Connection, method: str, head: bytes, body: bytes | bytearray, on_sent: Callable[[], object] | None
    ) -> UpstreamResponse:
        transport = conn.transport
        assert transport is not None
        conn.has_data = False
        conn.begin_exchange(method == "HEAD")
        if len(body) <= _SMALL_BODY_BYTES:
            transport.write(head + body if body else head)
        else:
            transport.write(head)
            transport.write(body)
        try:
            if on_sent is not None:
                on_sent()
            while conn.response is None:
                if conn.error is not None:
                    raise conn.error
                if conn.is_ended:
                    if conn.is_reused and not conn.has_data:
                        raise _StaleConnection(f"reused connection ended ({conn.end_error or 'EOF'})")
                    raise UpstreamDisconnected(f"connection ended before the response head ({conn.end_error or 'EOF'})")
                await conn.wait_for_data(self.read_timeout_s)
            response, conn.response = conn.response, None
            response._start(conn, self.read_timeout_s)
            return response
        except BaseException:
            conn.abort()  # includes CancelledError: a connection with a request in flight is never reused
            raise

    # --- connections --------------------------------------------------------------------------------------

    async def _connect(self, key: tuple[str, int]) -> _Connection:
        loop = self._loop
        assert loop is not None
        host, port = key
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(self, key, loop), host, port)
        except TimeoutError as exc:
            raise UpstreamConnectError(f"connect to {host}:{port} timed out after {self.connect_timeout_s} s") from exc
        except OSError as exc:
            raise UpstreamConnectError(f"connect to {host}:{port} failed: {exc}") from exc
        if self._is_closed:
            conn.abort()
            raise UpstreamError("the upstream pool is closed")
        return conn

    def _pop_idle(self, key: tuple[str, int]) -> _Connection | None:
        stack = self._idle.get(key)
        if not stack:
            return None
        assert self._loop is not None
        oldest_ok = self._loop.time() - self.idle_timeout_s
        while stack:
            conn = stack.pop()
            conn.is_idle = False
            transport = conn.transport
            if conn.is_ended or transport is None or transport.is_closing() or conn.idle_since <= oldest_ok:
                conn.close()
                continue
            conn.is_reused = True
            self._num_reused += 1
            return conn
        return None

    def _opened(self, conn: _Connection) -> None:
        self._open.add(conn)
        self._num_created += 1

    def _forget(self, conn: _Connection) -> None:
        self._open.discard(conn)
        if conn.is_idle:
            conn.is_idle = False
            stack = self._idle.get(conn.key)
            if stack is not None:
                stack.remove(conn)

    def _release(self, conn: _Connection) -> None:
        stack = self._idle.get(conn.key)
        if stack is None:
            stack = self._idle[conn.key] = deque()
        if self._is_closed or len(stack) >= self.max_idle_per_host or self._loop is None:
            conn.close()
            return
        conn.is_idle = True
        conn.idle_since = self._loop.time()
        stack.append(conn)
        if self._sweep is None:
            self._sweep = self._loop.call_at(conn.idle_since + self.idle_timeout_s, self._close_expired)

    def _close_expired(self) -> None:
        """Closes connections idle for `idle_timeout_s`; runs on a timer while any connection is idle."""
        self._sweep = None
        assert self._loop is not None
        oldest_ok = self._loop.time() - self.idle_timeout_s
        next_due: float | None = None
        for key, stack in list(self._idle.items()):
            while stack and stack[0].idle_since <= oldest_ok:
                conn = stack.popleft()
                conn.is_idle = False
                conn.close()
            if stack:
                due = stack[0].idle_since + self.idle_timeout_s
                next_due = due if next_due is None else min(next_due, due)
            else:
                del self._idle[key]
        if next_due is not None and not self._is_closed:
            self._sweep = self._loop.call_at(next_due, self._close_expired)
