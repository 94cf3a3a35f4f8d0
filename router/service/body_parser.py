"""Request bodies parsed and validated, the large ones in a child process so the event loop keeps serving.

orjson reads token ids at some 60 MB/s and holds the GIL, as do the checks and packing of the ids; on the loop (or
on a thread, which holds the same GIL) a 20 MB body stopped every other request for most of a second. A body of
at least `limits.parse_off_loop_min_bytes` goes to a child process, which parses and validates it exactly as the
loop does and sends back only what the proxy uses: the top-level fields it reads (`BodyParser.FIELDS`) and the
routing key's head, as far as `hashing.max_blocks` hashes, with the prompt's whole length. The raw bytes are
forwarded as they came.

The child is started (with `spawn`: the router runs threads, which a fork does not copy) on the first large body.
If it dies, the request in it gets a 500, one line is logged and the next large body starts a new child.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import orjson

from router.common.child_processes import parent_death_signal
from router.policy.routing_text import RoutingInputError, RoutingKey, chat_routing_key, completion_routing_key

log = logging.getLogger("shoal.router")

_ROUTED_PATHS = {"/v1/completions": completion_routing_key, "/v1/chat/completions": chat_routing_key}


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a body is refused: the message, code and param of an OpenAI-style 400."""

    message: str
    code: str | None = None
    param: str | None = None


@dataclass(frozen=True, slots=True)
class ParsedBody:
    body: dict[str, Any]
    """The JSON object, or, parsed off the loop, its fields named in `BodyParser.FIELDS`."""
    key: RoutingKey | None
    """The routing key of a routed path (`/v1/completions`, `/v1/chat/completions`); None on other paths."""
    is_whole: bool = True
    """False when `body` holds only some fields and `key` only its head (parsed off the loop)."""


class ParserDied(RuntimeError):
    """The child process parsing a body exited (killed, out of memory); the request cannot be answered."""


def parse_body(path: str, raw: bytes | bytearray | memoryview) -> ParsedBody | Refusal:
    """`raw` as a JSON object with, on a routed path, its routing key; a Refusal when the client sent a body the
    path cannot take. Other paths take anything, and route on load alone."""
    routing_key = _ROUTED_PATHS.get(path)
    try:
        body = orjson.loads(raw) if raw or routing_key is not None else {}
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting too deep for the decoder
        return Refusal(f"request body is not valid JSON: {exc}", "invalid_json")
    if routing_key is None:
        return ParsedBody(body if isinstance(body, dict) else {}, None)
    if not isinstance(body, dict):
        return Refusal("request body must be a JSON object", "invalid_json")
    try:
        return ParsedBody(body, routing_key(body))
    except RoutingInputError as exc:
        return Refusal(str(exc), param=exc.param)


def parse_summary(
    path: str, raw: bytes | bytearray | memoryview, max_text_bytes: int, max_token_ids: int
) -> ParsedBody | Refusal:
    """`parse_body`, keeping only what the proxy reads of the body and the head of its key (run in the child)."""
    parsed = parse_body(path, raw)
    if isinstance(parsed, Refusal):
        return parsed
    fields = {name: parsed.body[name] for name in BodyParser.FIELDS if name in parsed.body}
    key = None if parsed.key is None else parsed.key.head(max_text_bytes, max_token_ids)
    return ParsedBody(fields, key, is_whole=False)


def _parse_shared(path: str, name: str, size: int, max_text_bytes: int, max_token_ids: int) -> ParsedBody | Refusal:
    """`parse_summary` of the body the router put in shared memory `name` (run in the child)."""
    shared = SharedMemory(name)
    try:
        assert shared.buf is not None
        with shared.buf[:size] as raw:
            return parse_summary(path, raw, max_text_bytes, max_token_ids)
    finally:
        shared.close()


_COPY_STEP_BYTES = 1 << 20


async def _copy(raw: bytes | bytearray, shared: SharedMemory) -> None:
    """`raw` into `shared`, a MiB at a time with a turn of the event loop between: copying 20 MB into fresh pages
    at once held the loop 15 ms. (The pipe of a process pool took 20 MB in 64 KB writes by a thread that took the
    GIL from the event loop for each.)"""
    target, source = shared.buf, memoryview(raw)
    assert target is not None
    for start in range(0, len(raw), _COPY_STEP_BYTES):
        end = start + _COPY_STEP_BYTES
        target[start:end] = source[start:end]
        await asyncio.sleep(0)


def _child_start(router_pid: int) -> None:
    """In the child, first: leave Ctrl-C to the router, and die with it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_parent_death_signal = parent_death_signal()
    if set_parent_death_signal is not None:
        set_parent_death_signal()
    if os.getppid() != router_pid:  # the router died before the call above
        os._exit(0)


class BodyParser:
    FIELDS = ("model", "max_tokens", "max_completion_tokens")
    """The top-level fields the proxy reads of a body."""

    def __init__(self, off_loop_min_bytes: int, max_text_bytes: int, max_token_ids: int) -> None:
        self.off_loop_min_bytes = off_loop_min_bytes
        self.max_text_bytes = max_text_bytes
        self.max_token_ids = max_token_ids
        self._pool: ProcessPoolExecutor | None = None

    async def parse(self, path: str, raw: bytes | bytearray) -> ParsedBody | Refusal:
        """`parse_body` on the loop for bodies under `off_loop_min_bytes`, `parse_summary` in the child for others;
        raises ParserDied when the child exits while parsing."""
        if len(raw) < self.off_loop_min_bytes:
            return parse_body(path, raw)
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("spawn"), initializer=_child_start, initargs=(os.getpid(),)
            )
        pool = self._pool
        loop = asyncio.get_running_loop()
        shared = SharedMemory(create=True, size=len(raw))
        try:
            await _copy(raw, shared)
            return await loop.run_in_executor(
                pool, _parse_shared, path, shared.name, len(raw), self.max_text_bytes, self.max_token_ids
            )
        except BrokenProcessPool:
            if self._pool is pool:
                log.error("the body parser process exited while parsing a %d-byte body; starting a new one", len(raw))
                self._pool = None
                pool.shutdown(wait=False, cancel_futures=True)
            raise ParserDied("the body parser process exited") from None
        finally:
            shared.close()
            shared.unlink()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
