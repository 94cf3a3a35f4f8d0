"""Prometheus metrics of one router process, on a registry of its own (never the global one).

Per-request counters and histograms are plain numbers bumped on the request path (a dict update or a bisect,
well under a microsecond; prometheus_client's own metric objects take a lock per update) and exported by a
collector at scrape time. They are only touched from the event loop's thread, the scrape included, so they
need no lock. Gauges of the pool (in-flight, queue, prefill backlog per replica and fleet-wide, for the
autoscaler) are read from the live state at scrape time, so the request path pays nothing for them.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from router.service.pool import ReplicaPool, Status
from router.service.supervise import TaskFailures

_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_DECISION_BUCKETS_S = (10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 10e-3)


class Counter:
    """A counter with labels; `inc(labels)` takes the label values in `labelnames` order."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = list(labelnames)
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, labels: tuple[str, ...] = (), amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def export(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, value in self.values.items():
            family.add_metric(list(labels), value)
        return family


class Histogram:
    """A histogram without labels, with fixed upper bounds (seconds)."""

    def __init__(self, name: str, documentation: str, bounds: Sequence[float]) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = list(bounds)
        self.counts = [0] * (len(bounds) + 1)  # the last is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def export(self) -> Metric:
        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        return HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=self.total)


class RouterMetrics:
    def __init__(self, pool: ReplicaPool, worker: str | None = None) -> None:
        self.requests = Counter(
            "shoal_router_requests",
            "Requests answered, by HTTP status, route branch (spill: left its cached replica for prefill backlog, "
            "spill_queue: for its queue for batch slots) and replica",
            ["status", "branch", "replica"],
        )
        self.retries = Counter("shoal_router_retries", "Attempts retried on another replica, by reason", ["reason"])
        self.decision_seconds = Histogram(
            "shoal_router_decision_seconds", "Time to hash, match and choose a replica", _DECISION_BUCKETS_S
        )
        self.ttft_seconds = Histogram(
            "shoal_router_ttft_seconds", "Observed time to first byte of streams", _LATENCY_BUCKETS_S
        )
        self.predicted_ttft_seconds = Histogram(
            "shoal_router_predicted_ttft_seconds", "The policy's predicted time to first token", _LATENCY_BUCKETS_S
        )
        self.request_seconds = Histogram(
            "shoal_router_request_seconds", "Whole request time through the router", _LATENCY_BUCKETS_S
        )
        self.predicted_cached_tokens = Counter(
            "shoal_router_predicted_cached_tokens", "Prompt tokens the router predicted to be cached"
        )
        self.observed_cached_tokens = Counter(
            "shoal_router_observed_cached_tokens",
            "Prompt tokens the replicas reported cached (usage.prompt_tokens_details.cached_tokens)",
        )
        self.prompt_tokens = Counter(
            "shoal_router_prompt_tokens", "Prompt tokens the replicas reported (usage.prompt_tokens)"
        )
        self.request_log_dropped = Counter(
            "shoal_router_request_log_dropped",
            "Request log lines dropped because the log's writer was behind (router/service/request_log.py)",
        )
        self.kv_events_applied = Counter(
            "shoal_router_kv_events_applied", "KV events applied to the prefix index, by kind", ["kind"]
        )
        self.kv_events_skipped = Counter(
            "shoal_router_kv_events_skipped",
            "KV events not applied, by reason: unknown_parent (the block they extend is not indexed), unsupported "
            "(another medium or attention kind, a LoRA adapter without a name), malformed (a ZMQ batch that could "
            "not be decoded)",
            ["reason"],
        )
        self.kv_events_reconnects = Counter(
            "shoal_router_kv_events_reconnects",
            "KV-event connections ended and retried, by reason (closed, error, gap, malformed, replica_down)",
            ["reason"],
        )
        self.kv_events_gaps = Counter(
            "shoal_router_kv_events_gaps",
            "Sequence gaps in KV-event streams: an SSE stream resyncs from a fresh snapshot, a ZMQ stream clears "
            "the replica's index entries",
        )
        self.tokenize_fallbacks = Counter(
            "shoal_router_tokenize_fallbacks",
            "Requests for a model with a router tokenizer that routed on text instead of token ids, by reason: "
            "template_error (the chat template rejected the chat), oversized (a body past "
            "tokenizer.max_request_bytes), unsupported (a request's own chat template, a folder without one)",
            ["reason"],
        )
        self.held_requests = 0
        """Requests waiting for any replica to become able to serve them (the router's own queue)."""
        self.tasks = TaskFailures(logging.getLogger("shoal.router.tasks"))
        """Failures of the background tasks (router/service/supervise.py)."""
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_RequestCollector(self))
        self.registry.register(self.tasks.collector("shoal_router"))
        self.registry.register(_PoolCollector(pool))
        self.worker = worker
        """This process's label among `--workers`; None for a lone router."""
        self._exported = self.registry
        if worker is not None:  # a `--workers` process (router/service/workers.py): every sample gets `worker`
            self._exported = CollectorRegistry(auto_describe=False)
            self._exported.register(_Labelled(self.registry, "worker", worker))

    def exposition(self) -> bytes:
        """The /metrics text of every collector registered, fleet sharing and KV events included."""
        return generate_latest(self._exported)


