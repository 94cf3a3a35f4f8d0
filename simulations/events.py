"""The discrete-event core: a heap of timed callbacks and a virtual clock.

Events are `(time_s, seq, callback, arg)` tuples on a binary heap. `seq` is a counter taken at scheduling time,
so two events at the same instant run in the order they were scheduled: runs are deterministic without
comparing callbacks. The clock (`now`) only moves forward, to each event's time as it is popped; nothing here
reads the wall clock. A callback takes one argument (the `arg` given at scheduling), which avoids allocating a
closure per event on the hot path (engine steps, arrivals).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

Callback = Callable[[Any], None]


class Simulator:
    """A virtual clock and its event queue."""

    def __init__(self) -> None:
        self.now = 0.0
        """Virtual seconds since the start of the simulation."""
        self._heap: list[tuple[float, int, Callback, Any]] = []
        self._seq = 0
        self.num_events = 0
        """Events run so far."""

    def at(self, time_s: float, callback: Callback, arg: Any = None) -> None:
        """Run `callback(arg)` at virtual time `time_s` (never earlier than `now`)."""
        if time_s < self.now:
            raise ValueError(f"cannot schedule at {time_s} s, before now ({self.now} s)")
        self._seq += 1
        heapq.heappush(self._heap, (time_s, self._seq, callback, arg))

    def after(self, delay_s: float, callback: Callback, arg: Any = None) -> None:
        """Run `callback(arg)` `delay_s` seconds from now."""
        self.at(self.now + delay_s, callback, arg)

    @property
    def num_pending(self) -> int:
        return len(self._heap)

    def run(self, until_s: float = float("inf")) -> None:
        """Run events in (time, scheduling order) until none is left or the next is after `until_s`."""
        heap = self._heap
        pop = heapq.heappop
        count = 0
        while heap and heap[0][0] <= until_s:
            time_s, _, callback, arg = pop(heap)
            self.now = time_s
            callback(arg)
            count += 1
        self.num_events += count
