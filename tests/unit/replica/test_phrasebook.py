"""The demo corpus's phrasebooks are package data: they load into the same phrases the demo model was built on,
ship with the package, and a file that does not fit the types is refused with its name."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import tomllib
from pathlib import Path

import pytest

from replica.demo.build import DemoRecipe
from replica.demo.corpus import generate_conversations
from replica.demo.phrasebook import DELAY_CODES, PHRASEBOOKS, PHRASEBOOKS_FILE, load_phrasebooks

ROOT = Path(__file__).parents[3]
BUILD_CORPUS_SHA256 = "bdb1d0ad2e4e127879d9a4cdd422ec84a2550ffa06952e811f1dad0b6d5a0ab4"
"""The corpus `shoal replica build-demo` trains the packaged demo model on (its recipe's conversation count and
seed), as JSON with sorted keys: generated from the phrasebooks as they were in code when those weights were built."""


def test_the_build_corpus_is_the_one_the_packaged_model_was_trained_on() -> None:
    recipe = DemoRecipe()
    conversations = generate_conversations(recipe.num_conversations, seed=recipe.seed)
    text = json.dumps(conversations, ensure_ascii=False, sort_keys=True)
    assert hashlib.sha256(text.encode()).hexdigest() == BUILD_CORPUS_SHA256


def test_the_phrasebooks_ship_as_package_data() -> None:
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert any(fnmatch.fnmatch(f"demo/{PHRASEBOOKS_FILE}", pattern) for pattern in package_data["replica"])
    assert [book.language for book in PHRASEBOOKS] == ["ja", "en"]
    for book in PHRASEBOOKS:
        assert isinstance(book.scenarios, tuple) and isinstance(book.products[0], tuple)
        assert len(book.delay_reasons) == len(DELAY_CODES)


def test_a_file_that_does_not_fit_is_refused_with_its_name() -> None:
    data = json.loads((ROOT / "replica" / "demo" / PHRASEBOOKS_FILE).read_text(encoding="utf-8"))
    data["phrasebooks"][0]["colour"] = "blue"
    with pytest.raises(ValueError, match=f"{PHRASEBOOKS_FILE}.*colour"):
        load_phrasebooks(json.dumps(data))
    data["phrasebooks"][0].pop("colour")
    data["phrasebooks"][1]["delay_reasons"].pop()
    with pytest.raises(ValueError, match="en has 3 delay reasons for 4 delay codes"):
        load_phrasebooks(json.dumps(data))
