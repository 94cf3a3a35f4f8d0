"""The router's chat rendering (Jinja, as transformers renders it) against the engines': the demo model's template
equals the replica's own renderer, a Qwen2.5-style template renders ChatML as Qwen's does, and a chat the template
rejects routes on text and is counted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from replica.chat_template import CHAT_TEMPLATE
from replica.demo.build import PACKAGED_DIR
from replica.demo.corpus import CALIBRATION_PATH, TOOLS, chat_requests, generate_conversations, uses_tools
from replica.tokenizer import Tokenizer, apply_chat_template
from router.service.chat_template import ChatTemplate, ChatTemplateError
from router.service.chat_tokenizer import ChatTokenizer, TokenizeFallback

QWEN_TEMPLATE = Path(__file__).parents[1] / "data" / "chat_templates" / "qwen2.5_tool_chat.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "天気を調べる",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def demo_chats() -> list[dict[str, Any]]:
    """Calibration chats, whole conversations with and without tools, and hand-made edge cases."""
    lines = Path(CALIBRATION_PATH).read_text(encoding="utf-8").splitlines()
    bodies = [json.loads(line) for line in lines]
    bodies += chat_requests(60, seed=11, japanese_fraction=1.0, tool_fraction=0.5)
    for conversation in generate_conversations(40, seed=5):
        bodies.append({"messages": conversation, "tools": TOOLS if uses_tools(conversation) else None})
    parts = [{"type": "text", "text": "見積書を"}, {"type": "text", "text": "送ってください。"}]
    bodies += [
        {"messages": [{"role": "user", "content": parts}]},
        {"messages": [{"role": "user", "content": "東京の天気は?"}], "tools": [WEATHER]},
        {
            "messages": [
                {"role": "user", "content": "大阪と京都"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "a",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"大阪"}'},
                        },
                        {
                            "id": "b",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": {"city": "京都"}},
                        },
                    ],
                },
                {"role": "tool", "tool_call_id": "a", "content": "晴れ"},
                {"role": "tool", "tool_call_id": "b", "content": "雨"},
            ],
            "tools": [WEATHER],
        },
    ]
    return bodies


def demo_template() -> ChatTemplate:
    config = json.loads((PACKAGED_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    return ChatTemplate.from_tokenizer_config(config)


def test_the_packaged_tokenizer_config_holds_the_template() -> None:
    config = json.loads((PACKAGED_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"] == CHAT_TEMPLATE
    assert demo_template().takes_content_parts


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_demo_template_renders_what_the_replica_renders(add_generation_prompt: bool) -> None:
    template = demo_template()
    bodies = demo_chats()
    assert sum(bool(b.get("tools")) for b in bodies) > 20
    for body in bodies:
        expected = apply_chat_template(
            body["messages"], tools=body.get("tools"), add_generation_prompt=add_generation_prompt
        )
        rendered = template.render(
            body["messages"], tools=body.get("tools"), add_generation_prompt=add_generation_prompt
        )
        assert rendered == expected


def test_the_router_tokenizes_chats_to_the_replicas_prompt_ids() -> None:
    router = ChatTokenizer.from_dir(PACKAGED_DIR)
    replica = Tokenizer.from_file(PACKAGED_DIR / "tokenizer.json")
    for body in demo_chats()[::7]:
        text = replica.apply_chat_template(body["messages"], tools=body.get("tools"), add_generation_prompt=True)
        assert router.chat_ids(body) == replica.encode(text)


def test_the_demo_template_rejects_what_the_replica_rejects() -> None:
    template = demo_template()
    bad = [
        [{"role": "robot", "content": "hi"}],
        [{"role": "user"}],
        [{"role": "tool", "content": "x"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}],
    ]
    for messages in bad:
        with pytest.raises(ValueError):
            apply_chat_template(messages)
        with pytest.raises(ChatTemplateError):
            template.render(messages)


def qwen() -> ChatTemplate:
    return ChatTemplate(QWEN_TEMPLATE.read_text(encoding="utf-8"), {"eos_token": "<|im_end|>"})


QWEN_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"


def test_a_qwen_template_renders_chatml_with_its_default_system_prompt() -> None:
    rendered = qwen().render([{"role": "user", "content": "こんにちは"}])
    assert rendered == QWEN_SYSTEM + "<|im_start|>user\nこんにちは<|im_end|>\n<|im_start|>assistant\n"
    two_turns = qwen().render(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": [{"type": "text", "text": "One"}, {"type": "text", "text": "two"}]},
        ],
        add_generation_prompt=False,
    )
    assert two_turns == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nOne\ntwo<|im_end|>\n"
    )


def test_a_qwen_template_renders_tools_calls_and_grouped_responses() -> None:
    messages = [
        {"role": "user", "content": "大阪と京都"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "大阪"}'}},
                {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "京都"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "晴れ"},
        {"role": "tool", "tool_call_id": "b", "content": "雨"},
    ]
    rendered = qwen().render(messages, tools=[WEATHER])
    tools_json = json.dumps(WEATHER, ensure_ascii=False)
    assert rendered == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\nYou are provided with function "
        f"signatures within <tools></tools> XML tags:\n<tools>\n{tools_json}\n</tools>\n\nFor each function call, "
        "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n大阪と京都<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "大阪"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "京都"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n晴れ\n</tool_response>\n<tool_response>\n雨\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not qwen().takes_content_parts
    # A growing conversation extends its previous rendering, so each turn's KV prefix is reusable.
    shorter = qwen().render(messages[:2], tools=[WEATHER], add_generation_prompt=False)
    assert rendered.startswith(shorter)


def test_templates_see_special_tokens_and_raise_exception() -> None:
    template = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{{ eos_token }}"
        "{% else %}{{ raise_exception('only user turns') }}{% endif %}{% endfor %}",
        {"bos_token": "<s>", "eos_token": "</s>"},
    )
    assert template.render([{"role": "user", "content": "a"}]) == "<s>a</s>"
    with pytest.raises(ChatTemplateError, match="only user turns"):
        template.render([{"role": "assistant", "content": "a"}])
    with pytest.raises(ChatTemplateError):  # a type error inside the template is a rejection too
        ChatTemplate("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "a"}])


def test_a_rejected_chat_falls_back_with_its_reason() -> None:
    tokenizer = ChatTokenizer.from_dir(PACKAGED_DIR)
    with pytest.raises(TokenizeFallback) as caught:
        tokenizer.routing_key("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]})
    assert caught.value.reason == "template_error"
    with pytest.raises(TokenizeFallback) as caught:
        tokenizer.routing_key("/v1/chat/completions", {"messages": [], "chat_template": "{{ 1 }}"})
    assert caught.value.reason == "unsupported"
    key = tokenizer.routing_key("/v1/completions", {"prompt": "見積書を送ってください"})
    assert key.token_ids == Tokenizer.from_file(PACKAGED_DIR / "tokenizer.json").encode("見積書を送ってください")


def test_rendering_equals_transformers_apply_chat_template() -> None:
    """Against transformers itself where it is installed (it is no dependency of the project)."""
    transformers = pytest.importorskip("transformers")
    config = json.loads((PACKAGED_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(PACKAGED_DIR / "tokenizer.json"), eos_token=config["eos_token"]
    )
    qwen_source = QWEN_TEMPLATE.read_text(encoding="utf-8")
    for body in demo_chats()[::3]:
        messages = json.loads(json.dumps(body["messages"]))
        for message in messages:  # as vLLM hands them over: tool-call arguments as objects
            for call in message.get("tool_calls") or []:
                if isinstance(call["function"]["arguments"], str):
                    call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        for ours, source in ((demo_template(), config["chat_template"]), (qwen(), qwen_source)):
            if source is qwen_source and any(isinstance(m.get("content"), list) for m in messages):
                continue  # vLLM joins the parts for this template before transformers sees them
            expected = hf.apply_chat_template(
                messages, tools=body.get("tools"), chat_template=source, tokenize=False, add_generation_prompt=True
            )
            assert ours.render(body["messages"], tools=body.get("tools")) == expected


def test_a_chat_template_jinja_file_beside_the_tokenizer_is_the_template(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((PACKAGED_DIR / "tokenizer.json").read_bytes())
    assert ChatTokenizer.from_dir(tmp_path).template is None  # no template: chats route on text
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}', encoding="utf-8")
    (tmp_path / "chat_template.jinja").write_text(QWEN_TEMPLATE.read_text(encoding="utf-8"), encoding="utf-8")
    tokenizer = ChatTokenizer.from_dir(tmp_path)
    assert tokenizer.template is not None and tokenizer.template.special_tokens == {"eos_token": "<|im_end|>"}
    assert tokenizer.render_chat({"messages": [{"role": "user", "content": "hi"}]}).startswith(QWEN_SYSTEM)
