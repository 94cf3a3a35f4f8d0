"""One OpenAI error shape from the router and the replica alike: {"error": {message, type, param, code}}, JSON for
every status, and the official `openai` client raising the class each status calls for."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest

from tests.integration.conftest import MODEL, StartRouter
from tests.integration.replica_support import StartReplica

pytestmark = pytest.mark.integration


def assert_openai_error(body: Any, *, status: int) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error") or status == 401
    assert error["code"] is None or isinstance(error["code"], str)


@pytest.fixture
async def urls(start_replica: StartReplica, start_router: StartRouter) -> dict[str, str]:
    replica = await start_replica()
    router = await start_router(replicas=[replica.url], num_ready=1)
    return {"replica": replica.url, "router": router.url}


@pytest.mark.parametrize("target", ["replica", "router"])
async def test_every_status_answers_the_same_json_shape(
    urls: dict[str, str], http: aiohttp.ClientSession, target: str
) -> None:
    url = urls[target]
    cases = [
        ("GET", "/v1/no-such-path", None, 404),
        ("GET", "/v1/chat/completions", None, 405),
        ("POST", "/v1/chat/completions", {"model": MODEL, "messages": "not a list"}, 400),
        ("POST", "/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404),
    ]
    for method, path, body, status in cases:
        async with http.request(method, url + path, json=body) as resp:
            assert resp.status == status, (method, path, await resp.text())
            assert resp.content_type == "application/json", (method, path)
            assert_openai_error(await resp.json(), status=status)


@pytest.mark.parametrize("target", ["replica", "router"])
async def test_max_tokens_past_the_context_is_a_400_naming_both_numbers(urls: dict[str, str], target: str) -> None:
    async with openai.AsyncOpenAI(base_url=urls[target] + "/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model=MODEL, prompt="Hello there", max_tokens=100_000)
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="no-such-model", prompt="Hello there", max_tokens=1)
        fine = await client.completions.create(model=MODEL, prompt="Hello there", max_tokens=2)
    assert fine.choices[0].finish_reason == "length"
    message = caught.value.message
    assert "4096" in message and "100000" in message, message
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "max_tokens"


def nested_arguments(depth: int) -> str:
    return '{"x": ' * depth + "1" + "}" * depth


@pytest.mark.parametrize(
    "messages",
    [
        '[{"role": {"x": 1}, "content": "hi"}]',
        '[{"role": ["user"], "content": "hi"}]',
        '[{"role": "user", "content": "hi"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c", '
        '"type": "function", "function": {"name": "f", "arguments": ' + nested_arguments(1000) + "}}]}]",
    ],
    ids=["role-object", "role-array", "deeply-nested-tool-arguments"],
)
async def test_what_a_client_sends_is_never_a_500(
    urls: dict[str, str], http: aiohttp.ClientSession, messages: str
) -> None:
    body = f'{{"model": "{MODEL}", "max_tokens": 1, "messages": {messages}}}'
    async with http.post(urls["replica"] + "/v1/chat/completions", data=body) as resp:
        assert resp.status == 400, await resp.text()
        assert_openai_error(await resp.json(), status=400)


async def test_the_schema_limit_holds_for_all_tools_together(urls: dict[str, str], http: aiohttp.ClientSession) -> None:
    # Each schema ~1.4 KB, far under the limit alone; 60 of them pass 64 KB together.
    properties = {f"field_{i}": {"type": "string", "description": "x" * 20} for i in range(30)}
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": properties}}}
        for i in range(60)
    ]
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    async with http.post(urls["replica"] + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 400, await resp.text()
        error = (await resp.json())["error"]
    assert error["param"] == "tools" and "together" in error["message"]
