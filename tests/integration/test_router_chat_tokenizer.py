"""Exact mode for chat: a router holding the demo model's tokenizer and chat template, in front of two real Shoal
replicas that publish KV events, hashes a chat on the token ids the replica prefilled, so the replica's `stored`
events name the chat's blocks and the router sends the conversation back to it. Without the tokenizer the router
hashes routing text, which no event names. Clients are the official openai package."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest

from router.policy.hashing import hash_tokens, namespace_seed
from router.service.app import ROUTING, TOKENIZERS
from router.service.settings import KVEventSettings, TokenizerSettings
from tests.integration.conftest import MODEL, RouterHandle, StartRouter, eventually, metric_value
from tests.integration.replica_support import ReplicaHandle, StartReplica

pytestmark = pytest.mark.integration

SEED = namespace_seed(MODEL)
BLOCK = 16
SYSTEM = (
    "You are the business assistant of Shoal Trading Co., Ltd. Answer in the language of the user, and use the "
    "tools to look up orders, inventory and invoices instead of guessing. 見積書の有効期限は発行日から三十日間です。 "
) * 12
TURN1: list[dict[str, Any]] = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is the validity period of a quotation?"},
]


def rid(handle: ReplicaHandle) -> str:
    return handle.url.removeprefix("http://")


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def cached_blocks(replica: ReplicaHandle, token_ids: list[int]) -> int:
    """Leading blocks of `token_ids` the replica's prefix cache holds."""
    cached = replica.state.engine.engine.block_manager.hash_to_block
    depth = 0
    for h in hash_tokens(token_ids, SEED, BLOCK):
        if h not in cached:
            break
        depth += 1
    return depth


def indexed_blocks(router: RouterHandle, replica: ReplicaHandle, token_ids: list[int]) -> int:
    """Leading blocks of `token_ids` the router's index holds for the replica by its KV events alone (guesses
    have expired this far ahead)."""
    now = asyncio.get_running_loop().time() + 10_000.0
    return router.app[ROUTING].index.match(hash_tokens(token_ids, SEED, BLOCK), now=now).get(rid(replica), 0)


async def serve_directly(replica: ReplicaHandle, messages: list[dict[str, Any]]) -> str:
    """One chat answered by the replica itself, out of the router's sight: only its KV events tell the router."""
    async with client(replica.url) as c:
        reply = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    return reply.choices[0].message.content or ""


async def start_pair(
    start_replica: StartReplica, start_router: StartRouter, tokenizer: TokenizerSettings | None
) -> tuple[RouterHandle, list[ReplicaHandle]]:
    replicas = [await start_replica(), await start_replica()]
    overrides: dict[str, Any] = {"kv_events": KVEventSettings(source="sse", reconnect_min_s=0.05)}
    if tokenizer is not None:
        overrides["tokenizer"] = tokenizer
    router = await start_router(replicas, **overrides)  # type: ignore[arg-type]
    await eventually(lambda: sum(r.has_live_kv_events for r in router.app[ROUTING].pool) == 2, timeout_s=10)
    return router, replicas


def prompt_ids(replica: ReplicaHandle, messages: list[dict[str, Any]]) -> list[int]:
    """The ids the replica prefills for a chat, by its own tokenizer: what its KV events name."""
    tokenizer = replica.state.tokenizer
    ids: list[int] = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return ids


@pytest.mark.parametrize("has_tokenizer", [True, False], ids=["tokenizer", "text"])
async def test_a_chat_served_once_is_a_hit_on_the_replica_that_holds_it(
    start_replica: StartReplica, start_router: StartRouter, tiny_checkpoint: Path, has_tokenizer: bool
) -> None:
    # off_loop_min_bytes=0: every chat is tokenized on a worker thread (the rejection test below keeps the loop).
    tokenizer = TokenizerSettings(models={MODEL: tiny_checkpoint}, off_loop_min_bytes=0) if has_tokenizer else None
    router, replicas = await start_pair(start_replica, start_router, tokenizer)
    holder = replicas[1]
    answer = await serve_directly(holder, TURN1)
    turn1_ids = prompt_ids(holder, TURN1)
    num_blocks = len(turn1_ids) // BLOCK
    assert num_blocks >= 40 and cached_blocks(holder, turn1_ids) == num_blocks
    await eventually(lambda: indexed_blocks(router, holder, turn1_ids) == num_blocks, what="the stored events")
    if has_tokenizer:
        assert router.app[TOKENIZERS][MODEL].chat_ids({"messages": TURN1}) == turn1_ids

    turn2 = [*TURN1, {"role": "assistant", "content": answer}, {"role": "user", "content": "ありがとうございます"}]
    async with client(router.url) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=turn2,  # type: ignore[arg-type]
            max_tokens=2,
            temperature=0,
        )
    reply = raw.parse()
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    if has_tokenizer:
        assert (raw.headers["x-shoal-replica"], raw.headers["x-shoal-route-branch"]) == (rid(holder), "cache_hit")
        assert (reply.usage.prompt_tokens_details.cached_tokens or 0) >= num_blocks * BLOCK
    else:  # routing text: no event names its blocks, so the router cannot see that the holder has them
        assert raw.headers["x-shoal-route-branch"] == "cache_miss"


async def test_a_chat_the_template_rejects_still_routes_and_is_counted(
    start_replica: StartReplica, start_router: StartRouter, tiny_checkpoint: Path
) -> None:
    router, _ = await start_pair(start_replica, start_router, TokenizerSettings(models={MODEL: tiny_checkpoint}))
    reply = await router.chat([{"role": "robot", "content": "hello"}], max_tokens=1)
    assert reply.status == 400 and reply.replica is not None  # routed on text; the replica's own answer
    text = await router.metrics()
    assert metric_value(text, "shoal_router_tokenize_fallbacks_total", {"reason": "template_error"}) == 1


async def test_an_oversized_chat_routes_on_text_and_is_counted(
    start_replica: StartReplica, start_router: StartRouter, tiny_checkpoint: Path
) -> None:
    tokenizer = TokenizerSettings(models={MODEL: tiny_checkpoint}, max_request_bytes=256)
    router, _ = await start_pair(start_replica, start_router, tokenizer)
    reply = await router.chat(TURN1, max_tokens=1)
    assert reply.status == 200 and reply.replica is not None
    text = await router.metrics()
    assert metric_value(text, "shoal_router_tokenize_fallbacks_total", {"reason": "oversized"}) == 1
    assert metric_value(text, "shoal_router_tokenize_fallbacks_total", {"reason": "template_error"}) is None
