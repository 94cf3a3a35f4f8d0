"""Real vLLM servers (its CPU build, on loopback) beside Shoal's replica and behind Shoal's router.

Beside: vLLM and `shoal replica` give the same greedy text for the same prompt token ids on held-out chats of
the demo checkpoint (float32), with speculation off and on; where a token differs, the test shows both engines'
margin between their two best tokens there, which must be a tie.

Behind: the router in exact mode finds each server's ZMQ publisher through its `GET /kv_event_sources`, applies
its 128-token blocks as the router's 16-token ones, and routes chat on the demo model's token ids
(`tokenizer.models`). What vLLM's own counters say is the judge: `vllm:prefix_cache_hits_total` must grow by the
prefixes the router claims to find.
The tests share the module's two servers and run in file order; the last one kills a server.
"""

from __future__ import annotations

import asyncio
import random
import signal
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from autoscaler.observe import RouterClient, static_routers
from replica.demo.corpus import chat_requests
from router.policy.hashing import hash_tokens, namespace_seed
from router.service.app import POOL, ROUTING
from router.service.chat_tokenizer import ChatTokenizer
from router.service.settings import HealthSettings, KVEventSettings, ScrapeSettings, TokenizerSettings
from tests.integration.conftest import ADMIN_TOKEN, RouterHandle, StartRouter, eventually, metric_value
from tests.integration.replica_support import StartReplica
from tests.integration.vllm_support import CHECKPOINT, MODEL, RunningVllm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

NUM_CHATS = 50
HELDOUT_SEED = 20_261_205
"""Chats the demo model never trained on (its corpus is drawn with `replica.demo.corpus.TRAINING_SEED`)."""
MAX_TOKENS = 96
"""Enough for most demo answers to end by themselves, so that few texts are cut inside a character."""
TIE_NATS = 1e-3
"""The most a top-2 logprob gap may be where the two engines part: float32 sums in another order move logits by
~1e-5, so a larger gap is a real disagreement."""

VLLM_BLOCK = 128
"""vLLM's KV block on CPUs, in tokens (its `vllm:cache_config_info`)."""
ROUTER_BLOCK = 16
"""The router's block (`hashing.token_block_size`, its default)."""
NUM_PREFIXES = 6
REPEATS = 4
WORDS = ("order", "invoice", "meeting", "room", "delivery", "supplier", "contract", "budget", "report", "shipment")


def system_prompt(rng: random.Random, num_words: int = 420) -> str:
    """A long system prompt of its own: some 700 tokens of the demo tokenizer, five or more of vLLM's blocks."""
    return f"Policy {rng.randrange(10**9)}: " + " ".join(rng.choice(WORDS) for _ in range(num_words))


def chat_body(system: str, ask: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": ask}],
        "max_tokens": 4,
        "temperature": 0,
    }


async def vllm_counter(http: aiohttp.ClientSession, server: RunningVllm, name: str) -> float:
    async with http.get(server.url + "/metrics") as resp:
        text = await resp.text()
    return metric_value(text, name) or 0.0


SLOW_ANSWER_S = 15.0
"""Probe and scrape timeout: with both engines decoding, each on one of two cores, vLLM's API server answered
`/metrics` in up to 6.8 s (the tests' default of 1 s would leave the router's gauges as they were before the load)."""


async def start_exact_router(start_router: StartRouter, servers: list[RunningVllm], **overrides: Any) -> RouterHandle:
    settings: dict[str, Any] = {
        "health": HealthSettings(interval_s=0.2, unhealthy_interval_s=0.05, timeout_s=SLOW_ANSWER_S),
        "scrape": ScrapeSettings(interval_s=0.2, timeout_s=SLOW_ANSWER_S),
        **overrides,
    }
    router = await start_router(
        replicas=[s.url for s in servers],
        kv_events=KVEventSettings(source="zmq", reconnect_min_s=0.05, reconnect_max_s=0.5),
        tokenizer=TokenizerSettings(models={MODEL: CHECKPOINT}),
        num_ready=len(servers),
        **settings,
    )
    await eventually(
        lambda: all(r.has_live_kv_events for r in router.app[POOL]),
        timeout_s=30,
        what="every vLLM's KV-event stream in sync",
    )
    return router


