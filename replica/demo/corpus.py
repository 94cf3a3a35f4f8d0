"""A seeded generator of synthetic business chats: the demo model's training corpus and its calibration requests.

A conversation is a list of OpenAI chat messages: a system prompt (one of a handful, two of them shared by both
languages, so conversations share long prefixes), then one to three exchanges. An exchange is a user ask answered
either in plain text or, in a tool conversation (exactly one exchange of it), by an assistant tool call, the tool's
JSON result and an assistant summary. Each exchange fills one `phrasebook.Situation` with slots drawn for it. The
tool arguments are the slots the ask mentions, and the result carries an outcome drawn from those the scenario can
summarize, so the ask, the arguments, the JSON result and the summary always agree: structure a ~5M parameter model
can learn, varied by hundreds of template and slot combinations.

The mix is stratified rather than sampled: exactly round(n * japanese_fraction) conversations are Japanese and
round(n * tool_fraction) use tools, the two assignments shuffled independently. Everything is drawn from one
`random.Random(seed)`, whose sequences are stable across Python versions for int seeds, so a seed names a corpus.

A chat request is a conversation cut after a user turn or a tool result, i.e. where the model answers next, with
`TOOLS` attached when the conversation uses tools. `generate_annotated_conversations` also says what each exchange
was drawn from (language, scenario, the ask's template, slots), which `answercheck` judges answers by.
`python -m replica.demo.corpus` rewrites the committed calibration file; a unit test checks that the committed file
is what this code generates.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path
from typing import Any, Final

from replica.demo.phrasebook import DELAY_CODES, ENGLISH, JAPANESE, Phrasebook, Situation

Message = dict[str, Any]

TRAINING_SEED: Final = 0
"""The seed the demo model's training corpus is generated with."""
CALIBRATION_SEED: Final = 20_250_601
"""Distinct from `TRAINING_SEED`, so calibration requests are not training conversations."""
CALIBRATION_NUM_REQUESTS: Final = 200
CALIBRATION_JAPANESE_FRACTION: Final = 0.6
CALIBRATION_TOOL_FRACTION: Final = 0.4
"""Calibration leans on what quantization hurts first in this model: Japanese text and JSON arguments."""
CALIBRATION_PATH: Final = Path(__file__).with_name("calibration_chats.jsonl")

