"""The routers, as the autoscaler reads and steers them: fleet demand, per-replica load, drain and registration.

Demand is the sum of every router's fleet gauges (`shoal_router_in_flight`, `_queue_depth`, `_held_requests`,
`_prefill_backlog_tokens`, DESIGN.md contract 3), with the engines' own queue gauges from the admin API where
the routers scrape them (`autoscaler.policy.demand.fleet_demand`: held and engine-queued requests are demand); a
round in which any router does not answer yields no demand at
all, since a partial sum would understate the load and could shrink the fleet. TTFT is a quantile of the requests
since the previous round: each router's `shoal_router_ttft_seconds` histogram minus its previous scrape, summed.
Per-replica figures come from the admin API (contract 4): in-flight requests (summed over routers) and the
prefix-index entries each router holds for the replica (its cached-prefix value), for the choice of a victim.
Replicas are matched across routers and actuators by base URL, since each router names them its own way.

Demand may come from elsewhere instead (`DemandSource`, e.g. a Prometheus HTTP API in `autoscaler.prometheus`):
then the routers' /metrics are not scraped, but their admin API still gives the per-replica figures, and a round
in which a router's admin API or the source fails yields no demand either. The reading is then as old as the
source's oldest sample.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from autoscaler.policy.demand import fleet_demand
from autoscaler.policy.types import Demand

log = logging.getLogger(__name__)

RouterSource = Callable[[], Awaitable[Sequence[str]]]
"""Returns the base URLs of every router now (a static list, or the endpoints of a Service)."""

_GAUGES = {
    "shoal_router_in_flight": "in_flight",
    "shoal_router_queue_depth": "queue_depth",
    "shoal_router_held_requests": "held",
    "shoal_router_prefill_backlog_tokens": "prefill_backlog_tokens",
}
_TTFT = "shoal_router_ttft_seconds"
_ANSWERED = "shoal_router_requests"
_REQUEST_SECONDS = "shoal_router_request_seconds"


def static_routers(urls: Sequence[str]) -> RouterSource:
    routers = [u.rstrip("/") for u in urls]

    async def source() -> Sequence[str]:
        return routers

    return source


@dataclass(frozen=True, slots=True)
class DemandReading:
    """A demand source's answer in one round."""

    demand: Demand | None
    """None when any of its figures failed (see `errors`). `kv_usage` None: the routers' admin API gives it."""
    age_s: float = 0.0
    """Seconds since its oldest sample was taken."""
    errors: tuple[str, ...] = ()


class DemandSource(Protocol):
    """Fleet demand from something other than the routers' /metrics."""

    async def read(self) -> DemandReading: ...


class RouterError(RuntimeError):
    """A router did not answer, or answered something unexpected."""


@dataclass(frozen=True, slots=True)
class RouterReplica:
    """One replica as one router lists it (`GET /admin/replicas`)."""

    id: str
    url: str
    status: str
    is_eligible: bool
    in_flight: int
    kv_usage: float | None
    engine_waiting: int | None = None
    """The engine's queued sequences (`vllm:num_requests_waiting`); None unscraped."""


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica across every router."""

    url: str
    in_flight: int
    """Requests in flight to it, summed over routers."""
    cached_blocks: int
    """Prefix-index entries for it (exact and guessed), the most any router holds: its cached-prefix value."""
    kv_usage: float | None


@dataclass(frozen=True, slots=True)
class RouterFigures:
    """One router's answer in one round."""

    gauges: Mapping[str, float]
    ttft_buckets: tuple[tuple[float, float], ...]
    """Cumulative (upper bound, count) of its TTFT histogram, +Inf last."""
    replicas: tuple[RouterReplica, ...] | None
    """None without an admin token."""
    cached_blocks: Mapping[str, int]
    """Prefix-index entries per replica id."""
    answered: float | None = None
    """Requests answered since the router started (`shoal_router_requests_total`, every label)."""
    request_seconds: tuple[float, float] | None = None
    """(sum, count) of its whole-request time histogram."""


@dataclass(frozen=True, slots=True)
class RoutersReading:
    """Every router's figures in one round, at `measured_at` (the caller's clock)."""

    measured_at: float
    demand: Demand | None
    """None when any router failed to answer (see `errors`)."""
    replicas: Mapping[str, ReplicaLoad] = field(default_factory=dict)
    """By base URL; empty without an admin token."""
    listed: Mapping[str, Mapping[str, RouterReplica]] = field(default_factory=dict)
    """Per router URL, the replicas it lists, by base URL."""
    errors: tuple[str, ...] = ()


