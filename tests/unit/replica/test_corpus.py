"""The demo corpus: determinism, the language and tool mix, tool calls that fit their schemas, the calibration file."""

from __future__ import annotations

import json
import random
import re
import string
from pathlib import Path
from typing import Any

import pytest

from replica.demo.corpus import (
    CALIBRATION_PATH,
    CALIBRATION_SEED,
    TOOLS,
    TRAINING_SEED,
    _draw_slots,
    generate_conversations,
    uses_tools,
    write_calibration_file,
    write_chat_requests,
)
from replica.demo.phrasebook import PHRASEBOOKS
from replica.tokenizer import apply_chat_template

_JAPANESE = re.compile(r"[\u3040-\u30ff\u4e00-\u9fff]")
_SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


def is_japanese(conversation: list[dict[str, Any]]) -> bool:
    first_user = next(message for message in conversation if message["role"] == "user")
    return bool(_JAPANESE.search(first_user["content"]))


def schema_errors(value: Any, schema: dict[str, Any], where: str = "arguments") -> list[str]:
    """The JSON-schema subset TOOLS uses: type, properties, required, items, enum."""
    kinds: dict[str, type | tuple[type, ...]] = {
        "string": str,
        "integer": int,
        "number": (int, float),
        "array": list,
        "object": dict,
    }
    is_kind = isinstance(value, kinds[schema["type"]]) and not isinstance(value, bool)
    if not is_kind:
        return [f"{where}: {value!r} is not {schema['type']}"]
    errors = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} not in {schema['enum']}")
    if schema["type"] == "object":
        errors += [f"{where}: unknown {key!r}" for key in value if key not in schema["properties"]]
        errors += [f"{where}: missing {key!r}" for key in schema.get("required", []) if key not in value]
        for key, item in value.items():
            if key in schema["properties"]:
                errors += schema_errors(item, schema["properties"][key], f"{where}.{key}")
    if schema["type"] == "array":
        for index, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{where}[{index}]")
    return errors


def test_same_seed_same_corpus_other_seed_other_corpus() -> None:
    first = generate_conversations(60, seed=7)
    assert first == generate_conversations(60, seed=7)
    other = generate_conversations(60, seed=8)
    assert sum(a != b for a, b in zip(first, other, strict=True)) > 50


def test_mix_of_languages_and_tools() -> None:
    conversations = generate_conversations(600, seed=TRAINING_SEED)
    assert sum(map(is_japanese, conversations)) == 300
    assert sum(map(uses_tools, conversations)) == 200
    japanese_with_tools = sum(is_japanese(c) and uses_tools(c) for c in conversations)
    assert 60 <= japanese_with_tools <= 140, "the two assignments should be independent"
    custom = generate_conversations(100, seed=1, japanese_fraction=0.6, tool_fraction=0.4)
    assert (sum(map(is_japanese, custom)), sum(map(uses_tools, custom))) == (60, 40)


def test_conversations_share_a_handful_of_system_prompts() -> None:
    conversations = generate_conversations(300, seed=3)
    systems = {conversation[0]["content"] for conversation in conversations}
    assert all(conversation[0]["role"] == "system" for conversation in conversations)
    assert 4 <= len(systems) <= 8


def test_messages_are_well_formed_openai_messages() -> None:
    for conversation in generate_conversations(300, seed=4):
        pending_call_ids: list[str] = []
        for message in conversation:
            assert message["role"] in {"system", "user", "assistant", "tool"}
            assert isinstance(message["content"], str)
            if message["role"] == "tool":
                assert message["tool_call_id"] == pending_call_ids.pop(0)
            for call in message.get("tool_calls", []):
                assert set(call) == {"id", "type", "function"} and call["type"] == "function"
                pending_call_ids.append(call["id"])
        assert not pending_call_ids
        assert conversation[-1]["role"] == "assistant"
        apply_chat_template(conversation, tools=TOOLS if uses_tools(conversation) else None)


