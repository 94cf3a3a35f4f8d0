"""The tool-call scorer of the demo model: prompts end where the corpus calls a tool, and each completion reaches
the level it earns."""

from __future__ import annotations

import json

from replica.demo.toolcheck import rates, score, tool_prompts


def test_prompts_end_at_the_ask_and_know_the_call() -> None:
    prompts = tool_prompts(20)
    assert len(prompts) == 20
    for prompt in prompts:
        assert prompt.messages[-1]["role"] == "user"
        assert not any(message.get("tool_calls") for message in prompt.messages)
    assert {p.name for p in prompts} >= {"get_order_status", "schedule_meeting", "check_inventory"}


def test_each_completion_reaches_the_level_it_earns() -> None:
    prompt = next(p for p in tool_prompts(40) if p.name == "check_inventory")
    exact = json.dumps({"name": prompt.name, "arguments": prompt.arguments}, ensure_ascii=False)
    other_value = {**prompt.arguments, "quantity": prompt.arguments["quantity"] + 1}
    cases = {
        "no call here": None,
        '<tool_call>\n{"name": "check_inventory", "arguments": {"product": </tool_call>': "call",
        '<tool_call>\n{"name": "get_order_status", "arguments": {"order_id": "ORD-1"}}\n</tool_call>': "json",
        '<tool_call>\n{"name": "check_inventory", "arguments": {"item": "x"}}\n</tool_call>': "name",
        '<tool_call>\n{"name": "check_inventory", "arguments": {"product": "x", "quantity": "5"}}': "name",
        f"<tool_call>\n{json.dumps({'name': prompt.name, 'arguments': other_value})}\n</tool_call>": "schema",
        f"Let me check.\n<tool_call>\n{exact}\n</tool_call>": "exact",
    }
    levels = [score(text, prompt) for text in cases]
    assert levels == list(cases.values())
    assert rates(levels) == {"call": 6 / 7, "json": 5 / 7, "name": 4 / 7, "schema": 2 / 7, "exact": 1 / 7}
