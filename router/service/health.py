"""Active health probes and metric scrapes, as two background tasks of the app.

Each task sleeps until the earliest replica is due (or until woken: passive failure marking and new replicas
set `wake`), probes the due replicas concurrently, and applies the results through `Replica`'s transitions.
Unhealthy replicas are probed every `unhealthy_interval_s`, healthy ones every `interval_s`. The replica's
models come from `/v1/models`, fetched while unknown and every `_MODELS_EVERY` probes.

A replica that does not answer is the probes' everyday business. One whose answer breaks the code that reads
it is a failure of that replica's probe or scrape (router/service/supervise.py), counted and logged as a task
failure; it costs that replica only: a probe so broken counts as a failed probe, a scrape so broken clears the
replica's engine gauges (unknown, not stale) and is retried after a backoff, while the others go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import aiohttp

from router.service.pool import Replica, ReplicaPool
from router.service.scrape import parse_engine_metrics
from router.service.settings import HealthSettings, ScrapeSettings
from router.service.supervise import TaskFailures, backoff_s

log = logging.getLogger("shoal.router.health")

_MODELS_EVERY = 15
_MAX_SCRAPE_BACKOFF_S = 60.0
"""Longest wait before scraping again a replica whose answers cannot be read."""


class HealthChecker:
    def __init__(
        self,
        settings: HealthSettings,
        pool: ReplicaPool,
        session: aiohttp.ClientSession,
        on_down: Callable[[Replica], None],
        clock: Callable[[], float],
        failures: TaskFailures,
        on_up: Callable[[Replica], None] = lambda replica: None,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.session = session
        self.on_down = on_down
        self.on_up = on_up
        self.clock = clock
        self.failures = failures
        failures.declare("health")
        self.wake = asyncio.Event()

    async def run(self) -> None:
        while True:
            now = self.clock()
            due = [r for r in self.pool if r.probe_now or r.next_probe_at <= now]
            if due:
                await asyncio.gather(*(self.probe(r) for r in due))
            upcoming = [0.0 if r.probe_now else r.next_probe_at for r in self.pool]
            delay = max(0.0, min(upcoming, default=now + self.settings.interval_s) - self.clock())
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout=max(delay, 0.01))

    async def probe(self, replica: Replica) -> None:
        s = self.settings
        client_timeout = aiohttp.ClientTimeout(total=s.timeout_s)
        try:
            async with self.session.get(replica.url + s.path, timeout=client_timeout) as resp:
                await resp.read()
                if resp.status != 200:
                    raise _ProbeError(f"{s.path} answered HTTP {resp.status}")
            if not replica.model_cards or replica.probes_since_models >= _MODELS_EVERY:
                replica.model_cards = await self._models(replica, client_timeout)
                replica.probes_since_models = 0
            replica.probes_since_models += 1
        except (aiohttp.ClientError, TimeoutError, _ProbeError, ValueError) as exc:
            self._probe_failed(replica, str(exc) or type(exc).__name__)
        except Exception as exc:  # its answer broke the code that reads it: that replica's failure only
            self.failures.failed("health", exc, where=replica.id)
            self._probe_failed(replica, f"{type(exc).__name__}: {exc}")
        else:
            if replica.probe_succeeded(s, self.clock()):
                log.info("replica %s is in rotation", replica.id)
                self.on_up(replica)
        replica.next_probe_at = self.clock() + (s.interval_s if replica.is_healthy else s.unhealthy_interval_s)

    def _probe_failed(self, replica: Replica, error: str) -> None:
        if replica.probe_failed(self.settings, error):
            log.warning("replica %s is out of rotation: %s", replica.id, error)
            self.on_down(replica)

    async def _models(self, replica: Replica, client_timeout: aiohttp.ClientTimeout) -> dict[str, dict[str, Any]]:
        async with self.session.get(replica.url + "/v1/models", timeout=client_timeout) as resp:
            if resp.status != 200:
                return replica.model_cards
            data = await resp.json(content_type=None)
        cards: dict[str, dict[str, Any]] = {}
        for card in data.get("data", []) if isinstance(data, dict) else []:
            if isinstance(card, dict) and isinstance(card.get("id"), str):
                cards[card["id"]] = card
        return cards


class _ProbeError(Exception):
    pass


Gauges = Callable[[Replica, int | None, int | None, float | None, int | None], object]
"""`on_gauges(replica, num_running, num_waiting, kv_usage, max_num_seqs)`: one scrape's engine gauges."""


