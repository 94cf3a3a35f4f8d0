"""One large request does not stall the replica for the others: a prompt text that cannot fit the context is
refused before it is tokenized, a large body is read off the event loop (a token-id prompt past the context refused
there), and a large prompt that must be tokenized is tokenized off the loop, so small requests sent meanwhile, one
every 5 ms (`latency.py`), keep their p99 within 50 ms of what it was before."""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import orjson

from tests.integration.latency import latencies_around, p99
from tests.integration.replica_support import ReplicaHandle, StartReplica

ALLOWED_S = 0.050


async def around(replica: ReplicaHandle, body: bytes) -> tuple[int, dict[str, Any], list[float], list[float]]:
    """POST `body` to /v1/completions while GET /v1/models runs every 5 ms: -> (its status, its JSON, the small
    requests' latencies before it, while it was in flight)."""
    async with aiohttp.ClientSession() as session:

        async def small() -> None:
            async with session.get(f"{replica.url}/v1/models") as response:
                await response.read()
                assert response.status == 200

        before, during, (status, answer) = await latencies_around(small, f"{replica.url}/v1/completions", body)
    return status, orjson.loads(answer), before, during


def assert_unmoved(before: list[float], during: list[float]) -> None:
    assert len(during) >= 10, f"only {len(during)} small requests while the large one was in flight"
    assert p99(during) <= p99(before) + ALLOWED_S, (
        f"p99 {p99(during) * 1e3:.1f} ms while it was in flight, {p99(before) * 1e3:.1f} ms before "
        f"(worst {max(during) * 1e3:.1f} ms of {len(during)})"
    )


async def test_a_prompt_past_the_context_is_refused_before_tokenizing(start_any_replica: StartReplica) -> None:
    replica = await start_any_replica(model="demo", num_speculative_tokens=0)
    text = "hello world " * (15 * 1024 * 1024 // 12)  # 15 MB: seconds of tokenizing
    began = time.perf_counter()
    status, answer, before, during = await around(
        replica, orjson.dumps({"model": "shoal-demo", "prompt": text, "max_tokens": 1})
    )
    assert status == 400
    message = answer["error"]["message"]
    assert "the prompt has at least" in message and "context is 4096 tokens" in message, message
    assert answer["error"]["param"] == "prompt"
    assert time.perf_counter() - began < 5.0  # reading and refusing, no tokenizing
    assert_unmoved(before, during)


async def test_a_token_id_prompt_past_the_context_is_refused_off_the_loop(start_any_replica: StartReplica) -> None:
    replica = await start_any_replica(model="demo", num_speculative_tokens=0)
    body = b'{"model":"shoal-demo","max_tokens":1,"prompt":[' + b"0," * 6_999_999 + b"0]}"  # 14 MB
    status, answer, before, during = await around(replica, body)
    assert status == 400, answer
    assert answer["error"]["param"] == "prompt"
    assert "the prompt has 7000000 tokens; this model's context is 4096 tokens" in answer["error"]["message"]
    assert_unmoved(before, during)


async def test_a_large_prompt_is_tokenized_off_the_loop(start_any_replica: StartReplica) -> None:
    replica = await start_any_replica(model="demo", num_speculative_tokens=0)
    text = "hello world " * (600 * 1024 // 12)  # under the refusal bound: tokenized (some 0.3 s), then too long
    status, answer, before, during = await around(
        replica, orjson.dumps({"model": "shoal-demo", "prompt": text, "max_tokens": 1})
    )
    assert status == 400 and "maximum context length is 4096" in answer["error"]["message"]
    assert_unmoved(before, during)
