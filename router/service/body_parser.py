"""Request bodies parsed and validated, the large ones in a child process so the event loop keeps serving.

A body of at least `limits.parse_off_loop_min_bytes` goes to a child process (`router.common.body_process`), which
parses and validates it exactly as the loop does and sends back only what the proxy uses: the top-level fields it
reads (`BodyParser.FIELDS`) and the routing key's head, as far as `hashing.max_blocks` hashes, with the prompt's
whole length. The raw bytes are forwarded as they came. On the loop, a 20 MB body of token ids held every other
request up for 0.7 s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from router.common.body_process import BodyProcess
from router.policy.routing_text import RoutingInputError, RoutingKey, chat_routing_key, completion_routing_key

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
    raw: bytes | bytearray | memoryview, path: str, max_text_bytes: int, max_token_ids: int
) -> ParsedBody | Refusal:
    """`parse_body`, keeping only what the proxy reads of the body and the head of its key (run in the child)."""
    parsed = parse_body(path, raw)
    if isinstance(parsed, Refusal):
        return parsed
    fields = {name: parsed.body[name] for name in BodyParser.FIELDS if name in parsed.body}
    key = None if parsed.key is None else parsed.key.head(max_text_bytes, max_token_ids)
    return ParsedBody(fields, key, is_whole=False)


class BodyParser:
    FIELDS = ("model", "max_tokens", "max_completion_tokens")
    """The top-level fields the proxy reads of a body."""

    def __init__(self, off_loop_min_bytes: int, max_text_bytes: int, max_token_ids: int) -> None:
        self.off_loop_min_bytes = off_loop_min_bytes
        self.max_text_bytes = max_text_bytes
        self.max_token_ids = max_token_ids
        self._process = BodyProcess()

    async def parse(self, path: str, raw: bytes | bytearray) -> ParsedBody | Refusal:
        """`parse_body` on the loop for bodies under `off_loop_min_bytes`, `parse_summary` in the child for others;
        raises BodyProcessDied when the child exits while parsing."""
        if len(raw) < self.off_loop_min_bytes:
            return parse_body(path, raw)
        return await self._process.run(parse_summary, raw, path, self.max_text_bytes, self.max_token_ids)

    def close(self) -> None:
        self._process.close()
