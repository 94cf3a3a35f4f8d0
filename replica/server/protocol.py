"""OpenAI request parsing and response bodies for `/v1/completions` and `/v1/chat/completions`.

Parsing turns a JSON body into (prompt token ids, SamplingParams, options) or raises `ProtocolError` with a message
naming the offending field; nothing reaches the engine unchecked. A field Shoal does not implement (logit_bias,
suffix, best_of other than n, service_tier other than auto/default, any name it does not know) is refused by name
rather than silently ignored.

Served: `n` choices (seeded choice i draws with seed + i), `stop` (up to 4) and vLLM's `stop_token_ids`, OpenAI's
presence/frequency penalties and vLLM's repetition_penalty, `logprobs` (completions: an int, the top alternatives
per token; chat: a bool with `top_logprobs`), `max_completion_tokens` (chat; equal to max_tokens if both are
sent), `echo` (completions; with `logprobs`, the prompt's tokens get theirs too, the first one null, as OpenAI's
legacy completions report them), `stream_options.include_usage`.

Constrained output (`replica.grammar`): `response_format` json_object or json_schema (strict or not: both enforced)
on both endpoints, and chat `tools` with `tool_choice` auto, none, required or a named function, and
`parallel_tool_calls`. The grammar is built and validated here, so a bad schema is a 400 that names the problem
before anything is queued. tool_choice none offers no tools to the chat template and parses no call. vLLM's
`structured_outputs: {"grammar": ...}` (a Lark grammar, llguidance's dialect) is taken too.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import llguidance

from replica.engine.sampler import TokenLogprob
from replica.engine.sampling import MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, SamplingError, SamplingParams
from replica.grammar.formats import json_object_grammar, json_schema_grammar, tool_call_grammar
from replica.grammar.matcher import GrammarCompiler, GrammarError
from replica.tokenizer import TOOL_CALL_END, TOOL_CALL_START, Tokenizer


class ProtocolError(ValueError):
    """A request body that is not a valid request (400), with the field it concerns."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ParsedRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    model: str
    has_tools: bool
    """Tools were offered and tool_choice is not none: tool calls are parsed out of the output."""
    prompt_text: str | None = None
    """The prompt as text: the chat template's rendering, or a completion's string prompt; None for token ids."""
    n: int = 1
    echo: bool = False
    """Completions: the prompt's text comes before the output."""

    def choice_params(self) -> list[SamplingParams]:
        """The parameters of each of the n choices: a seeded request's choice i draws with seed + i (vLLM's)."""
        if self.params.seed is None:
            return [self.params] * self.n
        return [replace(self.params, seed=(self.params.seed + i) % 2**63) for i in range(self.n)]


MAX_N = 16
"""Most choices per request."""

_COMMON_FIELDS = frozenset(
    {
        "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
        "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "n",
        "best_of", "logprobs", "user", "response_format", "structured_outputs", "logit_bias", "service_tier",
    }
)  # fmt: skip
_CHAT_FIELDS = _COMMON_FIELDS | {
    "messages", "tools", "tool_choice", "parallel_tool_calls", "top_logprobs", "max_completion_tokens",
}  # fmt: skip
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "suffix"}

_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "suffix": lambda v: v is not None,
    "logit_bias": lambda v: v not in (None, {}),
    "service_tier": lambda v: v not in (None, "auto", "default"),
}


def _check_fields(body: dict[str, Any], known: frozenset[str]) -> None:
    for name in body:
        if name not in known:
            raise ProtocolError(f"'{name}' is not supported by this server", name)
    for name, is_unsupported in _UNSUPPORTED.items():
        if name in body and is_unsupported(body[name]):
            raise ProtocolError(f"'{name}' is not supported by this server", name)


def _choices(body: dict[str, Any]) -> int:
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise ProtocolError(f"'n' must be in [1, {MAX_N}], got {n}", "n")
    best_of = _get(body, "best_of", int, n)
    if best_of != n:
        raise ProtocolError("'best_of' other than n is not supported by this server", "best_of")
    return int(n)


