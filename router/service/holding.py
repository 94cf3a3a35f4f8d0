"""Holding: requests that no replica can take yet wait at the router, in arrival order, within `hold` limits.

A request waits when no replica serves its model yet (a cold start, a fleet-wide restart, scale from zero), or when
every replica is at `hold.max_in_flight_per_replica`, or when older requests already wait. Whoever frees room (a
request finishing, a replica joining) calls `release`, which wakes waiting requests in arrival order, as many as
each model has free slots.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass

from router.service.metrics import RouterMetrics
from router.service.routing import PoolRouting
from router.service.settings import HoldSettings


@dataclass(slots=True)
class _Held:
    """A request waiting at the router for a replica with room."""

    model: str | None
    released: asyncio.Future[None]


class HoldLine:
    """The requests waiting for a replica with room; `metrics.held_requests` counts them."""

    def __init__(
        self, settings: HoldSettings, routing: PoolRouting, metrics: RouterMetrics, clock: Callable[[], float]
    ) -> None:
        self.settings = settings
        self.routing = routing
        self.metrics = metrics
        self._clock = clock
        self._waiting: collections.deque[_Held] = collections.deque()

    def __bool__(self) -> bool:
        """True while a request waits."""
        return bool(self._waiting)

    async def wait(self, model: str | None, started: float) -> bool:
        """No replica can take the request yet (none serves its model, or all are at the in-flight limit, or
        older requests are held): wait in line, within `hold` limits. False when the wait is over."""
        hold = self.settings
        remaining_s = started + hold.max_wait_s - self._clock()
        if self.metrics.held_requests >= hold.max_requests or remaining_s <= 0:
            return False
        held = _Held(model, asyncio.get_running_loop().create_future())
        self._waiting.append(held)
        self.metrics.held_requests += 1
        is_through = False
        try:
            self.release()  # there may be room already: another model's request was first in line
            async with asyncio.timeout(remaining_s):
                await held.released
            is_through = True
        except TimeoutError:
            return False
        finally:
            self.metrics.held_requests -= 1
            if held.released.cancelled() or not held.released.done():  # timed out or cancelled in line: leave
                held.released.cancel()
                self._waiting.remove(held)
            elif not is_through:  # released, then timed out or cancelled before choosing: pass the slot on
                self.release()
        return True

    def release(self) -> None:
        """Release held requests in arrival order, each whose model has a free slot, as many as there are free
        slots. A released request chooses at once (nothing awaits between its wake-up and `begin`), so the
        slots it was counted against are still free then."""
        room: dict[str | None, int] = {}
        kept: collections.deque[_Held] = collections.deque()
        for held in self._waiting:
            free = room.get(held.model)
            if free is None:
                free = self.routing.free_slots(held.model)
            if free > 0:
                held.released.set_result(None)
                free -= 1
            else:
                kept.append(held)
            room[held.model] = free
        self._waiting = kept
