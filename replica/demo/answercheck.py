"""How well a demo checkpoint answers: held-out chats cut after a user turn, each answer judged by what it reaches.

The prompts are conversations of the corpus generator from a seed of their own (`HELDOUT_SEED`, none of the
training, calibration, traffic or tool-check seeds), each cut after one of its user turns, so the generator knows
what was asked there: the language, the scenario and the slot values the user gave. An answer reaches, each level
on top of the one before (`LEVELS`):

- "ended": it ended by itself (EOS or a stop token), not at `max_tokens`;
- "language": it is in the asked language: a Japanese answer holds Japanese script (kana or kanji), an English one
  none (for a tool call: the text before the call, if any);
- "scenario": it answers the asked scenario, in one of two ways:
  - a plain reply: the text is one of the scenario's reply templates (the closing exchange: one of the welcomes)
    with its slots filled by any one-line values;
  - a tool call, where the corpus could answer with one (tools offered, none called yet in the conversation, and
    the scenario has a tool): `toolcheck` level "schema" or better, i.e. a call of the scenario's tool whose
    arguments fit its schema (this is "complete" too);
- "complete": the reply's slots that the user's ask gave hold the ask's values (an order number, a date, a
  product, copied right); slots the ask did not give (a delivery date, a total) may hold any value, since the
  corpus draws them too.

Stdlib only here; `judge` runs on text, `check_answers` drives an engine (torch) to make it.
"""

from __future__ import annotations

import json
import random
import re
import string
from dataclasses import dataclass
from typing import Any

from replica.demo.corpus import CLOSING, TOOLS, Exchange, Message, generate_annotated_conversations, uses_tools
from replica.demo.phrasebook import PHRASEBOOKS, Situation
from replica.demo.toolcheck import LEVELS as TOOL_CALL_LEVELS
from replica.demo.toolcheck import ToolPrompt
from replica.demo.toolcheck import score as score_tool_call

HELDOUT_SEED = 31_415
"""Neither the training, calibration, traffic (drafter) nor tool-check seed: chats the model never saw."""

_JAPANESE = re.compile(r"[\u3040-\u30ff\u4e00-\u9fff]")
_TOOL_CALL = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)
_SCENARIOS: dict[tuple[str, str], Situation] = {
    (book.language, scenario.name): scenario for book in PHRASEBOOKS for scenario in book.scenarios
}
_WELCOMES = {book.language: book.welcomes for book in PHRASEBOOKS}


@dataclass(frozen=True)
class AnswerPrompt:
    messages: list[Message]
    tools: list[dict[str, Any]] | None
    exchange: Exchange
    """The exchange whose ask ends `messages`."""
    reference: str
    """What the corpus answered, as the model writes it (a call as a `<tool_call>` block after its preamble)."""

    @property
    def tool(self) -> str | None:
        """The tool the answer may call, or None where the corpus would only reply in plain text."""
        if self.tools is None or self.exchange.scenario == CLOSING:
            return None
        if any(message.get("tool_calls") for message in self.messages):
            return None
        return _SCENARIOS[self.exchange.language, self.exchange.scenario].tool


LEVELS = ("ended", "language", "scenario", "complete")
"""What an answer reaches, each level on top of the one before: it ended by itself; in the asked language; an
answer of the asked scenario (one of its replies with any values, or a valid call of its tool); with the ask's
values copied."""


@dataclass(frozen=True)
class Verdict:
    level: str | None
    """The last of `LEVELS` the answer reaches (None: it did not end by itself)."""
    reason: str
    """"complete", or the first requirement the answer misses."""
    wrong_slots: tuple[str, ...] = ()
    """At level "scenario": the asked slots whose values the answer did not copy (as `reason` lists them)."""

    @property
    def is_complete(self) -> bool:
        return self.level == "complete"

    def reaches(self, level: str) -> bool:
        return self.level is not None and LEVELS.index(self.level) >= LEVELS.index(level)


def answer_prompts(num_prompts: int, *, seed: int = HELDOUT_SEED) -> list[AnswerPrompt]:
    """`num_prompts` prompts, half Japanese and half English, a third of them offering tools, each cut after a user
    turn chosen at random among its conversation's."""
    rng = random.Random(seed)
    prompts = []
    for messages, exchanges in generate_annotated_conversations(num_prompts, seed=seed):
        exchange = rng.choice(exchanges)
        answer = messages[exchange.user_index + 1]
        reference = answer["content"]
        for call in answer.get("tool_calls", []):
            function = {"name": call["function"]["name"], "arguments": json.loads(call["function"]["arguments"])}
            reference += f"\n<tool_call>\n{json.dumps(function, ensure_ascii=False)}\n</tool_call>"
        prompts.append(
            AnswerPrompt(
                messages=messages[: exchange.user_index + 1],
                tools=TOOLS if uses_tools(messages) else None,
                exchange=exchange,
                reference=reference,
            )
        )
    return prompts


