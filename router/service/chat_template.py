"""A model's chat template rendered as Hugging Face transformers renders it, so the router sees the engine's prompt.

transformers compiles `tokenizer_config.json`'s `chat_template` in an `ImmutableSandboxedEnvironment` with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension and a `{% generation %}` tag, a `tojson` filter that
is plain `json.dumps` (no HTML escaping, `ensure_ascii=False`), and the globals `raise_exception` and
`strftime_now`; it renders with `messages`, `tools`, `add_generation_prompt` and the tokenizer's special tokens
(`bos_token`, `eos_token`, ...). This module does the same. vLLM renders chat through it after two changes to the
request, which `ChatTemplate.render` makes too: tool-call `arguments` strings become objects, and, for a template
that does not loop over a message's content parts, text parts are joined with newlines into one string.

A template that raises (`raise_exception`, a type error in the template) raises `ChatTemplateError`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_LOOPS_OVER_CONTENT = re.compile(r"\bfor\s+\w+\s+in\s+[\w\[\]]+(?:\.content\b|\[\s*['\"]content['\"]\s*\])")
"""A template that iterates a message's content takes OpenAI content parts as they are (vLLM's "openai" content
format); any other gets each message's text parts as one string (its "string" format)."""


class ChatTemplateError(ValueError):
    """The template rejected the chat, or failed on it."""


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks assistant tokens); renders its body."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's own class attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """One compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        """`special_tokens`: template variables such as `eos_token`; a token the tokenizer lacks is left out, so
        the template sees it undefined, as in transformers."""
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the chat template does not compile: {exc}") from exc
        self.special_tokens = dict(special_tokens or {})
        self.takes_content_parts = _LOOPS_OVER_CONTENT.search(source) is not None

    @classmethod
    def from_tokenizer_config(cls, config: Mapping[str, Any]) -> ChatTemplate:
        """From a parsed `tokenizer_config.json`; ValueError when it has no (default) chat template."""
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
            source = named.get("default")
        if not isinstance(source, str):
            raise ValueError("tokenizer_config.json has no chat_template (or no 'default' one)")
        tokens = {key: _token_text(config.get(key)) for key in _SPECIAL_TOKEN_KEYS}
        return cls(source, {key: token for key, token in tokens.items() if token is not None})

    def render(
        self,
        messages: Sequence[Any],
        *,
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """The prompt text of a chat; `extra` are further template variables (a request's chat_template_kwargs)."""
        try:
            return self._template.render(
                **self.special_tokens,
                **extra,
                messages=[self._prepared(m) for m in messages],
                tools=tools,
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, RecursionError) as exc:
            raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from None

    def _prepared(self, message: Any) -> Any:
        """The message as vLLM hands it to the template (module docstring); the request's own is not changed."""
        if not isinstance(message, dict):
            return message
        content = message.get("content")
        tool_calls = message.get("tool_calls")
        if isinstance(content, list) and not self.takes_content_parts:
            texts = [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
            if len(texts) != len(content) or any(p.get("type") != "text" for p in content):
                raise ChatTemplateError("only text content parts can be rendered by this template")
            message = {**message, "content": "\n".join(texts)}
        if isinstance(tool_calls, list) and message.get("role") == "assistant":
            message = {**message, "tool_calls": [_with_object_arguments(call) for call in tool_calls]}
        return message


def _with_object_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"]) if function["arguments"] else {}
    except json.JSONDecodeError as exc:
        raise ChatTemplateError(f"tool call arguments are not valid JSON: {exc}") from None
    return {**call, "function": {**function, "arguments": arguments}}


def _token_text(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken object with its `content`."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None