class RouterClient:
    """The autoscaler's client of every router: reads their figures (`observe`), drains, undrains, registers and
    deregisters replicas through their admin API. Holds the previous TTFT histograms, so one instance serves one
    loop."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        routers: RouterSource,
        *,
        admin_token: str | None,
        timeout_s: float = 2.0,
        ttft_quantile: float = 0.9,
        clock: Callable[[], float],
        demand_source: DemandSource | None = None,
    ) -> None:
        self._session = session
        self._demand_source = demand_source
        self._routers = routers
        self._headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else None
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._quantile = ttft_quantile
        self._clock = clock
        self._previous: dict[str, tuple[float, RouterFigures]] = {}
        """Per router, when it last answered and what: TTFT, arrivals and request times are measured since."""
        self.last_reading: RoutersReading | None = None

    # Observation ---------------------------------------------------------------------------------------------

    async def observe(self) -> RoutersReading:
        measured_at = self._clock()
        try:
            routers = list(await self._routers())
        except Exception as exc:  # discovery is someone else's API: any failure is a missing observation
            return self._remember(RoutersReading(measured_at, None, errors=(f"router discovery failed: {exc}",)))
        if not routers:
            return self._remember(RoutersReading(measured_at, None, errors=("no router to observe",)))
        reading, answers = await asyncio.gather(
            self._read_source(),
            asyncio.gather(*(self._read_router(url) for url in routers), return_exceptions=True),
        )
        errors = tuple(
            f"{url}: {answer}" for url, answer in zip(routers, answers, strict=True) if isinstance(answer, Exception)
        )
        for error in errors:
            log.warning("router observation failed: %s", error)
        figures = {
            url: answer for url, answer in zip(routers, answers, strict=True) if isinstance(answer, RouterFigures)
        }
        listed = {url: {r.url: r for r in f.replicas} for url, f in figures.items() if f.replicas is not None}
        replicas = _replica_loads(figures)
        demand: Demand | None
        if reading is None:
            demand = None if errors else self._demand(figures, replicas, measured_at)
        else:
            errors += reading.errors
            measured_at -= reading.age_s
            demand = None if errors or reading.demand is None else reading.demand
            if demand is not None and demand.kv_usage is None:
                demand = replace(demand, kv_usage=_kv_usage(figures, replicas))
        for url, f in figures.items():
            self._previous[url] = (measured_at, f)
        for gone in set(self._previous) - set(routers):
            del self._previous[gone]
        return self._remember(RoutersReading(measured_at, demand, replicas, listed, errors))

    async def _read_source(self) -> DemandReading | None:
        return None if self._demand_source is None else await self._demand_source.read()

    def _remember(self, reading: RoutersReading) -> RoutersReading:
        self.last_reading = reading
        return reading

    def _demand(
        self, figures: Mapping[str, RouterFigures], replicas: Mapping[str, ReplicaLoad], measured_at: float
    ) -> Demand:
        total = dict.fromkeys(_GAUGES.values(), 0.0)
        for f in figures.values():
            for key in total:
                total[key] += f.gauges.get(key, 0.0)
        before = {url: self._previous.get(url) for url in figures}
        deltas = [_delta(f.ttft_buckets, _ttft_buckets(before[url])) for url, f in figures.items()]
        ttft = histogram_quantile(self._quantile, _sum_buckets([d for d in deltas if d]))
        return fleet_demand(
            in_flight=total["in_flight"],
            waiting=total["queue_depth"],
            held=total["held"],
            engine_waiting=_engine_waiting(figures),
            prefill_backlog_tokens=total["prefill_backlog_tokens"],
            kv_usage=_kv_usage(figures, replicas),
            ttft_s=ttft,
            **_rates(figures, before, measured_at),
        )

    async def _read_router(self, url: str) -> RouterFigures:
        gauges: dict[str, float] = {}
        buckets: list[tuple[float, float]] = []
        answered: float | None = None
        seconds: tuple[float, float] | None = None
        text = "" if self._demand_source is not None else await self._get_text(url + "/metrics")
        for family in text_string_to_metric_families(text):
            if family.name in _GAUGES:
                gauges[_GAUGES[family.name]] = sum(s.value for s in family.samples)
            elif family.name == _TTFT:
                buckets = sorted(
                    (float(s.labels["le"]), s.value) for s in family.samples if s.name == _TTFT + "_bucket"
                )
            elif family.name == _ANSWERED:
                answered = sum(s.value for s in family.samples if s.name == _ANSWERED + "_total")
            elif family.name == _REQUEST_SECONDS:
                by_name = {s.name: s.value for s in family.samples if not s.labels}
                if _REQUEST_SECONDS + "_sum" in by_name and _REQUEST_SECONDS + "_count" in by_name:
                    seconds = (by_name[_REQUEST_SECONDS + "_sum"], by_name[_REQUEST_SECONDS + "_count"])
        if "in_flight" not in gauges and self._demand_source is None:
            raise RouterError("no shoal_router_in_flight gauge: not a Shoal router?")
        replicas: tuple[RouterReplica, ...] | None = None
        cached: dict[str, int] = {}
        if self._headers is not None:
            listing, index = await asyncio.gather(
                self._get_json(url + "/admin/replicas"), self._get_json(url + "/admin/index")
            )
            replicas = tuple(_router_replica(r) for r in listing.get("replicas", []))
            cached = {str(k): int(v) for k, v in (index.get("blocks_per_replica") or {}).items()}
        return RouterFigures(gauges, tuple(buckets), replicas, cached, answered, seconds)

    # Steering ------------------------------------------------------------------------------------------------

    async def register(self, url: str, name: str) -> None:
        """Add a replica at every router that does not list it, and undrain it where it is listed as draining
        (a drain that was cancelled, or left behind by an autoscaler that stopped mid-drain)."""
        reading = self.last_reading
        for router in await self._routers():
            listed = reading.listed.get(router, {}).get(url) if reading else None
            if listed is None:
                await self._send("POST", router + "/admin/replicas", {"url": url, "name": name}, ok=(200, 201))
                log.info("registered %s (%s) with %s", name, url, router)
            elif listed.status == "draining":
                await self._send("POST", f"{router}/admin/replicas/{listed.id}/undrain", ok=(200,))

    async def deregister(self, url: str) -> None:
        """Remove a replica from every router that lists it."""
        for router, replica in await self._each_listing(url):
            await self._send("DELETE", f"{router}/admin/replicas/{replica.id}", ok=(200, 404))

    async def drain(self, url: str) -> int:
        """Stop new requests to a replica at every router; returns how many routers list it."""
        listings = await self._each_listing(url)
        for router, replica in listings:
            await self._send("POST", f"{router}/admin/replicas/{replica.id}/drain", ok=(200,))
        return len(listings)

    async def undrain(self, url: str) -> None:
        for router, replica in await self._each_listing(url):
            await self._send("POST", f"{router}/admin/replicas/{replica.id}/undrain", ok=(200, 404))

    async def in_flight(self, url: str) -> int | None:
        """Requests in flight to a replica over every router; None when a router cannot say."""
        try:
            listings = await self._each_listing(url)
        except (RouterError, aiohttp.ClientError, TimeoutError):
            return None
        return sum(replica.in_flight for _, replica in listings)

    async def _each_listing(self, url: str) -> list[tuple[str, RouterReplica]]:
        """(router, its entry) for every router that lists the replica at `url`; raises if one cannot say."""
        routers = list(await self._routers())
        listings = await asyncio.gather(*(self._get_json(r + "/admin/replicas") for r in routers))
        found = []
        for router, listing in zip(routers, listings, strict=True):
            for entry in listing.get("replicas", []):
                replica = _router_replica(entry)
                if replica.url == url:
                    found.append((router, replica))
        return found

    # HTTP ----------------------------------------------------------------------------------------------------

    async def _get_text(self, url: str) -> str:
        try:
            async with self._session.get(url, timeout=self._timeout) as resp:
                if resp.status != 200:
                    raise RouterError(f"GET {url}: HTTP {resp.status}")
                return await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RouterError(f"GET {url}: {exc!r}") from exc

    async def _get_json(self, url: str) -> dict[str, Any]:
        if self._headers is None:
            raise RouterError("the admin API needs an admin token")
        try:
            async with self._session.get(url, headers=self._headers, timeout=self._timeout) as resp:
                if resp.status != 200:
                    raise RouterError(f"GET {url}: HTTP {resp.status}: {(await resp.text())[:200]}")
                body = await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise RouterError(f"GET {url}: {exc!r}") from exc
        if not isinstance(body, dict):
            raise RouterError(f"GET {url}: expected a JSON object")
        return body

    async def _send(self, method: str, url: str, body: Any = None, *, ok: tuple[int, ...]) -> None:
        if self._headers is None:
            raise RouterError("the admin API needs an admin token")
        try:
            async with self._session.request(
                method, url, json=body, headers=self._headers, timeout=self._timeout
            ) as resp:
                if resp.status not in ok:
                    raise RouterError(f"{method} {url}: HTTP {resp.status}: {(await resp.text())[:200]}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RouterError(f"{method} {url}: {exc!r}") from exc


def _rates(
    figures: Mapping[str, RouterFigures], before: Mapping[str, tuple[float, RouterFigures] | None], now: float
) -> dict[str, Any]:
    """`arrivals_per_s` and `request_s` since each router's previous answer, over every router: a request that
    arrived was answered, or is still in flight or held (arrivals = answered + the change of those). Both None
    unless every router gave both counters now and before and neither went back (a restarted router's would
    understate); `request_s` None also when no request finished."""
    unknown: dict[str, Any] = {"arrivals_per_s": None, "request_s": None}
    if not figures:
        return unknown
    arrivals_per_s = seconds = finished = 0.0
    for url, f in figures.items():
        previous = before[url]
        if previous is None or now <= previous[0]:
            return unknown
        then, old = previous
        if f.answered is None or f.request_seconds is None or old.answered is None or old.request_seconds is None:
            return unknown
        answered = f.answered - old.answered
        (seconds_now, count_now), (seconds_then, count_then) = f.request_seconds, old.request_seconds
        if answered < 0 or count_now < count_then:
            return unknown
        arrived = answered + _present(f) - _present(old)
        arrivals_per_s += max(0.0, arrived) / (now - then)
        seconds += seconds_now - seconds_then
        finished += count_now - count_then
    return {"arrivals_per_s": arrivals_per_s, "request_s": seconds / finished if finished else None}


def _ttft_buckets(previous: tuple[float, RouterFigures] | None) -> tuple[tuple[float, float], ...] | None:
    return None if previous is None else previous[1].ttft_buckets


def _present(figures: RouterFigures) -> float:
    """Requests in flight at the router or held by it."""
    return figures.gauges.get("in_flight", 0.0) + figures.gauges.get("held", 0.0)


def _router_replica(entry: Mapping[str, Any]) -> RouterReplica:
    engine = entry.get("engine") or {}
    kv = engine.get("kv_usage")
    waiting = engine.get("num_waiting")
    return RouterReplica(
        id=str(entry["id"]),
        url=str(entry["url"]).rstrip("/"),
        status=str(entry.get("status", "")),
        is_eligible=bool(entry.get("eligible", False)),
        in_flight=int(entry.get("in_flight", 0)),
        kv_usage=float(kv) if kv is not None else None,
        engine_waiting=int(waiting) if waiting is not None else None,
    )


def _engine_waiting(figures: Mapping[str, RouterFigures]) -> int | None:
    """Queued requests summed over the engines some router scraped, each engine once (every router scrapes the
    same engine); None when no router lists the figure (no admin token, or engines unscraped)."""
    per_url: dict[str, int] = {}
    for f in figures.values():
        for r in f.replicas or ():
            if r.engine_waiting is not None:
                per_url.setdefault(r.url, r.engine_waiting)
    return sum(per_url.values()) if per_url else None


def _kv_usage(figures: Mapping[str, RouterFigures], replicas: Mapping[str, ReplicaLoad]) -> float | None:
    """Sum of the eligible replicas' KV fractions; None unless every one of them reports it."""
    eligible = {r.url for f in figures.values() if f.replicas is not None for r in f.replicas if r.is_eligible}
    kv = [replicas[u].kv_usage for u in eligible if u in replicas]
    return sum(k for k in kv if k is not None) if kv and all(k is not None for k in kv) else None


