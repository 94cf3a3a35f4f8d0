"""A hot prefix in front of batch-slot-bound engines: estimated_ttft spreads it as well as round robin does.

Four fake replicas serve 4 requests at once each, with a fixed per-request time and a short decode, so their
latency is set by the queue for slots, not by prefill tokens: every request is a cheap cache hit by prefill
arithmetic. 32 clients send one hot prefix (bounded in count and time): a warm-up round the measure leaves out, so
that the router has seen requests finish and scraped a queue once, then the measured round. The busiest replica's
share must stay at most 60% and the TTFT p99 at most 2x round robin's on the same kind of fakes: fakes that export
their limit (as SGLang and Shoal's replica do), and vLLM-like fakes that do not, in front of a router that infers it
from scrapes (`scrape.infer_max_num_seqs`).

Router, fakes and clients share this process's event loop, so a pause of the whole process lands on dozens of
requests at once, and the p99 of one round is the second-slowest of 192. A full collection of a heap as large as
earlier tests leave is such a pause (0.33 s with 3 million objects on it, against slot times of 0.1 s; p99 2.7x
round robin's): the test pauses the collector while it measures (`latency.collector_paused`); `shoal router`
freezes its own heap after start-up (`router.common.heap`).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.policy.config import EstimatedTTFTConfig, RoundRobinConfig
from router.service.settings import ScrapeSettings
from tests.fakes import FakeReplica
from tests.integration.conftest import LONG_PREFIX_BYTES, StartFakes, StartRouter, unique_text
from tests.integration.latency import collector_paused

pytestmark = pytest.mark.integration

CONCURRENCY = 32
WARMUP_REQUESTS = 64
MEASURED_REQUESTS = 192
RUN_TIMEOUT_S = 20.0
SLOT_BOUND = {
    "max_num_running": 4,
    "exports_batch_limit": True,
    "first_byte_delay_s": 0.04,
    "per_token_delay_s": 0.008,
    "num_output_tokens": 8,
    "prefill_s_per_token": 2e-5,
}
"""A request holds a slot ~0.1 s (0.04 fixed + 8 x 8 ms decode), its cold 1k-token prefix adds 20 ms."""


@pytest.fixture
def paused_collector() -> Iterator[None]:
    """No garbage collection while this test times requests (`collector_paused`)."""
    with collector_paused():
        yield


async def hot_prefix_round(client: openai.AsyncOpenAI, system: str, num_requests: int, tag: str) -> list[float]:
    """TTFT of each of `num_requests` streamed chats on the hot prefix, `CONCURRENCY` at a time."""
    ttfts: list[float] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(num_requests):
        queue.put_nowait(i)

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            started = time.perf_counter()
            stream = await client.chat.completions.create(
                model="shoal-demo",
                messages=[{"role": "system", "content": system}, {"role": "user", "content": f"{tag} question {i}"}],
                stream=True,
            )
            first: float | None = None
            async for _ in stream:
                if first is None:
                    first = time.perf_counter() - started
            assert first is not None
            ttfts.append(first)

    async with asyncio.timeout(RUN_TIMEOUT_S):
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return ttfts


async def run_policy(
    start_fakes: StartFakes,
    start_router: StartRouter,
    policy: Any,
    fake_config: dict[str, Any] = SLOT_BOUND,
    **router_settings: Any,
) -> tuple[float, float, float]:
    """(busiest replica's share, TTFT p99 s) of the measured round under `policy`, and the requests of both rounds
    that left the cached replica for its slot queue (branch spill_queue)."""
    fakes: list[FakeReplica] = await start_fakes(4, **fake_config)
    router = await start_router(fakes, policy=policy, **router_settings)
    system = unique_text(LONG_PREFIX_BYTES, "hot prefix")
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="sk-test", max_retries=0, timeout=10) as client:
        await hot_prefix_round(client, system, WARMUP_REQUESTS, "warm-up")
        before = [f.completed for f in fakes]
        ttfts = await hot_prefix_round(client, system, MEASURED_REQUESTS, "measured")
    served = [f.completed - b for f, b in zip(fakes, before, strict=True)]
    assert sum(served) == MEASURED_REQUESTS
    p99 = statistics.quantiles(ttfts, n=100, method="inclusive")[98]
    spills = sum(
        sample.value
        for family in text_string_to_metric_families(await router.metrics())
        for sample in family.samples
        if sample.name == "shoal_router_requests_total" and sample.labels.get("branch") == "spill_queue"
    )
    return max(served) / MEASURED_REQUESTS, p99, spills


async def test_a_hot_prefix_spreads_over_batch_slot_bound_replicas(
    paused_collector: None, start_fakes: StartFakes, start_router: StartRouter
) -> None:
    rr_share, rr_p99, _ = await run_policy(start_fakes, start_router, RoundRobinConfig())
    share, p99, spills = await run_policy(start_fakes, start_router, EstimatedTTFTConfig())
    print(f"round_robin: busiest share {rr_share:.2f}, TTFT p99 {rr_p99:.3f} s")
    print(f"estimated_ttft: busiest share {share:.2f}, TTFT p99 {p99:.3f} s, spill_queue {spills:.0f}")
    assert share <= 0.60
    assert p99 <= 2.0 * rr_p99
    assert spills >= 1  # the hot prefix left its first replica because of its queue, and says so


async def test_a_batch_limit_inferred_from_scrapes_spreads_a_hot_prefix_over_engines_that_export_none(
    paused_collector: None, start_fakes: StartFakes, start_router: StartRouter
) -> None:
    vllm_like = {**SLOT_BOUND, "exports_batch_limit": False}
    blind = ScrapeSettings(interval_s=0.2, timeout_s=1.0, infer_max_num_seqs=False)
    rr_share, rr_p99, _ = await run_policy(start_fakes, start_router, RoundRobinConfig(), vllm_like)
    blind_share, blind_p99, _ = await run_policy(
        start_fakes, start_router, EstimatedTTFTConfig(), vllm_like, scrape=blind
    )
    share, p99, spills = await run_policy(start_fakes, start_router, EstimatedTTFTConfig(), vllm_like)
    print(f"round_robin: busiest share {rr_share:.2f}, TTFT p99 {rr_p99:.3f} s")
    print(f"estimated_ttft, limit unknown: busiest share {blind_share:.2f}, TTFT p99 {blind_p99:.3f} s")
    print(f"estimated_ttft, limit inferred: busiest share {share:.2f}, TTFT p99 {p99:.3f} s, spill_queue {spills:.0f}")
    assert blind_share > 0.60  # the same fakes, the limit unknown: it is the inference that spreads the prefix
    assert share <= 0.60
    assert p99 <= 2.0 * rr_p99
    assert spills >= 1
