"""What the demo model trains and is measured on: the copy rows of its short steps, and the assistant's tokens that its
held-out loss averages over."""

from __future__ import annotations

import torch

from replica.demo.build import PACKAGED_DIR, assistant_tokens, copy_task
from replica.tokenizer import SPECIAL_TOKENS, Tokenizer, training_text


def test_copy_rows_weigh_only_the_tokens_that_the_first_copy_predicts() -> None:
    rows, seq_len = 3, 16
    tokens, weights = copy_task(rows, seq_len, 50, torch.Generator().manual_seed(0))
    assert tokens.shape == (rows, seq_len + 1) and weights.shape == (rows, seq_len)
    assert int(tokens.min()) >= len(SPECIAL_TOKENS)
    tokenizer = Tokenizer.from_file(PACKAGED_DIR / "tokenizer.json")
    assert max(tokenizer.encode(token)[0] for token in SPECIAL_TOKENS) == len(SPECIAL_TOKENS) - 1  # numbered first
    half = seq_len // 2
    for row, weight in zip(tokens, weights, strict=True):
        assert len(set(row[:half].tolist())) > 1  # a random string, not one token repeated
        for target in range(seq_len):  # target j is row[j + 1]
            predictable = target >= half  # row[j + 1] repeats row[j + 1 - half], read after row[j - half]
            assert weight[target] == (1.0 if predictable else 0.0)
            if predictable:
                assert row[target + 1] == row[target + 1 - half]


def test_the_held_out_loss_counts_the_assistants_turns_and_nothing_else() -> None:
    tokenizer = Tokenizer.from_file(PACKAGED_DIR / "tokenizer.json")
    replies = ["Order ORD-12345 ships on 2025-05-07.", "You're welcome."]
    conversation = [
        {"role": "system", "content": "You are an assistant."},
        {"role": "user", "content": "Where is ORD-12345?"},
        {"role": "assistant", "content": replies[0]},
        {"role": "user", "content": "assistant, thanks"},
        {"role": "assistant", "content": replies[1]},
    ]
    ids = [*tokenizer.encode(training_text(conversation, None)), tokenizer.endoftext_token_id]
    inside = assistant_tokens(torch.tensor(ids), tokenizer).tolist()
    spans: list[list[int]] = []
    for i, (token, written) in enumerate(zip(ids, inside, strict=True)):
        if written:
            if not inside[i - 1]:
                spans.append([])
            spans[-1].append(token)
    assert [tokenizer.decode(span) for span in spans] == ["\n" + reply for reply in replies]
    assert all(span[-1] == tokenizer.eos_token_id for span in spans)  # each turn's <|im_end|>, the stop it learns
