"""The answer scorer of the demo model: the corpus's own answers are complete, and each way of missing is caught."""

from __future__ import annotations

import json

from replica.demo.answercheck import answer_prompts, judge
from replica.demo.corpus import CLOSING


def call_text(name: str, arguments: dict[str, object]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"


def test_the_corpus_answers_are_complete() -> None:
    prompts = answer_prompts(400)
    assert {p.exchange.language for p in prompts} == {"ja", "en"}
    assert sum(p.exchange.is_tool_call for p in prompts) > 50
    assert sum(p.exchange.scenario == CLOSING for p in prompts) > 10
    for prompt in prompts:
        assert prompt.messages[-1]["role"] == "user"
        assert ("<tool_call>" in prompt.reference) == prompt.exchange.is_tool_call
        assert judge(prompt.reference, "stop", prompt).is_complete, (prompt.messages[-1], prompt.reference)


def test_each_miss_is_caught() -> None:
    prompts = answer_prompts(200)
    order = next(p for p in prompts if p.exchange.scenario == "order_status" and not p.exchange.is_tool_call)
    order_id = order.exchange.slots["order_id"]
    assert order_id in order.messages[-1]["content"] and order_id in order.reference
    wrong_id = order.reference.replace(order_id, "ORD-12345")
    english = next(p for p in prompts if p.exchange.language == "en" and not p.exchange.is_tool_call)
    japanese = next(p for p in prompts if p.exchange.language == "ja" and not p.exchange.is_tool_call)
    tool = next(p for p in prompts if p.exchange.is_tool_call and '"get_order_status"' in p.reference)
    no_tools = next(p for p in prompts if p.tools is None and p.exchange.scenario == "order_status")
    cases = [
        (order.reference, "length", order, "did not end by itself (length)"),
        (wrong_id, "stop", order, f"the ask's values not copied: order_id 'ORD-12345' for '{order_id}'"),
        (english.reference, "stop", japanese, "not in the asked language (ja)"),
        (japanese.reference, "stop", english, "not in the asked language (en)"),
        (order.reference + " Anything else?", "stop", order, "not a reply of the scenario order_status"),
        (call_text("get_order_status", {"order_id": "X"}), "stop", no_tools, "a tool call where the corpus replies"),
        (call_text("check_inventory", {"product": "x"}), "stop", tool, "not a valid call of get_order_status"),
        (call_text("get_order_status", {"order": "X"}), "stop", tool, "not a valid call of get_order_status"),
        ("Let me check.\n" + call_text("get_order_status", {"order_id": "X"}), "stop", tool, "complete"),
    ]
    levels = [None, "scenario", "ended", "ended", "language", "language", "language", "language", "complete"]
    for (text, finish_reason, prompt, reason), level in zip(cases, levels, strict=True):
        verdict = judge(text, finish_reason, prompt)
        assert verdict.reason.startswith(reason), (text, verdict)
        assert verdict.level == level, (text, verdict)
        assert verdict.is_complete == (reason == "complete")
        assert verdict.reaches("scenario") == (level in ("scenario", "complete"))
        assert verdict.wrong_slots == (("order_id",) if level == "scenario" else ())