def _replica_loads(figures: Mapping[str, RouterFigures]) -> dict[str, ReplicaLoad]:
    loads: dict[str, ReplicaLoad] = {}
    for f in figures.values():
        for r in f.replicas or ():
            before = loads.get(r.url)
            cached = f.cached_blocks.get(r.id, 0)
            if before is None:
                loads[r.url] = ReplicaLoad(r.url, r.in_flight, cached, r.kv_usage)
            else:
                kv = r.kv_usage if r.kv_usage is not None else before.kv_usage
                loads[r.url] = ReplicaLoad(r.url, before.in_flight + r.in_flight, max(before.cached_blocks, cached), kv)
    return loads


def _delta(
    now: tuple[tuple[float, float], ...], before: tuple[tuple[float, float], ...] | None
) -> tuple[tuple[float, float], ...]:
    """Bucket counts since the previous scrape; empty on a first scrape. A count that went down means the
    router restarted: its whole histogram is new."""
    if before is None:
        return ()
    if [b for b, _ in before] != [b for b, _ in now] or any(c < p for (_, c), (_, p) in zip(now, before, strict=True)):
        return now
    return tuple((bound, c - p) for (bound, c), (_, p) in zip(now, before, strict=True))


def _sum_buckets(histograms: list[tuple[tuple[float, float], ...]]) -> tuple[tuple[float, float], ...]:
    if not histograms:
        return ()
    first = histograms[0]
    if any([b for b, _ in h] != [b for b, _ in first] for h in histograms):
        return max(histograms, key=lambda h: h[-1][1])  # routers of different versions: the busiest one
    return tuple((bound, sum(h[i][1] for h in histograms)) for i, (bound, _) in enumerate(first))


def histogram_quantile(q: float, buckets: tuple[tuple[float, float], ...]) -> float | None:
    """Prometheus' `histogram_quantile` over cumulative (upper bound, count) buckets, +Inf last: linear
    interpolation within the bucket that holds the rank; the highest finite bound when it falls in +Inf."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound
