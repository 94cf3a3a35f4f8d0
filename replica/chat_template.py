"""The demo model's chat template as Jinja, for engines and routers that render templates the Hugging Face way.

`CHAT_TEMPLATE` renders exactly what `replica.tokenizer.apply_chat_template` renders (messages, tools, the
generation prompt), given messages whose tool-call `arguments` are objects, as vLLM and the router pass them:
`tests/unit/test_chat_template.py` holds the two equal over the demo's calibration chats, tool chats and Japanese.
`write_tokenizer_config` writes it into a checkpoint's `tokenizer_config.json` beside its tokenizer.json, with the
special tokens a template reads (`eos_token`, `pad_token`; ChatML has no BOS).

The replica keeps its Python renderer, whose validation gives each malformed request its own 400 message; the
template raises on the same malformed inputs, with shorter messages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from replica.tokenizer import ENDOFTEXT, IM_END

CHAT_TEMPLATE = r"""
{%- macro text(message, where) -%}
    {%- if message.content is string -%}
        {{- message.content -}}
    {%- elif message.content is iterable and message.content is not mapping -%}
        {%- for part in message.content -%}
            {%- if part is not mapping or part.type != 'text' or part.text is not string -%}
                {{- raise_exception(where ~ ' must hold text content parts only') -}}
            {%- endif -%}
            {{- part.text -}}
        {%- endfor -%}
    {%- else -%}
        {{- raise_exception(where ~ ' must be a string or a list of text parts') -}}
    {%- endif -%}
{%- endmacro -%}
{%- if tools -%}
    {%- set ns = namespace(tools_block='# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>') -%}
    {%- for tool in tools -%}
        {%- if tool is not mapping or tool.type != 'function' or tool.function is not mapping or tool.function.name is not string -%}
            {{- raise_exception('tools[' ~ loop.index0 ~ '] must be {"type": "function", "function": {"name": ...}}') -}}
        {%- endif -%}
        {%- set ns.tools_block = ns.tools_block ~ '\n' ~ (tool | tojson) -%}
    {%- endfor -%}
    {%- set tools_block = ns.tools_block ~ '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' -%}
    {%- if messages[0].role == 'system' -%}
        {{- '<|im_start|>system\n' ~ text(messages[0], 'messages[0].content') ~ '\n\n' ~ tools_block ~ '<|im_end|>\n' -}}
        {%- set first = 1 -%}
    {%- else -%}
        {{- '<|im_start|>system\n' ~ tools_block ~ '<|im_end|>\n' -}}
        {%- set first = 0 -%}
    {%- endif -%}
{%- else -%}
    {%- set first = 0 -%}
{%- endif -%}
{%- for message in messages[first:] -%}
    {%- set where = 'messages[' ~ (loop.index0 + first) ~ ']' -%}
    {%- if message.role not in ['system', 'user', 'assistant', 'tool'] -%}
        {{- raise_exception(where ~ '.role must be system, user, assistant or tool') -}}
    {%- endif -%}
    {%- if message.role == 'tool' and message.tool_call_id is not string -%}
        {{- raise_exception(where ~ " (role 'tool') needs a string 'tool_call_id'") -}}
    {%- endif -%}
    {%- if message.tool_calls -%}
        {%- if message.role != 'assistant' -%}
            {{- raise_exception(where ~ ' has tool_calls; only assistant messages call tools') -}}
        {%- endif -%}
        {%- set content = '' if message.content is none or message.content is undefined else text(message, where ~ '.content') -%}
        {{- '<|im_start|>assistant\n' ~ content -}}
        {%- for call in message.tool_calls -%}
            {%- if call.function is not mapping or call.function.name is not string or call.function.arguments is not mapping -%}
                {{- raise_exception(where ~ '.tool_calls[' ~ loop.index0 ~ '] needs a function name and object arguments') -}}
            {%- endif -%}
            {%- if content or not loop.first -%}
                {{- '\n' -}}
            {%- endif -%}
            {{- '<tool_call>\n{"name": ' ~ (call.function.name | tojson) ~ ', "arguments": ' ~ (call.function.arguments | tojson) ~ '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- else -%}
        {%- if message.content is undefined -%}
            {{- raise_exception(where ~ ' is missing content') -}}
        {%- endif -%}
        {{- '<|im_start|>' ~ message.role ~ '\n' ~ text(message, where ~ '.content') ~ '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
""".strip()
"""Jinja source of the demo's ChatML template (module docstring)."""


def tokenizer_config(*, model_max_length: int) -> dict[str, Any]:
    """The `tokenizer_config.json` of a Shoal checkpoint: the chat template and the special tokens it reads."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer_config(folder: Path, *, model_max_length: int) -> Path:
    """Write `tokenizer_config.json` into a checkpoint folder; returns its path."""
    path = folder / "tokenizer_config.json"
    text = json.dumps(tokenizer_config(model_max_length=model_max_length), ensure_ascii=False, indent=2)
    path.write_text(text + "\n", encoding="utf-8")
    return path
