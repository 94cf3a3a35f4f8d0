"""`make demo`'s requests on the demo model. The tool-call request gives a valid call of the named tool on the
packaged model and on other builds of it (stand-ins: copies with noise on every weight, decoding greedily and
sampled), and the packaged model's call carries the order number asked for; the Japanese chat gets an answer of its
scenario with its order number; no tool call is parsed from a chat that offered no tools, whatever its text looks
like."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest
import torch

from replica.demo.build import ensure_demo_model
from replica.demo.corpus import TOOLS
from replica.demo.phrasebook import PHRASEBOOKS
from replica.demo.requests import japanese_chat_request, tool_call_request
from replica.engine.engine import EngineConfig, LLMEngine
from replica.grammar.matcher import GrammarCompiler
from replica.model.loader import load_model
from replica.model.model import MoEForCausalLM
from replica.server.protocol import parse_chat
from replica.server.tool_stream import split_tool_calls
from replica.tokenizer import Tokenizer

PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def demo() -> tuple[MoEForCausalLM, Tokenizer]:
    path = ensure_demo_model()
    return load_model(path), Tokenizer.from_file(path / "tokenizer.json")


def other_build(model: MoEForCausalLM, seed: int) -> MoEForCausalLM:
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.3 * p.float().std().to(p.dtype))
    return other


def answer(model: MoEForCausalLM, tokenizer: Tokenizer, body: dict[str, object]) -> tuple[str, bool]:
    grammars = GrammarCompiler(
        tokenizer.to_json(), vocab_size=model.config.vocab_size, eos_token_ids=tokenizer.eos_token_ids
    )
    parsed = parse_chat(body, tokenizer, model="shoal-demo", default_max_tokens=80, grammars=grammars)
    engine = LLMEngine(model, EngineConfig(num_blocks=64), eos_token_ids=tokenizer.eos_token_ids, grammar=grammars)
    engine.add_request(parsed.prompt_token_ids, parsed.params)
    ids: list[int] = []
    while engine.has_work:
        for out in engine.step().outputs:
            ids.extend(out.new_token_ids)
    return tokenizer.decode(ids), parsed.has_tools


@pytest.mark.parametrize("build", [None, 1, 2])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_demo_tool_call_is_a_valid_call_of_the_named_tool(
    demo: tuple[MoEForCausalLM, Tokenizer], build: int | None, temperature: float
) -> None:
    model, tokenizer = demo
    if build is not None:
        model = other_build(model, build)
    body = {**tool_call_request("shoal-demo"), "temperature": temperature, "seed": 3}
    text, has_tools = answer(model, tokenizer, body)
    content, calls = split_tool_calls(text)
    assert has_tools and content is None and len(calls) == 1, text
    assert calls[0]["function"]["name"] == "get_order_status"
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), PARAMETERS["get_order_status"])


def test_the_packaged_demo_model_calls_with_the_asked_order_number(demo: tuple[MoEForCausalLM, Tokenizer]) -> None:
    model, tokenizer = demo
    body = tool_call_request("shoal-demo")
    asked = body["messages"][0]["content"].split()[-1].rstrip("?")
    text, _ = answer(model, tokenizer, body)
    _, calls = split_tool_calls(text)
    assert json.loads(calls[0]["function"]["arguments"]) == {"order_id": asked}, text


def test_the_packaged_demo_model_answers_the_japanese_chat_with_its_order_number(
    demo: tuple[MoEForCausalLM, Tokenizer],
) -> None:
    text, _ = answer(*demo, japanese_chat_request("shoal-demo"))
    (book,) = [book for book in PHRASEBOOKS if book.language == "ja"]
    (scenario,) = [s for s in book.scenarios if s.name == "order_status"]
    # Each reply up to its slot after the order number, with the asked number in it (max_tokens may cut the rest).
    starts = [template.split("{eta}")[0].format(order_id="ORD-30981") for template in scenario.replies]
    assert any(text.startswith(start) for start in starts), text


def test_a_chat_without_tools_never_returns_a_tool_call(demo: tuple[MoEForCausalLM, Tokenizer]) -> None:
    model, tokenizer = demo
    body = {
        "messages": [{"role": "user", "content": "来週の火曜日に打ち合わせの時間をいただけますか。"}],
        "temperature": 0,
    }
    _, has_tools = answer(model, tokenizer, body)
    assert not has_tools  # the server parses calls only when has_tools
    assert not parse_chat(
        {**body, "tools": TOOLS, "tool_choice": "none"}, tokenizer, model="shoal-demo", default_max_tokens=8
    ).has_tools
