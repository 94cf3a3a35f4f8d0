"""The fake replica speaks the OpenAI API well enough for the official client, and its faults and counters work."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest

from tests.fakes import FakeReplica, FakeReplicaConfig


@pytest.fixture
async def replica() -> AsyncIterator[FakeReplica]:
    async with FakeReplica(FakeReplicaConfig(name="a", num_output_tokens=4)) as fake:
        yield fake


async def test_completion_json_names_the_replica(replica: FakeReplica) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"model": "shoal-demo", "prompt": "hello"}
        async with session.post(f"{replica.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.headers["x-fake-replica"] == "a"
            data = await resp.json()
    assert data["object"] == "text_completion"
    assert data["choices"][0]["text"] == "a/tok0 a/tok1 a/tok2 a/tok3 "
    assert data["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    assert replica.requests_by_path["/v1/completions"] == 1
    assert replica.received_bodies[-1] == body


async def test_health_models_metrics_and_echo(replica: FakeReplica) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{replica.url}/health") as resp:
            assert resp.status == 200
        replica.set_healthy(False)
        async with session.get(f"{replica.url}/health") as resp:
            assert resp.status == 503
        async with session.get(f"{replica.url}/v1/models") as resp:
            assert [m["id"] for m in (await resp.json())["data"]] == ["shoal-demo"]
        async with session.get(f"{replica.url}/metrics") as resp:
            text = await resp.text()
        assert 'vllm:num_requests_running{engine="0",model_name="shoal-demo"} 0.0' in text
        assert "vllm:num_requests_waiting{" in text and "vllm:kv_cache_usage_perc{" in text
        replica.config.metrics_flavor = "sglang"
        replica.config.metric_overrides = {"waiting": 7}
        async with session.get(f"{replica.url}/metrics") as resp:
            text = await resp.text()
        assert 'sglang:num_queue_reqs{model_name="shoal-demo"} 7.0' in text
        async with session.post(f"{replica.url}/v1/rerank?x=1", json={"q": 1}) as resp:
            echo = await resp.json()
        assert echo == {
            "object": "echo",
            "replica": "a",
            "method": "POST",
            "path": "/v1/rerank",
            "query": {"x": "1"},
            "body": {"q": 1},
        }
        async with session.post(f"{replica.url}/v1/completions", json={"model": "other", "prompt": "x"}) as resp:
            assert resp.status == 404


async def test_official_client_sync_async_and_streaming(replica: FakeReplica) -> None:
    def sync_calls() -> tuple[str, str]:
        client = openai.OpenAI(base_url=replica.url + "/v1", api_key="x", max_retries=0)
        completion = client.completions.create(model="shoal-demo", prompt="hi", max_tokens=2)
        chat = client.chat.completions.create(model="shoal-demo", messages=[{"role": "user", "content": "hi"}])
        return completion.choices[0].text, chat.choices[0].message.content or ""

    text, content = await asyncio.to_thread(sync_calls)  # the server runs on this loop
    assert text == "a/tok0 a/tok1 "
    assert content == "a/tok0 a/tok1 a/tok2 a/tok3 "

    client = openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key="x", max_retries=0)
    stream = await client.chat.completions.create(
        model="shoal-demo",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    async for chunk in stream:
        pieces += [c.delta.content or "" for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(pieces) == "a/tok0 a/tok1 a/tok2 a/tok3 "
    assert usage is not None and usage.completion_tokens == 4
    models = await client.models.list()
    assert [m.id for m in models.data] == ["shoal-demo"]
    embedding = await client.embeddings.create(model="shoal-demo", input="x")
    assert len(embedding.data[0].embedding) == 4
    await client.close()


async def test_injected_failures_are_seeded_and_counted(replica: FakeReplica) -> None:
    client = openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key="x", max_retries=0)
    replica.fail_next(2, status=503)
    for _ in range(2):
        with pytest.raises(openai.InternalServerError):
            await client.completions.create(model="shoal-demo", prompt="x")
    await client.completions.create(model="shoal-demo", prompt="x")

    replica.config.fail_rate = 0.5
    outcomes = []
    for _ in range(20):
        try:
            await client.completions.create(model="shoal-demo", prompt="x")
            outcomes.append(True)
        except openai.InternalServerError:
            outcomes.append(False)
    assert 0 < sum(outcomes) < 20
    assert replica.failed == 2 + outcomes.count(False)
    await client.close()


async def test_dropped_stream_breaks_the_client_mid_body(replica: FakeReplica) -> None:
    replica.config.drop_connection_after_chunks = 2
    async with aiohttp.ClientSession() as session:
        body = {"model": "shoal-demo", "prompt": "x", "stream": True}
        async with session.post(f"{replica.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
    await replica.wait_until(lambda r: r.in_flight == 0)
    assert (replica.dropped, replica.cancelled) == (1, 0)


async def test_client_disconnect_is_counted_as_cancelled(replica: FakeReplica) -> None:
    replica.config.hang = True
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(session.post(f"{replica.url}/v1/completions", json={"prompt": "x"}))
        await replica.wait_until(lambda r: r.in_flight == 1)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
    await replica.wait_until(lambda r: r.cancelled == 1 and r.in_flight == 0)


async def test_prefix_cache_hits_shorten_prefill() -> None:
    config = FakeReplicaConfig(prefill_s_per_token=0.002, num_output_tokens=1)
    async with FakeReplica(config) as fake, aiohttp.ClientSession() as session:
        body = {"prompt": "p" * 640}  # 10 blocks, 160 tokens: 0.32 s uncached
        durations = []
        for _ in range(2):
            start = time.perf_counter()
            async with session.post(f"{fake.url}/v1/completions", json=body) as resp:
                await resp.read()
            durations.append(time.perf_counter() - start)
    assert durations[0] > 0.3 > 0.1 > durations[1]
    assert (fake.prefix_query_bytes, fake.prefix_hit_bytes) == (1280, 640)


async def test_waiting_requests_show_in_metrics() -> None:
    config = FakeReplicaConfig(max_num_running=1, first_byte_delay_s=10.0)
    async with FakeReplica(config) as fake, aiohttp.ClientSession() as session:
        requests = [asyncio.create_task(session.post(f"{fake.url}/v1/completions", json={})) for _ in range(3)]
        await fake.wait_until(lambda r: r.in_flight == 3 and r.running == 1)
        async with session.get(f"{fake.url}/metrics") as resp:
            text = await resp.text()
        assert 'vllm:num_requests_running{engine="0",model_name="shoal-demo"} 1.0' in text
        assert 'vllm:num_requests_waiting{engine="0",model_name="shoal-demo"} 2.0' in text
        for task in requests:
            task.cancel()
        await asyncio.gather(*requests, return_exceptions=True)
        await fake.wait_until(lambda r: r.in_flight == 0)


async def test_a_batch_slot_bound_fake_exports_its_limit_and_refuses_past_its_queue() -> None:
    config = FakeReplicaConfig(max_num_running=2, max_num_waiting=1, exports_batch_limit=True, first_byte_delay_s=10.0)
    async with FakeReplica(config) as fake, aiohttp.ClientSession() as session:
        requests = [asyncio.create_task(session.post(f"{fake.url}/v1/completions", json={})) for _ in range(3)]
        await fake.wait_until(lambda r: r.in_flight == 3 and r.running == 2)
        async with session.post(f"{fake.url}/v1/completions", json={}) as resp:
            assert resp.status == 503 and "queue full" in (await resp.json())["error"]["message"]
        async with session.get(f"{fake.url}/metrics") as resp:
            text = await resp.text()
        assert 'sglang:max_running_requests{engine="0",model_name="shoal-demo"} 2.0' in text
        assert 'vllm:num_requests_waiting{engine="0",model_name="shoal-demo"} 1.0' in text
        for task in requests:
            task.cancel()
        await asyncio.gather(*requests, return_exceptions=True)
        await fake.wait_until(lambda r: r.in_flight == 0)


async def test_kill_drops_streams_and_restart_serves_on_the_same_port() -> None:
    config = FakeReplicaConfig(name="k", per_token_delay_s=0.05, num_output_tokens=100)
    async with FakeReplica(config) as fake, aiohttp.ClientSession() as session:
        url = fake.url
        async with session.post(f"{url}/v1/completions", json={"stream": True}) as resp:
            await resp.content.readline()
            await fake.kill()
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
        with pytest.raises(aiohttp.ClientConnectionError):
            async with session.get(f"{url}/health"):
                pass
        assert fake.in_flight == 0 and fake.cancelled == 0
        await fake.restart()
        assert fake.url == url
        async with session.get(f"{url}/health") as resp:
            assert resp.status == 200
        assert fake.requests_by_path["/health"] == 1
