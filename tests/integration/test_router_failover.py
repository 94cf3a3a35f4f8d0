"""Failures of replicas: crashes, restarts, 5xx answers, the circuit breaker, streams that break midway."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import aiohttp
import pytest

from tests.integration.conftest import (
    MODEL,
    RouterHandle,
    StartFakes,
    StartRouter,
    eventually,
    metric_value,
    replica_id,
    unique_text,
)

pytestmark = pytest.mark.integration


async def stream_events(router: RouterHandle, path: str, body: dict[str, Any]) -> tuple[int, str | None, list[Any]]:
    """POST a streaming request; returns status, replica and the decoded `data:` events ("[DONE]" kept as is)."""
    events: list[Any] = []
    timeout = aiohttp.ClientTimeout(total=10)
    async with router.http.post(router.url + path, json={**body, "stream": True}, timeout=timeout) as resp:
        async for line in resp.content:
            if line.startswith(b"data: "):
                payload = line[6:].strip()
                events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
        return resp.status, resp.headers.get("x-shoal-replica"), events


async def test_crash_mid_run_loses_no_request_and_restart_rejoins(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    fakes = await start_fakes(3, first_byte_delay_s=0.05, per_token_delay_s=0.01, num_output_tokens=4)
    router = await start_router(fakes)
    victim = fakes[0]
    victim_id = replica_id(victim)
    killed = asyncio.Event()
    statuses: Counter[int] = Counter()
    stream_outcomes: Counter[str] = Counter()

    async def plain_worker(w: int) -> None:
        for i in range(12):
            reply = await router.complete(unique_text(400, f"plain {w} {i}"))
            statuses[reply.status] += 1
            assert reply.status == 200, reply.body

    async def stream_worker(w: int) -> None:
        for i in range(8):
            status, _, events = await stream_events(
                router, "/v1/completions", {"model": MODEL, "prompt": unique_text(400, f"stream {w} {i}")}
            )
            assert status == 200
            if events and events[-1] == "[DONE]":
                stream_outcomes["done"] += 1
            else:
                # Only a stream that had already started may end early, and then with an error event.
                assert any(isinstance(e, dict) and "error" in e for e in events), events
                stream_outcomes["error_event"] += 1

    async def killer() -> None:
        await victim.wait_until(lambda f: f.in_flight >= 2, timeout_s=5)
        await victim.kill()
        killed.set()

    await asyncio.wait_for(
        asyncio.gather(killer(), *(plain_worker(w) for w in range(4)), *(stream_worker(w) for w in range(2))),
        timeout=30,
    )
    assert killed.is_set()
    assert statuses == Counter({200: 48})
    assert sum(stream_outcomes.values()) == 16
    # Marked out of rotation passively, at once: no probe interval has to pass.
    view = (await router.replicas())[victim_id]
    assert (view["status"], view["eligible"]) == ("unhealthy", False)
    served_before = victim.requests_by_path["/v1/completions"]

    await victim.restart()
    await router.wait_eligible([victim_id], timeout_s=2.0)
    for i in range(6):
        reply = await router.complete(unique_text(400, f"after restart {i}"))
        assert reply.status == 200
    assert victim.requests_by_path["/v1/completions"] > served_before


async def test_killed_idle_replica_is_skipped_on_first_refused_connection(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    # Probes are slow here, so only passive marking can take the replica out quickly.
    from router.service.settings import HealthSettings

    fakes = await start_fakes(2)
    router = await start_router(fakes, health=HealthSettings(interval_s=30, unhealthy_interval_s=0.05))
    victim_id = replica_id(fakes[0])
    await fakes[0].kill()
    for i in range(6):
        reply = await router.complete(unique_text(300, f"after kill {i}"))
        assert (reply.status, reply.replica) == (200, replica_id(fakes[1]))
    view = (await router.replicas())[victim_id]
    assert view["status"] == "unhealthy" and view["last_error"]
    assert metric_value(await router.metrics(), "shoal_router_retries_total", {"reason": "connect_error"}) == 1.0
    await fakes[0].restart()
    await router.wait_eligible([victim_id], timeout_s=2.0)


async def test_503_is_retried_on_another_replica_never_the_same(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    fakes = await start_fakes(3)
    broken, also_broken, good = fakes
    for fake in (broken, also_broken):
        fake.config.fail_rate, fake.config.fail_status = 1.0, 503
    from router.service.settings import BreakerSettings

    router = await start_router(fakes, breaker=BreakerSettings(failure_threshold=1000))
    num_requests = 9
    for i in range(num_requests):
        reply = await router.complete(unique_text(300, f"retry {i}"))
        assert (reply.status, reply.replica) == (200, replica_id(good)), reply.body
    # Each client request reached each broken replica at most once.
    assert 0 < broken.failed <= num_requests and 0 < also_broken.failed <= num_requests
    assert good.requests_by_path["/v1/completions"] == num_requests
    text = await router.metrics()
    num_retries = metric_value(text, "shoal_router_retries_total", {"reason": "http_503"})
    assert num_retries == broken.failed + also_broken.failed


async def test_all_replicas_failing_gives_an_openai_error(start_fakes: StartFakes, start_router: StartRouter) -> None:
    fakes = await start_fakes(2)
    router = await start_router(fakes, hold={"max_wait_s": 0.2})
    for fake in fakes:
        fake.fail_next(1, 503)
    reply = await router.complete("everything is broken")
    assert reply.status == 503
    error = reply.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert [f.failed for f in fakes] == [1, 1]  # two attempts, one per replica, not three
    # Every replica gone: the router's own 503.
    for fake in fakes:
        await fake.kill()
    reply = await router.complete("nobody home")
    assert reply.status == 503
    assert reply.json()["error"]["code"] in {"upstream_unavailable", "no_replica_available"}
    assert reply.json()["error"]["type"] == "server_error"
    reply = await router.complete("still nobody")
    assert (reply.status, reply.json()["error"]["code"]) == (503, "no_replica_available")
    assert reply.headers.get("Retry-After") == "1"


async def test_circuit_opens_after_consecutive_failures_and_closes_after_open_s(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    from router.service.settings import BreakerSettings

    fakes = await start_fakes(2)
    flaky, good = fakes
    flaky.config.fail_rate, flaky.config.fail_status = 1.0, 500
    router = await start_router(fakes, breaker=BreakerSettings(failure_threshold=3, open_s=0.5))
    flaky_id = replica_id(flaky)
    # Distinct prompts alternate over idle replicas, so the flaky one is tried first about every other request.
    for i in range(12):
        reply = await router.complete(unique_text(300, f"breaker {i}"))
        assert (reply.status, reply.replica) == (200, replica_id(good))
        if flaky.failed >= 3:
            break
    assert flaky.failed == 3
    view = (await router.replicas())[flaky_id]
    assert (view["status"], view["eligible"]) == ("circuit_open", False)
    assert metric_value(await router.metrics(), "shoal_router_replica_up", {"replica": flaky_id}) == 0.0
    for i in range(4):
        reply = await router.complete(unique_text(300, f"while open {i}"))
        assert reply.replica == replica_id(good)
    assert flaky.failed == 3  # no traffic while the circuit is open
    # Its /health is fine, so the first probe after open_s closes the circuit.
    flaky.config.fail_rate = 0.0
    await router.wait_eligible([flaky_id], timeout_s=3.0)
    landed = {(await router.complete(unique_text(300, f"closed {i}"))).replica for i in range(4)}
    assert flaky_id in landed


async def test_stream_broken_midway_ends_with_error_event(start_fakes: StartFakes, start_router: StartRouter) -> None:
    fakes = await start_fakes(1, num_output_tokens=8, drop_connection_after_chunks=3, per_token_delay_s=0.01)
    router = await start_router(fakes)
    for path, body in (
        ("/v1/completions", {"model": MODEL, "prompt": "break me"}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "break me"}]}),
    ):
        status, _, events = await asyncio.wait_for(stream_events(router, path, body), timeout=5)
        assert status == 200
        assert len(events) == 4, events  # three relayed chunks, then the router's error event
        assert all("choices" in e for e in events[:3])
        assert events[-1]["error"]["type"] == "server_error" and events[-1]["error"]["message"]
    assert fakes[0].dropped == 2
    await eventually(
        lambda: _in_flight_zero(router), timeout_s=2, what="in-flight gauge back to 0 after broken streams"
    )


async def _in_flight_zero(router: RouterHandle) -> bool:
    return metric_value(await router.metrics(), "shoal_router_in_flight") == 0.0


async def test_stream_dropped_before_first_chunk_is_retried(start_fakes: StartFakes, start_router: StartRouter) -> None:
    fakes = await start_fakes(2, num_output_tokens=3)
    dropper, good = fakes
    dropper.config.drop_connection_after_chunks = 0  # headers sent, then the connection dies before any chunk
    router = await start_router(fakes)
    num_requests = 6
    for i in range(num_requests):
        status, replica, events = await stream_events(
            router, "/v1/completions", {"model": MODEL, "prompt": unique_text(300, f"drop {i}")}
        )
        assert (status, replica) == (200, replica_id(good))
        assert events[-1] == "[DONE]" and not any("error" in e for e in events if isinstance(e, dict))
    assert dropper.dropped >= 1
    assert good.requests_by_path["/v1/completions"] == num_requests


async def test_replica_answering_invalid_http_is_retried_elsewhere(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    # A raw server that passes probes but answers inference requests with a broken status line.
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                await reader.readexactly(length)
                if head.startswith((b"GET /health", b"GET /v1/models", b"GET /metrics")):
                    body = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                        + body
                    )
                    await writer.drain()
                    continue
                writer.write(b"this is not HTTP\r\n\r\n")
                await writer.drain()
                break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    (good,) = await start_fakes(1)
    router = await start_router([good], num_ready=1)
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        reply = await router.admin("POST", "/replicas", {"url": f"http://127.0.0.1:{port}", "name": "garbage"})
        assert reply.status == 201
        await router.wait_eligible(["garbage"])
        for i in range(6):
            reply = await router.complete(unique_text(300, f"garbage {i}"), stream=i % 2 == 1)
            assert (reply.status, reply.replica) == (200, replica_id(good)), reply.body
        retries = metric_value(await router.metrics(), "shoal_router_retries_total", {"reason": "invalid_response"})
        assert retries is not None and retries >= 1
        assert (await router.replicas())["garbage"]["last_error"].startswith("invalid response")
    finally:
        server.close()
        await router.cleanup()  # closes its keep-alive connections to the raw server
        await server.wait_closed()
