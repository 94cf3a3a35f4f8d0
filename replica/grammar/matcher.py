"""Token masks from llguidance: one `GrammarCompiler` per replica, one `GrammarMatcher` per constrained request.

The compiler builds llguidance's `LLTokenizer` once from the replica's tokenizer.json (a few milliseconds for the
demo's 2,048 ids, about a second for a 150k vocabulary), validates grammars for the server (so a bad one is a 400
before anything is queued) and fills masks for a whole batch in one call of llguidance's thread pool
(`LLExecutor`), which runs outside the GIL.

A mask is llguidance's bitmask, int32 words of 32 tokens each, [N, ceil(V / 32)]; `allowed(bitmask, V)` unpacks it
to bool [N, V] on whatever device the bitmask was moved to, so a step moves V / 8 bytes per row, not V.

A matcher's state is the tokens it consumed. The engine keeps it at the sequence's committed tokens between steps:
masks along drafts are computed by advancing through the drafts and rolling back (llguidance does both inside
`fill_masks`), and the drafter's walk rolls back what it consumed (`replica.engine.decide`).

N = mask rows, W = ceil(V / 32) words, V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import llguidance

if TYPE_CHECKING:
    import torch


class GrammarError(ValueError):
    """A grammar that cannot constrain output (the server answers 400 with this message)."""


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    @property
    def is_stopped(self) -> bool:
        """No token but EOS can follow (the grammar is complete), or the matcher failed."""
        return bool(self._matcher.is_stopped())

    @property
    def is_accepting(self) -> bool:
        return bool(self._matcher.is_accepting())

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() or None

    def consume(self, token: int) -> bool:
        """Advance by `token`; False (and the matcher stays failed) when the grammar does not allow it."""
        return bool(self._matcher.consume_token(token))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"the grammar matcher could not roll back {num_tokens} tokens: {self.error}")

    @property
    def llmatcher(self) -> llguidance.LLMatcher:
        return self._matcher


class GrammarCompiler:
    """The replica's llguidance tokenizer and thread pool."""

    def __init__(
        self,
        tokenizer_json: str,
        *,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        num_threads: int | None = None,
        limits: llguidance.LLParserLimits | None = None,
    ) -> None:
        """`vocab_size`: the model's (its logits' width, at least the tokenizer's); `eos_token_ids`: what the
        grammar allows once it is complete."""
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_token_ids))
        self.limits = limits
        self._executor = llguidance.LLExecutor(num_threads)

    def validate(self, grammar: str) -> None:
        """Raises GrammarError with llguidance's message when `grammar` cannot be compiled for this tokenizer."""
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer, limits=self.limits
        )
        if is_error:
            raise GrammarError(messages[0] if messages else "the grammar is invalid")

    def matcher(self, grammar: str) -> GrammarMatcher:
        """A matcher at the grammar's start; GrammarError if it does not compile."""
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if m.is_error():
            raise GrammarError(m.get_error())
        return GrammarMatcher(m)

    def fill_masks(self, rows: Sequence[tuple[GrammarMatcher, int, Sequence[int]]], num_rows: int) -> torch.Tensor:
        """Bitmasks [num_rows, W] int32 on the CPU: for each (matcher, row, drafts), the mask at the matcher's state
        goes to `row` and the mask after drafts[:j + 1] to `row + j + 1`; matchers end where they started. Rows
        not written stay 0 (no token allowed), as do those past a draft the grammar refuses."""
        import torch

        bitmask = torch.zeros(num_rows, self.num_words, dtype=torch.int32)
        plain = [(m.llmatcher, row) for m, row, drafts in rows if not drafts]
        drafted = [(m.llmatcher, row, list(drafts)) for m, row, drafts in rows if drafts]
        one_mask_bytes = self.num_words * 4
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), one_mask_bytes, num_rows)
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                drafted, bitmask.data_ptr(), one_mask_bytes, num_rows
            )
        return bitmask


def allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bitmask [N, W] int32 -> allowed tokens [N, V] bool, on the bitmask's device (bit j of word i: token 32i + j)."""
    import torch

    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1)[:, :vocab_size].bool()
