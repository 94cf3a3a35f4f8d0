"""Latency of small requests while a large one is in flight: the large one from a thread of its own (blocking
sockets, which release the GIL, so the sender costs this process's event loop nothing), the small ones open-loop,
each timed from when it was due, so a stall shows in every request it delays, not only in one.
The collector is paused while it measures (`collector_paused`)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import http.client
import statistics
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from urllib.parse import urlsplit

INTERVAL_S = 0.005
"""Small requests are due one per 5 ms, whatever the server is doing."""
MAX_SMALL = 4000
"""Small requests sent at most (20 s of them)."""


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No garbage collection while the block runs, after one that clears what earlier tests left. In-process
    servers share the test process's heap, and a full pass over it (up to 270,000 objects that tests made, beside
    what collection imported and `tests/conftest.py` froze) held the GIL, and with it every server of the test, for
    up to 0.2 s: a timing test read it as the server's stall. `shoal router` and `shoal replica` freeze what they
    loaded once started, so their own passes stay short."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def post_in_a_thread(url: str, body: bytes, headers: dict[str, str] | None = None) -> asyncio.Future[tuple[int, bytes]]:
    """POST `body` (JSON, with `headers` besides) to `url` from a thread; the future gets the status and the
    answer's body."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[tuple[int, bytes]] = loop.create_future()
    parts = urlsplit(url)

    def post() -> None:
        connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=120)
        try:
            connection.request(
                "POST", parts.path, body=body, headers={"Content-Type": "application/json", **(headers or {})}
            )
            response = connection.getresponse()
            answer = response.read()
            loop.call_soon_threadsafe(done.set_result, (response.status, answer))
        except Exception as exc:  # handed to the test
            loop.call_soon_threadsafe(done.set_exception, exc)
        finally:
            connection.close()

    threading.Thread(target=post, daemon=True).start()
    return done


async def open_loop(small: Callable[[], Awaitable[None]], is_done: Callable[[], bool]) -> list[float]:
    """`small()` every `INTERVAL_S` until `is_done()` (or `MAX_SMALL` of them); each one's seconds from its due time
    to its end."""

    async def timed(due: float) -> float:
        await small()
        return time.perf_counter() - due

    tasks: list[asyncio.Task[float]] = []
    first = time.perf_counter()
    while not is_done() and len(tasks) < MAX_SMALL:
        due = first + len(tasks) * INTERVAL_S
        tasks.append(asyncio.create_task(timed(due)))
        await asyncio.sleep(max(0.0, due + INTERVAL_S - time.perf_counter()))
    return list(await asyncio.gather(*tasks))


async def latencies_around(
    small: Callable[[], Awaitable[None]],
    url: str,
    body: bytes,
    *,
    headers: dict[str, str] | None = None,
    num_before: int = 200,
) -> tuple[list[float], list[float], tuple[int, bytes]]:
    """(small latencies before, small latencies while `body` is POSTed to `url`, its status and answer)."""
    with collector_paused():
        sent = iter(range(num_before))
        before = await open_loop(small, lambda: next(sent, None) is None)
        large = post_in_a_thread(url, body, headers)
        during = await open_loop(small, large.done)
        return before, during, await large


def p99(latencies: list[float]) -> float:
    return statistics.quantiles(latencies, n=100, method="inclusive")[98]
