"""Streamed tool calls: however the text is split, the deltas assemble to the content and the calls as written."""

from __future__ import annotations

import json
import random

import pytest

from replica.server.tool_stream import ToolCallStream, split_tool_calls

CALLS = [
    ("get_order_status", {"order_id": "ORD-48213", "filters": {"a": [1, {"b": "}"}]}}),
    ("book_room", {"room": "三階", "hours": 2}),
]
TEXT = "Sure, checking.\n" + "\n".join(
    "<tool_call>\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False) + "\n</tool_call>" for n, a in CALLS
)


def assemble(pieces: list[str]) -> tuple[str, list[dict[str, str]]]:
    stream = ToolCallStream()
    deltas = [d for p in pieces for d in stream.feed(p)] + stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls: list[dict[str, str]] = []
    for d in deltas:
        for call in d.get("tool_calls", []):
            if call["index"] == len(calls):
                assert call["id"].startswith("call-") and call["type"] == "function"
                calls.append({"name": call["function"]["name"], "arguments": ""})
            else:
                assert "id" not in call and "name" not in call["function"]
            calls[call["index"]]["arguments"] += call["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize("seed", range(20))
def test_any_split_assembles_to_the_calls(seed: int) -> None:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(TEXT)), rng.randrange(1, 40)))
    pieces = [TEXT[a:b] for a, b in zip([0, *cuts], [*cuts, len(TEXT)], strict=True)]
    content, calls = assemble(pieces)
    assert content == "Sure, checking.\n"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == CALLS


def test_text_without_calls_is_content_and_a_cut_call_keeps_its_arguments() -> None:
    assert assemble(["a <tool", "_ca", "ll is not here"]) == ("a <tool_call is not here", [])
    content, calls = assemble(['<tool_call>\n{"name": "f", "arguments": {"x": "ab'])
    assert content == "" and calls == [{"name": "f", "arguments": '{"x": "ab'}]


@pytest.mark.parametrize(
    "text",
    [
        'Let me check.\n<tool_call>\n{"name": "get_order_status", "arguments": {"order_id": "ORD-1"}}\n</tool_call>',
        'Sure.<tool_call>\n{"name": "book_room", "arguments": {"floor": 4, "hou',  # cut short by max_tokens
        'Sure.<tool_call>\n{"name": "book_r',  # cut inside the call's name: no call, no marker in the content
        "Just words, no call.",
    ],
    ids=["whole", "cut-in-arguments", "cut-in-name", "no-call"],
)
def test_unstreamed_answers_are_the_streamed_deltas_assembled(text: str) -> None:
    content, calls = split_tool_calls(text)
    stream = ToolCallStream()
    deltas = [d for i in range(0, len(text), 3) for d in stream.feed(text[i : i + 3])] + stream.finish()
    streamed_content = "".join(d.get("content", "") for d in deltas).strip() or None
    streamed_arguments: dict[int, str] = {}
    for d in deltas:
        for piece in d.get("tool_calls", ()):
            streamed_arguments[piece["index"]] = (
                streamed_arguments.get(piece["index"], "") + piece["function"]["arguments"]
            )
    assert content == streamed_content and "<tool_call>" not in (content or "")
    # Whitespace before the arguments lands in them or not by where the stream's pieces were cut.
    unstreamed = [c["function"]["arguments"].strip() for c in calls]
    assert unstreamed == [streamed_arguments[i].strip() for i in sorted(streamed_arguments)]
