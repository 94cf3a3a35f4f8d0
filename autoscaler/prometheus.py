"""Fleet demand from a Prometheus HTTP API: one instant query per signal, `GET <url>/api/v1/query`.

The `time` parameter is left out, so Prometheus evaluates each query at its own now and stamps every sample with
that time. The answer is Prometheus' JSON envelope: `status` (`success`, or `error` with `errorType` and `error`)
and `data`, whose `resultType` must be `vector` (a list of series, each `{"metric": {...}, "value": [t, "v"]}`)
or `scalar` (`[t, "v"]`); `t` is Unix seconds and `v` a string ("NaN" and "+Inf" included). Several series are
summed (TTFT: the largest), so a query that leaves out `sum()` still counts every router.

A round yields demand only when every query succeeds and each of the four gauges (in flight, queue depth, held,
prefill backlog) gives a finite sample at most `max_sample_age_s` old. An error status, an HTTP error, no answer
in time, an empty vector, NaN or an old sample fails the round (the policy then holds, as when a router does not
answer its scrape), and the log names the query. TTFT, KV usage, arrivals and request time are optional figures:
no sample, or NaN (a rate over a window without requests), is no figure, while an error still fails the round.

A sum cannot tell a router that went away from one that died: a dead router's series go stale and drop out of
it, and demand looks smaller than it is. So each round also counts the router targets Prometheus finds down
(`up == 0`, the `routers_down` query); while any is, the round fails and the log says how many. A router that
was removed (its target gone from discovery) is no longer counted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from autoscaler.observe import DemandReading
from autoscaler.policy.types import Demand
from autoscaler.settings import PrometheusSettings

log = logging.getLogger(__name__)

_OPTIONAL = frozenset({"ttft_s", "kv_usage", "arrivals_per_s", "request_s", "routers_down"})
"""Figures whose absence is no failure (no router down: `count()` of nothing is no series)."""


class PrometheusError(RuntimeError):
    """A query failed: no answer, an HTTP error, an error status, or an answer of the wrong shape."""


Sample = tuple[float, float]
"""(Unix seconds, value) of one series."""


class PrometheusDemand:
    """Reads `Demand` from Prometheus with the queries of `settings` (a `DemandSource` for `RouterClient`)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        settings: PrometheusSettings,
        *,
        ttft_quantile: float,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if settings.url is None:
            raise ValueError("PrometheusDemand needs settings.url")
        self._session = session
        self._endpoint = settings.url + "/api/v1/query"
        self.queries = settings.queries.resolved(settings.selector, ttft_quantile)
        """The query of each `Demand` figure, defaults filled in."""
        self._headers = dict(settings.headers)
        if settings.bearer_token is not None:
            self._headers["Authorization"] = f"Bearer {settings.bearer_token.get_secret_value()}"
        self._timeout = aiohttp.ClientTimeout(total=settings.timeout_s)
        self._evaluation_timeout = f"{settings.timeout_s:g}s"
        self._max_age_s = settings.max_sample_age_s
        self._wall_clock = wall_clock

    async def read(self) -> DemandReading:
        names = list(self.queries)
        answers = await asyncio.gather(*(self.query(self.queries[n]) for n in names), return_exceptions=True)
        now = self._wall_clock()
        errors: list[str] = []
        values: dict[str, float | None] = {}
        oldest_s = now
        for name, answer in zip(names, answers, strict=True):
            if isinstance(answer, PrometheusError):
                errors.append(f"{name} query {self.queries[name]!r}: {answer}")
                continue
            if isinstance(answer, BaseException):
                raise answer
            value = _combine(name, answer)
            if value is None or math.isnan(value):
                if name not in _OPTIONAL:
                    what = "no sample" if value is None else "NaN"
                    errors.append(f"{name} query {self.queries[name]!r}: {what}")
                values[name] = None
                continue
            if math.isinf(value):
                errors.append(f"{name} query {self.queries[name]!r}: {value}")
                continue
            taken_at = min(t for t, _ in answer)
            if now - taken_at > self._max_age_s:
                errors.append(
                    f"{name} query {self.queries[name]!r}: sample {now - taken_at:.0f} s old "
                    f"(limit {self._max_age_s:.0f} s)"
                )
                continue
            values[name] = value
            oldest_s = min(oldest_s, taken_at)
        down = values.get("routers_down")
        if down:
            errors.append(
                f"{down:.0f} router target(s) down (query {self.queries['routers_down']!r}): the sums miss their"
                " requests"
            )
        for error in errors:
            log.warning("Prometheus observation failed: %s", error)
        if errors:
            return DemandReading(None, errors=tuple(errors))
        held = values["held"] or 0.0
        demand = Demand(
            requests=(values["in_flight"] or 0.0) + held,
            waiting=(values["queue_depth"] or 0.0) + held,
            prefill_backlog_tokens=values["prefill_backlog_tokens"] or 0.0,
            kv_usage=values.get("kv_usage"),
            ttft_s=values.get("ttft_s"),
            arrivals_per_s=values.get("arrivals_per_s"),
            request_s=values.get("request_s"),
        )
        return DemandReading(demand, age_s=max(0.0, now - oldest_s))

    async def query(self, promql: str) -> list[Sample]:
        """One instant query: a sample per series (one for a scalar); raises `PrometheusError`."""
        params = {"query": promql, "timeout": self._evaluation_timeout}
        try:
            async with self._session.get(
                self._endpoint, params=params, headers=self._headers, timeout=self._timeout
            ) as resp:
                status, text = resp.status, await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise PrometheusError(f"GET {self._endpoint}: {exc!r}") from exc
        try:
            body = json.loads(text)
        except ValueError:
            raise PrometheusError(f"HTTP {status}, not JSON: {text[:200]!r}") from None
        if not isinstance(body, dict):
            raise PrometheusError(f"HTTP {status}: expected a JSON object")
        if body.get("status") != "success":
            raise PrometheusError(f"HTTP {status}: {body.get('errorType', 'error')}: {body.get('error', text[:200])}")
        if status != 200:
            raise PrometheusError(f"HTTP {status}")
        for warning in body.get("warnings") or ():
            log.warning("Prometheus warns about %r: %s", promql, warning)
        return _samples(body.get("data"))


def _samples(data: Any) -> list[Sample]:
    if not isinstance(data, dict):
        raise PrometheusError("no data in a successful answer")
    kind, result = data.get("resultType"), data.get("result")
    if kind == "scalar":
        return [_sample(result)]
    if kind == "vector" and isinstance(result, list):
        return [_sample(series.get("value") if isinstance(series, dict) else None) for series in result]
    raise PrometheusError(f"result type {kind!r}: the query must give an instant vector or a scalar")


def _sample(pair: Any) -> Sample:
    """[t, "v"] as floats; a series without one (a native histogram's `histogram`) is an error."""
    try:
        t, v = pair
        return float(t), float(v)
    except (TypeError, ValueError):
        raise PrometheusError(f"not a [time, value] sample: {pair!r}") from None


def _combine(name: str, samples: Sequence[Sample]) -> float | None:
    """The figure of several series: their sum, or the largest for TTFT (a quantile does not add up); None for
    an empty vector."""
    if not samples:
        return None
    if name == "ttft_s":
        finite = [v for _, v in samples if not math.isnan(v)]
        return max(finite) if finite else math.nan
    return sum(v for _, v in samples)
