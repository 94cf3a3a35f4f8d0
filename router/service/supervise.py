"""Long-lived background tasks under one rule (STYLE.md 19): nothing stops silently.

`supervise(task, run, ...)` runs `run()` until it returns or is cancelled. A failure `run` did not handle itself is
recorded in the service's `TaskFailures`, reported to `on_failure` (a health flag), and `run` is started again
after a backoff that doubles from `min_backoff_s` to `max_backoff_s` and starts over once a run has lasted
`max_backoff_s`; while it waits, the task counts as down. A loop's own expected failures (Redis away, a peer
gone) stay the loop's to handle; this catches what it did not foresee.

Work a loop does per replica (a probe, a scrape) records its own failures with `TaskFailures.failed`, so that
what one replica answers costs that replica only, never the loop that serves the others.

`TaskFailures` counts failures by task and logs each one line with its reason: the traceback with a task's first
failure, and at debug after. Its collector exports `<prefix>_task_failures_total{task}` and
`<prefix>_tasks_down{task}` (instances of the task waiting out a backoff or otherwise out of work).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_MAX_REASON_CHARS = 300
"""Characters of an exception's message a log line keeps: the message may quote what a peer sent."""


def backoff_s(num_failures: int, min_s: float, max_s: float) -> float:
    """Wait after `num_failures` consecutive failures: `min_s` doubled per failure after the first, at most
    `max_s`."""
    return min(max_s, min_s * 2.0 ** min(max(num_failures - 1, 0), 30))


class TaskFailures:
    """One service's record of its background tasks' failures (module docstring)."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.counts: dict[str, int] = {}
        """Failures so far, by task."""
        self.num_down: dict[str, int] = {}
        """Instances of each task that are down now (a task may run once per replica)."""
        self._has_traceback: set[str] = set()

    def declare(self, task: str) -> None:
        """Export the task's series at zero before its first failure."""
        self.counts.setdefault(task, 0)
        self.num_down.setdefault(task, 0)

    def failed(self, task: str, exc: BaseException, *, where: str = "", retry_in_s: float | None = None) -> None:
        """Count one failure of `task` (at `where`, say a replica) and log it in one line."""
        self.declare(task)
        self.counts[task] += 1
        is_first = task not in self._has_traceback
        self._has_traceback.add(task)
        self.log.error(
            "background task %s%s failed (%s: %s)%s",
            task,
            f" ({where})" if where else "",
            type(exc).__name__,
            _reason(exc),
            "" if retry_in_s is None else f"; retrying in {retry_in_s:.2f} s",
            exc_info=exc if is_first else None,
        )
        if not is_first:
            self.log.debug("background task %s%s failed", task, f" ({where})" if where else "", exc_info=exc)

    def down(self, task: str) -> None:
        self.declare(task)
        self.num_down[task] += 1

    def up(self, task: str) -> None:
        self.num_down[task] = max(0, self.num_down.get(task, 0) - 1)

    def collector(self, prefix: str) -> Collector:
        return _TaskCollector(self, prefix)


def _reason(exc: BaseException) -> str:
    """The exception's message on one line, at most `_MAX_REASON_CHARS`."""
    reason = " ".join(str(exc).split())
    return reason if len(reason) <= _MAX_REASON_CHARS else reason[: _MAX_REASON_CHARS - 3] + "..."


class _TaskCollector(Collector):
    def __init__(self, failures: TaskFailures, prefix: str) -> None:
        self._failures = failures
        self._prefix = prefix

    def collect(self) -> Iterator[Metric]:
        counts = CounterMetricFamily(
            f"{self._prefix}_task_failures",
            "Failures of background tasks that the task did not handle itself, by task",
            labels=["task"],
        )
        for task, count in sorted(self._failures.counts.items()):
            counts.add_metric([task], count)
        yield counts
        down = GaugeMetricFamily(
            f"{self._prefix}_tasks_down",
            "Background tasks (one per replica for per-replica ones) out of work after a failure, by task",
            labels=["task"],
        )
        for task, num_down in sorted(self._failures.num_down.items()):
            down.add_metric([task], num_down)
        yield down


async def supervise(
    task: str,
    run: Callable[[], Awaitable[None]],
    *,
    failures: TaskFailures,
    clock: Callable[[], float],
    where: str = "",
    on_failure: Callable[[BaseException], None] = lambda exc: None,
    min_backoff_s: float = 0.5,
    max_backoff_s: float = 30.0,
) -> None:
    failures.declare(task)
    num_failures = 0
    while True:
        started = clock()
        try:
            await run()
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if clock() - started >= max_backoff_s:
                num_failures = 0  # it ran well for a while: this failure starts a new series
            num_failures += 1
            delay_s = backoff_s(num_failures, min_backoff_s, max_backoff_s)
            on_failure(exc)
            failures.failed(task, exc, where=where, retry_in_s=delay_s)
        failures.down(task)
        try:
            await asyncio.sleep(delay_s)  # the backoff of a restart, not a wait on state
        finally:
            failures.up(task)