def test_tool_calls_match_their_schemas_and_the_text_around_them() -> None:
    tools_called = set()
    for conversation in generate_conversations(400, seed=5):
        for index, message in enumerate(conversation):
            for call in message.get("tool_calls", []):
                name = call["function"]["name"]
                arguments = json.loads(call["function"]["arguments"])
                assert schema_errors(arguments, _SCHEMAS[name]) == []
                tools_called.add(name)
                ask, result_message, summary = conversation[index - 1], conversation[index + 1], conversation[index + 2]
                assert (ask["role"], summary["role"]) == ("user", "assistant")
                result = json.loads(result_message["content"])
                if name == "get_order_status":
                    assert arguments["order_id"] in ask["content"]
                    assert result["order_id"] in summary["content"]
                if name == "check_inventory":
                    assert arguments["product"] in ask["content"]
                    assert f"{result['available']}" in summary["content"]
                    assert (result["available"] >= arguments["quantity"]) == ("restock_date" not in result)
                if name == "create_invoice":
                    assert result["invoice_id"] in summary["content"]
                    assert result["customer"] == arguments["customer"]
    assert tools_called == set(_SCHEMAS)


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _leaves(item)]
    if isinstance(value, list):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]


def test_tool_arguments_are_copied_from_the_ask() -> None:
    """Every argument value is written in the user's ask as the call writes it (ISO dates, plain unit prices), or is
    a default the tool's scenario always uses: what a small model can learn is copying, not converting."""
    defaults = {60, "JPY", "USD", *(book.room_booking_title for book in PHRASEBOOKS)}
    num_calls = 0
    for conversation in generate_conversations(300, seed=6, tool_fraction=1.0):
        for index, message in enumerate(conversation):
            for call in message.get("tool_calls", []):
                ask = conversation[index - 1]["content"]
                for leaf in _leaves(json.loads(call["function"]["arguments"])):
                    assert json.dumps(leaf, ensure_ascii=False).strip('"') in ask or leaf in defaults, (leaf, ask)
                num_calls += 1
    assert num_calls == 300


def test_every_template_names_only_slots_that_are_drawn() -> None:
    for book in PHRASEBOOKS:
        slots = _draw_slots(random.Random(0), book, book.companies[0], book.people[0])
        templates = [*book.thanks, *book.welcomes]
        for scenario in book.scenarios:
            templates += [*scenario.asks, *scenario.replies, *scenario.preambles]
            templates += [summary for summaries in scenario.summaries.values() for summary in summaries]
            assert scenario.tool is None or scenario.tool in _SCHEMAS
            assert scenario.tool is None or scenario.summaries, f"{scenario.name} calls a tool but cannot summarize it"
        for template in templates:
            names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
            assert names <= set(slots), (book.language, template)


def test_requests_end_where_the_model_answers(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    write_chat_requests(path, 80, seed=11)
    first = path.read_bytes()
    write_chat_requests(path, 80, seed=11)
    assert path.read_bytes() == first
    bodies = [json.loads(line) for line in first.decode().splitlines()]
    assert len(bodies) == 80
    assert {body["messages"][-1]["role"] for body in bodies} == {"user", "tool"}


def test_calibration_file_is_committed_as_generated(tmp_path: Path) -> None:
    assert len({CALIBRATION_SEED, TRAINING_SEED}) == 2
    regenerated = tmp_path / "calibration.jsonl"
    write_calibration_file(regenerated)
    assert CALIBRATION_PATH.read_bytes() == regenerated.read_bytes(), "run `python -m replica.demo.corpus`"
    assert CALIBRATION_PATH.stat().st_size < 300_000


def test_calibration_requests_are_valid_and_weighted() -> None:
    bodies = [json.loads(line) for line in CALIBRATION_PATH.read_text(encoding="utf-8").splitlines()]
    assert len(bodies) == 200
    for body in bodies:
        assert set(body) <= {"messages", "tools"}
        assert body.get("tools", TOOLS) == TOOLS
        assert body["messages"][-1]["role"] in {"user", "tool"}
        apply_chat_template(body["messages"], tools=body.get("tools"))
    japanese_fraction = sum(is_japanese(body["messages"]) for body in bodies) / len(bodies)
    tools_fraction = sum("tools" in body for body in bodies) / len(bodies)
    assert japanese_fraction == pytest.approx(0.6, abs=0.01)
    assert tools_fraction == pytest.approx(0.4, abs=0.01)
    assert sum(body["messages"][-1]["role"] == "tool" for body in bodies) >= 10
