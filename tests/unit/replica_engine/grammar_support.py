"""A byte-level tokenizer for the tiny test model: one token per printable ASCII character, newline, and an end
token, inside the model's 128 ids (the ids past the tokenizer's are never allowed by a grammar)."""

from __future__ import annotations

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from replica.grammar.matcher import GrammarCompiler
from tests.unit.replica_engine.conftest import TINY


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which the ByteLevel pre-tokenizer and decoder use."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


TEXT_BYTES = [*range(0x20, 0x7F), 0x0A]
EOS = len(TEXT_BYTES)
"""The end token's id (96)."""


def ascii_tokenizer_json() -> str:
    to_unicode = _byte_to_unicode()
    vocab = {to_unicode[b]: i for i, b in enumerate(TEXT_BYTES)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<end>", special=True)])
    return str(backend.to_str())


def ascii_compiler() -> GrammarCompiler:
    return GrammarCompiler(ascii_tokenizer_json(), vocab_size=TINY.vocab_size, eos_token_ids=[EOS])


def decode(ids: list[int]) -> str:
    return bytes(TEXT_BYTES[i] for i in ids if i < EOS).decode()
