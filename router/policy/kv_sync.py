"""Keeping the exact index in step with one replica's KV events, message by message (DESIGN.md contract 2).

A replica numbers its event messages: `seq` grows by one per message, and a snapshot (`cleared`, then every cached
block) carries the seq of the last message it includes. The index may hold a replica's exact entries only while
the messages applied since its last snapshot are exactly seq+1, seq+2, ... with none missing. Any other seq is
a lost sync, whatever caused it: a message dropped (a trimmed stream, a full queue), delivered twice, out of order
or replayed, or a replica that restarted and counts from 1 again. No order of events can be trusted past it (a
`removed` that arrives before its `stored` would leave the block indexed for good), so the replica's entries are
cleared at once and nothing is applied until the next snapshot rebuilds them. Skipping a duplicate instead would
be a guess: a restarted replica's first messages look exactly like old ones. For the same reason a message names
its publisher's `epoch` (new each time the replica starts) where it can: a restarted replica's seq can pass the
position the router waits for, and only the epoch tells its message from the old run's.

`EventSync` makes that decision and applies to a `PrefixIndex`; the driver fetches snapshots when it asks for one.
Pure: no I/O, `now` comes from the caller.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from router.policy.kv_events import AllCleared, KVEvent
from router.policy.prefix_index import PrefixIndex


class Verdict(enum.StrEnum):
    APPLIED = "applied"
    """The next message in sequence: applied."""
    WAITING = "waiting"
    """Out of sync, waiting for a snapshot: left out."""
    LOST_SYNC = "lost_sync"
    """Not the next seq: the replica's entries were cleared, and a snapshot is needed."""


class EventSync:
    """One replica's position in its event sequence, and its entries in `index`."""

    def __init__(self, index: PrefixIndex, replica: str, seed: bytes) -> None:
        self.index = index
        self.replica = replica
        self.seed = seed
        self.epoch: str | None = None
        """The epoch of the snapshot and messages applied; a message of another epoch is a lost sync."""
        self.next_seq: int | None = None
        """The seq the next message must carry; None until a snapshot, and after a lost sync."""
        self.num_lost = 0

    @property
    def is_live(self) -> bool:
        """The replica's exact entries are what it caches as of message `next_seq - 1`."""
        return self.next_seq is not None

    def snapshot(self, seq: int, events: Sequence[KVEvent], now: float, *, epoch: str | None = None) -> None:
        """Rebuild the replica's entries from a snapshot that includes every message up to `seq`."""
        self.epoch = epoch
        self.index.apply(self.replica, AllCleared(), seed=self.seed, now=now)
        for event in events:
            self.index.apply(self.replica, event, seed=self.seed, now=now)
        self.next_seq = seq + 1

    def message(self, seq: int, events: Sequence[KVEvent], now: float, *, epoch: str | None = None) -> Verdict:
        """One message of the replica's stream, as it arrived."""
        if self.next_seq is None:
            return Verdict.WAITING
        if seq != self.next_seq or epoch != self.epoch:
            self.lose_sync(now)
            return Verdict.LOST_SYNC
        for event in events:
            self.index.apply(self.replica, event, seed=self.seed, now=now)
        self.next_seq = seq + 1
        return Verdict.APPLIED

    def lose_sync(self, now: float) -> None:
        """Forget the replica's entries until the next snapshot (a gap, or the stream itself was lost)."""
        self.index.apply(self.replica, AllCleared(), seed=self.seed, now=now)
        self.next_seq = None
        self.num_lost += 1
