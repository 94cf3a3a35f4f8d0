"""Token-id routing keys for chat and text prompts: a model's tokenizer and chat template, held by the router.

With a model's `tokenizer.json` and chat template (`tokenizer_config.json`, or `chat_template.jinja`; setting
`tokenizer.models`), a chat request is rendered as the engine renders it (`chat_template.ChatTemplate`) and
tokenized without added special tokens, as vLLM tokenizes chat; a completion's string prompt is tokenized with
them, vLLM's default for completions. The request then routes on token ids, the blocks the engine hashes, so in
exact mode the replicas' KV events match it.

A request the tokenizer cannot take routes on its text key as before, and the proxy counts why
(`TokenizeFallback.reason`): `template_error` (the template rejected the chat), `oversized` (a body past
`tokenizer.max_request_bytes`), `unsupported` (a request that names its own chat template, or a model folder
without one). Methods here are thread-safe (the tokenizer is Rust, the template immutable), so the proxy may call
them from a worker thread.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from router.policy.routing_text import RoutingKey
from router.service.settings import TokenizerSettings

try:
    import tokenizers

    from router.service.chat_template import ChatTemplate, ChatTemplateError
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        f"the router's tokenizer.models setting needs the `tokenize` extra (pip install 'shoal[tokenize]'): {exc}"
    ) from exc


class TokenizeFallback(Exception):
    """The request routes on text; `reason` is the label it is counted under."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class ChatTokenizer:
    """One model's tokenizer and chat template: request body -> the prompt's token ids."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        template: ChatTemplate | None,
        *,
        exclude_tools_when_tool_choice_none: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        """None for a model folder without a chat template: its chats route on text."""
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none

    @classmethod
    def from_dir(cls, path: Path, *, exclude_tools_when_tool_choice_none: bool = True) -> ChatTokenizer:
        """Load `path/tokenizer.json` and the chat template: `path/chat_template.jinja` where there is one (newer
        transformers save it there), else `tokenizer_config.json`'s `chat_template`; special tokens from the
        latter."""
        tokenizer = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config_path, jinja_path = path / "tokenizer_config.json", path / "chat_template.jinja"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        if jinja_path.is_file():
            config["chat_template"] = jinja_path.read_text(encoding="utf-8")
        template = ChatTemplate.from_tokenizer_config(config) if config.get("chat_template") is not None else None
        return cls(tokenizer, template, exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none)

    def render_chat(self, body: Mapping[str, Any]) -> str:
        """The prompt text of a `/v1/chat/completions` body, as the engine renders it."""
        if self.template is None:
            raise TokenizeFallback("unsupported", "the model's folder has no chat template")
        if body.get("chat_template") is not None:
            raise TokenizeFallback("unsupported", "the request names its own chat template")
        tools = body.get("tools") or None
        if tools is not None and self.exclude_tools_when_tool_choice_none and body.get("tool_choice") == "none":
            tools = None
        extra = body.get("chat_template_kwargs")
        extra = dict(extra) if isinstance(extra, Mapping) else {}
        extra.pop("messages", None)  # the request's own fields win over its template kwargs, as in vLLM
        extra.pop("tools", None)
        add_generation_prompt = body.get("add_generation_prompt", True)
        try:
            return self.template.render(
                body["messages"], tools=tools, add_generation_prompt=add_generation_prompt is not False, **extra
            )
        except ChatTemplateError as exc:
            raise TokenizeFallback("template_error", str(exc)) from None

    def chat_ids(self, body: Mapping[str, Any]) -> list[int]:
        """The token ids the engine prefills for a chat body (vLLM: `add_special_tokens=False` after the template)."""
        return self._encode(self.render_chat(body), add_special_tokens=False)

    def prompt_ids(self, prompt: str) -> list[int]:
        """The token ids of a completion's string prompt, special tokens added (vLLM's default for completions)."""
        return self._encode(prompt, add_special_tokens=True)

    def _encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        # encode_batch releases the GIL while it encodes (encode does not), so a worker thread's encode leaves the
        # event loop free (benchmarks/bench_chat_tokenize.py).
        return list(self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def routing_key(self, path: str, body: Mapping[str, Any]) -> RoutingKey:
        """The token-id routing key of a validated body for `path`; `TokenizeFallback` when it routes on text."""
        if path == "/v1/chat/completions":
            return RoutingKey(token_ids=self.chat_ids(body))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt:
            prompt = prompt[0]  # a batch routes on its first prompt, as the text key does
        if not isinstance(prompt, str):
            raise TokenizeFallback("unsupported", "the prompt is not a string")
        return RoutingKey(token_ids=self.prompt_ids(prompt))


def load_tokenizers(settings: TokenizerSettings) -> dict[str, ChatTokenizer]:
    """Each configured model's `ChatTokenizer`, by served model name."""
    return {
        model: ChatTokenizer.from_dir(
            path, exclude_tools_when_tool_choice_none=settings.exclude_tools_when_tool_choice_none
        )
        for model, path in settings.models.items()
    }
