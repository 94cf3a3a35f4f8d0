"""Long timeouts without a timer each: `Deadlines.call_later` and `Deadlines.timeout`.

Every proxied request bounds its whole time (`limits.request_timeout_s`, 30 minutes by default) and each wait for a
replica's bytes (`limits.upstream_idle_timeout_s`, 10 minutes), and they almost never fire. As event-loop timers
they cost several µs a request (`python -m benchmarks.bench_timeouts` times both ways). Here a timeout of at least
`_COARSE_FACTOR` sweep intervals goes into a set that one sweep per interval (1 s) checks, and it fires at most one
interval late, under 25% of its length (0.06% for the defaults). Shorter timeouts get an exact timer as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType
from typing import Any, Protocol

_COARSE_FACTOR = 4
"""Timeouts at least this many sweep intervals long are swept; shorter ones get their own timer."""


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class _Entry:
    __slots__ = ("args", "callback", "owner", "when")

    def __init__(self, owner: Deadlines, when: float, callback: Callable[..., object], args: tuple[Any, ...]) -> None:
        self.owner = owner
        self.when = when
        self.callback = callback
        self.args = args

    def cancel(self) -> None:
        self.owner._entries.discard(self)


class Deadlines:
    """Timeouts on one event loop: exact timers for short ones, a sweep every `interval_s` for long ones."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float = 1.0) -> None:
        self.loop = loop
        self.interval_s = interval_s
        self._entries: set[_Entry] = set()
        self._sweep: asyncio.TimerHandle | None = None

    def call_later(self, delay_s: float, callback: Callable[..., object], *args: Any) -> Cancellable:
        """Runs `callback(*args)` after `delay_s` (up to one interval late when swept), unless cancelled first."""
        if delay_s < _COARSE_FACTOR * self.interval_s:
            return self.loop.call_later(delay_s, callback, *args)
        entry = _Entry(self, self.loop.time() + delay_s, callback, args)
        self._entries.add(entry)
        if self._sweep is None:
            self._sweep = self.loop.call_later(self.interval_s, self._run_sweep)
        return entry

    def timeout(self, delay_s: float) -> Timeout:
        """`async with deadlines.timeout(s):` as `asyncio.timeout(s)`: TimeoutError once `s` have passed."""
        return Timeout(self, delay_s)

    def __len__(self) -> int:
        """Swept timeouts pending."""
        return len(self._entries)

    def _run_sweep(self) -> None:
        self._sweep = None
        now = self.loop.time()
        due = [entry for entry in self._entries if entry.when <= now]
        for entry in due:
            self._entries.discard(entry)
        for entry in due:
            entry.callback(*entry.args)
        if self._entries:
            self._sweep = self.loop.call_later(self.interval_s, self._run_sweep)


class Timeout:
    """The context manager of `Deadlines.timeout`, with `asyncio.timeout`'s semantics (Python 3.11): on expiry the
    task is cancelled, and that cancellation, and only that one, leaves the block as TimeoutError."""

    __slots__ = ("_cancelling", "_deadlines", "_delay_s", "_handle", "_task", "expired")

    def __init__(self, deadlines: Deadlines, delay_s: float) -> None:
        self._deadlines = deadlines
        self._delay_s = delay_s
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self._handle: Cancellable | None = None
        self.expired = False

    async def __aenter__(self) -> Timeout:
        # With the loop given, current_task skips get_running_loop, whose getpid() is a system call per request.
        task = asyncio.current_task(self._deadlines.loop)
        if task is None:
            raise RuntimeError("Timeout should be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._handle = self._deadlines.call_later(self._delay_s, self._expire)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._handle is not None and self._task is not None
        self._handle.cancel()
        if self.expired and self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc

    def _expire(self) -> None:
        self.expired = True
        assert self._task is not None
        self._task.cancel()
