r"""The replica's tokenizer layer: byte-level BPE, a ChatML chat template, and streaming detokenization.

`Tokenizer` wraps a HF `tokenizers` tokenizer (a tokenizer.json). `train_bpe` makes the demo model's: byte-level BPE
(ByteLevel pre-tokenizer and decoder, no normalizer), so any string, Japanese included, round-trips through
encode/decode. `<|endoftext|>`, `<|im_start|>` and `<|im_end|>` are special: atomic, and dropped by
`decode(skip_special_tokens=True)`. `<tool_call>` and `</tool_call>` are atomic but not special, as in Qwen, so
decoded output keeps them and the server can parse tool calls out of generated text.

The chat template is Qwen2.5's ChatML, rendered in Python rather than Jinja:

    <|im_start|>system\n{system}\n\n# Tools ... <tools>\n{one tool JSON per line}\n</tools> ...<|im_end|>\n
    <|im_start|>{role}\n{content}<|im_end|>\n                              (user, assistant, system, tool)
    <|im_start|>assistant\n{content}\n<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call><|im_end|>\n
    <|im_start|>assistant\n                                                (the generation prompt)

The tools block exists only when tools are given, merged into the first message when that is a system message.
Every message renders from itself alone, so a conversation extended by a turn renders to an extension of the shorter
rendering (without generation prompt), and `render(m) + reply + "<|im_end|>\n" == render(m + [reply])`: each turn
of a multi-turn chat extends the prefix the previous turn cached.

`IncrementalDetokenizer` uses the prefix/read offsets of TGI and vLLM: it decodes a short window of recent ids and
emits what grew, holding back text that ends in U+FFFD, the mark of a character whose bytes are split across tokens.
`StopChecker` holds back a suffix that may begin a stop string and cuts output where one starts (excluding it).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from os import PathLike
from typing import Any, Final

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers

ENDOFTEXT: Final = "<|endoftext|>"
IM_START: Final = "<|im_start|>"
IM_END: Final = "<|im_end|>"
TOOL_CALL_START: Final = "<tool_call>"
TOOL_CALL_END: Final = "</tool_call>"
SPECIAL_TOKENS: Final = (ENDOFTEXT, IM_START, IM_END)
"""Skipped by `decode` unless asked; ids 0, 1, 2 in a tokenizer from `train_bpe`."""
TOOL_CALL_TOKENS: Final = (TOOL_CALL_START, TOOL_CALL_END)
"""Atomic but kept by `decode`; ids 3, 4 in a tokenizer from `train_bpe`."""
ROLES: Final = frozenset({"system", "user", "assistant", "tool"})

_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)
_REPLACEMENT_CHAR = "\ufffd"
_NUM_CONTEXT_TOKENS = 6
"""Prompt ids an `IncrementalDetokenizer` decodes along with the output (vLLM uses 5), for tokenizers whose decoding
of a token depends on the one before it (SentencePiece's leading space)."""


class Tokenizer:
    """Text <-> token ids for one model, with the ChatML vocabulary above."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        missing = [token for token in (*SPECIAL_TOKENS, *TOOL_CALL_TOKENS) if backend.token_to_id(token) is None]
        if missing:
            raise ValueError(f"the tokenizer lacks the chat tokens {missing}")
        self._backend = backend
        self.im_start_token_id: Final = self._token_id(IM_START)
        self.endoftext_token_id: Final = self._token_id(ENDOFTEXT)
        self.eos_token_id: Final = self._token_id(IM_END)
        """What a chat turn ends with."""
        self.eos_token_ids: Final = frozenset({self.eos_token_id, self.endoftext_token_id})
        """Any of these ends generation."""
        self.bos_token_id: Final[int | None] = None
        """ChatML prompts start with `<|im_start|>`, not a BOS token."""
        self._max_token_bytes: Final = _max_token_bytes(backend)

    @classmethod
    def from_file(cls, path: str | PathLike[str]) -> Tokenizer:
        """Load a tokenizer.json."""
        return cls(tokenizers.Tokenizer.from_file(str(path)))

    def save(self, path: str | PathLike[str]) -> None:
        self._backend.save(str(path))

    def to_json(self) -> str:
        """The tokenizer.json text (what llguidance builds its token trie from)."""
        return str(self._backend.to_str())

    @property
    def vocab_size(self) -> int:
        """Ids are below this, added tokens included: the size of the model's embedding table."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """The ids of `text`; special tokens written in it become their ids, none are added. Releases the GIL while
        it works (`encode_batch` does, `encode` does not), so a long text encoded in a worker thread leaves the
        event loop running."""
        return list(self._backend.encode_batch([text], add_special_tokens=False)[0].ids)

    def min_tokens(self, text: str) -> int:
        """A lower bound on `len(encode(text))` that costs no tokenizing: no token spans more than the longest
        token's bytes. 0 (no bound) for a tokenizer with a normalizer, which may shorten the text first."""
        if self._max_token_bytes is None:
            return 0
        return -(-len(text.encode("utf-8", "surrogatepass")) // self._max_token_bytes)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        """The id of one token of the vocabulary (say `<|endoftext|>`); None if there is no such token."""
        token_id = self._backend.token_to_id(token)
        return None if token_id is None else int(token_id)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        return apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt)

    def _token_id(self, token: str) -> int:
        token_id = self.token_to_id(token)
        assert token_id is not None
        return token_id


def train_bpe(texts: Iterable[str], *, vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer of `vocab_size` ids (chat tokens first) trained on `texts`."""
    num_reserved = 256 + len(SPECIAL_TOKENS) + len(TOOL_CALL_TOKENS)
    if vocab_size < num_reserved:
        raise ValueError(f"vocab_size must be >= {num_reserved} (every byte plus the chat tokens), got {vocab_size}")
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # All five are trainer special tokens, so BPE never merges across or into them; the tool call markers are then
    # re-added as non-special. `decode` reads a stale special set until the tokenizer is rebuilt from its JSON.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL_TOKENS, *TOOL_CALL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in TOOL_CALL_TOKENS])
    return Tokenizer(tokenizers.Tokenizer.from_str(backend.to_str()))


def apply_chat_template(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The ChatML prompt of an OpenAI chat request; `ValueError` says what is malformed."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of message objects")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{index}] must be an object, got {type(message).__name__}")
    tools_block = _render_tools(tools) if tools else None
    pieces = []
    first = messages[0]
    if tools_block is not None and first.get("role") == "system":
        system = _text(first.get("content"), "messages[0].content")
        pieces.append(f"{IM_START}system\n{system}\n\n{tools_block}{IM_END}\n")
        rest: Iterable[tuple[int, Mapping[str, Any]]] = enumerate(messages[1:], start=1)
    else:
        if tools_block is not None:
            pieces.append(f"{IM_START}system\n{tools_block}{IM_END}\n")
        rest = enumerate(messages)
    pieces += [_render_message(message, f"messages[{index}]") for index, message in rest]
    if add_generation_prompt:
        pieces.append(f"{IM_START}assistant\n")
    return "".join(pieces)


def training_text(conversation: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> str:
    """What the demo model trains on: the whole conversation rendered, without a generation prompt."""
    return apply_chat_template(conversation, tools=tools, add_generation_prompt=False)


def _render_tools(tools: Sequence[Mapping[str, Any]]) -> str:
    if isinstance(tools, str | bytes) or not isinstance(tools, Sequence):
        raise ValueError("tools must be a list of tool objects")
    lines = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(function, Mapping):
            raise ValueError(f'tools[{index}] must be {{"type": "function", "function": {{...}}}}')
        if not isinstance(function.get("name"), str):
            raise ValueError(f"tools[{index}].function.name must be a string")
        lines.append("\n" + json.dumps(tool, ensure_ascii=False))
    return _TOOLS_PREAMBLE + "".join(lines) + _TOOLS_POSTAMBLE


def _render_message(message: Mapping[str, Any], where: str) -> str:
    role = message.get("role")
    if role is None:
        raise ValueError(f"{where} is missing 'role'")
    if not isinstance(role, str) or role not in ROLES:
        raise ValueError(f"{where}.role must be one of {sorted(ROLES)}, got {role!r}")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and role != "assistant":
        raise ValueError(f"{where} has tool_calls but role {role!r}; only assistant messages call tools")
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise ValueError(f"{where} (role 'tool') needs a string 'tool_call_id'")
    if tool_calls:
        content = _text(message.get("content"), f"{where}.content", is_optional=True)
        calls = _render_tool_calls(tool_calls, f"{where}.tool_calls")
        content = f"{content}\n{calls}" if content else calls
    else:
        if "content" not in message:
            raise ValueError(f"{where} (role {role!r}) is missing 'content'")
        content = _text(message["content"], f"{where}.content")
    return f"{IM_START}{role}\n{content}{IM_END}\n"


def _render_tool_calls(tool_calls: Any, where: str) -> str:
    if not isinstance(tool_calls, list):
        raise ValueError(f"{where} must be a list")
    rendered = []
    for index, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            raise ValueError(f"{where}[{index}] is missing 'function'")
        name = function.get("name")
        if not isinstance(name, str):
            raise ValueError(f"{where}[{index}].function.name must be a string")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}[{index}].function.arguments is not valid JSON: {error}") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"{where}[{index}].function.arguments must be a JSON object")
        call_json = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        rendered.append(f"{TOOL_CALL_START}\n{call_json}\n{TOOL_CALL_END}")
    return "\n".join(rendered)


def _text(content: Any, where: str, *, is_optional: bool = False) -> str:
    """A message's content as text: a string, or the concatenated text of OpenAI content parts."""
    if isinstance(content, str):
        return content
    if content is None and is_optional:
        return ""
    if isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            if not isinstance(part, Mapping):
                raise ValueError(f"{where}[{index}] must be a content part object")
            if part.get("type") != "text":
                kind = part.get("type")
                raise ValueError(f"{where}[{index}] has type {kind!r}; only text content parts are supported")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{where}[{index}].text must be a string")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"{where} must be a string or a list of text parts, got {type(content).__name__}")


class IncrementalDetokenizer:
    """Turns generated ids into text as they arrive, never emitting half a character.

    Invariant: `decode(ids[prefix_offset:read_offset])` has been emitted in full (or belongs to the prompt); the text
    past it is what the window `ids[prefix_offset:]` decodes to beyond that, emitted once it no longer ends in U+FFFD.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None, *, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids[-_NUM_CONTEXT_TOKENS:]) if prompt_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_id: int) -> str:
        """The text that `token_id` completes (often "", while a character's bytes are still arriving)."""
        self._ids.append(token_id)
        return self._advance(is_final=False)

    def flush(self) -> str:
        """Whatever is held back, at the end of generation (U+FFFD for bytes that never completed a character)."""
        return self._advance(is_final=True)

    def _advance(self, *, is_final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT_CHAR) and not is_final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


class StopChecker:
    """Cuts streamed text at the first stop string to complete, which is not emitted (as OpenAI and vLLM do).

    "First" is by where a stop string ends, as if text arrived one character at a time: with stops `。` and
    `b。c`, the text `b。c` stops at `。`, whether it arrives in one piece or in several.

    A suffix that could begin a stop string is held back until later text rules it out; `flush` returns it when
    generation ends for another reason. Empty stop strings are ignored.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if isinstance(stop, str):
            raise ValueError("stop must be a list of strings, not a string")
        self._stops = tuple(text for text in stop if text)
        self._held = ""
        self.matched_stop: str | None = None
        """The stop string generation ended on (vLLM's `stop_reason`), once `check` has returned stopped."""

    @property
    def is_stopped(self) -> bool:
        return self.matched_stop is not None

    def check(self, new_text: str) -> tuple[str, bool]:
        """(text to emit now, whether a stop string was reached); after a stop, every call returns ("", True)."""
        if self.is_stopped:
            return "", True
        text = self._held + new_text
        matches = [(index, stop) for stop in self._stops if (index := text.find(stop)) >= 0]
        if matches:
            index, self.matched_stop = min(matches, key=lambda m: (m[0] + len(m[1]), m[0]))
            self._held = ""
            return text[:index], True
        num_held = self._num_held(text)
        self._held = text[len(text) - num_held :]
        return text[: len(text) - num_held], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _num_held(self, text: str) -> int:
        """The length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest


def _max_token_bytes(backend: tokenizers.Tokenizer) -> int | None:
    """The most UTF-8 bytes of text one token of `backend` can stand for, or None where the text may shrink before
    it is split (a normalizer, or a pre-tokenizer that drops characters, as BERT's drops whitespace). Counted over
    the vocabulary's strings as written, which for byte-level vocabularies (each character a byte) overstates it:
    a safe bound."""
    config = json.loads(backend.to_str())
    if config.get("normalizer") is not None or not _keeps_text(config.get("pre_tokenizer")):
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    return max((len(token.encode("utf-8", "surrogatepass")) for token in vocab), default=1) or 1


def _keeps_text(pre_tokenizer: dict[str, Any] | None) -> bool:
    """Whether every character of the text reaches some token through this pre-tokenizer configuration."""
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in pre_tokenizer.get("pretokenizers", []))
    if kind in ("Split", "Punctuation"):
        return pre_tokenizer.get("behavior") != "Removed"
    return kind in ("ByteLevel", "Digits", "Metaspace")
