"""What of an OpenAI request the router hashes: its routing key.

Chat requests render every message (role, name, content parts, tool calls, tool call id), in order, each as a
self-contained record, after the tool definitions. A conversation that grows by one turn therefore extends the
previous rendering byte for byte, which is what makes multi-turn traffic land on the replica that holds its KV.
JSON parts are rendered canonically (sorted keys, no spaces), so the same request always gives the same bytes.

Completions route on the prompt: a string, or token ids (which need no tokenizer and use token mode). A batch
(a list of prompts) routes on its first prompt, since the engine caches each prompt of a batch on its own.

Malformed requests raise `RoutingInputError`, whose message is fit for an OpenAI-style 400 body.
"""

from __future__ import annotations

import json
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

from router.policy.hashing import pack_tokens

_RECORD = "\x1e"  # ASCII record separator: starts each message
_UNIT = "\x1f"  # ASCII unit separator: between the fields of one message


class RoutingInputError(ValueError):
    """The request body lacks what the endpoint requires; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class RoutingKey:
    """The units a request is hashed over: UTF-8 text, or token ids (token mode)."""

    text: bytes | None = None
    token_ids: Sequence[int] | None = None
    packed: bytes | None = None
    """`token_ids` as `hashing.pack_tokens` packs them, when the parser has packed them already."""
    num_units: int | None = None
    """The whole prompt's length (UTF-8 bytes or token ids) when `text` or `token_ids` hold only its head (`head`);
    None: they hold all of it."""

    @property
    def is_tokens(self) -> bool:
        return self.token_ids is not None

    @property
    def length(self) -> int:
        """The whole prompt's length in its units: UTF-8 bytes of text, or token ids."""
        if self.num_units is not None:
            return self.num_units
        return len(self.token_ids) if self.token_ids is not None else len(self.text or b"")

    def head(self, max_text_bytes: int, max_token_ids: int) -> RoutingKey:
        """This key cut to its first `max_text_bytes` of text or `max_token_ids` ids, its whole length kept: all
        that a router hashing at most that far uses, and little to send between processes."""
        if self.token_ids is not None:
            if len(self.token_ids) <= max_token_ids:
                return self
            if self.packed is None:
                return RoutingKey(token_ids=list(self.token_ids[:max_token_ids]), num_units=self.length)
            packed = self.packed[: 4 * max_token_ids]
            # The ids as an array over the packed bytes: it pickles as those bytes, where a list pickles id by id.
            return RoutingKey(token_ids=_unpacked(packed), packed=packed, num_units=self.length)
        text = self.text or b""
        if len(text) <= max_text_bytes:
            return self
        return RoutingKey(text=text[:max_text_bytes], num_units=len(text))


def _unpacked(packed: bytes) -> Sequence[int]:
    ids = array("I")
    ids.frombytes(packed)
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        ids.byteswap()
    return ids


def _canonical(value: Any, param: str) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except RecursionError:  # nesting deeper than the interpreter's stack, which the JSON decoder allowed
        raise RoutingInputError(f"'{param}' is nested too deeply", param) from None


def _render_content(content: Any, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces = []
        for part in content:
            if isinstance(part, str):
                pieces.append(part)
            elif isinstance(part, dict):
                if part.get("type") == "text" and isinstance(part.get("text"), str):
                    pieces.append(part["text"])
                else:
                    pieces.append(_canonical(part, param))
            else:
                raise RoutingInputError(f"'{param}' parts must be objects", param)
        return _UNIT.join(pieces)
    raise RoutingInputError(f"'{param}' must be a string or a list of content parts", param)


def render_message(message: Any, index: int) -> str:
    """One chat message as a self-contained record (the unit of prefix growth)."""
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise RoutingInputError(f"'{param}' must be an object", param)
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise RoutingInputError(f"'{param}.role' is required", f"{param}.role")
    name = message.get("name") or ""
    if not isinstance(name, str):
        raise RoutingInputError(f"'{param}.name' must be a string", f"{param}.name")
    fields = [role, name, _render_content(message.get("content"), f"{param}.content")]
    if message.get("tool_calls"):
        fields.append(_canonical(message["tool_calls"], f"{param}.tool_calls"))
    if message.get("tool_call_id"):
        fields.append(str(message["tool_call_id"]))
    return _RECORD + _UNIT.join(fields)


def chat_routing_key(body: dict[str, Any]) -> RoutingKey:
    """Routing key of a `/v1/chat/completions` body."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RoutingInputError("'messages' is required and must be a non-empty array", "messages")
    parts = []
    tools = body.get("tools")
    if tools:
        parts.append(_RECORD + "tools" + _UNIT + _canonical(tools, "tools"))
    parts.extend(render_message(message, i) for i, message in enumerate(messages))
    return RoutingKey(text="".join(parts).encode())


def _packed_token_list(value: Any) -> bytes | None:
    """`value` packed as token ids when it is a non-empty list of ints (None when it is not one), checked in
    C: a Python-level type and range check costs about 1 ms for 8k ids, packing them 50-80 us.

    Raises RoutingInputError for an int outside [0, 2**32).
    """
    if not isinstance(value, list) or not value or type(value[0]) is not int:
        return None
    try:
        packed = pack_tokens(value)  # TypeError for a float, a string, a list...
    except TypeError:
        return None
    except OverflowError:
        raise RoutingInputError("token ids in 'prompt' must be in [0, 2**32)", "prompt") from None
    return None if _holds_a_bool(value, packed) else packed


_MAX_FLAG_CANDIDATES = 256
"""Ids of value 0 or 1 checked one by one for being JSON booleans; past this many, one pass over every id's type
in C is cheaper (10 million zeros: 0.24 s, against 2.8 s one by one)."""


def _holds_a_bool(ids: list[int], packed: bytes) -> bool:
    """Whether JSON `true` or `false` sits among the ids, which packing took for 1 and 0: a byte search of the
    packed ids for the values 1 and 0 (one `find` over memory), then an identity check per id that has one; with
    many such ids, the set of all the ids' types."""
    one, zero = b"\x01\x00\x00\x00", b"\x00\x00\x00\x00"
    if packed.count(one) + packed.count(zero) > _MAX_FLAG_CANDIDATES:
        return bool in set(map(type, ids))
    for flag, value in ((True, one), (False, zero)):
        at = packed.find(value)
        while at >= 0:
            if at % 4:  # the bytes straddle two ids
                at = packed.find(value, at + 1)
                continue
            if ids[at // 4] is flag:
                return True
            at = packed.find(value, at + 4)
    return False


def completion_routing_key(body: dict[str, Any]) -> RoutingKey:
    """Routing key of a `/v1/completions` body: prompt string, list of strings, token ids, or lists of them."""
    if "prompt" not in body:
        raise RoutingInputError("'prompt' is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return RoutingKey(text=prompt.encode())
    packed = _packed_token_list(prompt)
    if packed is not None:
        return RoutingKey(token_ids=prompt, packed=packed)
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if all(isinstance(p, str) for p in prompt):
            return RoutingKey(text=first.encode())
        # A batch routes on its first prompt; the others are checked for ints only, in C (packing each of a million
        # one-id prompts held the event loop for seconds).
        packed_first = _packed_token_list(first)
        if (
            packed_first is not None
            and all(type(p) is list and p for p in prompt)
            and set(map(type, chain.from_iterable(prompt))) == {int}
        ):
            return RoutingKey(token_ids=first, packed=packed_first)
    raise RoutingInputError(
        "'prompt' must be a string, an array of strings, an array of token ids or an array of such arrays",
        "prompt",
    )
