"""Word pools and sentence templates of the demo corpus: one phrasebook per language, read from `phrasebooks.json`.

Templates are `str.format` strings over the slots that `corpus` draws for each exchange: company, person, attendee,
product, quantity, unit_price, amount, order_id, invoice_id, meeting_id, date, time, duration, room, topic, eta,
due, restock, carrier, delay_reason, warehouse, available. A scenario lists what users ask, how the assistant answers
without a tool, what it says before calling its tool, and its summaries of the tool result keyed by outcome (the
outcomes a scenario lists are the ones the corpus draws for it). Pools whose entries travel together are pairs (a
product with its unit price), and delay reasons line up with `DELAY_CODES`, so the JSON a tool returns and the
sentence that reports it always agree.

Japanese is business keigo (お世話になっております, 承知いたしました, ございます); English is plain business prose.
Two system prompts are bilingual and shared by both phrasebooks, so Japanese and English chats share prefixes too.

The words are data, shipped as package data beside this module; this module gives them types. The file is read
once, at import, and its lists become tuples, so the corpus (and the demo model built from it) is the same as long
as the file is: a unit test pins the build corpus's checksum.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True, slots=True)
class Situation:
    """One business situation in one language."""

    name: str
    tool: str | None
    """The function the assistant calls when the conversation uses tools; None: never part of a tool exchange."""
    asks: tuple[str, ...]
    replies: tuple[str, ...]
    """Answers without calling a tool."""
    preambles: tuple[str, ...] = ("",)
    """Assistant text before its tool call ("" is a bare call)."""
    summaries: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    """Tool outcome -> answers after the tool result."""


@dataclass(frozen=True, slots=True)
class Phrasebook:
    """Everything language-specific the corpus draws from."""

    language: str
    system_prompts: tuple[str, ...]
    companies: tuple[str, ...]
    people: tuple[str, ...]
    products: tuple[tuple[str, float], ...]
    """(name, unit price in `currency`)."""
    currency: str
    money_format: str
    """Formats `value`, an amount in `currency`."""
    price_format: str
    """Formats `value`, a unit price, as the JSON number a tool call writes for it (no thousands separators, no
    trailing zeros), so the model copies the ask's digits into the arguments."""
    date_format: str
    """Formats `iso` (YYYY-MM-DD), `month` (a name from `months`), `day` and `weekday` (a name from `weekdays`,
    Monday first). It leads with the ISO date, the form tool arguments take, so the model copies it."""
    months: tuple[str, ...]
    weekdays: tuple[str, ...]
    rooms: tuple[str, ...]
    topics: tuple[str, ...]
    room_booking_title: str
    """The meeting title when a room is booked without naming a topic."""
    carriers: tuple[str, ...]
    warehouses: tuple[str, ...]
    delay_reasons: tuple[str, ...]
    """Aligned with `DELAY_CODES`."""
    scenarios: tuple[Situation, ...]
    thanks: tuple[str, ...]
    """A user's closing turn."""
    welcomes: tuple[str, ...]
    """The assistant's answer to a closing turn."""


PHRASEBOOKS_FILE = "phrasebooks.json"
"""Package data beside this module: `delay_codes` and one object per phrasebook, fields named as `Phrasebook`'s."""


def load_phrasebooks(text: str | None = None) -> tuple[tuple[str, ...], tuple[Phrasebook, ...]]:
    """(delay codes, phrasebooks) from the packaged JSON, or from `text`; a ValueError names what does not fit."""
    if text is None:
        text = resources.files(__package__ or "replica.demo").joinpath(PHRASEBOOKS_FILE).read_text(encoding="utf-8")
    try:
        data = json.loads(text)
        delay_codes = tuple(data["delay_codes"])
        books = tuple(_phrasebook(book) for book in data["phrasebooks"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{PHRASEBOOKS_FILE}: {exc!r}") from exc
    for book in books:
        if len(book.delay_reasons) != len(delay_codes):
            raise ValueError(
                f"{PHRASEBOOKS_FILE}: {book.language} has {len(book.delay_reasons)} delay reasons for "
                f"{len(delay_codes)} delay codes"
            )
    return delay_codes, books


def _phrasebook(data: dict[str, Any]) -> Phrasebook:
    fields: dict[str, Any] = {key: tuple(value) if isinstance(value, list) else value for key, value in data.items()}
    fields["products"] = tuple((str(name), price) for name, price in data["products"])
    fields["scenarios"] = tuple(_scenario(scenario) for scenario in data["scenarios"])
    return Phrasebook(**fields)


def _scenario(data: dict[str, Any]) -> Situation:
    fields: dict[str, Any] = {key: tuple(value) if isinstance(value, list) else value for key, value in data.items()}
    summaries = {outcome: tuple(texts) for outcome, texts in data.get("summaries", {}).items()}
    fields["summaries"] = MappingProxyType(summaries)
    return Situation(**fields)


DELAY_CODES, PHRASEBOOKS = load_phrasebooks()
JAPANESE, ENGLISH = PHRASEBOOKS