async def send_repeats(
    router: RouterHandle, prompts: list[str], rng: random.Random, first: dict[str, str] | None = None
) -> tuple[dict[str, str], int, int]:
    """Each prompt once (unless `first` says where it went), then `REPEATS` times with new asks, one after another.
    Returns (the replica of each prompt's first request, repeats that landed there, repeats)."""
    first = dict(first or {})
    for prompt in prompts:
        if prompt not in first:
            reply = await router.request("POST", "/v1/chat/completions", json_body=chat_body(prompt, "hello"))
            assert reply.status == 200, reply.body
            assert reply.replica is not None
            first[prompt] = reply.replica
    landed = total = 0
    for _ in range(REPEATS):
        for prompt in prompts:
            ask = f"question {rng.randrange(10**6)}"
            reply = await router.request("POST", "/v1/chat/completions", json_body=chat_body(prompt, ask), timeout_s=60)
            assert reply.status == 200, reply.body
            total += 1
            landed += reply.replica == first[prompt]
    return first, landed, total


@pytest.fixture
def prompts() -> list[str]:
    rng = random.Random(32)
    return [system_prompt(rng) for _ in range(NUM_PREFIXES)]


async def greedy(http: aiohttp.ClientSession, url: str, ids: list[int]) -> tuple[str, list[dict[str, float]]]:
    body = {"model": MODEL, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 2}
    async with http.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)) as resp:
        assert resp.status == 200, await resp.text()
        choice = (await resp.json())["choices"][0]
    return choice["text"], choice["logprobs"]["top_logprobs"]


def is_same_text(a: str, b: str) -> bool:
    """Equal, or equal but for the end of an answer cut by max_tokens inside a character: there vLLM holds back the
    pending token's bytes (and may hold the character before it), where Shoal's replica shows U+FFFD."""
    if a == b:
        return True
    a, b = a.rstrip("\ufffd"), b.rstrip("\ufffd")
    short, long = sorted((a, b), key=len)
    return long.startswith(short) and len(long) - len(short) <= 2


def margin(top: dict[str, float]) -> float:
    best = sorted(top.values(), reverse=True)
    return best[0] - best[1] if len(best) > 1 else float("inf")


def test_a_vllm_whose_port_was_taken_starts_again_on_fresh_ports(vllm_servers: list[RunningVllm]) -> None:
    first, second = vllm_servers
    assert first.server.port == first.first_port  # nothing in its way: started once
    assert second.server.port != second.first_port  # its replay port was held: started again elsewhere
    first_log = second.log.with_name(f"vllm-{second.first_port}.log").read_text(errors="replace").lower()
    assert "address already in use" in first_log
    assert second.is_running()


@pytest.mark.parametrize("num_speculative_tokens", [0, None], ids=["speculation_off", "speculation_default"])
async def test_vllm_and_shoal_replica_give_the_same_greedy_text(
    vllm_servers: list[RunningVllm],
    start_any_replica: StartReplica,
    http: aiohttp.ClientSession,
    num_speculative_tokens: int | None,
) -> None:
    replica = await start_any_replica(model=str(CHECKPOINT), num_speculative_tokens=num_speculative_tokens)
    tokenizer = ChatTokenizer.from_dir(CHECKPOINT)
    chats = chat_requests(NUM_CHATS, seed=HELDOUT_SEED)
    same, parted = 0, []
    for chat in chats:
        ids = tokenizer.chat_ids(chat)
        (vllm_text, vllm_top), (shoal_text, shoal_top) = await asyncio.gather(
            greedy(http, vllm_servers[0].url, ids), greedy(http, replica.url, ids)
        )
        if is_same_text(vllm_text, shoal_text):
            same += 1
            continue
        # The first position where the two engines' chosen tokens differ: both must see a tie there.
        at = next(
            i
            for i, (a, b) in enumerate(zip(vllm_top, shoal_top, strict=False))
            if max(a, key=a.get) != max(b, key=b.get)
        )
        parted.append((at, margin(vllm_top[at]), margin(shoal_top[at]), vllm_text, shoal_text))
    print(
        f"same greedy text on {same} of {len(chats)} held-out chats; parted at: {[(p[0], p[1], p[2]) for p in parted]}"
    )
    for at, vllm_margin, shoal_margin, vllm_text, shoal_text in parted:
        assert max(vllm_margin, shoal_margin) <= TIE_NATS, (
            f"the engines part at token {at} with top-2 gaps {vllm_margin:.2e} (vLLM) and {shoal_margin:.2e} "
            f"(Shoal), not a tie:\n  vLLM:  {vllm_text!r}\n  Shoal: {shoal_text!r}"
        )


