"""Constrained outputs through the official openai client: json_schema (strict and not) and json_object on both
endpoints, tool_choice required / named / auto / none with parallel_tool_calls, streamed tool calls assembled by
the client's stream helper, bad schemas refused with a 400 before queueing, and a grammar that dead-ends failing
alone while the other requests of its batch finish.

The tiny checkpoint's model is random: what it writes is valid only because of the grammar. Schemas bound every
string and array so that a random walk through them ends well within max_tokens.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import jsonschema
import openai
import pytest

from tests.integration.replica_support import StartReplica

pytestmark = pytest.mark.integration

SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "maxLength": 12},
        "priority": {"enum": ["low", "high"]},
        "units": {"type": "integer", "minimum": 1, "maximum": 999},
        "lines": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 10}, "maxItems": 3},
    },
    "required": ["customer", "priority", "units", "lines"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_order_status",
            "description": "Look up an order.",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string", "pattern": "^ORD-[0-9]{5}$"}},
                "required": ["order_id"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "book_room",
            "description": "Book a meeting room.",
            "parameters": {
                "type": "object",
                "properties": {"floor": {"type": "integer", "minimum": 1, "maximum": 9}, "hours": {"enum": [1, 2]}},
                "required": ["floor", "hours"],
                "additionalProperties": False,
            },
        },
    },
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Please check order ORD-48213 and book a room."}]


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def json_schema_format(strict: bool) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA, "strict": strict}}


@pytest.mark.parametrize("strict", [True, False])
async def test_json_schema_on_both_endpoints_greedy_and_sampled(start_replica: StartReplica, strict: bool) -> None:
    replica = await start_replica()
    async with client(replica.url) as c:
        for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2)):
            chat = await c.chat.completions.create(
                model="shoal-demo",
                messages=ASK,
                max_tokens=200,
                temperature=temperature,
                seed=seed,
                response_format=json_schema_format(strict),  # type: ignore[arg-type]
            )
            assert chat.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(chat.choices[0].message.content or ""), SCHEMA)
            completion = await c.completions.create(
                model="shoal-demo",
                prompt="Order as JSON:",
                max_tokens=200,
                temperature=temperature,
                seed=seed,
                extra_body={"response_format": json_schema_format(strict)},
            )
            assert completion.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(completion.choices[0].text), SCHEMA)


async def test_json_object_streamed_and_not(start_replica: StartReplica) -> None:
    replica = await start_replica()
    async with client(replica.url) as c:
        reply = await c.chat.completions.create(
            model="shoal-demo", messages=ASK, max_tokens=300, temperature=0, response_format={"type": "json_object"}
        )
        chunks = await c.chat.completions.create(
            model="shoal-demo",
            messages=ASK,
            max_tokens=300,
            temperature=0,
            response_format={"type": "json_object"},
            stream=True,
        )
        streamed = "".join([ch.choices[0].delta.content or "" async for ch in chunks if ch.choices])
    text = reply.choices[0].message.content or ""
    assert streamed == text
    if reply.choices[0].finish_reason == "stop":  # a random model may write a long object; cut, it is a prefix
        assert isinstance(json.loads(text), dict)
    assert text.startswith("{")


def check_calls(calls: Any, names: set[str]) -> list[str]:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    return [call.function.name for call in calls]


async def test_tool_choice_required_named_auto_and_none(start_replica: StartReplica) -> None:
    replica = await start_replica()
    async with client(replica.url) as c:
        for seed in range(3):
            common: dict[str, Any] = {"model": "shoal-demo", "messages": ASK, "max_tokens": 200, "seed": seed}
            required = await c.chat.completions.create(**common, tools=TOOLS, tool_choice="required")  # type: ignore[arg-type]
            assert required.choices[0].finish_reason == "tool_calls"
            check_calls(required.choices[0].message.tool_calls, set(PARAMETERS))
            named = await c.chat.completions.create(
                **common,
                tools=TOOLS,  # type: ignore[arg-type]
                tool_choice={"type": "function", "function": {"name": "book_room"}},
            )
            assert check_calls(named.choices[0].message.tool_calls, {"book_room"}) == ["book_room"]
            single = await c.chat.completions.create(
                **common,
                tools=TOOLS,  # type: ignore[arg-type]
                tool_choice="required",
                parallel_tool_calls=False,
            )
            assert len(check_calls(single.choices[0].message.tool_calls, set(PARAMETERS))) == 1
            auto = await c.chat.completions.create(**common, tools=TOOLS, tool_choice="auto")  # type: ignore[arg-type]
            if auto.choices[0].message.tool_calls and auto.choices[0].finish_reason != "length":
                check_calls(auto.choices[0].message.tool_calls, set(PARAMETERS))  # a call cut short is partial
            assert "<tool_call>" not in (auto.choices[0].message.content or "")
            none = await c.chat.completions.create(**common, tools=TOOLS, tool_choice="none")  # type: ignore[arg-type]
            assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason != "tool_calls"


async def test_streamed_tool_calls_assemble_in_the_client_stream_helper(start_replica: StartReplica) -> None:
    replica = await start_replica()
    async with client(replica.url) as c:
        for choice in ("required", {"type": "function", "function": {"name": "get_order_status"}}):
            body: dict[str, Any] = {"model": "shoal-demo", "messages": ASK, "max_tokens": 200, "temperature": 0}
            whole = await c.chat.completions.create(**body, tools=TOOLS, tool_choice=choice)  # type: ignore[arg-type]
            async with c.chat.completions.stream(**body, tools=TOOLS, tool_choice=choice) as stream:  # type: ignore[arg-type]
                final = await stream.get_final_completion()
            message = final.choices[0].message
            assert final.choices[0].finish_reason == "tool_calls"
            check_calls(message.tool_calls, set(PARAMETERS))
            expected = whole.choices[0].message.tool_calls
            assert expected is not None and message.tool_calls is not None
            assert [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls] == [
                (t.function.name, json.loads(t.function.arguments)) for t in expected
            ]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}}, "not"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            "strin",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"minLength": "a"}}}},
            "minLength",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
        ({"tool_choice": "required"}, "needs 'tools'"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice must be"),
        ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ],
)
async def test_bad_schemas_get_a_400_that_names_the_problem(
    start_replica: StartReplica, body: dict[str, Any], fragment: str
) -> None:
    replica = await start_replica()
    async with aiohttp.ClientSession() as http:
        payload = {"model": "shoal-demo", "messages": ASK, "max_tokens": 8, **body}
        async with http.post(replica.url + "/v1/chat/completions", json=payload) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
            assert fragment in error["message"], error
    assert replica.state.engine.engine.num_waiting == 0 and replica.state.engine.num_in_flight == 0


async def test_a_schema_nested_past_the_limit_gets_a_400(start_replica: StartReplica) -> None:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(40):
        schema = {"type": "array", "items": schema}
    replica = await start_replica()
    async with client(replica.url) as c:
        with pytest.raises(openai.BadRequestError, match="nests deeper than 32 levels"):
            await c.chat.completions.create(
                model="shoal-demo",
                messages=ASK,
                max_tokens=8,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            )


async def test_a_dead_end_fails_its_request_and_the_batch_finishes(start_replica: StartReplica) -> None:
    """A grammar with no way out ("a" then an endless chain of "b"): llguidance's parser fails, the request ends with
    an error event (streamed) or a 500, and the requests beside it in the same batch finish valid."""
    replica = await start_replica()
    dead_end = {"structured_outputs": {"grammar": 'start: "a" x\nx: "b" x'}}
    async with client(replica.url) as c:

        async def good(seed: int) -> str:
            r = await c.chat.completions.create(
                model="shoal-demo",
                messages=ASK,
                max_tokens=200,
                seed=seed,
                response_format=json_schema_format(True),  # type: ignore[arg-type]
            )
            return r.choices[0].message.content or ""

        async def streamed_dead_end() -> str:
            chunks = await c.chat.completions.create(
                model="shoal-demo", messages=ASK, max_tokens=50, stream=True, extra_body=dead_end
            )
            with pytest.raises(openai.APIError, match="generation failed"):
                async for _ in chunks:
                    pass
            return "raised"

        async def whole_dead_end() -> str:
            with pytest.raises(openai.InternalServerError, match="generation failed"):
                await c.chat.completions.create(model="shoal-demo", messages=ASK, max_tokens=50, extra_body=dead_end)
            return "raised"

        results = await asyncio.wait_for(
            asyncio.gather(good(1), streamed_dead_end(), good(2), whole_dead_end(), good(3)), timeout=120
        )
    for text in (results[0], results[2], results[4]):
        jsonschema.validate(json.loads(text), SCHEMA)
    async with aiohttp.ClientSession() as http, http.get(replica.url + "/health") as resp:
        assert resp.status == 200
