"""KV-event fan-out: an SSE stream per subscriber (`GET /v1/kv_events`), which each router reads directly.

A new subscriber first receives a snapshot (`cleared`, then every cached block, parents first), taken between
engine steps, then every step's events in order, each SSE message `{"seq": n, "replica": id, "events": [...]}`
with `seq` increasing by one, so a gap tells the reader it missed something and should reconnect. A subscriber
that falls `max_queued` messages behind is disconnected rather than letting its backlog grow without bound.
"""

from __future__ import annotations

import asyncio
import logging

import orjson

from router.policy.kv_events import KVEvent, to_dict

log = logging.getLogger(__name__)


class _Subscriber:
    def __init__(self, max_queued: int) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(max_queued)
        self.is_dropped = False


class KVEventHub:
    def __init__(self, replica_id: str, *, max_queued: int = 4096) -> None:
        self.replica_id = replica_id
        self.max_queued = max_queued
        self._subscribers: set[_Subscriber] = set()
        self._seq = 0

    def _message(self, events: list[KVEvent]) -> bytes:
        self._seq += 1
        body = {"seq": self._seq, "replica": self.replica_id, "events": [to_dict(e) for e in events]}
        return orjson.dumps(body)

    def subscribe(self, snapshot: list[KVEvent]) -> _Subscriber:
        """Register a subscriber; `snapshot` must have been taken between steps, as this call is."""
        sub = _Subscriber(self.max_queued)
        sub.queue.put_nowait(
            orjson.dumps(
                {
                    "seq": self._seq,
                    "replica": self.replica_id,
                    "snapshot": True,
                    "events": [to_dict(e) for e in snapshot],
                }
            )
        )
        self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: _Subscriber) -> None:
        self._subscribers.discard(sub)

    def publish(self, events: list[KVEvent]) -> None:
        if not events or not self._subscribers:
            return
        message = self._message(events)
        for sub in list(self._subscribers):
            try:
                sub.queue.put_nowait(message)
            except asyncio.QueueFull:
                log.warning("KV-event subscriber fell %d messages behind; disconnecting it", self.max_queued)
                sub.is_dropped = True
                self._subscribers.discard(sub)

    def end_streams(self) -> None:
        """End every subscriber's stream (on shutdown, so open SSE responses do not hold the server up)."""
        for sub in list(self._subscribers):
            try:
                sub.queue.put_nowait(None)
            except asyncio.QueueFull:
                sub.is_dropped = True
        self._subscribers.clear()

    async def close(self) -> None:
        self.end_streams()