class _Labelled(Collector):
    """A registry's metrics with one more label on every sample."""

    def __init__(self, registry: CollectorRegistry, name: str, value: str) -> None:
        self._registry = registry
        self._label = {name: value}

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            family.samples = [sample._replace(labels={**sample.labels, **self._label}) for sample in family.samples]
            yield family


class _RequestCollector(Collector):
    def __init__(self, metrics: RouterMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        for value in vars(self._metrics).values():
            if isinstance(value, Counter | Histogram):
                yield value.export()
        yield GaugeMetricFamily(
            "shoal_router_held_requests",
            "Requests held while no replica can serve them (cold start, restart, scale from zero)",
            value=self._metrics.held_requests,
        )


class _PoolCollector(Collector):
    def __init__(self, pool: ReplicaPool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        per_replica = {
            "in_flight": GaugeMetricFamily(
                "shoal_router_replica_in_flight", "Requests in flight to a replica", labels=["replica"]
            ),
            "waiting": GaugeMetricFamily(
                "shoal_router_replica_waiting", "Requests waiting for their first byte", labels=["replica"]
            ),
            "streaming": GaugeMetricFamily(
                "shoal_router_replica_streaming", "Requests streaming output", labels=["replica"]
            ),
            "waiting_prompt_tokens": GaugeMetricFamily(
                "shoal_router_replica_prefill_backlog_tokens",
                "Uncached prompt tokens of requests waiting for their first byte",
                labels=["replica"],
            ),
        }
        rate = GaugeMetricFamily(
            "shoal_router_replica_prefill_tokens_per_second", "Learned prefill rate", labels=["replica"]
        )
        slot = GaugeMetricFamily(
            "shoal_router_replica_slot_seconds",
            "Learned seconds a request holds one of the replica's batch slots (absent until one finished)",
            labels=["replica"],
        )
        slots = GaugeMetricFamily(
            "shoal_router_replica_batch_slots",
            "Batch slots assumed for the replica: its scraped limit, else learned from latencies",
            labels=["replica"],
        )
        fixed = GaugeMetricFamily(
            "shoal_router_replica_fixed_seconds",
            "Learned seconds of each first byte that no prefill token explains",
            labels=["replica"],
        )
        up = GaugeMetricFamily(
            "shoal_router_replica_up", "1 when the replica takes new requests", labels=["replica", "status"]
        )
        totals = dict.fromkeys(per_replica, 0)
        by_status = dict.fromkeys(Status, 0)
        for replica in self._pool:
            s = replica.state
            own = {  # this router's own: the autoscaler sums over routers
                "in_flight": s.own_in_flight,
                "waiting": s.own_waiting,
                "streaming": s.streaming - (s.peer_in_flight - s.peer_waiting),
                "waiting_prompt_tokens": s.own_waiting_prompt_tokens,
            }
            for key, family in per_replica.items():
                family.add_metric([replica.id], own[key])
                totals[key] += own[key]
            rate.add_metric([replica.id], s.prefill_tokens_per_s)
            if s.slot_s is not None:
                slot.add_metric([replica.id], s.slot_s)
            if (batch_slots := s.batch_slots) is not None:
                slots.add_metric([replica.id], batch_slots)
            fixed.add_metric([replica.id], s.fixed_s)
            up.add_metric([replica.id, replica.status.value], 1.0 if replica.is_eligible else 0.0)
            by_status[replica.status] += 1
        yield from per_replica.values()
        yield rate
        yield slot
        yield slots
        yield fixed
        yield up
        yield GaugeMetricFamily("shoal_router_in_flight", "Requests in flight, all replicas", value=totals["in_flight"])
        yield GaugeMetricFamily(
            "shoal_router_queue_depth", "Requests waiting for their first byte, all replicas", value=totals["waiting"]
        )
        yield GaugeMetricFamily(
            "shoal_router_prefill_backlog_tokens",
            "Uncached prompt tokens waiting, all replicas",
            value=totals["waiting_prompt_tokens"],
        )
        yield GaugeMetricFamily(
            "shoal_router_kv_events_live_streams",
            "Replicas whose KV-event stream is connected and in sync (exact mode)",
            value=sum(replica.has_live_kv_events for replica in self._pool),
        )
        replicas = GaugeMetricFamily("shoal_router_replicas", "Replicas by status", labels=["status"])
        for status, count in by_status.items():
            replicas.add_metric([status.value], count)
        yield replicas