def judge(text: str, finish_reason: str, prompt: AnswerPrompt) -> Verdict:
    """Whether `text`, an answer that finished for `finish_reason` ("stop" or "length"), completes `prompt`."""
    if finish_reason != "stop":
        return Verdict(None, f"did not end by itself ({finish_reason})")
    exchange = prompt.exchange
    is_call = "<tool_call>" in text
    prose = _TOOL_CALL.sub("", text).strip()
    if prose or not is_call:
        is_japanese = bool(_JAPANESE.search(prose))
        if is_japanese != (exchange.language == "ja"):
            return Verdict("ended", f"not in the asked language ({exchange.language})")
    if is_call:
        if prompt.tool is None:
            return Verdict("language", "a tool call where the corpus replies in plain text")
        level = score_tool_call(text, ToolPrompt(prompt.messages, prompt.tool, {}))
        if level is None or TOOL_CALL_LEVELS.index(level) < TOOL_CALL_LEVELS.index("schema"):
            return Verdict("language", f"not a valid call of {prompt.tool} (reached {level})")
        return Verdict("complete", "complete")
    if exchange.scenario == CLOSING:
        templates: tuple[str, ...] = _WELCOMES[exchange.language]
    else:
        templates = _SCENARIOS[exchange.language, exchange.scenario].replies
    asked = {name for _, name, _, _ in string.Formatter().parse(exchange.ask) if name}
    wrong_slots = None
    for template in templates:
        match = _template_pattern(template).fullmatch(prose)
        if match is None:
            continue
        values = [(group.rsplit("__", 1)[0], value) for group, value in match.groupdict().items()]
        wrong = [(slot, value) for slot, value in values if slot in asked and value != str(exchange.slots[slot])]
        if not wrong:
            return Verdict("complete", "complete")
        wrong_slots = wrong_slots or wrong
    if wrong_slots:
        reason = ", ".join(f"{slot} {value!r} for {exchange.slots[slot]!r}" for slot, value in wrong_slots)
        return Verdict("scenario", "the ask's values not copied: " + reason, tuple(slot for slot, _ in wrong_slots))
    return Verdict("language", f"not a reply of the scenario {exchange.scenario}")


def _template_pattern(template: str) -> re.Pattern[str]:
    """A reply template as a regex: literal text escaped, each `{slot}` a named group of one line's text."""
    parts = []
    for index, (literal, name, _, _) in enumerate(string.Formatter().parse(template.strip())):
        parts.append(re.escape(literal))
        if name:
            parts.append(f"(?P<{name}__{index}>[^\\n]+?)")
    return re.compile("".join(parts))


def check_answers(
    model: Any, tokenizer: Any, prompts: list[AnswerPrompt], *, max_tokens: int = 192
) -> list[tuple[Verdict, str]]:
    """Answer every prompt greedily (batched in one engine) -> (verdict, answer text) per prompt."""
    from replica.engine.engine import EngineConfig, LLMEngine
    from replica.engine.sampling import SamplingParams

    engine = LLMEngine(
        model,
        EngineConfig(num_blocks=4096, max_num_seqs=64, max_num_batched_tokens=4096),
        eos_token_ids=tokenizer.eos_token_ids,
    )
    ids = []
    for prompt in prompts:
        text = tokenizer.apply_chat_template(prompt.messages, tools=prompt.tools)
        ids.append(engine.add_request(tokenizer.encode(text), SamplingParams(max_tokens=max_tokens, temperature=0.0)))
    outputs: dict[int, list[int]] = {i: [] for i in ids}
    reasons: dict[int, str] = {}
    while engine.has_work:
        for out in engine.step().outputs:
            outputs[out.seq_id].extend(out.new_token_ids)
            if out.finished:
                assert out.finish_reason is not None
                reasons[out.seq_id] = out.finish_reason.value
    texts = [tokenizer.decode(outputs[i]) for i in ids]
    return [(judge(t, reasons[i], p), t) for t, i, p in zip(texts, ids, prompts, strict=True)]
