"""Streamed tool calls: generated text in, OpenAI `delta.content` and `delta.tool_calls` pieces out.

The text has the chat template's form (`replica.grammar.formats`): content, then calls
`<tool_call>\\n{"name": "...", "arguments": {...}}\\n</tool_call>` separated by newlines. As OpenAI does, a call's
first delta carries its index, id, type and function name with empty arguments, and later deltas carry fragments
of the arguments, whose concatenation is the arguments' JSON text as the model wrote it. A fragment is emitted only
once it is known to belong to the arguments: text from the last `}` on is held back (the call's own closing brace
is the last one before `</tool_call>`), and so is a suffix that may begin a marker. Whitespace between calls is not
content.
"""

from __future__ import annotations

import json
import re
from typing import Any

from replica.server.protocol import new_id
from replica.tokenizer import TOOL_CALL_END, TOOL_CALL_START

_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def _held_marker(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolCallStream:
    def __init__(self) -> None:
        self._buffer = ""
        self._state = "content"  # content | header | arguments
        self._num_calls = 0
        self._has_content = False

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas `text` completes (each a chat delta: {"content": ...} or {"tool_calls": [...]})."""
        self._buffer += text
        deltas: list[dict[str, Any]] = []
        while True:
            if self._state == "content":
                at = self._buffer.find(TOOL_CALL_START)
                if at < 0:
                    keep = _held_marker(self._buffer, TOOL_CALL_START)
                    self._content(self._buffer[: len(self._buffer) - keep], deltas)
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return deltas
                self._content(self._buffer[:at], deltas)
                self._buffer = self._buffer[at + len(TOOL_CALL_START) :]
                self._state = "header"
            elif self._state == "header":
                m = _HEADER.match(self._buffer)
                if m is None:
                    return deltas
                name = json.loads(f'"{m.group(1)}"')
                call = {"index": self._num_calls, "id": new_id("call"), "type": "function"}
                deltas.append({"tool_calls": [{**call, "function": {"name": name, "arguments": ""}}]})
                self._buffer = self._buffer[m.end() :]
                self._state = "arguments"
            else:
                end = self._buffer.find(TOOL_CALL_END)
                if end < 0:
                    brace = self._buffer.rfind("}")
                    cut = brace if brace >= 0 else len(self._buffer) - _held_marker(self._buffer, TOOL_CALL_END)
                    self._arguments(self._buffer[:cut], deltas)
                    self._buffer = self._buffer[cut:]
                    return deltas
                call_text = self._buffer[:end].rstrip()
                self._arguments(call_text[:-1] if call_text.endswith("}") else call_text, deltas)
                self._buffer = self._buffer[end + len(TOOL_CALL_END) :].lstrip()
                self._num_calls += 1
                self._state = "content"

    def finish(self) -> list[dict[str, Any]]:
        """What is still held when generation ends (a call cut short keeps the arguments written so far)."""
        deltas: list[dict[str, Any]] = []
        rest, self._buffer = self._buffer, ""
        if self._state == "content":
            self._content(rest, deltas)
        elif self._state == "arguments":
            self._arguments(rest, deltas)
            self._num_calls += 1
        return deltas

    def _content(self, text: str, deltas: list[dict[str, Any]]) -> None:
        if self._num_calls and not text.strip():
            return  # the newline between calls
        if text:
            deltas.append({"content": text})

    def _arguments(self, text: str, deltas: list[dict[str, Any]]) -> None:
        if text:
            deltas.append({"tool_calls": [{"index": self._num_calls, "function": {"arguments": text}}]})


def split_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """An unstreamed answer's content and OpenAI tool calls: the stream's deltas of the whole text, assembled, so
    that both forms of an answer agree (a call cut short keeps the arguments written so far, in both)."""
    stream = ToolCallStream()
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for delta in [*stream.feed(text), *stream.finish()]:
        if "content" in delta:
            content.append(delta["content"])
            continue
        for piece in delta["tool_calls"]:
            call = calls.get(piece["index"])
            if call is None:
                calls[piece["index"]] = {k: v for k, v in piece.items() if k != "index"} | {
                    "function": dict(piece["function"])
                }
            else:
                call["function"]["arguments"] += piece["function"]["arguments"]
    joined = "".join(content).strip()
    return joined or None, [calls[i] for i in sorted(calls)]
