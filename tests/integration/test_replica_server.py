"""`shoal replica` over HTTP: the official openai client, streaming, usage with cached tokens, metrics under vLLM's
names, KV events, bad input that gets a 400 and leaves the server serving, and capture of raw token ids."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from replica.capture import fingerprint_model, fingerprint_tokenizer, iter_captures
from router.policy.hashing import hash_tokens, namespace_seed
from tests.integration.conftest import eventually, metric_value
from tests.integration.replica_support import StartReplica

pytestmark = pytest.mark.integration

SYSTEM = "あなたはさくら商事のアシスタントです。 You help customers with orders, invoices and meetings. " * 8


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


async def test_openai_client_chat_completion_and_models(start_replica: StartReplica) -> None:
    replica = await start_replica()
    async with client(replica.url) as c:
        models = await c.models.list()
        assert [m.id for m in models.data] == ["shoal-demo"]
        reply = await c.chat.completions.create(
            model="shoal-demo", messages=[{"role": "user", "content": "こんにちは"}], max_tokens=8, temperature=0
        )
    assert reply.object == "chat.completion"
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.completion_tokens <= 8
    assert reply.usage.prompt_tokens > 0


async def test_streaming_matches_non_streaming_and_reports_usage(start_replica: StartReplica) -> None:
    replica = await start_replica()
    messages = [{"role": "user", "content": "Please confirm order SO-1234."}]
    async with client(replica.url) as c:
        whole = await c.chat.completions.create(
            model="shoal-demo", messages=messages, max_tokens=12, temperature=0, seed=1
        )
        stream = await c.chat.completions.create(
            model="shoal-demo",
            messages=messages,
            max_tokens=12,
            temperature=0,
            seed=1,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts, finish, usage = [], None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
    assert "".join(parts) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]


async def test_shared_prefix_reports_cached_tokens(start_replica: StartReplica) -> None:
    replica = await start_replica()
    async with client(replica.url) as c:
        first = await c.chat.completions.create(
            model="shoal-demo",
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Invoice status?"}],
            max_tokens=2,
        )
        second = await c.chat.completions.create(
            model="shoal-demo",
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "会議室の予約をお願いします"}],
            max_tokens=2,
        )
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None and second.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= first.usage.prompt_tokens // 2, (cached, first.usage.prompt_tokens)
    assert cached % 16 == 0  # whole blocks only


async def test_completions_with_text_and_token_ids(start_replica: StartReplica) -> None:
    replica = await start_replica()
    async with client(replica.url) as c:
        by_text = await c.completions.create(model="shoal-demo", prompt="Dear Mr. Tanaka,", max_tokens=5, temperature=0)
        ids = replica.state.tokenizer.encode("Dear Mr. Tanaka,")
        by_ids = await c.completions.create(model="shoal-demo", prompt=ids, max_tokens=5, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage is not None and by_text.usage.prompt_tokens == len(ids)


async def test_stop_string_cuts_output(start_replica: StartReplica) -> None:
    replica = await start_replica()
    async with client(replica.url) as c:
        free = await c.completions.create(model="shoal-demo", prompt="Hello", max_tokens=20, temperature=0)
        text = free.choices[0].text
        assert len(text) >= 4
        stop = text[2:4]
        cut = await c.completions.create(model="shoal-demo", prompt="Hello", max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 5}, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 17}, "'n'"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "lots"}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": 3}, "stop"),
        ({"messages": [{"role": "user", "content": "hi " * 3000}]}, "context"),
    ],
)
async def test_bad_chat_requests_get_400_and_the_server_keeps_serving(
    start_replica: StartReplica, body: dict[str, Any], fragment: str
) -> None:
    replica = await start_replica()
    async with aiohttp.ClientSession() as http:
        async with http.post(replica.url + "/v1/chat/completions", json={"model": "shoal-demo", **body}) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
            assert fragment in error["message"], error
        async with http.post(replica.url + "/v1/chat/completions", data=b"{not json") as resp:
            assert resp.status == 400
        async with http.post(replica.url + "/v1/completions", json={"model": "shoal-demo", "prompt": [10**9]}) as resp:
            assert resp.status == 400
            assert "vocabulary" in (await resp.json())["error"]["message"]
        async with http.post(replica.url + "/v1/completions", json={"model": "other", "prompt": "x"}) as resp:
            assert resp.status == 404
        async with http.get(replica.url + "/health") as resp:
            assert resp.status == 200
        async with http.post(
            replica.url + "/v1/completions", json={"model": "shoal-demo", "prompt": "ok", "max_tokens": 2}
        ) as resp:
            assert resp.status == 200


async def test_full_queue_gets_429_with_retry_after(start_replica: StartReplica) -> None:
    replica = await start_replica(max_num_seqs=1, max_waiting=0)
    body = {"model": "shoal-demo", "prompt": "Hello", "max_tokens": 200, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:

        async def send() -> tuple[int, str | None]:
            async with http.post(replica.url + "/v1/completions", json=body) as resp:
                await resp.read()
                return resp.status, resp.headers.get("Retry-After")

        results = await asyncio.gather(*(send() for _ in range(4)))
    statuses = sorted(s for s, _ in results)
    assert statuses.count(200) >= 1 and 429 in statuses, statuses
    assert all(retry == "1" for s, retry in results if s == 429)


async def test_client_disconnect_aborts_and_frees_blocks(start_replica: StartReplica) -> None:
    replica = await start_replica()
    engine = replica.state.engine.engine
    body = {"model": "shoal-demo", "prompt": "Hello " * 50, "max_tokens": 500, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as http:
        resp = await http.post(replica.url + "/v1/completions", json=body)
        await resp.content.readline()  # the first chunk arrived: the request is running
        resp.close()
    await eventually(lambda: not engine.has_work, timeout_s=10, what="the aborted request to leave the engine")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.check_invariants()


async def test_metrics_use_vllm_names(start_replica: StartReplica) -> None:
    replica = await start_replica(max_num_seqs=6)
    async with client(replica.url) as c:
        for _ in range(2):
            await c.completions.create(model="shoal-demo", prompt=SYSTEM, max_tokens=3)
    async with aiohttp.ClientSession() as http, http.get(replica.url + "/metrics") as resp:
        text = await resp.text()
    labels = {"model_name": "shoal-demo"}
    assert metric_value(text, "vllm:num_requests_running", labels) == 0
    assert metric_value(text, "vllm:num_requests_waiting", labels) == 0
    assert metric_value(text, "vllm:kv_cache_usage_perc", labels) == 0
    hits = metric_value(text, "vllm:prefix_cache_hits_total", labels)
    queries = metric_value(text, "vllm:prefix_cache_queries_total", labels)
    assert hits is not None and queries is not None and 0 < hits < queries
    assert metric_value(text, "vllm:generation_tokens_total", labels) == 6
    assert metric_value(text, "vllm:time_to_first_token_seconds_count", labels) == 2
    assert metric_value(text, "vllm:request_success_total", {**labels, "finished_reason": "length"}) == 2
    assert metric_value(text, "shoal_replica_max_num_seqs", labels) == 6  # vLLM has no gauge for its batch limit


async def test_kv_events_stream_snapshot_then_stored_blocks_with_router_hashes(start_replica: StartReplica) -> None:
    replica = await start_replica()
    async with client(replica.url) as c:
        await c.completions.create(model="shoal-demo", prompt=SYSTEM, max_tokens=1)
    seed = namespace_seed("shoal-demo")
    async with aiohttp.ClientSession() as http, http.get(replica.url + "/v1/kv_events") as resp:
        snapshot = json.loads((await resp.content.readline()).decode()[len("data: ") :])
        await resp.content.readline()  # blank line ending the SSE message
        assert snapshot["snapshot"] is True
        kinds = [e["type"] for e in snapshot["events"]]
        assert kinds[0] == "cleared" and kinds.count("stored") >= 4
        system_ids = replica.state.tokenizer.encode(SYSTEM)
        prompt_ids = system_ids + system_ids[:32]  # two more full blocks, whatever the tokenizer merges
        async with client(replica.url) as c:
            await c.completions.create(model="shoal-demo", prompt=prompt_ids, max_tokens=1)
        message = json.loads((await resp.content.readline()).decode()[len("data: ") :])
    assert message["seq"] == snapshot["seq"] + 1
    stored = [e for e in message["events"] if e["type"] == "stored"]
    assert stored, message
    event = stored[0]
    # The replica hashes exactly as the router does: recompute from the event's tokens and parent.
    assert event["block_hashes"] == hash_tokens(
        event["token_ids"], seed, event["block_size"], parent_hash=event["parent_hash"]
    )
    known = {h for e in snapshot["events"] if e["type"] == "stored" for h in e["block_hashes"]}
    assert event["parent_hash"] in known


async def test_capture_records_the_ids_the_engine_read_and_emitted(
    start_replica: StartReplica, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    capture_dir = tmp_path / "capture"
    replica = await start_replica(capture_dir=capture_dir)
    tokenizer = replica.state.tokenizer
    messages = [{"role": "user", "content": "Please confirm order SO-1234."}]
    async with client(replica.url) as c:
        chat = await c.chat.completions.create(model="shoal-demo", messages=messages, max_tokens=12, temperature=0)
        completion = await c.completions.create(model="shoal-demo", prompt="Dear Mr. Tanaka,", max_tokens=10, seed=3)
        stream = await c.completions.create(
            model="shoal-demo", prompt="Invoice INV-2024 status:", max_tokens=10, temperature=0.8, seed=5, stream=True
        )
        parts, stream_id, stream_finish = [], "", None
        async for chunk in stream:
            stream_id = chunk.id
            parts += [choice.text for choice in chunk.choices]
            stream_finish = next((ch.finish_reason for ch in chunk.choices if ch.finish_reason), stream_finish)
    writer = replica.state.capture
    await eventually(lambda: writer.stats().num_records_written == 3, what="three capture records")

    records = {r.request_id: r for r in iter_captures(capture_dir)}
    chat_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    expected = {
        chat.id: ("chat", chat_prompt, chat.choices[0].message.content, chat.choices[0].finish_reason),
        completion.id: (
            "completions",
            "Dear Mr. Tanaka,",
            completion.choices[0].text,
            completion.choices[0].finish_reason,
        ),
        stream_id: ("completions", "Invoice INV-2024 status:", "".join(parts), stream_finish),
    }
    assert records.keys() == expected.keys()
    for request_id, (endpoint, prompt, text, finish) in expected.items():
        rec = records[request_id]
        assert (rec.endpoint, rec.finish_reason, rec.model) == (endpoint, finish, "shoal-demo")
        assert rec.prompt_token_ids == tokenizer.encode(prompt)
        assert rec.output_token_ids and tokenizer.decode(rec.output_token_ids) == text
        assert rec.model_hash == fingerprint_model(tiny_checkpoint)
        assert rec.tokenizer_hash == fingerprint_tokenizer(tiny_checkpoint / "tokenizer.json")
        assert rec.prompt_text is None and rec.output_text is None
        assert rec.ttft_s is not None and 0 < rec.ttft_s <= rec.e2e_s
    assert chat.usage is not None and len(records[chat.id].output_token_ids) == chat.usage.completion_tokens
    assert (records[stream_id].params["temperature"], records[stream_id].params["seed"]) == (0.8, 5)
    data = b"".join(path.read_bytes() for path in capture_dir.iterdir())
    assert not [word for word in (b"Tanaka", b"SO-1234", b"INV-2024", b"confirm") if word in data]

    async with aiohttp.ClientSession() as http, http.get(replica.url + "/metrics") as resp:
        text = await resp.text()
    assert metric_value(text, "shoal_replica_capture_records_total") == 3
    assert metric_value(text, "shoal_replica_capture_bytes_total") == len(data)
    assert metric_value(text, "shoal_replica_capture_dropped_total", {"reason": "queue_full"}) == 0


async def test_capture_text_full_keeps_text_ids_cut_at_a_stop_string_and_aborted_requests(
    start_replica: StartReplica, tmp_path: Path
) -> None:
    capture_dir = tmp_path / "capture"
    replica = await start_replica(capture_dir=capture_dir, capture_text="full")
    tokenizer = replica.state.tokenizer
    async with client(replica.url) as c:
        free = await c.completions.create(model="shoal-demo", prompt="Hello", max_tokens=20, temperature=0)
        text = free.choices[0].text
        assert len(text) >= 4
        stop = text[2:4]
        cut = await c.completions.create(model="shoal-demo", prompt="Hello", max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    long_prompt = "Hello " * 50
    body = {"model": "shoal-demo", "prompt": long_prompt, "max_tokens": 500, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as http:
        resp = await http.post(replica.url + "/v1/completions", json=body)
        await resp.content.readline()  # the first chunk arrived; then the client goes away
        resp.close()
    writer = replica.state.capture
    await eventually(lambda: writer.stats().num_records_written == 3, timeout_s=10, what="three capture records")

    records = {r.request_id: r for r in iter_captures(capture_dir)}
    free_rec, cut_rec = records.pop(free.id), records.pop(cut.id)
    (aborted,) = records.values()
    assert (free_rec.prompt_text, free_rec.output_text) == ("Hello", text)
    assert (cut_rec.output_text, cut_rec.finish_reason, cut_rec.params["stop"]) == (cut.choices[0].text, "stop", [stop])
    # The engine's ids up to the one that completed the stop string: a prefix of the free run's, past the cut text.
    assert cut_rec.output_token_ids == free_rec.output_token_ids[: len(cut_rec.output_token_ids)]
    assert tokenizer.decode(cut_rec.output_token_ids).startswith(cut.choices[0].text + stop)
    assert aborted.finish_reason == "abort" and aborted.prompt_text == long_prompt
    assert aborted.prompt_token_ids == tokenizer.encode(long_prompt)
    assert 0 < len(aborted.output_token_ids) < 500


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
async def test_a_full_capture_disk_never_fails_a_request(start_replica: StartReplica, tmp_path: Path) -> None:
    capture_dir = tmp_path / "capture"
    replica = await start_replica(capture_dir=capture_dir)
    full = capture_dir / "capture-00000001.jsonl"
    full.symlink_to("/dev/full")  # the file the writer opens next: every write fails with ENOSPC
    writer = replica.state.capture
    async with aiohttp.ClientSession() as http:

        async def send(path: str, body: dict[str, Any]) -> tuple[int, bytes]:
            async with http.post(replica.url + path, json={"model": "shoal-demo", "max_tokens": 8, **body}) as resp:
                return resp.status, await resp.read()

        requests = [("/v1/completions", {"prompt": f"Order {i} shipped"}) for i in range(4)]
        requests += [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Invoice?"}]}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Meeting?"}], "stream": True}),
        ]
        replies = await asyncio.gather(*(send(path, body) for path, body in requests))
        assert [status for status, _ in replies] == [200] * 6
        assert replies[-1][1].endswith(b"data: [DONE]\n\n")
        await eventually(lambda: writer.stats().num_dropped["write_error"] == 6, what="six failed capture writes")

        full.unlink()  # room on the disk again
        assert (await send("/v1/completions", {"prompt": "Order 9 shipped"}))[0] == 200
        await eventually(lambda: writer.stats().num_records_written == 1, what="capture to work again")
        async with http.get(replica.url + "/metrics") as resp:
            text = await resp.text()
    assert metric_value(text, "shoal_replica_capture_dropped_total", {"reason": "write_error"}) == 6
    assert metric_value(text, "shoal_replica_capture_records_total") == 1
    assert [r.prompt_token_ids for r in iter_captures(capture_dir)] == [
        replica.state.tokenizer.encode("Order 9 shipped")
    ]


@pytest.mark.parametrize("where", ["step", "on_step"])
async def test_a_failed_engine_answers_503_to_every_request_and_on_health(
    start_replica: StartReplica, where: str
) -> None:
    """A failure injected into the real engine's step, or into the handling of a step's outputs (the metrics and KV
    events, which once ended the engine's driver unseen: requests hung): the request that met it gets a 503, so does
    every later one, streamed or not, and /health says why, while the server itself keeps answering."""
    replica = await start_replica()

    def fail(*_: object) -> Any:
        raise RuntimeError("injected failure")

    if where == "step":
        replica.state.engine.engine.step = fail
    else:
        replica.state.on_step = fail
    messages = [{"role": "user", "content": "Please confirm order SO-1234."}]
    async with client(replica.url) as c:
        for stream in (False, True, False):
            with pytest.raises(openai.APIStatusError) as failed:
                await asyncio.wait_for(
                    c.chat.completions.create(model="shoal-demo", messages=messages, max_tokens=4, stream=stream),
                    timeout=30,
                )
            assert failed.value.status_code == 503
            assert failed.value.code == "engine_unavailable"
            assert "injected failure" in failed.value.message
    async with aiohttp.ClientSession() as session, session.get(replica.url + "/health") as health:
        assert health.status == 503
        assert "injected failure" in (await health.json())["error"]["message"]
