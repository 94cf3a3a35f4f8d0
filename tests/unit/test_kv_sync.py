"""Event integrity under fuzz (router/policy/kv_sync.py): random event histories of a model replica cache, delivered
dropped, duplicated, reordered, replayed and across restarts, never leave in the index a block the replica does not
hold, and the index equals the replica's cache whenever the sync says it is live."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from router.policy.hashing import hash_tokens, namespace_seed
from router.policy.kv_events import AllCleared, BlockRemoved, BlockStored, KVEvent
from router.policy.kv_sync import EventSync, Verdict
from router.policy.prefix_index import PrefixIndex

SEED = namespace_seed("m")
BLOCK = 2
CAPACITY = 6
REPLICA = "r"


@dataclass(frozen=True)
class Message:
    epoch: str
    seq: int
    events: tuple[KVEvent, ...]
    cache_after: frozenset[int]
    """Engine hashes the replica caches once this message's events are applied."""
    snapshot_after: tuple[KVEvent, ...]


class ModelReplica:
    """A prefix cache of CAPACITY blocks, evicting a leaf (least recently stored first) when full; engine hashes are
    the router's own, so the index's entries can be compared with it."""

    def __init__(self) -> None:
        self.epoch_num = 0
        self.restart()

    def restart(self) -> None:
        self.epoch_num += 1
        self.seq = 0
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # hash -> (parent, tokens), stored order

    def _leaves(self) -> list[int]:
        parents = {parent for parent, _ in self.blocks.values()}
        return [h for h in self.blocks if h not in parents]

    def step(self, op: str, tokens: list[int]) -> Message:
        events: list[KVEvent] = []
        if op == "clear":
            self.blocks = {}
            events.append(AllCleared())
        else:
            hashes = hash_tokens(tokens, SEED, BLOCK)
            new = [i for i, h in enumerate(hashes) if h not in self.blocks]
            if new:
                first = new[0]
                while len(self.blocks) + len(hashes) - first > CAPACITY:
                    victims = [h for h in self._leaves() if h not in hashes]
                    if not victims:
                        break
                    del self.blocks[victims[0]]
                    events.append(BlockRemoved((victims[0],)))
                stored = hashes[first : first + max(0, CAPACITY - len(self.blocks))]
                if stored:
                    parent = hashes[first - 1] if first else None
                    for i, h in enumerate(stored):
                        self.blocks[h] = (
                            hashes[first + i - 1] if first + i else None,
                            tuple(tokens[(first + i) * BLOCK : (first + i + 1) * BLOCK]),
                        )
                    events.append(
                        BlockStored(
                            tuple(stored), parent, tuple(tokens[first * BLOCK : (first + len(stored)) * BLOCK]), BLOCK
                        )
                    )
        self.seq += 1
        return Message(f"e{self.epoch_num}", self.seq, tuple(events), frozenset(self.blocks), self.snapshot())

    def snapshot(self) -> tuple[KVEvent, ...]:
        return tuple(BlockStored((h,), parent, tokens, BLOCK) for h, (parent, tokens) in self.blocks.items())


prompts = st.lists(st.integers(0, 9), min_size=BLOCK, max_size=5 * BLOCK)
steps = st.lists(st.tuples(st.sampled_from(["store", "store", "store", "clear", "restart"]), prompts), max_size=30)
actions = st.lists(
    st.tuples(
        st.sampled_from(["next", "next", "next", "drop", "dup", "swap", "replay", "snapshot"]), st.integers(0, 40)
    ),
    max_size=60,
)


Position = tuple[Message | None, frozenset[int], tuple[KVEvent, ...], str, int]


def build_history(model_steps: list[tuple[str, list[int]]]) -> list[Position]:
    """Per position: the message (None for a restart, which sends nothing), then the replica's state after it."""
    model = ModelReplica()
    history: list[Position] = []
    for op, tokens in model_steps:
        if op == "restart":
            model.restart()
            history.append((None, frozenset(), (), f"e{model.epoch_num}", 0))
        else:
            message = model.step(op, tokens)
            history.append((message, message.cache_after, message.snapshot_after, message.epoch, message.seq))
    return history


def exact_blocks(index: PrefixIndex) -> int:
    return index.stats().blocks_per_replica.get(REPLICA, 0)


@settings(max_examples=300, deadline=None)
@given(steps, actions)
def test_no_evicted_block_survives_a_resync(
    model_steps: list[tuple[str, list[int]]], deliveries: list[tuple[str, int]]
) -> None:
    history = build_history(model_steps)
    index = PrefixIndex()
    index.add_replica(REPLICA)
    sync = EventSync(index, REPLICA, SEED)
    mirrored: int | None = -1  # the position whose state the index must equal while live (-1: before any)
    position = 0  # next message the channel would deliver in order
    delivered: list[int] = []

    def deliver(i: int) -> None:
        nonlocal mirrored
        message = history[i][0]
        if message is None:
            return
        verdict = sync.message(message.seq, message.events, now=0.0, epoch=message.epoch)
        # Applied: the index must now be the replica's state after message i (checked below).
        mirrored = i if verdict is Verdict.APPLIED else None
        delivered.append(i)

    for action, k in [("snapshot", 0), *deliveries, ("snapshot", 0), ("drain", 0), ("snapshot", 0)]:
        if action == "next" and position < len(history):
            deliver(position)
            position += 1
        elif action == "drop" and position < len(history):
            position += 1
        elif action == "dup" and delivered:
            deliver(delivered[-1])
        elif action == "swap" and position + 1 < len(history):
            deliver(position + 1)
            deliver(position)
            position += 2
        elif action == "replay" and position:
            deliver(k % position)
        elif action == "snapshot":
            _, _, snapshot, epoch, seq = history[position - 1] if position else (None, frozenset(), (), "e1", 0)
            sync.snapshot(seq, snapshot, now=0.0, epoch=epoch)
            mirrored = position - 1
        elif action == "drain":  # after one resync, the rest of the channel in order
            while position < len(history):
                deliver(position)
                position += 1
        cache = history[mirrored][1] if sync.is_live and mirrored is not None and mirrored >= 0 else frozenset()
        if sync.is_live:
            assert exact_blocks(index) == len(cache)
            for h in cache:
                assert index.holds(h)
        else:
            assert exact_blocks(index) == 0  # out of sync: nothing is guessed
    # One resync at the end of the history: live, and (checked in the loop) the replica's final cache exactly.
    assert sync.is_live and mirrored == len(history) - 1


def test_a_restarted_replica_whose_seq_catches_up_is_a_lost_sync() -> None:
    index = PrefixIndex()
    index.add_replica(REPLICA)
    sync = EventSync(index, REPLICA, SEED)
    tokens = (1, 2)
    (h,) = hash_tokens(list(tokens), SEED, BLOCK)
    sync.snapshot(4, [BlockStored((h,), None, tokens, BLOCK)], now=0.0, epoch="old")
    assert index.holds(h)
    assert sync.message(5, [], now=0.0, epoch="new") is Verdict.LOST_SYNC
    assert not index.holds(h) and not sync.is_live
    assert sync.message(6, [], now=0.0, epoch="new") is Verdict.WAITING
