"""A request body read as JSON, its nesting bounded; large bodies are read in a child process.

Reading JSON holds the GIL, and so does walking what it read: a 14 MB body of seven million token ids held the
replica's event loop 0.27 s, on the loop or on a thread. Bodies larger than `OFF_LOOP_BYTES` are read by
`read_large` in a child process (`router.common.body_process`), which also refuses a token-id prompt longer than
the model's context, so that such a prompt never crosses back; the others come back parsed, to be tokenized on a
thread. This module imports nothing heavy: the child imports it.
"""

from __future__ import annotations

from typing import Any

import orjson

MAX_JSON_DEPTH = 128
"""Nesting of a request body's objects and arrays: a tool schema may nest 32 deep (`MAX_SCHEMA_DEPTH`) inside a
dozen levels of the request; deeper is refused before any code that recurses over it (the chat template's
rendering of tool-call arguments hit Python's recursion limit: a 500)."""

OFF_LOOP_BYTES = 64 * 1024
"""A larger body is read in the child process and tokenized on a thread: tokenizing releases the GIL, so the loop
keeps serving other requests (15 MB of text took 21 s on the loop)."""


class BodyError(ValueError):
    """A body that is not a valid request (400), with the field it concerns; pickles, to come back from the child."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, param)
        self.message = message
        self.param = param

    def __str__(self) -> str:
        return self.message


def read_json(raw: bytes | bytearray | memoryview) -> Any:
    """The body's JSON value; raises BodyError for invalid JSON or nesting past `MAX_JSON_DEPTH`."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BodyError(f"the body is not valid JSON: {exc}") from None
    if _depth_exceeds(body, MAX_JSON_DEPTH):
        raise BodyError(f"the body nests objects and arrays more than {MAX_JSON_DEPTH} deep")
    return body


def read_large(raw: memoryview, context: int) -> Any:
    """In the child: `read_json`, and a token-id prompt longer than `context` refused; returns the body, or the
    BodyError to raise."""
    try:
        body = read_json(raw)
    except BodyError as exc:
        return exc
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(prompt, list) and prompt:
        prompts = prompt if isinstance(prompt[0], list) else [prompt] if isinstance(prompt[0], int) else []
        longest = max((len(p) for p in prompts if isinstance(p, list)), default=0)
        if longest >= context:
            return BodyError(
                f"the prompt has {longest} tokens; this model's context is {context} tokens including at least one "
                "generated token",
                "prompt",
            )
    return body


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether `value` nests containers deeper than `limit`; iterative, so no input can exhaust the stack."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False
