"""One large request does not stall the replica for the others: a prompt text that cannot fit the context is
refused before it is tokenized, and a large one that must be tokenized is tokenized off the event loop, so small
requests sent meanwhile keep their latency (p99 within 50 ms)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson

from tests.integration.replica_support import ReplicaHandle, StartReplica

SMALL_P99_S = 0.05


async def small_latencies_during(
    replica: ReplicaHandle, body: dict[str, object]
) -> tuple[int, dict[str, Any], list[float]]:
    """Send `body` to /v1/completions while GET /v1/models runs back to back; -> (its status, its JSON, the
    latencies of the small requests that started while it was in flight)."""
    data = orjson.dumps(body)
    latencies: list[float] = []
    in_flight = asyncio.Event()
    done = asyncio.Event()
    async with aiohttp.ClientSession() as session:

        async def small() -> None:
            while not done.is_set():
                started = time.perf_counter()
                async with session.get(f"{replica.url}/v1/models") as response:
                    await response.read()
                if in_flight.is_set() and not done.is_set():
                    latencies.append(time.perf_counter() - started)
                await asyncio.sleep(0.005)

        poller = asyncio.create_task(small())
        in_flight.set()
        async with session.post(
            f"{replica.url}/v1/completions", data=data, headers={"Content-Type": "application/json"}
        ) as response:
            status, answer = response.status, await response.json()
        done.set()
        await poller
    return status, answer, latencies


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


async def test_a_prompt_past_the_context_is_refused_before_tokenizing(start_any_replica: StartReplica) -> None:
    replica = await start_any_replica(model="demo", num_speculative_tokens=0)
    text = "hello world " * (15 * 1024 * 1024 // 12)  # 15 MB: seconds of tokenizing
    began = time.perf_counter()
    status, answer, latencies = await small_latencies_during(
        replica, {"model": "shoal-demo", "prompt": text, "max_tokens": 1}
    )
    assert status == 400
    message = answer["error"]["message"]
    assert "the prompt has at least" in message and "context is 4096 tokens" in message, message
    assert answer["error"]["param"] == "prompt"
    assert time.perf_counter() - began < 5.0  # reading and refusing, no tokenizing
    assert not latencies or p99(latencies) <= SMALL_P99_S


async def test_a_large_prompt_is_tokenized_off_the_loop(start_any_replica: StartReplica) -> None:
    replica = await start_any_replica(model="demo", num_speculative_tokens=0)
    text = "hello world " * (600 * 1024 // 12)  # under the refusal bound: tokenized (some 0.3 s), then too long
    status, answer, latencies = await small_latencies_during(
        replica, {"model": "shoal-demo", "prompt": text, "max_tokens": 1}
    )
    assert status == 400 and "maximum context length is 4096" in answer["error"]["message"]
    assert len(latencies) >= 10, len(latencies)  # the small requests ran while it was tokenized
    assert p99(latencies) <= SMALL_P99_S, sorted(latencies)[-5:]
