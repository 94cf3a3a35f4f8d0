"""The runner's step inputs: cache slots of new tokens, and logits only for the rows that are sampled."""

from __future__ import annotations

import random

import pytest

from replica.engine.runner import append_slots


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_slots_are_the_block_tables_slots_position_by_position(block_size: int) -> None:
    rng = random.Random(block_size)
    for _ in range(200):
        num_blocks = rng.randrange(1, 12)
        table = rng.sample(range(100), num_blocks)
        start = rng.randrange(num_blocks * block_size)
        end = rng.randrange(start, num_blocks * block_size + 1)
        slots = [-1]  # appended to, not replaced
        append_slots(slots, table, start, end, block_size)
        assert slots[1:] == [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        assert slots[0] == -1
