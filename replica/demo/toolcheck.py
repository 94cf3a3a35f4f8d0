"""How well a demo checkpoint writes tool calls: prompts cut from unseen tool conversations, scored by structure.

Each prompt is a tool conversation of the corpus (from a seed that is neither the training nor the calibration
seed) cut right after the user's ask that the corpus answers with a call, so the expected call is known. A
completion is scored, cumulatively: it holds a `<tool_call>` block; the block is JSON with a string `name` and an
object `arguments`; the name is the expected function; the arguments fit that function's schema in `TOOLS`
(required names present, no unknown names, JSON types right); and the arguments equal the expected ones.

Stdlib only here; `score_completions` runs on text, `check_tool_calls` drives an engine (torch) to make it.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any

from replica.demo.corpus import TOOLS, generate_conversations, uses_tools

CHECK_SEED = 7_777
"""Neither `TRAINING_SEED` nor `CALIBRATION_SEED`: the prompts are conversations the model never saw."""
LEVELS = ("call", "json", "name", "schema", "exact")

_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "array": (list,),
    "object": (dict,),
}
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolPrompt:
    messages: list[dict[str, Any]]
    name: str
    arguments: dict[str, Any]


def tool_prompts(num_prompts: int, *, seed: int = CHECK_SEED) -> list[ToolPrompt]:
    """`num_prompts` prompts, half Japanese and half English, each ending at a user ask answered by a call."""
    prompts: list[ToolPrompt] = []
    for conversation in generate_conversations(num_prompts, seed=seed, tool_fraction=1.0):
        assert uses_tools(conversation)
        index = next(i for i, m in enumerate(conversation) if m.get("tool_calls"))
        call = conversation[index]["tool_calls"][0]["function"]
        prompts.append(ToolPrompt(conversation[:index], call["name"], json.loads(call["arguments"])))
    random.Random(seed).shuffle(prompts)
    return prompts


def _fits_schema(value: Any, schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    if kind is None:
        return True
    if not isinstance(value, _TYPES[kind]) or (kind in ("integer", "number") and isinstance(value, bool)):
        return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    if isinstance(value, list):
        return all(_fits_schema(item, schema.get("items", {})) for item in value)
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        if any(name not in properties for name in value):
            return False
        if any(name not in value for name in schema.get("required", [])):
            return False
        return all(_fits_schema(value[name], properties[name]) for name in value)
    return True


def score(text: str, prompt: ToolPrompt) -> str | None:
    """The last level of `LEVELS` the completion reaches, or None if it holds no tool call."""
    match = _BLOCK.search(text)
    if match is None:
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError:
        return "call"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return "call"
    if not isinstance(call.get("arguments"), dict):
        return "call"
    if call["name"] != prompt.name:
        return "json"
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == prompt.name)
    if not _fits_schema(call["arguments"], schema):
        return "name"
    return "exact" if call["arguments"] == prompt.arguments else "schema"


def rates(levels: list[str | None]) -> dict[str, float]:
    """Fraction of completions that reach each level (reaching one means reaching every level before it)."""
    reached = {level: 0 for level in LEVELS}
    for got in levels:
        if got is not None:
            for level in LEVELS[: LEVELS.index(got) + 1]:
                reached[level] += 1
    return {level: count / max(len(levels), 1) for level, count in reached.items()}


def check_tool_calls(
    model: Any, tokenizer: Any, prompts: list[ToolPrompt], *, temperature: float, max_tokens: int = 160
) -> tuple[list[str | None], list[str]]:
    """Generate one completion per prompt (batched in one engine) -> (level reached, completion text)."""
    from replica.engine.engine import EngineConfig, LLMEngine
    from replica.engine.sampling import SamplingParams

    engine = LLMEngine(
        model,
        EngineConfig(num_blocks=4096, max_num_seqs=64, max_num_batched_tokens=4096),
        eos_token_ids=tokenizer.eos_token_ids,
    )
    end = tokenizer.token_to_id("</tool_call>")
    ids = []
    for i, prompt in enumerate(prompts):
        text = tokenizer.apply_chat_template(prompt.messages, tools=TOOLS)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, stop_token_ids=frozenset({end}))
        ids.append(engine.add_request(tokenizer.encode(text), params))
    outputs: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_work:
        for out in engine.step().outputs:
            outputs[out.seq_id].extend(out.new_token_ids)
    texts = [tokenizer.decode(outputs[i]) for i in ids]
    return [score(t, p) for t, p in zip(texts, prompts, strict=True)], texts