def _logprobs(body: dict[str, Any], *, chat: bool) -> int | None:
    """The number of alternatives per token, or None for no logprobs."""
    if chat:
        wanted = _get(body, "logprobs", bool, False)
        top = _get(body, "top_logprobs", int)
        if top is not None and not wanted:
            raise ProtocolError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if not wanted:
            return None
        top = 0 if top is None else top
        name = "top_logprobs"
    else:
        top = _get(body, "logprobs", int)
        if top is None:
            return None
        name = "logprobs"
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ProtocolError(f"'{name}' must be in [0, {MAX_TOP_LOGPROBS}], got {top}", name)
    return int(top)


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = float(_get(body, name, (int, float), default))
    if value != value:
        raise ProtocolError(f"'{name}' must be a number, got NaN", name)
    return value


def _get(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ProtocolError(f"'{name}' must be {getattr(kind, '__name__', kind)}, not a boolean", name)
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ProtocolError(f"'{name}' must be {names}, got {type(value).__name__}", name)
    return value


def _sampling(
    body: dict[str, Any], *, default_max_tokens: int, chat: bool, grammar: str | None = None
) -> SamplingParams:
    max_tokens = _get(body, "max_tokens", int)
    if chat:
        max_completion = _get(body, "max_completion_tokens", int)
        if max_completion is not None and max_tokens is not None and max_completion != max_tokens:
            raise ProtocolError(
                "'max_tokens' and 'max_completion_tokens' differ; send one of them", "max_completion_tokens"
            )
        max_tokens = max_completion if max_completion is not None else max_tokens
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise ProtocolError("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise ProtocolError(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise ProtocolError("'stop' strings must not be empty", "stop")
    stop_ids = _get(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise ProtocolError("'stop_token_ids' must be a list of integers", "stop_token_ids")
    try:
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
            temperature=_number(body, "temperature", 1.0),
            top_p=_number(body, "top_p", 1.0),
            top_k=_get(body, "top_k", int, 0) if body.get("top_k") != -1 else 0,
            seed=_get(body, "seed", int),
            stop=stops,
            stop_token_ids=frozenset(stop_ids),
            ignore_eos=bool(_get(body, "ignore_eos", bool, False)),
            grammar=grammar,
            presence_penalty=_number(body, "presence_penalty", 0.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0),
            repetition_penalty=_number(body, "repetition_penalty", 1.0),
            logprobs=_logprobs(body, chat=chat),
        )
    except SamplingError as exc:
        param = next((n for n in _PARAM_NAMES if str(exc).startswith(n)), None)
        raise ProtocolError(str(exc), param) from None


_PARAM_NAMES = (
    "max_tokens", "temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "top_logprobs",
)  # fmt: skip


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = bool(_get(body, "stream", bool, False))
    options = _get(body, "stream_options", dict, {})
    for name in options:
        if name != "include_usage":
            raise ProtocolError(f"stream_options.{name} is not supported by this server", "stream_options")
    if options and not stream:
        raise ProtocolError("'stream_options' needs 'stream': true", "stream_options")
    include_usage = bool(_get(options, "include_usage", bool, False))
    return stream, include_usage


def _response_format_grammar(body: dict[str, Any]) -> str | None:
    """The grammar of `response_format`, or of vLLM's `structured_outputs: {"grammar": <Lark>}` extension."""
    extension = body.get("structured_outputs")
    if extension is not None:
        if (
            not isinstance(extension, dict)
            or set(extension) != {"grammar"}
            or not isinstance(extension["grammar"], str)
        ):
            raise ProtocolError(
                "structured_outputs supports only {'grammar': <Lark grammar>} on this server", "structured_outputs"
            )
        if body.get("response_format") not in (None, {"type": "text"}):
            raise ProtocolError("send response_format or structured_outputs, not both", "structured_outputs")
        return str(llguidance.LLMatcher.grammar_from_lark(extension["grammar"]))
    response_format = body.get("response_format")
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_grammar()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ProtocolError(
                "response_format json_schema needs 'json_schema': {'name': ..., 'schema': {...}}", "response_format"
            )
        if "strict" in spec and not isinstance(spec["strict"], bool | None):
            raise ProtocolError("response_format.json_schema.strict must be a boolean", "response_format")
        try:
            return json_schema_grammar(spec["schema"], "response_format.json_schema.schema")
        except GrammarError as exc:
            raise ProtocolError(str(exc), "response_format") from None
    raise ProtocolError("response_format.type must be 'text', 'json_object' or 'json_schema'", "response_format")


def _tool_grammar(
    body: dict[str, Any], tools: list[Any] | None, tokenizer: Tokenizer
) -> tuple[str | None, list[Any] | None]:
    """(the grammar tool_choice asks for, the tools to offer the chat template)."""
    choice = body.get("tool_choice")
    parallel = _get(body, "parallel_tool_calls", bool, True)
    if not tools:
        if choice not in (None, "none"):
            raise ProtocolError("tool_choice needs 'tools'", "tool_choice")
        return None, None
    if choice is None:
        choice = "auto"
    if choice == "none":
        return None, None
    functions = [t.get("function") if isinstance(t, dict) else None for t in tools]
    for index, function in enumerate(functions):
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ProtocolError(f"tools[{index}] must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
    if choice in ("auto", "required"):
        chosen = functions
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        chosen = [f for f in functions if f is not None and f.get("name") == name]
        if not chosen:
            raise ProtocolError(f"tool_choice names the function {name!r}, which is not in 'tools'", "tool_choice")
    else:
        raise ProtocolError(
            "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    start_id, end_id = tokenizer.token_to_id(TOOL_CALL_START), tokenizer.token_to_id(TOOL_CALL_END)
    assert start_id is not None and end_id is not None
    try:
        grammar = tool_call_grammar(
            [f for f in chosen if f is not None],
            call_start_id=start_id,
            call_end_id=end_id,
            is_forced=choice != "auto",
            is_parallel=parallel and not isinstance(choice, dict),  # a named function is called once, as in vLLM
        )
    except GrammarError as exc:
        raise ProtocolError(str(exc), "tools") from None
    return grammar, tools


def _validated(grammar: str | None, grammars: GrammarCompiler | None, param: str) -> str | None:
    if grammar is None:
        return None
    if grammars is None:
        raise ProtocolError("this replica serves no constrained outputs (it has no grammar tokenizer)", param)
    try:
        grammars.validate(grammar)
    except GrammarError as exc:
        raise ProtocolError(f"{param}: {exc}", param) from None
    return grammar


def _refuse_past_context(tokenizer: Tokenizer, text: str, context: int | None, param: str) -> None:
    """A text with more bytes than `context` of the tokenizer's longest tokens hold has too many tokens, whatever
    they are: refused at once (tokenizing 15 MB of text takes seconds)."""
    if context is not None and (at_least := tokenizer.min_tokens(text)) >= context:
        raise ProtocolError(
            f"the prompt has at least {at_least} tokens; this model's context is {context} tokens including at least "
            "one generated token",
            param,
        )


def parse_completion(
    body: Any,
    tokenizer: Tokenizer,
    *,
    model: str,
    default_max_tokens: int,
    grammars: GrammarCompiler | None = None,
    context: int | None = None,
) -> ParsedRequest:
    """`context`: the model's context in tokens; a prompt text that cannot fit is refused before it is tokenized."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    _check_fields(body, _COMPLETION_FIELDS)
    echo = bool(_get(body, "echo", bool, False))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    text: str | None = None
    if isinstance(prompt, str):
        _refuse_past_context(tokenizer, prompt, context, "prompt")
        ids, text = tokenizer.encode(prompt), prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise ProtocolError("send one prompt per request (batched prompts are not supported)", "prompt")
    else:
        raise ProtocolError("'prompt' must be a non-empty string or a list of token ids", "prompt")
    stream, include_usage = _stream_options(body)
    grammar = _validated(_response_format_grammar(body), grammars, "response_format")
    params = _sampling(body, default_max_tokens=default_max_tokens, chat=False, grammar=grammar)
    if echo and params.logprobs is not None:
        params = replace(params, prompt_logprobs=params.logprobs)
    return ParsedRequest(
        prompt_token_ids=ids,
        params=params,
        stream=stream,
        include_usage=include_usage,
        model=model,
        has_tools=False,
        prompt_text=text,
        n=_choices(body),
        echo=echo,
    )


def parse_chat(
    body: Any,
    tokenizer: Tokenizer,
    *,
    model: str,
    default_max_tokens: int,
    grammars: GrammarCompiler | None = None,
    context: int | None = None,
) -> ParsedRequest:
    """`context`: the model's context in tokens; a prompt text that cannot fit is refused before it is tokenized."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    _check_fields(body, _CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("'messages' must be a non-empty list", "messages")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ProtocolError("'tools' must be a list", "tools")
    format_grammar = _response_format_grammar(body)
    tool_grammar, offered = _tool_grammar(body, tools, tokenizer)
    if format_grammar is not None and tool_grammar is not None:
        raise ProtocolError(
            "response_format json_object/json_schema together with tools is not supported; send tool_choice 'none' "
            "or no response_format",
            "response_format",
        )
    grammar = _validated(format_grammar, grammars, "response_format") or _validated(tool_grammar, grammars, "tools")
    try:
        text = tokenizer.apply_chat_template(messages, tools=offered, add_generation_prompt=True)
    except ValueError as exc:
        raise ProtocolError(str(exc), "messages") from None
    _refuse_past_context(tokenizer, text, context, "messages")
    stream, include_usage = _stream_options(body)
    return ParsedRequest(
        prompt_token_ids=tokenizer.encode(text),
        params=_sampling(body, default_max_tokens=default_max_tokens, chat=True, grammar=grammar),
        stream=stream,
        include_usage=include_usage,
        model=model,
        has_tools=bool(offered),
        prompt_text=text,
        n=_choices(body),
    )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def now_s() -> int:
    return int(time.time())


# --- logprob bodies ---------------------------------------------------------------------------------------


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


MIN_LOGPROB = -9999.0
"""What a logprob of -inf is reported as (JSON has no infinity; OpenAI reports -9999.0 likewise)."""


def chat_logprobs(tokenizer: Tokenizer, pieces: list[TokenLogprob], token_ids: list[int]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(text.encode())}

    content = []
    for token_id, lp in zip(token_ids, pieces, strict=True):
        item = entry(token_id, lp.logprob)
        item["top_logprobs"] = [entry(t, v) for t, v in lp.top]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(
    tokenizer: Tokenizer, pieces: list[TokenLogprob], token_ids: list[int], offset: int
) -> tuple[dict[str, Any], int]:
    """The completions API's logprobs object, text offsets counted from `offset`; -> (it, the offset after it)."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, lp in zip(token_ids, pieces, strict=True):
        text = token_text(tokenizer, token_id)
        tokens.append(text)
        values.append(max(lp.logprob, MIN_LOGPROB))
        top: dict[str, float] = {}
        for t, v in lp.top:
            top.setdefault(token_text(tokenizer, t), max(v, MIN_LOGPROB))
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset


def joined_logprobs(first: dict[str, Any] | None, second: dict[str, Any]) -> dict[str, Any]:
    """Two completions logprobs objects end to end (the echoed prompt's, then the output's)."""
    return second if first is None else {key: first[key] + second[key] for key in second}
