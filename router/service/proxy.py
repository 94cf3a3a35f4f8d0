"""The OpenAI-compatible proxy's HTTP glue: `/v1/completions`, `/v1/chat/completions`, `/v1/models`, other `/v1/*`.

A request, read by the front under its size and time limits, is parsed and validated (`body_parser`: large bodies
in a child process; 400s in OpenAI's error shape, never a 500), routed by `PoolRouting`, and forwarded
(`forwarding.Forwarder`). Until a byte has reached the client, a refused connection or a 5xx moves the request to
another replica (never the one that just failed), within `retry.max_attempts` and `retry.total_timeout_s`. A
client that goes away cancels the handler (the front cancels its task), which closes the upstream connection at
once, so the replica stops generating for nobody. Requests that no replica can take yet wait in
`holding.HoldLine`; a new request lines up behind those already waiting.

For a model with a router tokenizer (`tokenizer.models`), the validated request's text key is replaced by its
token ids (`chat_tokenizer.ChatTokenizer`), on a worker thread for large bodies; when the tokenizer cannot take
the request it keeps the text key and the fallback is counted.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from router.common.body_process import BodyProcessDied
from router.policy.routing_text import RoutingKey
from router.service.body_parser import BodyParser, ParsedBody, Refusal
from router.service.errors import error_response
from router.service.forwarding import Forwarder, Retry, request_headers
from router.service.front import Answer, Body, FrontRequest, WholeAnswer
from router.service.holding import HoldLine
from router.service.metrics import RouterMetrics
from router.service.pool import Replica, ReplicaPool
from router.service.request_log import RequestLog
from router.service.routing import PoolRouting, Prepared, ReplicaTicket
from router.service.settings import RouterSettings
from router.service.upstream import UpstreamPool

if TYPE_CHECKING:
    from router.service.chat_tokenizer import ChatTokenizer

log = logging.getLogger("shoal.router")


class Proxy:
    def __init__(
        self,
        settings: RouterSettings,
        pool: ReplicaPool,
        routing: PoolRouting,
        metrics: RouterMetrics,
        upstream: UpstreamPool,
        on_unreachable: Callable[[Replica], None] = lambda replica: None,
        request_log: RequestLog | None = None,
        tokenizers: dict[str, ChatTokenizer] | None = None,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.routing = routing
        self.metrics = metrics
        # CLOCK_MONOTONIC at full resolution: uvloop's loop.time() ticks in milliseconds, too coarse for TTFT.
        self._clock = time.monotonic
        self.forwarder = Forwarder(settings, routing, metrics, upstream, self._clock, on_unreachable)
        self.held = HoldLine(settings.hold, routing, metrics, self._clock)
        self.request_log = request_log
        """Where one line per request goes; None: no request log."""
        self.tokenizers = tokenizers or {}
        """Served model name -> its tokenizer and chat template (`tokenizer.models`)."""
        off_loop_min_bytes = settings.limits.parse_off_loop_min_bytes
        if self.tokenizers:  # the router's tokenizer needs the whole body, parsed here
            off_loop_min_bytes = max(off_loop_min_bytes, settings.tokenizer.max_request_bytes + 1)
        blocks = settings.hashing.max_blocks
        self.parser = BodyParser(
            off_loop_min_bytes, blocks * settings.hashing.text_block_size, blocks * settings.hashing.token_block_size
        )

    # --- entry points -----------------------------------------------------------------------------------

    async def handle_front(self, request: FrontRequest, raw: Body) -> Answer:
        """A routed request the front parsed, its body read: a whole answer to write, or the stream it wrote."""
        started = self._clock()
        if request.content_type != "application/json":
            return _wrong_content_type(request.content_type)
        return await self._route_json(request, raw, started)

    async def _route_json(self, request: FrontRequest, raw: Body, started: float) -> Answer:
        parsed = await self._parse(request.path, raw)
        if isinstance(parsed, web.Response):
            return parsed
        body, key = parsed.body, parsed.key
        assert key is not None
        model = body.get("model")
        tokenizer = self.tokenizers.get(model) if isinstance(model, str) else None
        if tokenizer is not None and not key.is_tokens:
            key = await self._tokenized(tokenizer, request.path, parsed, len(raw), key)
        return await self._route_and_forward(request, body, raw, key, started)

    async def _parse(self, path: str, raw: Body) -> ParsedBody | web.Response:
        """The parsed body, or the answer to a body that cannot be served: a 400 naming what is wrong, or a 500
        when the process parsing it died."""
        try:
            parsed = await self.parser.parse(path, raw)
        except BodyProcessDied as exc:
            return error_response(500, str(exc), type_="server_error", code="internal_error")
        if isinstance(parsed, Refusal):
            return error_response(400, parsed.message, code=parsed.code, param=parsed.param)
        return parsed

    async def _tokenized(
        self, tokenizer: ChatTokenizer, path: str, parsed: ParsedBody, num_bytes: int, text_key: RoutingKey
    ) -> RoutingKey:
        """The request's token-id key, or `text_key` (counted) when the tokenizer cannot take it."""
        from router.service.chat_tokenizer import TokenizeFallback

        limits = self.settings.tokenizer
        body = parsed.body
        try:
            if num_bytes > limits.max_request_bytes or not parsed.is_whole:
                raise TokenizeFallback("oversized")
            if num_bytes >= limits.off_loop_min_bytes:
                return await asyncio.to_thread(tokenizer.routing_key, path, body)
            return tokenizer.routing_key(path, body)
        except TokenizeFallback as fallback:
            self.metrics.tokenize_fallbacks.inc((fallback.reason,))
            return text_key

    async def handle_passthrough(self, request: FrontRequest, raw: Body) -> Answer:
        """Any other /v1/* path: no prefix to route on, so the policy balances load alone."""
        started = self._clock()
        body: dict[str, Any] = {}
        if request.content_type == "application/json" and raw:
            parsed = await self._parse(request.path, raw)
            if isinstance(parsed, web.Response):
                return parsed
            body = parsed.body
        return await self._route_and_forward(request, body, raw, RoutingKey(text=b""), started)

    async def handle_models(self, request: FrontRequest) -> web.Response:
        seen: dict[str, dict[str, Any]] = {}
        for replica in self.pool:
            if replica.is_healthy:
                for model_id, card in replica.model_cards.items():
                    seen.setdefault(model_id, card)
        return web.json_response({"object": "list", "data": list(seen.values())})

    # --- routing and forwarding ---------------------------------------------------------------------------

    async def _route_and_forward(
        self, request: FrontRequest, body: dict[str, Any], raw: Body, key: RoutingKey, started: float
    ) -> Answer:
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
        if session_key is not None and not session_key.isascii():
            # Header values are read as UTF-8 with undecodable bytes kept as surrogates; a key is shared with the
            # fleet as JSON, which takes no surrogates, so such bytes are written as \xNN: a stable key all the same.
            session_key = session_key.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        decide_start = time.perf_counter()
        prepared = self.routing.prepare(key, model, session_key, max_tokens if isinstance(max_tokens, int) else None)
        headers = request_headers(request.headers.items(), request.headers.get("Connection"))
        tried: list[str] = []
        decision_s = 0.0
        deadline = started + self.settings.retry.total_timeout_s
        last_failure: Retry | None = None
        was_held = False
        while len(tried) < self.settings.retry.max_attempts and (not tried or self._clock() < deadline):
            now = self._clock()
            # A first attempt keeps the in-flight limit and, unless just released, lines up behind held requests.
            is_first = not tried
            if is_first and self.held and not was_held:
                decision = None
            else:
                decision = self.routing.choose(prepared, tried, now, within_limit=is_first)
            if decision is None:
                if is_first and await self.held.wait(model, started):
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
            ticket = self.routing.begin(replica, decision, prepared, now)
            commit = functools.partial(self.routing.commit, prepared, decision, now)
            try:
                response = await self.forwarder.attempt(request, ticket, headers, raw, commit)
                if isinstance(response, WholeAnswer):
                    request.deliver(response)  # the client has its answer before the bookkeeping below
            except Retry as failure:
                last_failure = failure
                self.metrics.retries.inc((failure.reason,))
                continue
            finally:
                self.routing.finish(ticket, self._clock())
                if self.held:
                    self.held.release()
            self.metrics.request_seconds.observe(self._clock() - started)
            self._log(request, ticket, prepared, response.status, started, len(tried), decision_s)
            return response
        self.metrics.request_seconds.observe(self._clock() - started)
        return self._give_up(request, model, last_failure, tried, started)

    def replica_ready(self) -> None:
        """A replica joined the rotation (first good probe, recovery, undrain): release the held requests it can
        take."""
        self.held.release()

    def _give_up(
        self, request: FrontRequest, model: str | None, failure: Retry | None, tried: list[str], started: float
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

    def _log(
        self,
        request: FrontRequest,
        ticket: ReplicaTicket,
        prepared: Prepared,
        status: int,
        started: float,
        attempts: int,
        decision_s: float,
    ) -> None:
        if self.request_log is not None:
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
        request: FrontRequest,
        status: int,
        replica: str,
        branch: str,
        started: float,
        attempts: int,
        **extra: Any,
    ) -> None:
        if self.request_log is None:
            return
        self.request_log.record(
            {
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
        )


def _wrong_content_type(content_type: str) -> web.Response:
    return error_response(
        400, f"Content-Type must be application/json, got {content_type!r}", code="invalid_content_type"
    )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)