class MetricsScraper:
    """Reads engine gauges (queue, KV usage and, where the engine exports it, its batch limit) every `interval_s`
    into `on_gauges` (the routing core's `set_gauges`), and the engine's KV cache size into
    `on_kv_capacity(replica, tokens)` unless the admin API set the replica's capacity. A replica whose answer
    cannot be read is scraped again after a backoff from `interval_s` to `_MAX_SCRAPE_BACKOFF_S`."""

    def __init__(
        self,
        settings: ScrapeSettings,
        pool: ReplicaPool,
        session: aiohttp.ClientSession,
        on_gauges: Gauges,
        *,
        clock: Callable[[], float],
        failures: TaskFailures,
        on_kv_capacity: Callable[[Replica, float], object] = lambda replica, tokens: None,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.session = session
        self.on_gauges = on_gauges
        self.on_kv_capacity = on_kv_capacity
        self.clock = clock
        self.failures = failures
        failures.declare("scrape")
        self._backoffs: dict[str, tuple[int, float]] = {}
        """Replica id -> (consecutive failed scrapes, when to scrape it next), for replicas whose last answer
        could not be read."""

    async def run(self) -> None:
        while True:
            now = self.clock()
            replicas = [r for r in self.pool if r.is_healthy and self._backoffs.get(r.id, (0, now))[1] <= now]
            await asyncio.gather(*(self.scrape(r) for r in replicas))
            for rid in self._backoffs.keys() - {r.id for r in self.pool}:
                del self._backoffs[rid]
                self.failures.up("scrape")
            await asyncio.sleep(self.settings.interval_s)

    async def scrape(self, replica: Replica) -> None:
        timeout = aiohttp.ClientTimeout(total=self.settings.timeout_s)
        try:
            async with self.session.get(replica.url + self.settings.path, timeout=timeout) as resp:
                if resp.status != 200:
                    return
                text = await resp.text()
            self._apply(replica, parse_engine_metrics(text))
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.debug("scrape of %s failed: %s", replica.id, exc)  # reachability is the health checker's
            return
        except Exception as exc:  # its answer broke the code that reads it: that replica's failure only
            self._failed(replica, exc)
            return
        if self._backoffs.pop(replica.id, None) is not None:
            self.failures.up("scrape")
            log.info("scrape of %s is readable again", replica.id)

    def _apply(self, replica: Replica, gauges: dict[str, float]) -> None:
        running, waiting, kv = gauges.get("num_running"), gauges.get("num_waiting"), gauges.get("kv_usage")
        limit = gauges.get("max_num_seqs")
        self.on_gauges(
            replica,
            int(running) if running is not None else None,
            int(waiting) if waiting is not None else None,
            kv,
            int(limit) if limit is not None else None,
        )
        block_size = gauges.get("kv_block_size")
        if block_size:
            replica.kv_block_size = int(block_size)
        capacity = gauges.get("kv_capacity_tokens")
        if capacity is not None and not replica.is_kv_capacity_configured:
            self.on_kv_capacity(replica, capacity)

    def _failed(self, replica: Replica, exc: Exception) -> None:
        """The replica's gauges become unknown, not stale, and its next scrape waits out a backoff."""
        self.on_gauges(replica, None, None, None, None)
        if replica.id not in self._backoffs:
            self.failures.down("scrape")
        num_failures = self._backoffs.get(replica.id, (0, 0.0))[0] + 1
        delay_s = backoff_s(num_failures, self.settings.interval_s, _MAX_SCRAPE_BACKOFF_S)
        self._backoffs[replica.id] = (num_failures, self.clock() + delay_s)
        self.failures.failed("scrape", exc, where=replica.id, retry_in_s=delay_s)
