"""The proxy itself: SSE relayed as it is produced, client disconnects reaching the replica, slow clients, headers,
other /v1/* paths, the models union, and graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json

import aiohttp
import pytest

from router.service.app import SHUTTING_DOWN
from tests.integration.conftest import (
    MODEL,
    RouterHandle,
    StartFakes,
    StartRouter,
    eventually,
    metric_value,
    replica_id,
)

pytestmark = pytest.mark.integration


async def in_flight(router: RouterHandle) -> float | None:
    return metric_value(await router.metrics(), "shoal_router_in_flight")


async def test_sse_chunks_are_relayed_as_they_are_produced(start_fakes: StartFakes, start_router: StartRouter) -> None:
    per_token_s = 0.15
    fakes = await start_fakes(1, num_output_tokens=8, per_token_delay_s=per_token_s)
    router = await start_router(fakes)
    loop = asyncio.get_running_loop()
    arrivals: list[tuple[float, bytes]] = []
    body = {"model": MODEL, "prompt": "count slowly", "stream": True}
    sent = loop.time()
    async with router.http.post(router.url + "/v1/completions", json=body) as resp:
        headers_at = loop.time() - sent
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert "Content-Length" not in resp.headers
        async for line in resp.content:
            if line.startswith(b"data: "):
                arrivals.append((loop.time() - sent, line[6:].strip()))
    # 8 token chunks and [DONE], each produced per_token_s after the one before.
    assert [payload for _, payload in arrivals][-1] == b"[DONE]"
    assert len(arrivals) == 9
    first_s, last_s = arrivals[0][0], arrivals[-1][0]
    assert headers_at < 0.1 and first_s < 0.1, (headers_at, first_s)
    assert last_s >= 8 * per_token_s * 0.95
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(arrivals)]
    assert min(gaps) > per_token_s * 0.5, gaps  # not buffered into bursts
    texts = [json.loads(p)["choices"][0]["text"] for _, p in arrivals[:-1]]
    assert texts == [f"f0/tok{i} " for i in range(8)]


async def test_streamed_chat_with_usage_is_passed_through_byte_for_byte(
    start_fakes: StartFakes, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    fakes = await start_fakes(1, num_output_tokens=3)
    router = await start_router(fakes)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http.post(router.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        raw = await resp.read()
    events = [line[6:] for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    decoded = [json.loads(e) for e in events[:-1]]
    assert decoded[0]["choices"][0]["delta"]["role"] == "assistant"
    assert decoded[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert raw.endswith(b"data: [DONE]\n\n")


async def test_client_disconnect_mid_stream_cancels_upstream(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    fakes = await start_fakes(1, num_output_tokens=50, per_token_delay_s=0.05)
    fake = fakes[0]
    router = await start_router(fakes)
    async with aiohttp.ClientSession() as own:
        resp = await own.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
        assert resp.status == 200
        await resp.content.readline()  # the stream has started
        assert fake.in_flight == 1
        resp.close()  # drops the connection
    await fake.wait_until(lambda f: f.cancelled == 1 and f.in_flight == 0, timeout_s=3)
    assert fake.completed == 0
    await eventually(lambda: _is_zero(router), timeout_s=3, what="router in-flight gauge back to 0")


async def test_client_disconnect_while_waiting_cancels_upstream(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    fakes = await start_fakes(1, hang=True)
    fake = fakes[0]
    router = await start_router(fakes)
    for body in (
        {"model": MODEL, "prompt": "never answered"},
        {"model": MODEL, "prompt": "never answered either", "stream": True},
    ):
        before = fake.cancelled
        task = asyncio.create_task(router.request("POST", "/v1/completions", json_body=body, timeout_s=30))
        await fake.wait_until(lambda f: f.in_flight == 1, timeout_s=3)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await fake.wait_until(lambda f, b=before: f.cancelled == b + 1 and f.in_flight == 0, timeout_s=3)
        await eventually(lambda: _is_zero(router), timeout_s=3, what="router in-flight gauge back to 0")
    view = (await router.replicas())[replica_id(fake)]
    assert (view["in_flight"], view["waiting"], view["eligible"]) == (0, 0, True)


async def _is_zero(router: RouterHandle) -> bool:
    return await in_flight(router) == 0.0


async def test_client_that_never_reads_does_not_block_others(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    # Each chunk names its replica twice (~16 KB), so the stalled stream (~64 MB) is far beyond what the socket
    # buffers on the way hold: the router ends up blocked writing to the client that does not read.
    fakes = await start_fakes(2, name="flood-" + "x" * 8000, num_output_tokens=4_000)
    router = await start_router(fakes)
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", int(router.url.rsplit(":", 1)[1]))
    try:
        body = json.dumps({"model": MODEL, "prompt": "flood me", "stream": True}).encode()
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")  # headers came; now never read again
        assert sum(f.in_flight for f in fakes) == 1
        started = loop.time()
        for i in range(20):
            reply = await router.complete(f"quick {i}", max_tokens=2)
            assert reply.status == 200
        for i in range(5):
            reply = await router.complete(f"s{i}", stream=True, max_tokens=2)
            assert reply.status == 200 and reply.body.endswith(b"data: [DONE]\n\n")
        assert loop.time() - started < 2.0
        # The stalled stream is still held by back-pressure, and the others all completed.
        assert (sum(f.in_flight for f in fakes), sum(f.completed for f in fakes)) == (1, 25)
        assert await in_flight(router) == 1.0
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    await eventually(lambda: sum(f.in_flight for f in fakes) == 0, timeout_s=5, what="the stalled stream to end")


async def test_hop_by_hop_headers_are_not_forwarded(
    start_fakes: StartFakes, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    fakes = await start_fakes(1)
    fake = fakes[0]
    router = await start_router(fakes)
    headers = {
        "Connection": "keep-alive, X-Private-Hop",
        "Keep-Alive": "timeout=5",
        "X-Private-Hop": "secret",
        "TE": "trailers",
        "Trailer": "X-Checksum",
        "Proxy-Authorization": "Basic abc",
        "Proxy-Authenticate": "Basic",
        "Authorization": "Bearer user-key",
        "X-Request-Id": "req-42",
        "OpenAI-Organization": "org-1",
    }
    async with http.post(
        router.url + "/v1/completions", json={"model": MODEL, "prompt": "headers"}, headers=headers
    ) as resp:
        assert resp.status == 200
        assert resp.headers["x-fake-replica"] == "f0"  # end-to-end response headers come back
        await resp.read()
    received = {k.lower(): v for k, v in fake.received_headers[-1].items()}
    for hop in ("keep-alive", "x-private-hop", "te", "trailer", "proxy-authorization", "proxy-authenticate"):
        assert hop not in received, hop
    assert received.get("connection", "keep-alive").lower() == "keep-alive"  # only the router's own, if any
    assert received["host"] == f"127.0.0.1:{fake.port}"  # the replica's host, not the router's
    assert received["authorization"] == "Bearer user-key"
    assert received["x-request-id"] == "req-42"
    assert received["openai-organization"] == "org-1"
    assert fake.received_bodies[-1] == {"model": MODEL, "prompt": "headers"}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_the_routers_tags_replace_those_of_a_router_behind_it(
    start_fakes: StartFakes, start_router: StartRouter, http: aiohttp.ClientSession, stream: bool
) -> None:
    fakes = await start_fakes(1)
    fakes[0].config.extra_response_headers = {"x-shoal-replica": "inner-replica", "x-shoal-route-branch": "spill"}
    router = await start_router(fakes)
    body = {"model": MODEL, "prompt": "tags", "stream": stream}
    async with http.post(router.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        await resp.read()
        assert resp.headers.getall("x-shoal-replica") == [replica_id(fakes[0])]
        assert resp.headers.getall("x-shoal-route-branch") == ["only_replica"]
        assert resp.headers["x-fake-replica"] == "f0"


async def test_other_v1_paths_pass_through(start_fakes: StartFakes, start_router: StartRouter) -> None:
    fakes = await start_fakes(2)
    router = await start_router(fakes)
    reply = await router.request("POST", "/v1/embeddings", json_body={"model": MODEL, "input": "embed me"})
    assert reply.status == 200
    assert reply.json()["data"][0]["embedding"] == [0.1, 0.2, 0.3, 0.4]
    assert reply.replica in {replica_id(f) for f in fakes}
    reply = await router.request("POST", "/v1/rerank?top_n=2", json_body={"model": MODEL, "query": "q"})
    assert reply.status == 200
    echo = reply.json()
    assert (echo["method"], echo["path"], echo["query"], echo["body"]) == (
        "POST",
        "/v1/rerank",
        {"top_n": "2"},
        {"model": MODEL, "query": "q"},
    )
    reply = await router.request("GET", "/v1/files/abc")
    assert (reply.status, reply.json()["method"], reply.json()["path"]) == (200, "GET", "/v1/files/abc")
    reply = await router.request("DELETE", "/v1/files/abc")
    assert (reply.status, reply.json()["method"]) == (200, "DELETE")
    reply = await router.request(
        "POST", "/v1/embeddings", data=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert reply.status == 400 and reply.json()["error"]["code"] == "invalid_json"
    reply = await router.request("POST", "/v1/embeddings", json_body={"model": "nope", "input": "x"})
    assert (reply.status, reply.json()["error"]["code"]) == (404, "model_not_found")


async def test_models_are_the_union_of_healthy_replicas_and_route_by_model(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    (only_a,) = await start_fakes(1, models=("model-a",))
    (both,) = await start_fakes(1, models=("model-a", "model-b"))
    router = await start_router([only_a, both], hold={"max_wait_s": 0.2})
    reply = await router.request("GET", "/v1/models")
    assert reply.status == 200
    data = reply.json()
    assert data["object"] == "list"
    assert sorted(card["id"] for card in data["data"]) == ["model-a", "model-b"]
    for i in range(4):
        reply = await router.request("POST", "/v1/completions", json_body={"model": "model-b", "prompt": f"b {i}"})
        assert (reply.status, reply.replica) == (200, replica_id(both))
    landed = set()
    for i in range(4):
        reply = await router.request("POST", "/v1/completions", json_body={"model": "model-a", "prompt": f"a {i}"})
        landed.add(reply.replica)
    assert landed == {replica_id(only_a), replica_id(both)}
    # A replica out of rotation takes its models out of the union.
    both.set_healthy(False)
    await eventually(lambda: _models_equal(router, ["model-a"]), timeout_s=3, what="model-b to leave /v1/models")
    reply = await router.request("POST", "/v1/completions", json_body={"model": "model-b", "prompt": "b"})
    assert reply.status == 503 and reply.json()["error"]["code"] == "no_replica_available"


async def _model_ids(router: RouterHandle) -> list[str]:
    reply = await router.request("GET", "/v1/models")
    return sorted(card["id"] for card in reply.json()["data"])


async def _models_equal(router: RouterHandle, expected: list[str]) -> bool:
    return await _model_ids(router) == expected


async def test_graceful_shutdown_lets_in_flight_requests_finish(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    fakes = await start_fakes(1, first_byte_delay_s=0.6)
    fake = fakes[0]
    router = await start_router(fakes)
    plain = asyncio.create_task(router.complete("slow one"))
    streamed = asyncio.create_task(router.complete("slow stream", stream=True))
    await fake.wait_until(lambda f: f.in_flight == 2, timeout_s=3)
    assert router.app[SHUTTING_DOWN].is_set() is False
    shutdown = asyncio.create_task(router.cleanup())
    await eventually(lambda: router.app[SHUTTING_DOWN].is_set(), timeout_s=2, what="shutdown to begin")
    # The listening socket is closed first: no new request gets in.
    with pytest.raises(aiohttp.ClientConnectionError):
        await router.request("GET", "/ready", timeout_s=2)
    assert not shutdown.done()
    plain_reply, stream_reply = await asyncio.wait_for(asyncio.gather(plain, streamed), timeout=5)
    assert plain_reply.status == 200 and plain_reply.json()["choices"][0]["text"]
    assert stream_reply.status == 200 and stream_reply.body.endswith(b"data: [DONE]\n\n")
    await asyncio.wait_for(shutdown, timeout=5)
    assert fake.completed == 2 and fake.cancelled == 0
