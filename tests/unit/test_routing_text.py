from __future__ import annotations

from typing import Any

import pytest

from router.policy.hashing import pack_tokens
from router.policy.routing_text import RoutingInputError, chat_routing_key, completion_routing_key


def test_chat_rendering_is_deterministic_and_covers_every_field() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "u"}}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ]
    }
    first = chat_routing_key(body).text
    assert first == chat_routing_key(body).text
    assert first is not None
    for piece in (b"You are terse.", b"hi", b'"url":"u"', b'"name":"f"', b"c1", b"42"):
        assert piece in first
    other = {"messages": [*body["messages"][:3], {"role": "tool", "tool_call_id": "c2", "content": "42"}]}
    assert chat_routing_key(other).text != first


def test_role_and_content_boundaries_do_not_collide() -> None:
    a = chat_routing_key({"messages": [{"role": "user", "content": "ab"}, {"role": "user", "content": "c"}]})
    b = chat_routing_key({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "bc"}]})
    assert a.text != b.text


def test_tools_lead_the_rendering() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    text = chat_routing_key({"messages": [{"role": "user", "content": "x"}], "tools": tools}).text
    assert text is not None and text.index(b"get_weather") < text.index(b"x")


@pytest.mark.parametrize(
    ("prompt", "expected_text", "expected_tokens"),
    [
        ("hello", b"hello", None),
        (["first", "second"], b"first", None),
        ([1, 2, 3], None, [1, 2, 3]),
        ([[4, 5], [6]], None, [4, 5]),
    ],
)
def test_completion_prompt_forms(
    prompt: object, expected_text: bytes | None, expected_tokens: list[int] | None
) -> None:
    key = completion_routing_key({"prompt": prompt})
    assert key.text == expected_text
    assert (list(key.token_ids) if key.token_ids is not None else None) == expected_tokens


@pytest.mark.parametrize(
    "body",
    [{}, {"prompt": 3}, {"prompt": []}, {"prompt": [1, "a"]}, {"prompt": [-1]}, {"prompt": [{"x": 1}]}],
)
def test_bad_completion_bodies(body: dict[str, object]) -> None:
    with pytest.raises(RoutingInputError) as info:
        completion_routing_key(body)
    assert info.value.param == "prompt"


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"messages": []},
        {"messages": "hi"},
        {"messages": [{"content": "no role"}]},
        {"messages": [3]},
        {"messages": [{"role": "user", "content": 5}]},
    ],
)
def test_bad_chat_bodies(body: dict[str, object]) -> None:
    with pytest.raises(RoutingInputError):
        chat_routing_key(body)


@pytest.mark.parametrize(
    "prompt",
    [
        [5, True],
        [1, 1, 0, False],
        [3, 1.0],
        [3, "4"],
        [3, None],
        [[1, 2], [3, True]],
        [0] * 5000 + [False],
        [[1, 2], *[[0]] * 1000, [3.0]],
    ],
    ids=[
        "true",
        "false-after-ones-and-zeros",
        "float",
        "string",
        "null",
        "batch with a bool",
        "false-after-many-zeros",
        "batch with a float after many prompts",
    ],
)
def test_token_lists_with_anything_but_ints_are_refused(prompt: list[Any]) -> None:
    with pytest.raises(RoutingInputError, match="must be a string, an array of strings") as caught:
        completion_routing_key({"prompt": prompt})
    assert caught.value.param == "prompt"


def test_token_ids_are_range_checked_and_packed_once() -> None:
    with pytest.raises(RoutingInputError, match=r"\[0, 2\*\*32\)"):
        completion_routing_key({"prompt": [1, 2**32]})
    with pytest.raises(RoutingInputError, match=r"\[0, 2\*\*32\)"):
        completion_routing_key({"prompt": [1, -1]})
    ids = [*range(0, 2**32, 2**20), 1, 0, 2**32 - 1]
    key = completion_routing_key({"prompt": ids})
    assert key.token_ids is ids and key.packed == pack_tokens(ids)