TOOLS: Final[list[dict[str, Any]]] = [
    {
        "type": "function",
        "function": {
            "name": "get_order_status",
            "description": "Look up the status and estimated delivery date of a customer order.",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string", "description": "Order number, e.g. ORD-48213."}},
                "required": ["order_id"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "schedule_meeting",
            "description": "Book a meeting; a room is assigned when none is given.",
            "parameters": {
                "type": "object",
                "properties": {
                    "title": {"type": "string"},
                    "date": {"type": "string", "description": "YYYY-MM-DD"},
                    "start_time": {"type": "string", "description": "HH:MM, 24-hour clock"},
                    "duration_minutes": {"type": "integer"},
                    "attendees": {"type": "array", "items": {"type": "string"}},
                    "room": {"type": "string"},
                },
                "required": ["title", "date", "start_time"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "create_invoice",
            "description": "Issue an invoice to a customer.",
            "parameters": {
                "type": "object",
                "properties": {
                    "customer": {"type": "string"},
                    "items": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "description": {"type": "string"},
                                "quantity": {"type": "integer"},
                                "unit_price": {"type": "number"},
                            },
                            "required": ["description", "quantity", "unit_price"],
                        },
                    },
                    "currency": {"type": "string", "enum": ["JPY", "USD"]},
                    "due_date": {"type": "string", "description": "YYYY-MM-DD"},
                },
                "required": ["customer", "items", "currency"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "check_inventory",
            "description": "Count the stock of a product, in one warehouse or wherever it is stocked.",
            "parameters": {
                "type": "object",
                "properties": {
                    "product": {"type": "string"},
                    "quantity": {"type": "integer", "description": "The quantity needed."},
                    "warehouse": {"type": "string"},
                },
                "required": ["product"],
            },
        },
    },
]
"""OpenAI tool definitions of every function the corpus calls. A constant: never mutate it."""

_FIRST_DAY = date(2025, 4, 1)
_NUM_DAYS = 270
_QUANTITIES = (10, 20, 30, 50, 100, 120, 200, 300, 500, 1000)
_START_TIMES = ("09:30", "10:00", "10:30", "11:00", "13:00", "13:30", "14:00", "15:00", "16:00", "16:30")
_DURATIONS_MIN = (30, 45, 60, 90)
_DEFAULT_DURATION_MIN = 60
"""What the assistant books when the ask names no duration."""
_EXCHANGE_COUNTS = (1, 1, 2, 2, 3)
_CLOSING_PROBABILITY = 0.35
"""Chance that the last exchange of a multi-exchange conversation is a thank-you."""
_CALL_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
CLOSING: Final = "closing"
"""The scenario name of a closing exchange (a user's thanks, the assistant's welcome)."""


@dataclass(frozen=True)
class Exchange:
    """What the generator drew for one exchange of a conversation: enough to judge any answer to its ask."""

    user_index: int
    """Index of the exchange's user message in the conversation."""
    language: str
    scenario: str
    """A `Situation` name of the phrasebook of `language`, or `CLOSING`."""
    ask: str
    """The ask's template (its `{slot}` names are the values the user gave)."""
    slots: dict[str, Any]
    is_tool_call: bool
    """The corpus answers this ask with a tool call (else with a plain reply)."""


def generate_conversations(
    num_conversations: int, *, seed: int, japanese_fraction: float = 0.5, tool_fraction: float = 1 / 3
) -> list[list[Message]]:
    """`num_conversations` conversations; the same arguments always give the same list."""
    return _generate(random.Random(seed), num_conversations, japanese_fraction, tool_fraction)


def generate_annotated_conversations(
    num_conversations: int, *, seed: int, japanese_fraction: float = 0.5, tool_fraction: float = 1 / 3
) -> list[tuple[list[Message], list[Exchange]]]:
    """`generate_conversations`' conversations (the same ones for the same arguments), each with its exchanges."""
    return _generate_annotated(random.Random(seed), num_conversations, japanese_fraction, tool_fraction)


def uses_tools(conversation: Sequence[Message]) -> bool:
    return any(message.get("tool_calls") for message in conversation)


def chat_requests(
    num_requests: int, *, seed: int, japanese_fraction: float = 0.5, tool_fraction: float = 1 / 3
) -> list[dict[str, Any]]:
    """Chat-completions request bodies, each cut from its own conversation where the model answers next."""
    rng = random.Random(seed)
    conversations = _generate(rng, num_requests, japanese_fraction, tool_fraction)
    bodies = []
    for conversation in conversations:
        cut_indices = [index for index, message in enumerate(conversation) if message["role"] in ("user", "tool")]
        body: dict[str, Any] = {"messages": conversation[: rng.choice(cut_indices) + 1]}
        if uses_tools(conversation):
            body["tools"] = TOOLS
        bodies.append(body)
    return bodies


def write_chat_requests(
    path: str | Path,
    num_requests: int,
    *,
    seed: int,
    japanese_fraction: float = 0.5,
    tool_fraction: float = 1 / 3,
) -> None:
    """Write `chat_requests` as JSONL, one request body per line."""
    bodies = chat_requests(num_requests, seed=seed, japanese_fraction=japanese_fraction, tool_fraction=tool_fraction)
    lines = [json.dumps(body, ensure_ascii=False, separators=(",", ":")) + "\n" for body in bodies]
    Path(path).write_text("".join(lines), encoding="utf-8")


def write_calibration_file(path: str | Path = CALIBRATION_PATH) -> None:
    write_chat_requests(
        path,
        CALIBRATION_NUM_REQUESTS,
        seed=CALIBRATION_SEED,
        japanese_fraction=CALIBRATION_JAPANESE_FRACTION,
        tool_fraction=CALIBRATION_TOOL_FRACTION,
    )


def _generate(
    rng: random.Random, num_conversations: int, japanese_fraction: float, tool_fraction: float
) -> list[list[Message]]:
    return [messages for messages, _ in _generate_annotated(rng, num_conversations, japanese_fraction, tool_fraction)]


def _generate_annotated(
    rng: random.Random, num_conversations: int, japanese_fraction: float, tool_fraction: float
) -> list[tuple[list[Message], list[Exchange]]]:
    if num_conversations < 0:
        raise ValueError(f"num_conversations must be >= 0, got {num_conversations}")
    for name, fraction in (("japanese_fraction", japanese_fraction), ("tool_fraction", tool_fraction)):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"{name} must be within [0, 1], got {fraction}")
    num_japanese = round(num_conversations * japanese_fraction)
    books = [JAPANESE] * num_japanese + [ENGLISH] * (num_conversations - num_japanese)
    num_with_tools = round(num_conversations * tool_fraction)
    has_tool_call = [True] * num_with_tools + [False] * (num_conversations - num_with_tools)
    rng.shuffle(books)
    rng.shuffle(has_tool_call)
    return [_conversation(rng, book, with_tools) for book, with_tools in zip(books, has_tool_call, strict=True)]


def _conversation(rng: random.Random, book: Phrasebook, has_tool_call: bool) -> tuple[list[Message], list[Exchange]]:
    company = rng.choice(book.companies)
    person = rng.choice(book.people)
    messages: list[Message] = [{"role": "system", "content": rng.choice(book.system_prompts)}]
    exchanges: list[Exchange] = []
    num_exchanges = rng.choice(_EXCHANGE_COUNTS)
    tool_exchange_index = rng.randrange(num_exchanges) if has_tool_call else None
    tool_scenarios = [scenario for scenario in book.scenarios if scenario.tool is not None]
    for index in range(num_exchanges):
        user_index = len(messages)
        slots = _draw_slots(rng, book, company, person)
        if index == tool_exchange_index:
            scenario = rng.choice(tool_scenarios)
            ask, exchange = _tool_exchange(rng, book, scenario, slots)
        elif 0 < index == num_exchanges - 1 and rng.random() < _CLOSING_PROBABILITY:
            thanks = rng.choice(book.thanks)
            messages += [
                {"role": "user", "content": thanks},
                {"role": "assistant", "content": rng.choice(book.welcomes)},
            ]
            exchanges.append(Exchange(user_index, book.language, CLOSING, thanks, {}, is_tool_call=False))
            continue
        else:
            scenario = rng.choice(book.scenarios)
            ask, exchange = _plain_exchange(rng, scenario, slots)
        messages += exchange
        exchanges.append(Exchange(user_index, book.language, scenario.name, ask, slots, index == tool_exchange_index))
    return messages, exchanges


def _draw_slots(rng: random.Random, book: Phrasebook, company: str, person: str) -> dict[str, Any]:
    """Every slot a template may name, plus the raw values (`*_iso`, `*_value`, `delay_code`) tool JSON uses."""
    day = _weekday_on_or_after(_FIRST_DAY + timedelta(days=rng.randrange(_NUM_DAYS)))
    eta = _weekday_on_or_after(day + timedelta(days=rng.randint(2, 14)))
    due = day + timedelta(days=30)
    restock = _weekday_on_or_after(day + timedelta(days=rng.randint(7, 21)))
    product, unit_price = rng.choice(book.products)
    quantity = rng.choice(_QUANTITIES)
    amount = round(quantity * unit_price, 2)
    delay_index = rng.randrange(len(DELAY_CODES))
    return {
        "company": company,
        "person": person,
        "attendee": rng.choice([name for name in book.people if name != person]),
        "product": product,
        "quantity": quantity,
        "unit_price": book.price_format.format(value=unit_price),
        "unit_price_value": int(unit_price) if float(unit_price).is_integer() else unit_price,
        "amount": book.money_format.format(value=amount),
        "amount_value": amount,
        "order_id": f"ORD-{rng.randint(10_000, 99_999)}",
        "invoice_id": f"INV-{day.year}-{rng.randint(1_000, 9_999)}",
        "meeting_id": f"MTG-{rng.randint(100_000, 999_999)}",
        "date": _format_date(book, day),
        "date_iso": day.isoformat(),
        "time": rng.choice(_START_TIMES),
        "duration": rng.choice(_DURATIONS_MIN),
        "room": rng.choice(book.rooms),
        "topic": rng.choice(book.topics),
        "eta": _format_date(book, eta),
        "eta_iso": eta.isoformat(),
        "due": _format_date(book, due),
        "due_iso": due.isoformat(),
        "restock": _format_date(book, restock),
        "restock_iso": restock.isoformat(),
        "carrier": rng.choice(book.carriers),
        "delay_reason": book.delay_reasons[delay_index],
        "delay_code": DELAY_CODES[delay_index],
        "warehouse": rng.choice(book.warehouses),
        "available": 0,
    }


def _plain_exchange(rng: random.Random, scenario: Situation, slots: dict[str, Any]) -> tuple[str, list[Message]]:
    """-> (the ask's template, the exchange's messages)."""
    ask = rng.choice(scenario.asks)
    if "{duration}" not in ask:
        slots["duration"] = _DEFAULT_DURATION_MIN
    return ask, [
        {"role": "user", "content": ask.format(**slots)},
        {"role": "assistant", "content": rng.choice(scenario.replies).format(**slots)},
    ]


def _tool_exchange(
    rng: random.Random, book: Phrasebook, scenario: Situation, slots: dict[str, Any]
) -> tuple[str, list[Message]]:
    """-> (the ask's template, the exchange's messages)."""
    assert scenario.tool is not None
    ask = rng.choice(scenario.asks)
    if "{duration}" not in ask:
        slots["duration"] = _DEFAULT_DURATION_MIN
    outcome = rng.choice(tuple(scenario.summaries))
    if outcome == "in_stock":
        slots["available"] = rng.randint(slots["quantity"], 5 * slots["quantity"])
    elif outcome == "insufficient":
        slots["available"] = rng.randrange(slots["quantity"])
    arguments = _tool_arguments(scenario.tool, ask, book, slots)
    result = _tool_result(scenario.tool, outcome, arguments, book, slots)
    call_id = "call_" + "".join(rng.choices(_CALL_ID_ALPHABET, k=12))
    tool_call = {
        "id": call_id,
        "type": "function",
        "function": {"name": scenario.tool, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }
    return ask, [
        {"role": "user", "content": ask.format(**slots)},
        {"role": "assistant", "content": rng.choice(scenario.preambles).format(**slots), "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps(result, ensure_ascii=False)},
        {"role": "assistant", "content": rng.choice(scenario.summaries[outcome]).format(**slots)},
    ]


def _tool_arguments(tool: str, ask: str, book: Phrasebook, slots: dict[str, Any]) -> dict[str, Any]:
    """What the user asked for: optional parameters appear only when the ask names their slot."""

    def mentions(slot: str) -> bool:
        return "{" + slot + "}" in ask

    arguments: dict[str, Any]
    if tool == "get_order_status":
        return {"order_id": slots["order_id"]}
    if tool == "schedule_meeting":
        arguments = {
            "title": slots["topic"] if mentions("topic") else book.room_booking_title,
            "date": slots["date_iso"],
            "start_time": slots["time"],
            "duration_minutes": slots["duration"],
        }
        attendees = [slots[slot] for slot in ("person", "attendee") if mentions(slot)]
        if attendees:
            arguments["attendees"] = attendees
        if mentions("room"):
            arguments["room"] = slots["room"]
        return arguments
    if tool == "create_invoice":
        item = {"description": slots["product"], "quantity": slots["quantity"], "unit_price": slots["unit_price_value"]}
        arguments = {"customer": slots["company"], "items": [item], "currency": book.currency}
        if mentions("due"):
            arguments["due_date"] = slots["due_iso"]
        return arguments
    if tool == "check_inventory":
        arguments = {"product": slots["product"], "quantity": slots["quantity"]}
        if mentions("warehouse"):
            arguments["warehouse"] = slots["warehouse"]
        return arguments
    raise ValueError(f"no arguments defined for tool {tool!r}")


def _tool_result(
    tool: str, outcome: str, arguments: dict[str, Any], book: Phrasebook, slots: dict[str, Any]
) -> dict[str, Any]:
    result: dict[str, Any]
    if tool == "get_order_status":
        result = {"order_id": slots["order_id"], "status": outcome, "estimated_delivery": slots["eta_iso"]}
        if outcome == "shipped":
            result["carrier"] = slots["carrier"]
        elif outcome == "delayed":
            result["delay_reason"] = slots["delay_code"]
        return result
    if tool == "schedule_meeting":
        return {
            "meeting_id": slots["meeting_id"],
            "status": outcome,
            "title": arguments["title"],
            "date": slots["date_iso"],
            "start_time": slots["time"],
            "duration_minutes": slots["duration"],
            "room": slots["room"],
        }
    if tool == "create_invoice":
        return {
            "invoice_id": slots["invoice_id"],
            "status": outcome,
            "customer": slots["company"],
            "total": slots["amount_value"],
            "currency": book.currency,
            "due_date": slots["due_iso"],
        }
    if tool == "check_inventory":
        result = {
            "product": slots["product"],
            "warehouse": slots["warehouse"],
            "available": slots["available"],
            "requested": slots["quantity"],
        }
        if outcome == "insufficient":
            result["restock_date"] = slots["restock_iso"]
        return result
    raise ValueError(f"no result defined for tool {tool!r}")


def _weekday_on_or_after(day: date) -> date:
    while day.weekday() >= 5:
        day += timedelta(days=1)
    return day


def _format_date(book: Phrasebook, day: date) -> str:
    return book.date_format.format(
        iso=day.isoformat(), month=book.months[day.month - 1], day=day.day, weekday=book.weekdays[day.weekday()]
    )


if __name__ == "__main__":
    write_calibration_file()
