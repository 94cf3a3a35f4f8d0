"""`create_app(settings, model, tokenizer)`: the replica's aiohttp application.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (JSON or SSE), `GET /v1/models`, `GET /health`,
`GET /metrics` (vLLM names), `GET /v1/kv_events` (SSE stream of KV events, snapshot first).

Errors are OpenAI-shaped JSON bodies: 400 for a bad body or parameters, 404 for another model's name, 429 with
Retry-After when the waiting queue is full, 503 once the engine has failed. A handler cancelled by its client's
disconnect aborts its request, so the engine frees the request's blocks at its next step.

Constrained outputs (`replica.grammar`): the replica's llguidance tokenizer is built once here. A request whose
grammar dead-ends (no token allowed) finishes with an error while the batch goes on: streamed, an error event
follows the text already sent; not streamed, a 500 that says so (the output cannot be completed, and the client
asked for output that fits). Chat tool calls are parsed only when tools were offered and tool_choice is not none;
streamed, they come as `delta.tool_calls` (`replica.server.tool_stream`).

With `capture_dir` set, every request that reached the engine (finished, stopped at a stop string, or aborted) is
handed to a `CaptureWriter` as the handler ends, with the ids the engine emitted (`replica.capture`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from replica.capture import CaptureSource, CaptureWriter, fingerprint_model, fingerprint_tokenizer
from replica.drafters.checkpoint import DrafterModel, default_num_speculative_tokens, drafter_runtime
from replica.engine.engine import LLMEngine, RequestError
from replica.grammar.matcher import GrammarCompiler
from replica.model.model import MoEForCausalLM
from replica.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from replica.server.generation import Generation, Piece, collect, merged, usage_of
from replica.server.kv_events import KVEventHub
from replica.server.metrics import ReplicaMetrics
from replica.server.protocol import (
    ParsedRequest,
    ProtocolError,
    chat_logprobs,
    completion_logprobs,
    joined_logprobs,
    new_id,
    now_s,
    parse_chat,
    parse_completion,
)
from replica.server.request_body import OFF_LOOP_BYTES, BodyError, read_json, read_large
from replica.server.state import STATE, ServerState
from replica.server.tool_stream import ToolCallStream, split_tool_calls
from replica.settings import ReplicaSettings
from replica.tokenizer import Tokenizer
from router.common.body_process import BodyProcessDied

log = logging.getLogger(__name__)

_CAPTURE_CLOSE_TIMEOUT_S = 5.0
"""Shutdown waits at most this long for queued capture records to be written: a stuck disk must not hold the exit."""


def _error(
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """An error as the OpenAI API (and Shoal's router) writes it: {"error": {message, type, param, code}}, the type
    `invalid_request_error` for the client's errors and `server_error` for the replica's."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers, dumps=lambda o: orjson.dumps(o).decode())


def _error_event(message: str, code: str) -> dict[str, Any]:
    """An error inside an event stream that already answered 200: the same body as a 5xx response's."""
    return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own refusals (an unknown path, a method a route does not take, a body past the size limit) in the
    same JSON shape as every other error."""
    try:
        response: web.StreamResponse = await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return _error(
            exc.status,
            exc.reason if exc.text is None else exc.text,
            code=exc.reason.lower().replace(" ", "_"),
            headers=headers,
        )
    return response


def _parse(state: ServerState, body: Any, *, chat: bool) -> tuple[Any, ParsedRequest | None]:
    """-> (the body, the request parsed and tokenized), or (the body, None) when it names another model."""
    model = body.get("model") if isinstance(body, dict) else None
    if model not in (None, state.model_name):
        return body, None
    parse = parse_chat if chat else parse_completion
    return body, parse(
        body,
        state.tokenizer,
        model=state.model_name,
        default_max_tokens=state.settings.max_tokens_default,
        grammars=state.grammars,
        context=state.engine.engine.max_model_len,
    )


def _check_context(state: ServerState, parsed: Any, body: Any, *, chat: bool) -> web.Response | None:
    """A 400 naming both numbers when the prompt and the max_tokens the client asked for do not fit the context, as
    vLLM answers; without an explicit max_tokens, generation stops where the context ends."""
    asked = body.get("max_completion_tokens", body.get("max_tokens")) if isinstance(body, dict) else None
    max_model_len = state.engine.engine.max_model_len
    num_prompt = len(parsed.prompt_token_ids)
    if asked is None or num_prompt + parsed.params.max_tokens <= max_model_len:
        return None
    where = "messages" if chat else "prompt"
    return _error(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{num_prompt + parsed.params.max_tokens} tokens ({num_prompt} in the {where}, "
        f"{parsed.params.max_tokens} in the completion). Please reduce the length of the {where} or completion.",
        code="context_length_exceeded",
        param="max_completion_tokens" if "max_completion_tokens" in body else "max_tokens",
    )


async def _generate(request: web.Request, *, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    arrival_s = time.monotonic()
    try:
        raw = await request.read()
        if len(raw) > OFF_LOOP_BYTES:
            read = await state.body_process.run(read_large, raw, state.engine.engine.max_model_len)
            if isinstance(read, BodyError):
                raise read
            body, parsed = await asyncio.to_thread(_parse, state, read, chat=chat)
        else:
            body, parsed = _parse(state, read_json(raw), chat=chat)
        if parsed is None:
            return _error(
                404,
                f"the model '{body.get('model')}' does not exist; this replica serves '{state.model_name}'",
                code="model_not_found",
                param="model",
            )
        if (too_long := _check_context(state, parsed, body, chat=chat)) is not None:
            return too_long
        streams = state.engine.submit_group(parsed.prompt_token_ids, parsed.choice_params())
    except (ProtocolError, BodyError) as exc:
        return _error(400, str(exc), param=exc.param)
    except BodyProcessDied as exc:
        return _error(500, str(exc), code="internal_error")
    except RequestError as exc:
        return _error(400, str(exc), param="messages" if chat else "prompt")
    except QueueFullError as exc:
        return _error(
            429,
            f"the replica is at capacity ({exc}); retry shortly",
            code="replica_busy",
            headers={"Retry-After": "1"},
        )
    except EngineDeadError as exc:
        return _error(503, str(exc), code="engine_unavailable")
    gens = [Generation(state, parsed, s, arrival_s, index=i) for i, s in enumerate(streams)]
    request_id = new_id("chatcmpl" if chat else "cmpl")
    try:
        if parsed.stream:
            return await _stream(request, gens, request_id, chat=chat)
        return await _complete(gens, request_id, chat=chat)
    except EngineDeadError as exc:
        return _error(503, str(exc), code="engine_unavailable")
    finally:
        for gen in gens:
            gen.stream.close()
            # Also when the client went away: the handler is cancelled. Choice i > 0 is recorded as "<id>-<i>".
            gen.capture(request_id if gen.index == 0 else f"{request_id}-{gen.index}", chat=chat)


async def _complete(gens: list[Generation], request_id: str, *, chat: bool) -> web.Response:
    results = await asyncio.gather(*(collect(g) for g in gens))
    state = gens[0].state
    failed = next((g for g in gens if g.finish_reason == "error"), None)
    if failed is not None:
        return _error(500, f"generation failed: {failed.error}", code="generation_failed")
    wants_logprobs = gens[0].parsed.params.logprobs is not None
    choices = []
    for gen, (text, logprobs, token_ids) in zip(gens, results, strict=True):
        choice: dict[str, Any]
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish = gen.finish_reason
            if gen.parsed.has_tools:
                content, calls = split_tool_calls(text)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    if finish == "stop":  # as streamed: a call cut short by max_tokens stays `length`
                        finish = "tool_calls"
            lp = chat_logprobs(state.tokenizer, logprobs, token_ids) if wants_logprobs else None
            choice = {"index": gen.index, "message": message, "finish_reason": finish, "logprobs": lp}
        else:
            echo = gen.echo_text()
            lp = None
            if wants_logprobs:
                prompt_lp, _ = gen.echo_logprobs()
                lp = joined_logprobs(prompt_lp, completion_logprobs(state.tokenizer, logprobs, token_ids, len(echo))[0])
            choice = {"index": gen.index, "text": echo + text, "finish_reason": gen.finish_reason, "logprobs": lp}
        choices.append(choice)
    body = {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": now_s(),
        "model": state.model_name,
        "choices": choices,
        "usage": usage_of(gens),
    }
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def _stream(request: web.Request, gens: list[Generation], request_id: str, *, chat: bool) -> web.StreamResponse:
    # Nothing is sent before the first token: a router reads the first body byte as the time to first token
    # (it learns each replica's prefill rate from it), and an engine failure before it is still a plain 503.
    pieces = merged(gens)
    first = await anext(pieces, None)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    created = now_s()
    obj = "chat.completion.chunk" if chat else "text_completion"
    state = gens[0].state
    model = state.model_name
    parsed = gens[0].parsed
    wants_logprobs = parsed.params.logprobs is not None
    calls = {g.index: ToolCallStream() for g in gens} if chat and parsed.has_tools else {}
    offsets = {g.index: len(g.echo_text()) for g in gens}

    def chunk(
        index: int,
        delta_text: str | None,
        finish: str | None,
        *,
        role: bool = False,
        delta: dict[str, Any] | None = None,
        logprobs: Any = None,
    ) -> bytes:
        if chat:
            if delta is None:
                delta = (
                    {"role": "assistant", "content": ""}
                    if role
                    else ({"content": delta_text} if delta_text is not None else {})
                )
            choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": delta_text or "", "finish_reason": finish, "logprobs": logprobs}
        body = {"id": request_id, "object": obj, "created": created, "model": model, "choices": [choice]}
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def logprobs_of(index: int, piece: Piece) -> Any:
        if not wants_logprobs or not piece.token_ids:
            return None
        if chat:
            return chat_logprobs(state.tokenizer, piece.logprobs, piece.token_ids)
        lp, offsets[index] = completion_logprobs(state.tokenizer, piece.logprobs, piece.token_ids, offsets[index])
        return lp

    async def write_piece(index: int, piece: Piece) -> None:
        logprobs = logprobs_of(index, piece)
        if not piece.text and logprobs is None:
            return
        tool_calls = calls.get(index)
        if tool_calls is None:
            await response.write(chunk(index, piece.text, None, logprobs=logprobs))
            return
        deltas = tool_calls.feed(piece.text)
        if not deltas and logprobs is not None:
            await response.write(chunk(index, None, None, delta={}, logprobs=logprobs))
        for i, delta in enumerate(deltas):
            await response.write(chunk(index, None, None, delta=delta, logprobs=logprobs if i == 0 else None))

    async def end_choice(gen: Generation) -> None:
        finish = gen.finish_reason
        tool_calls = calls.get(gen.index)
        if tool_calls is not None:
            for delta in tool_calls.finish():
                await response.write(chunk(gen.index, None, None, delta=delta))
            if tool_calls.num_calls and finish == "stop":
                finish = "tool_calls"
        if finish == "error":
            error = _error_event(f"generation failed: {gen.error}", "generation_failed")
            await response.write(b"data: " + orjson.dumps(error) + b"\n\n")
        else:
            await response.write(chunk(gen.index, None, finish))

    try:
        for gen in gens:
            if chat:
                await response.write(chunk(gen.index, None, None, role=True))
            elif parsed.echo:
                # The choices share the prompt: its logprobs are whichever first output brought them.
                echoed = next((g for g in gens if g.prompt_logprobs is not None), gen)
                prompt_lp = echoed.echo_logprobs()[0] if wants_logprobs else None
                await response.write(chunk(gen.index, gen.echo_text(), None, logprobs=prompt_lp))
        item = first
        while item is not None:
            index, piece = item
            if piece is None:
                await end_choice(gens[index])
            else:
                await write_piece(index, piece)
            item = await anext(pieces, None)
        if parsed.include_usage:
            body = {
                "id": request_id,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage_of(gens),
            }
            await response.write(b"data: " + orjson.dumps(body) + b"\n\n")
    except EngineDeadError as exc:
        await response.write(b"data: " + orjson.dumps(_error_event(str(exc), "engine_unavailable")) + b"\n\n")
    finally:
        await pieces.aclose()
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    card = {
        "id": state.model_name,
        "object": "model",
        "created": state.created_s,
        "owned_by": "shoal",
        "max_model_len": state.engine.engine.max_model_len,
    }
    return web.json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.engine.is_alive:
        return _error(503, f"the engine is not running: {state.engine.error!r}", code="engine_unavailable")
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.Response(body=generate_latest(state.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def kv_events(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    block_manager = state.engine.engine.block_manager
    taken: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def take_snapshot() -> None:
        if not taken.done():
            taken.set_result(state.events.subscribe(block_manager.snapshot_events()))

    state.engine.call_between_steps(take_snapshot)  # now if idle, else right after the running step
    sub = await taken
    try:
        while True:
            message = await sub.queue.get()
            if message is None:
                break
            await response.write(b"data: " + message + b"\n\n")
            if sub.is_dropped and sub.queue.empty():
                break
    finally:
        state.events.unsubscribe(sub)
    return response


def create_app(
    settings: ReplicaSettings,
    model: MoEForCausalLM,
    tokenizer: Tokenizer,
    *,
    checkpoint_dir: Path | None = None,
    drafter: DrafterModel | None = None,
    warm_up: bool = False,
    engine_thread: ThreadPoolExecutor | None = None,
) -> web.Application:
    """`checkpoint_dir` (config.json, *.safetensors, tokenizer.json) is fingerprinted for capture records; it is
    needed, and read, only when `settings.capture_dir` is set. With a `drafter` (and `num_speculative_tokens` > 0)
    the engine speculates. `warm_up`: the engine runs one throwaway request before it serves
    (`LLMEngine.warm_up`). `engine_thread`: the one-thread executor the steps run in (`AsyncEngine`), where the
    model was loaded; default: a new one."""
    model_name = settings.model_name
    k = settings.speculative_tokens(default_num_speculative_tokens(drafter)) if drafter is not None else 0
    config = settings.engine_config(num_speculative_tokens=k)
    runtime = None
    if drafter is not None and k:
        runtime = drafter_runtime(
            drafter, num_blocks=config.num_blocks, block_size=config.block_size, num_speculative_tokens=k
        )
    grammars = GrammarCompiler(
        tokenizer.to_json(), vocab_size=model.config.vocab_size, eos_token_ids=tokenizer.eos_token_ids
    )
    engine = LLMEngine(
        model, config, eos_token_ids=tokenizer.eos_token_ids, drafter=runtime, grammar=grammars, tokenizer=tokenizer
    )
    metrics_ = ReplicaMetrics(model_name)
    metrics_.cache_config.labels(model_name, str(settings.block_size), str(settings.num_blocks)).set(1)
    metrics_.max_num_seqs.labels(model_name).set(config.max_num_seqs)
    hub = KVEventHub(settings.replica_id or f"{settings.host}:{settings.port}")
    state_holder: list[ServerState] = []
    async_engine = AsyncEngine(
        engine,
        max_waiting=settings.max_waiting,
        on_step=lambda r: state_holder[0].on_step(r),
        executor=engine_thread,
    )
    state = ServerState(
        settings=settings,
        tokenizer=tokenizer,
        engine=async_engine,
        metrics=metrics_,
        events=hub,
        model_name=model_name,
        grammars=grammars,
    )
    state_holder.append(state)
    if settings.capture_dir is not None:
        if checkpoint_dir is None:
            raise ValueError("capture_dir is set: create_app needs the checkpoint_dir to fingerprint")
        state.capture_source = CaptureSource(
            model=model_name,
            model_hash=fingerprint_model(checkpoint_dir),
            tokenizer_hash=fingerprint_tokenizer(checkpoint_dir / "tokenizer.json"),
            keep_text=settings.capture_text == "full",
        )
        state.capture = CaptureWriter(
            settings.capture_dir,
            file_max_bytes=settings.capture_file_max_bytes,
            total_max_bytes=settings.capture_total_max_bytes,
            queue_max_records=settings.capture_queue_max_records,
        )
        metrics_.add_capture(state.capture.stats)
    capture = state.capture

    app = web.Application(client_max_size=16 * 1024 * 1024, middlewares=[_json_errors])
    app[STATE] = state

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        if capture is not None:
            capture.start()
        if warm_up:
            await async_engine.warm_up()
        async_engine.start()
        yield
        await hub.close()
        state.body_process.close()
        await async_engine.stop()
        state.log_speculation()
        if capture is not None and not await asyncio.to_thread(capture.close, _CAPTURE_CLOSE_TIMEOUT_S):
            log.warning(
                "capture: the writer did not finish in %.0f s; records still queued are lost", _CAPTURE_CLOSE_TIMEOUT_S
            )

    app.cleanup_ctx.append(lifecycle)

    async def end_event_streams(app: web.Application) -> None:
        hub.end_streams()

    app.on_shutdown.append(end_event_streams)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/kv_events", kv_events)
    return app
