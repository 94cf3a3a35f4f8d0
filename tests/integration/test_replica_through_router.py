"""The router in front of two real Shoal replicas, driven by the official openai client: a conversation's second
turn goes to the replica that cached its first, and that replica reports the cached tokens."""

from __future__ import annotations

import openai
import pytest

from tests.integration.conftest import StartRouter
from tests.integration.replica_support import StartReplica

pytestmark = pytest.mark.integration

SYSTEM = "You are the assistant of Sakura Trading. 見積書の有効期限は発行日から三十日間です。 " * 10


async def test_second_turn_lands_on_the_replica_holding_the_prefix(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    replicas = [await start_replica(), await start_replica()]
    router = await start_router(replicas)  # type: ignore[arg-type]
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0) as c:
        turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the quote validity?"}]
        raw1 = await c.chat.completions.with_raw_response.create(
            model="shoal-demo", messages=turn1, max_tokens=4, temperature=0
        )
        first = raw1.parse()
        answer = first.choices[0].message.content or ""
        turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "ありがとうございます"}]
        raw2 = await c.chat.completions.with_raw_response.create(
            model="shoal-demo", messages=turn2, max_tokens=4, temperature=0
        )
        second = raw2.parse()
        stream = await c.chat.completions.create(
            model="shoal-demo", messages=turn2, max_tokens=4, temperature=0, stream=True
        )
        streamed = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    assert raw1.headers["x-shoal-replica"] == raw2.headers["x-shoal-replica"]
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    assert first.usage is not None and cached >= first.usage.prompt_tokens - 16
    assert streamed == second.choices[0].message.content
