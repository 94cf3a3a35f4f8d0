"""The official `openai` package, sync and async, streaming or not, through the router."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.fakes import FakeReplica
from tests.integration.conftest import MODEL, RouterHandle, StartFakes, StartRouter, replica_id

pytestmark = pytest.mark.integration


@pytest.fixture
async def fleet(start_fakes: StartFakes, start_router: StartRouter) -> tuple[list[FakeReplica], RouterHandle]:
    fakes = await start_fakes(2, num_output_tokens=4)
    return fakes, await start_router(fakes)


def fingerprints(fakes: list[FakeReplica]) -> set[str]:
    return {f"fake-{f.name}" for f in fakes}


async def test_sync_client(fleet: tuple[list[FakeReplica], RouterHandle]) -> None:
    fakes, router = fleet

    def run() -> None:
        with openai.OpenAI(base_url=router.url + "/v1", api_key="sk-test", max_retries=0, timeout=10) as client:
            completion = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=3)
            assert completion.object == "text_completion"
            assert completion.choices[0].text.endswith("/tok2 ")
            assert completion.choices[0].finish_reason == "length"
            assert completion.usage is not None and completion.usage.completion_tokens == 3
            assert completion.system_fingerprint in fingerprints(fakes)

            chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}])
            assert chat.choices[0].message.role == "assistant"
            assert chat.choices[0].message.content and chat.choices[0].message.content.count("/tok") == 4

            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "headers?"}]
            )
            assert raw.headers["x-shoal-replica"] in {replica_id(f) for f in fakes}
            assert raw.headers["x-shoal-route-branch"] == "cache_miss"

            pieces = [
                chunk.choices[0].delta.content or ""
                for chunk in client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "stream it"}], stream=True
                )
                if chunk.choices
            ]
            assert "".join(pieces).count("/tok") == 4
            texts = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt="stream", stream=True)]
            assert len(texts) == 4

            models = client.models.list()
            assert [m.id for m in models.data] == [MODEL]

    await asyncio.wait_for(asyncio.to_thread(run), timeout=30)
    assert sum(f.requests_by_path["/v1/completions"] for f in fakes) == 2
    assert sum(f.requests_by_path["/v1/chat/completions"] for f in fakes) == 3


async def test_async_client(fleet: tuple[list[FakeReplica], RouterHandle]) -> None:
    fakes, router = fleet
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="sk-test", max_retries=0, timeout=10) as client:
        completion = await client.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=2)
        assert completion.choices[0].text.count("/tok") == 2
        chat = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        )
        assert chat.choices[0].message.content and chat.system_fingerprint in fingerprints(fakes)

        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "stream with usage"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).count("/tok") == 4

        completion_stream = await client.completions.create(model=MODEL, prompt="stream", stream=True)
        texts = [c.choices[0].text async for c in completion_stream]
        assert len(texts) == 4

        embedding = await client.embeddings.create(model=MODEL, input="embed")
        assert embedding.data[0].embedding == [0.1, 0.2, 0.3, 0.4]

        # Concurrent requests through one client all succeed and use both replicas.
        replies = await asyncio.gather(
            *(client.completions.with_raw_response.create(model=MODEL, prompt=f"parallel {i} " * 40) for i in range(8))
        )
        assert {r.headers["x-shoal-replica"] for r in replies} == {replica_id(f) for f in fakes}


async def test_client_sees_router_errors_as_typed_exceptions(fleet: tuple[list[FakeReplica], RouterHandle]) -> None:
    fakes, router = fleet
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="sk-test", max_retries=0, timeout=10) as client:
        with pytest.raises(openai.NotFoundError) as not_found:
            await client.completions.create(model="no-such-model", prompt="x")
        assert not_found.value.code == "model_not_found"
        assert not_found.value.param == "model"
        with pytest.raises(openai.BadRequestError) as bad:
            await client.chat.completions.create(model=MODEL, messages=[])
        assert bad.value.param == "messages"
        for fake in fakes:
            fake.config.fail_rate, fake.config.fail_status = 1.0, 503
        with pytest.raises(openai.InternalServerError) as unavailable:
            await client.completions.create(model=MODEL, prompt="all down")
        assert unavailable.value.status_code == 503

    # A replica breaking mid-stream surfaces as an error in the client's stream iteration.
    for fake in fakes:
        fake.config.fail_rate = 0.0
        fake.config.drop_connection_after_chunks = 2
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="sk-test", max_retries=0, timeout=10) as client:
        stream = await client.completions.create(model=MODEL, prompt="break", stream=True)
        received = []
        with pytest.raises(openai.APIError):
            async for chunk in stream:
                received.append(chunk)
        assert len(received) == 2
