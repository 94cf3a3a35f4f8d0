"""The pinned llguidance lets no invalid JSON through on the schema suite (tests/data/schema_suite.json).

For each schema, random walks through the matcher on the demo tokenizer: at every step a token is drawn among those
the mask allows, preferring adversarial ones (raw control characters, backslashes and escapes, quotes, surrogate
escapes, non-ASCII), then, past a length, tokens that close strings, arrays and objects, so that walks end. A walk
that the matcher completes must decode to JSON that Python's strict parser reads, that holds no lone surrogate, and
that `jsonschema` validates against the schema. Another JSON-schema library once let raw control characters inside
length-bounded strings and UTF-16 surrogates through on most of these schemas; this test catches that in whichever
library is pinned. Bad schemas are refused with messages that name the problem.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from replica.demo.build import PACKAGED_DIR
from replica.grammar.formats import MAX_SCHEMA_DEPTH, json_schema_grammar
from replica.grammar.matcher import GrammarCompiler, GrammarError, allowed
from replica.tokenizer import Tokenizer

SUITE = json.loads((Path(__file__).parents[2] / "data" / "schema_suite.json").read_text())["schemas"]
NUM_WALKS = 6
MAX_WALK_TOKENS = 400
CLOSE_AFTER = 60
"""Steps of adversarial walking before closing tokens are preferred."""


@pytest.fixture(scope="module")
def setup() -> tuple[GrammarCompiler, Tokenizer, list[set[int]]]:
    tokenizer = Tokenizer.from_file(PACKAGED_DIR / "tokenizer.json")
    compiler = GrammarCompiler(
        tokenizer.to_json(), vocab_size=tokenizer.vocab_size, eos_token_ids=tokenizer.eos_token_ids
    )
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in range(tokenizer.vocab_size)]
    escapes = {t for t, s in enumerate(texts) if any(c < " " or c == "\\" for c in s)}
    non_ascii = {t for t, s in enumerate(texts) if any(c > "~" for c in s)}
    closing = {t for t, s in enumerate(texts) if s and all(c in '"}]' for c in s)}
    digits = {t for t, s in enumerate(texts) if s and all(c in "0123456789" for c in s)}
    return compiler, tokenizer, [escapes, non_ascii, closing, digits]


def walk(compiler: GrammarCompiler, grammar: str, rng: random.Random, preferences: list[set[int]]) -> list[int] | None:
    """Token ids of one completed walk, or None if it did not end within MAX_WALK_TOKENS."""
    escapes, non_ascii, closing, digits = preferences
    matcher = compiler.matcher(grammar)
    ids: list[int] = []
    for step in range(MAX_WALK_TOKENS):
        if matcher.is_stopped:
            assert matcher.error is None, matcher.error
            return ids
        choices = allowed(compiler.fill_masks([(matcher, 0, ())], 1), compiler.vocab_size)[0].nonzero().flatten()
        options = choices.tolist()
        assert options, "the grammar dead-ended"
        eos = [t for t in options if t in compiler.tokenizer.eos_tokens]
        if eos and (step >= CLOSE_AFTER or rng.random() < 0.2):
            return ids
        options = [t for t in options if t not in compiler.tokenizer.eos_tokens]
        preferred = options
        if step < CLOSE_AFTER:
            kind = rng.random()
            if kind < 0.5:
                preferred = [t for t in options if t in escapes]
            elif kind < 0.7:
                preferred = [t for t in options if t in non_ascii]
        else:
            preferred = [t for t in options if t in closing] or [t for t in options if t in digits]
        token = rng.choice(preferred or options)
        assert matcher.consume(token)
        ids.append(token)
    return None


def check_output(text: str, schema: dict[str, Any]) -> None:
    value = json.loads(text)  # strict: a raw control character inside a string is an error
    json.dumps(value, ensure_ascii=False).encode("utf-8")  # a lone surrogate cannot be encoded
    jsonschema.validate(value, schema)


@pytest.mark.parametrize("entry", SUITE, ids=[e["name"] for e in SUITE])
def test_no_invalid_json_gets_through(setup: tuple[GrammarCompiler, Tokenizer, list[set[int]]], entry: Any) -> None:
    compiler, tokenizer, preferences = setup
    grammar = json_schema_grammar(entry["schema"])
    compiler.validate(grammar)
    rng = random.Random(entry["name"])
    completed = 0
    for _ in range(NUM_WALKS):
        ids = walk(compiler, grammar, rng, preferences)
        if ids is None:
            continue
        completed += 1
        check_output(tokenizer.decode(ids, skip_special_tokens=False), entry["schema"])
    assert completed >= NUM_WALKS // 2, f"only {completed} of {NUM_WALKS} walks ended"


@pytest.mark.parametrize(
    "text",
    ['{"code": "a\x01b", "note": ""}', '{"code": "\\ud800ab", "note": ""}', '{"code": "abcd", "note": ""}'],
    ids=["raw-control-character", "lone-surrogate", "too-long"],
)
def test_the_check_catches_what_a_lax_library_lets_through(text: str) -> None:
    schema = next(e["schema"] for e in SUITE if e["name"] == "string-lengths")
    with pytest.raises((ValueError, UnicodeEncodeError, jsonschema.ValidationError)):
        check_output(text, schema)


def test_walks_are_adversarial(setup: tuple[GrammarCompiler, Tokenizer, list[set[int]]]) -> None:
    """The walks do write escapes, control-character escapes and non-ASCII inside strings (else they prove little)."""
    compiler, tokenizer, preferences = setup
    entry = next(e for e in SUITE if e["name"] == "string-lengths")
    grammar = json_schema_grammar(entry["schema"])
    rng = random.Random(0)
    texts = [
        tokenizer.decode(ids, skip_special_tokens=False)
        for _ in range(20)
        if (ids := walk(compiler, grammar, rng, preferences))
    ]
    joined = "".join(texts)
    assert "\\" in joined and any(c > "~" for c in joined), texts


def test_the_suite_is_large_and_varied() -> None:
    assert len(SUITE) >= 30
    text = json.dumps(SUITE, ensure_ascii=False)
    for keyword in ("pattern", "maxLength", "minimum", "enum", "maxItems", "$ref", "format", "名前"):
        assert keyword in text


@pytest.mark.parametrize(
    ("schema", "fragment"),
    [
        ({"type": "object", "properties": {"a": {"type": "strin"}}}, "strin"),
        ({"not": {"type": "string"}}, "not"),
        ({"type": "string", "pattern": "(("}, "regex"),
        ({"$ref": "#/$defs/missing"}, "missing"),
        ({"type": "integer", "minimum": 5, "maximum": 2}, "minimum"),
        ("a string", "must be a JSON object"),
    ],
)
def test_bad_schemas_are_refused_with_the_problem_named(
    setup: tuple[GrammarCompiler, Tokenizer, list[set[int]]], schema: Any, fragment: str
) -> None:
    compiler = setup[0]
    with pytest.raises(GrammarError, match=fragment):
        compiler.validate(json_schema_grammar(schema))


def test_a_schema_nested_past_the_limit_is_refused() -> None:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(MAX_SCHEMA_DEPTH):
        schema = {"type": "array", "items": schema}
    with pytest.raises(GrammarError, match=f"deeper than {MAX_SCHEMA_DEPTH}"):
        json_schema_grammar(schema)