async def test_the_router_finds_each_vllm_publisher_and_routes_prefixes_where_vllm_caches_them(
    vllm_servers: list[RunningVllm], start_router: StartRouter, http: aiohttp.ClientSession, prompts: list[str]
) -> None:
    router = await start_exact_router(start_router, vllm_servers)
    hits_before = [await vllm_counter(http, s, "vllm:prefix_cache_hits_total") for s in vllm_servers]

    first, landed, total = await send_repeats(router, prompts, random.Random(1))
    assert len(set(first.values())) == 2, f"cold prefixes should spread over both replicas: {first}"
    assert landed >= 0.95 * total, f"{landed} of {total} repeats landed where their prefix is cached"

    # vLLM's own word: every repeat found at least the prompt's whole 128-token blocks but the last in its cache.
    hits_after = [await vllm_counter(http, s, "vllm:prefix_cache_hits_total") for s in vllm_servers]
    hits = sum(hits_after) - sum(hits_before)
    tokenizer = ChatTokenizer.from_dir(CHECKPOINT)
    min_cached = sum(
        (len(tokenizer.chat_ids(chat_body(p, "question"))) // VLLM_BLOCK - 1) * VLLM_BLOCK for p in prompts
    )
    print(f"repeats where their prefix is: {landed}/{total}; vLLM cache hits {hits:.0f} tokens")
    assert hits >= 0.95 * REPEATS * min_cached, (
        f"vLLM counted {hits:.0f} cached tokens, expected {min_cached * REPEATS}"
    )
    assert router.app[ROUTING].index.stats().events_applied > 0


async def test_a_restarted_router_replays_what_vllm_holds_and_routes_the_same(
    vllm_servers: list[RunningVllm], start_router: StartRouter, prompts: list[str]
) -> None:
    first_router = await start_exact_router(start_router, vllm_servers)
    first, _, _ = await send_repeats(first_router, prompts, random.Random(2))
    await first_router.cleanup()

    # A new router knows nothing of its own: vLLM's replay buffers are its only source, and before any request
    # its index holds each prompt's whole 128-token blocks on the replica that cached them.
    router = await start_exact_router(start_router, vllm_servers)
    index, tokenizer = router.app[ROUTING].index, ChatTokenizer.from_dir(CHECKPOINT)
    for prompt in prompts:
        hashes = hash_tokens(tokenizer.chat_ids(chat_body(prompt, "hello")), namespace_seed(MODEL), ROUTER_BLOCK)
        full_blocks = len(hashes) // (VLLM_BLOCK // ROUTER_BLOCK) * (VLLM_BLOCK // ROUTER_BLOCK)
        held = index.match(hashes, now=asyncio.get_running_loop().time())
        assert held.get(first[prompt], 0) >= full_blocks > 0, (held, first[prompt], full_blocks)
    _, landed, total = await send_repeats(router, prompts, random.Random(3), first=first)
    print(f"after a router restart, repeats where their prefix is: {landed}/{total}")
    assert landed >= 0.9 * total, f"after the restart {landed} of {total} repeats landed where their prefix is cached"


async def test_the_autoscaler_reads_the_vllm_queue_through_the_router(
    vllm_servers: list[RunningVllm], start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    router = await start_exact_router(start_router, vllm_servers)
    router_client = RouterClient(
        http, static_routers([router.url]), admin_token=ADMIN_TOKEN, clock=asyncio.get_running_loop().time
    )
    # Twelve requests are three times both servers' 4 sequences: some wait in vLLM's queue while the first four
    # on each decode. With 1,000 tokens they waited 8-10 s here (polling vLLM's /metrics), with 200 only 1.7-2.5 s,
    # which once ended before the router's scrape read it in CI.
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1000, "ignore_eos": True}
    load = [
        asyncio.ensure_future(router.request("POST", "/v1/completions", json_body=body, timeout_s=180))
        for _ in range(12)
    ]
    seen: list[list[int | None]] = []  # each reading's engine_waiting per listed replica, for the failure message
    try:

        async def engines_queue() -> bool:
            reading = await router_client.observe()
            listed = reading.listed.get(router.url, {})
            waiting = [r.engine_waiting for r in listed.values()]
            seen.append(waiting)
            return len(listed) == 2 and all(w is not None for w in waiting) and sum(w or 0 for w in waiting) > 0

        await eventually(
            engines_queue,
            timeout_s=60,
            interval_s=0.2,
            what="vLLM's queued requests in the view",
            detail=lambda: f"engine_waiting per reading: {seen}",
        )
    finally:
        replies = await asyncio.gather(*load)
    assert all(r.status == 200 for r in replies)


async def test_a_vllm_killed_mid_run_loses_no_request_that_had_not_started(
    vllm_servers: list[RunningVllm], start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    router = await start_exact_router(start_router, vllm_servers)
    # The victim is the vLLM the router has the most of this test's requests in flight to, once that vLLM runs
    # some. A victim named in advance was sometimes sent none of the 8. Long answers (2,500 tokens, some 35 s at
    # vLLM's pace here) keep them running past the kill.
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2500, "ignore_eos": True}
    started = asyncio.get_running_loop().time()
    load = [
        asyncio.ensure_future(router.request("POST", "/v1/completions", json_body=body, timeout_s=180))
        for _ in range(8)
    ]
    by_id = {server.url.removeprefix("http://"): server for server in vllm_servers}  # the router's replica ids
    chosen: list[RunningVllm] = []
    seen: list[float] = []  # the victim's running requests when it was chosen

    async def in_flight_and_running() -> bool:
        in_flight = {
            s.labels["replica"]: s.value
            for f in text_string_to_metric_families(await router.metrics())
            for s in f.samples
            if s.name == "shoal_router_replica_in_flight"
        }
        busiest = max(in_flight, key=lambda url: in_flight[url], default=None)
        if busiest is None or in_flight[busiest] < 1 or busiest not in by_id:
            return False
        running = await vllm_counter(http, by_id[busiest], "vllm:num_requests_running")
        if running > 0:
            chosen.append(by_id[busiest])
            seen.append(running)
            return True
        return False

    await eventually(in_flight_and_running, timeout_s=60, what="this test's requests running on a vLLM")
    victim = chosen[0]
    (survivor,) = [server for server in vllm_servers if server is not victim]
    victim.proc.send_signal(signal.SIGKILL)  # the API server; its engine follows it
    killed_after_s = asyncio.get_running_loop().time() - started
    assert await asyncio.to_thread(victim.proc.wait, 30) == -signal.SIGKILL  # the router's loop keeps running
    replies = await asyncio.gather(*load)
    # No byte of an unstreamed reply reaches the client before it is complete: every request is retried elsewhere.
    assert [r.status for r in replies] == [200] * 8
    retried = [
        s.value
        for f in text_string_to_metric_families(await router.metrics())
        for s in f.samples
        if s.name == "shoal_router_retries_total"
    ]
    assert sum(retried) > 0, (
        f"no request was retried: {victim.url} was killed {killed_after_s:.1f} s after the load started, "
        f"running {seen[0]:.0f} requests a moment before"
    )
    assert survivor.is_running()
