"""Bodies parsed in the child process route exactly as bodies parsed on the loop, and a dead child costs one request."""

from __future__ import annotations

import multiprocessing
import os
import signal

import orjson
import pytest

from router.common.body_process import BodyProcessDied
from router.policy.estimated_ttft import EstimatedTTFT, EstimatedTTFTConfig
from router.policy.prefix_index import PrefixIndex, PrefixIndexConfig
from router.policy.routing_core import RoutingConfig, RoutingCore
from router.service.body_parser import BodyParser, ParsedBody, Refusal, parse_body, parse_summary

MAX_BLOCKS = 64
CONFIG = RoutingConfig(max_blocks=MAX_BLOCKS, memo_entries=0)
MAX_TEXT = MAX_BLOCKS * CONFIG.text_block_size
MAX_IDS = MAX_BLOCKS * CONFIG.token_block_size

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def body(**fields: object) -> bytes:
    return orjson.dumps({"model": "m", "max_tokens": 7, **fields})


tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
BODIES = {
    "short text": (COMPLETIONS, body(prompt="hello world " * 20)),
    "long text": (COMPLETIONS, body(prompt="x" * (3 * MAX_TEXT + 5))),
    "text just past the head": (COMPLETIONS, body(prompt="y" * (MAX_TEXT + 1))),
    "long token ids": (COMPLETIONS, body(prompt=list(range(5 * MAX_IDS + 3)))),
    "token ids of zeros": (COMPLETIONS, body(prompt=[0] * (2 * MAX_IDS))),
    "a batch of id lists": (COMPLETIONS, body(prompt=[list(range(3 * MAX_IDS)), [1, 2]])),
    "a batch of strings": (COMPLETIONS, body(prompt=["z" * (2 * MAX_TEXT), "b"])),
    "long chat": (CHAT, body(messages=[{"role": "user", "content": "w" * (4 * MAX_TEXT)}], tools=[tool] * 300)),
    "max_completion_tokens": (
        CHAT,
        orjson.dumps({"max_completion_tokens": 3, "messages": [{"role": "user", "content": "v" * 300}]}),
    ),
}
REFUSED = {
    "not json": (COMPLETIONS, b"{nope"),
    "an array": (CHAT, b"[1]"),
    "a bool among ids": (COMPLETIONS, body(prompt=[0, 1, True] * MAX_IDS)),
    "no messages": (CHAT, body()),
    "nested too deeply": (CHAT, b'{"messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
}


def core() -> RoutingCore:
    return RoutingCore(CONFIG, PrefixIndex(PrefixIndexConfig()), EstimatedTTFT(EstimatedTTFTConfig()))


@pytest.mark.parametrize("name", list(BODIES))
def test_a_summary_routes_as_the_whole_body(name: str) -> None:
    path, raw = BODIES[name]
    whole, summary = parse_body(path, raw), parse_summary(raw, path, MAX_TEXT, MAX_IDS)
    assert isinstance(whole, ParsedBody) and isinstance(summary, ParsedBody)
    assert whole.key is not None and summary.key is not None
    assert summary.body == {
        k: whole.body[k] for k in ("model", "max_tokens", "max_completion_tokens") if k in whole.body
    }
    assert summary.is_whole is False and len(orjson.dumps(summary.body)) < 100
    assert (summary.key.is_tokens, summary.key.length) == (whole.key.is_tokens, whole.key.length)
    expected, got = core().prepare(whole.key, "m"), core().prepare(summary.key, "m")
    assert got.complete() == expected.complete() and len(expected.complete()) > 0
    assert (got.prompt_tokens, got.num_blocks) == (expected.prompt_tokens, expected.num_blocks)


def test_a_head_shorter_than_the_hashed_prefix_would_route_differently() -> None:
    """The negative control: cut one block short, the summary's hashes differ, so the test above can fail."""
    path, raw = BODIES["long token ids"]
    whole, short = parse_body(path, raw), parse_summary(raw, path, MAX_TEXT, MAX_IDS - CONFIG.token_block_size)
    assert isinstance(whole, ParsedBody) and isinstance(short, ParsedBody)
    assert whole.key is not None and short.key is not None
    assert core().prepare(short.key, "m").complete() != core().prepare(whole.key, "m").complete()


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_summary_refuses_what_the_loop_refuses(name: str) -> None:
    path, raw = REFUSED[name]
    refusal = parse_body(path, raw)
    assert isinstance(refusal, Refusal)
    assert parse_summary(raw, path, MAX_TEXT, MAX_IDS) == refusal


async def test_large_bodies_go_to_the_child_and_small_ones_stay_here() -> None:
    parser = BodyParser(1024, MAX_TEXT, MAX_IDS)
    try:
        small = await parser.parse(COMPLETIONS, body(prompt="hi"))
        large = await parser.parse(*BODIES["long token ids"])
        refused = await parser.parse(COMPLETIONS, body(prompt=[0, True] * 1000))
    finally:
        parser.close()
    assert isinstance(small, ParsedBody) and small.is_whole
    assert isinstance(large, ParsedBody) and not large.is_whole
    assert large.key is not None and large.key.length == 5 * MAX_IDS + 3
    assert isinstance(refused, Refusal) and refused.param == "prompt"


async def test_a_child_that_dies_fails_its_request_and_the_next_one_gets_a_new_child() -> None:
    parser = BodyParser(0, MAX_TEXT, MAX_IDS)
    path, raw = BODIES["long chat"]
    try:
        assert isinstance(await parser.parse(path, raw), ParsedBody)
        (child,) = multiprocessing.active_children()
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)
        with pytest.raises(BodyProcessDied):
            await parser.parse(path, raw)
        again = await parser.parse(path, raw)
    finally:
        parser.close()
    assert isinstance(again, ParsedBody) and again.key is not None
