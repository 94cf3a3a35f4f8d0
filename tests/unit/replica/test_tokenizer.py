"""The tokenizer layer: byte-level round trips, the chat template's prefix property, streaming detokenization, stops."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.demo.corpus import TOOLS, generate_conversations, uses_tools
from replica.tokenizer import (
    IM_END,
    IncrementalDetokenizer,
    StopChecker,
    Tokenizer,
    apply_chat_template,
    train_bpe,
    training_text,
)

_JAPANESE_ALPHABET = (
    "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわをんがぎぐげござじずぜぞ"
    "アイウエオカキクケコサシスセソタチツテトナニヌネノハヒフヘホマミムメモヤユヨラリルレロワヲンー"
    '会議室予約見積納期請求書注文確認株式社様鬱龘𠮷、。「」（）！？　ABCabc012 \n{}":,'
)
_MIXED = (
    "お世話になっております。注文番号ORD-48213の納期は5月12日（月）です。 Order shipped via UPS.\n"
    '{"order_id": "ORD-48213", "warehouse": "東京", "available": 120, "note": "鬱蒼 😀 ñ"}'
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    conversations = generate_conversations(150, seed=99)
    return train_bpe([training_text(c, TOOLS if uses_tools(c) else None) for c in conversations], vocab_size=800)


def test_train_bpe_reserves_chat_tokens_and_reaches_the_vocab_size(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 800
    assert [tokenizer.encode(token) for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [[0], [1], [2]]
    assert [tokenizer.encode(token) for token in ("<tool_call>", "</tool_call>")] == [[3], [4]]
    assert tokenizer.eos_token_id == 2
    assert tokenizer.token_to_id("<|endoftext|>") == 0
    assert tokenizer.token_to_id("no such token") is None
    assert tokenizer.eos_token_ids == {0, 2}
    assert tokenizer.bos_token_id is None
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(["abc"], vocab_size=100)


def test_round_trip_of_japanese_english_and_json(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(_MIXED)
    assert tokenizer.decode(ids) == _MIXED
    assert len(ids) < len(_MIXED.encode()), "BPE should merge something"


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_any_text_round_trips(tokenizer: Tokenizer, text: str) -> None:
    """Chat tokens written in the text included, when decode keeps them."""
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_decode_drops_chat_tokens_but_keeps_tool_call_markers(tokenizer: Tokenizer) -> None:
    text = '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n'
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.decode(ids) == 'assistant\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'


def test_save_and_load_keep_encoding_and_special_tokens(tokenizer: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    tokenizer.save(path)
    loaded = Tokenizer.from_file(path)
    text = f"<|im_start|>user\n{_MIXED}<|im_end|>\n<tool_call>x</tool_call>"
    assert loaded.encode(text) == tokenizer.encode(text)
    assert loaded.decode(loaded.encode(text)) == tokenizer.decode(tokenizer.encode(text))
    assert loaded.vocab_size == tokenizer.vocab_size


def test_chat_template_renders_chatml_with_tools_and_tool_calls() -> None:
    tools = [{"type": "function", "function": {"name": "get_order_status", "parameters": {}}}]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "丁寧に。"},
        {"role": "user", "content": [{"type": "text", "text": "ORD-1 "}, {"type": "text", "text": "は？"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_order_status", "arguments": '{"order_id":"ORD-1"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"status": "shipped"}'},
    ]
    rendered = apply_chat_template(messages, tools=tools)
    tool_json = '{"type": "function", "function": {"name": "get_order_status", "parameters": {}}}'
    assert rendered.startswith("<|im_start|>system\n丁寧に。\n\n# Tools\n\n")
    assert f"<tools>\n{tool_json}\n</tools>" in rendered
    assert rendered.endswith(
        "<|im_start|>user\nORD-1 は？<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_order_status", "arguments": {"order_id": "ORD-1"}}\n'
        "</tool_call><|im_end|>\n"
        '<|im_start|>tool\n{"status": "shipped"}<|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    assert rendered.count("<|im_start|>system") == 1
    without_system = apply_chat_template(messages[1:], tools=tools, add_generation_prompt=False)
    assert without_system.startswith("<|im_start|>system\n# Tools\n\n")
    assert apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_assistant_text_before_a_tool_call_precedes_it() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    message = {"role": "assistant", "content": "確認いたします。", "tool_calls": [call, call]}
    rendered = apply_chat_template([message], add_generation_prompt=False)
    block = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert rendered == f"<|im_start|>assistant\n確認いたします。\n{block}\n{block}<|im_end|>\n"


def test_each_turn_of_corpus_conversations_extends_the_previous_prompt() -> None:
    for conversation in generate_conversations(40, seed=21):
        tools = TOOLS if uses_tools(conversation) else None
        for length in range(1, len(conversation)):
            shorter = apply_chat_template(conversation[:length], tools=tools, add_generation_prompt=False)
            longer = apply_chat_template(conversation[: length + 1], tools=tools, add_generation_prompt=False)
            assert longer.startswith(shorter)
            prompt = apply_chat_template(conversation[:length], tools=tools)
            if conversation[length]["role"] == "assistant":
                # What the model generates after the prompt, up to and including its eos, is the next turn.
                assert longer.startswith(prompt) and longer.endswith(IM_END + "\n")
                assert IM_END not in longer[len(prompt) : -len(IM_END) - 1]


_texts = st.text(alphabet=_JAPANESE_ALPHABET, max_size=20)
_plain_messages = st.builds(
    lambda role, content: {"role": role, "content": content}, st.sampled_from(["system", "user", "assistant"]), _texts
)
_tool_messages = st.builds(lambda content: {"role": "tool", "tool_call_id": "c1", "content": content}, _texts)
_call_messages = st.builds(
    lambda content, value: {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"v": value})}}
        ],
    },
    st.one_of(st.none(), _texts),
    _texts,
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.one_of(_plain_messages, _tool_messages, _call_messages), min_size=2, max_size=6),
    st.booleans(),
    st.booleans(),
)
def test_rendering_of_a_longer_conversation_extends_the_shorter(
    messages: list[dict[str, Any]], has_tools: bool, add_generation_prompt: bool
) -> None:
    tools = TOOLS[:1] if has_tools else None
    shorter = apply_chat_template(messages[:-1], tools=tools, add_generation_prompt=False)
    assert apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt).startswith(shorter)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty"),
        ("hello", "non-empty"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"content": "hi"}], "missing 'role'"),
        ([{"role": "developer", "content": "hi"}], "role must be one of"),
        ([{"role": "user"}], "missing 'content'"),
        ([{"role": "user", "content": None}], "must be a string or a list of text parts"),
        ([{"role": "user", "content": 42}], "must be a string or a list of text parts, got int"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}], "only text content parts"),
        ([{"role": "user", "content": [{"type": "text"}]}], r"content\[0\]\.text must be a string"),
        ([{"role": "assistant", "content": None}], "must be a string"),
        ([{"role": "tool", "content": "{}"}], "tool_call_id"),
        ([{"role": "user", "content": "x", "tool_calls": []}], "only assistant messages call tools"),
        ([{"role": "assistant", "tool_calls": [{"id": "c"}]}], "missing 'function'"),
        ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], "name must be a string"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}], "not valid JSON"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}], "JSON object"),
    ],
)
def test_malformed_messages_raise_value_error(messages: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        apply_chat_template(messages)


def test_malformed_tools_raise_value_error() -> None:
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=r"tools\[0\] must be"):
        apply_chat_template(user, tools=[{"name": "f"}])
    with pytest.raises(ValueError, match="name must be a string"):
        apply_chat_template(user, tools=[{"type": "function", "function": {}}])


def stream(detokenizer: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detokenizer.push(token_id) for token_id in ids] + [detokenizer.flush()]


def test_japanese_characters_are_split_across_tokens(tokenizer: Tokenizer) -> None:
    """Without such splits the streaming tests below would not test holding back."""
    ids = tokenizer.encode("鬱龘")
    assert len(ids) == 6
    pieces = stream(IncrementalDetokenizer(tokenizer), ids)
    assert pieces == ["", "", "鬱", "", "", "龘", ""]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=_JAPANESE_ALPHABET, max_size=40), st.text(alphabet=_JAPANESE_ALPHABET, max_size=10))
def test_streamed_text_equals_full_decode(tokenizer: Tokenizer, text: str, prompt: str) -> None:
    ids = tokenizer.encode(text)
    pieces = stream(IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt)), ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == text


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=799), max_size=30))
def test_streaming_arbitrary_ids_equals_full_decode(tokenizer: Tokenizer, ids: list[int]) -> None:
    """Ids a model may sample in any order: invalid UTF-8 and special tokens included."""
    for skip_special_tokens in (True, False):
        pieces = stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens), ids)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_stop_string_split_across_pushes_is_cut_and_not_emitted() -> None:
    checker = StopChecker(["</end>"])
    assert checker.check("Hello </") == ("Hello ", False)
    assert checker.check("en") == ("", False)
    assert checker.check("d> trailing") == ("", True)
    assert checker.matched_stop == "</end>"
    assert checker.check("more") == ("", True)


def test_held_suffix_is_released_when_it_stops_matching() -> None:
    checker = StopChecker(["STOP"])
    assert checker.check("ST") == ("", False)
    assert checker.check("ART") == ("START", False)
    assert checker.check("abcSTO") == ("abc", False)
    assert checker.flush() == "STO"
    assert not checker.is_stopped


def test_earliest_stop_wins_and_japanese_stops_work() -> None:
    checker = StopChecker(["world", "lo"])
    assert checker.check("hello world") == ("hel", True)
    assert checker.matched_stop == "lo"
    japanese = StopChecker(["以上です。", ""])
    assert japanese.check("ご確認ください。以上") == ("ご確認ください。", False)
    assert japanese.check("です。追伸") == ("", True)
    assert StopChecker([]).check("anything") == ("anything", False)
    with pytest.raises(ValueError, match="list of strings"):
        StopChecker("STOP")


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.text(alphabet="abc。", max_size=6), max_size=8),
    st.lists(st.text(alphabet="abc。", min_size=1, max_size=3), max_size=3),
)
def test_streamed_stops_equal_cutting_the_whole_text(chunks: list[str], stops: list[str]) -> None:
    whole = "".join(chunks)
    # Generation stops when a stop string completes: the cut is at the occurrence that ends first.
    matches = [(whole.find(stop) + len(stop), whole.find(stop)) for stop in stops if stop in whole]
    expected = whole[: min(matches)[1]] if matches else whole
    checker = StopChecker(stops)
    emitted = []
    for chunk in chunks:
        text, stopped = checker.check(chunk)
        emitted.append(text)
        if stopped:
            break
    else:
        emitted.append(checker.flush())
    assert "".join(emitted) == expected
    assert checker.is_stopped == bool(matches)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=_JAPANESE_ALPHABET + "<|im_start|>", max_size=400))
def test_min_tokens_never_exceeds_the_tokens_of_the_text(tokenizer: Tokenizer, text: str) -> None:
    bound = tokenizer.min_tokens(text)
    assert 0 <= bound <= len(tokenizer.encode(text))
    if len(text.encode()) > 200:
        assert bound > 0  # a byte-level tokenizer gives a bound


def test_min_tokens_gives_no_bound_where_text_may_shrink_before_splitting(tokenizer: Tokenizer) -> None:
    import tokenizers
    from tokenizers import normalizers, pre_tokenizers

    for change in ("normalizer", "whitespace"):
        backend = tokenizers.Tokenizer.from_str(tokenizer.to_json())
        if change == "normalizer":
            backend.normalizer = normalizers.NFKC()
        else:
            backend.pre_tokenizer = pre_tokenizers.Whitespace()  # drops the spaces: 1 MB of them is no token
        assert Tokenizer(backend).min_tokens(" " * 10_000) == 0, change
