"""Long-lived background tasks under one rule (DESIGN.md, Background tasks): nothing stops silently.

`supervise(name, run, ...)` runs `run()` until it returns or is cancelled. An exception is logged with its reason
(the traceback the first time, one line after), reported to `on_failure` (a counter, a health flag), and `run` is
started again after a backoff that doubles from `min_backoff_s` to `max_backoff_s` and starts over once a run has
lasted `max_backoff_s`. A loop's own expected failures (Redis away, a peer gone) stay the loop's to handle; this
catches what it did not foresee.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("shoal.router.supervise")


async def supervise(
    name: str,
    run: Callable[[], Awaitable[None]],
    *,
    on_failure: Callable[[BaseException], None],
    clock: Callable[[], float],
    min_backoff_s: float = 0.5,
    max_backoff_s: float = 30.0,
) -> None:
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
            delay_s = min(max_backoff_s, min_backoff_s * 2 ** min(num_failures - 1, 30))
            on_failure(exc)
            log.error(
                "background task %r failed (%s: %s); restarting in %.1f s",
                name,
                type(exc).__name__,
                exc,
                delay_s,
                exc_info=num_failures == 1,
            )
        await asyncio.sleep(delay_s)  # the backoff of a restart, not a wait on state
