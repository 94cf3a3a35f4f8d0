"""Prometheus metrics under vLLM's names, so one scraper (the router's, the autoscaler's, a Grafana board made for
vLLM) reads Shoal's replica and vLLM alike. Each app owns its registry; nothing is global.

Capture counters (`shoal_replica_capture_*`, no vLLM equivalent) are read from the `CaptureWriter` at scrape time,
so the writer thread keeps plain counts and never touches Prometheus objects.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from replica.capture import DROP_REASONS, CaptureStats

_TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_ITL_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS_S = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class ReplicaMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry
        self.num_running = Gauge("vllm:num_requests_running", "Requests in the running batch", labels, registry=r)
        self.num_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", labels, registry=r)
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labels, registry=r
        )
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", labels, registry=r
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of admitted requests", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", labels, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Sequences preempted for KV blocks", labels, registry=r)
        self.request_success = Counter(
            "vllm:request_success", "Finished requests by reason", [*labels, "finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Arrival to first token", labels, buckets=_TTFT_BUCKETS_S, registry=r
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Time between tokens", labels, buckets=_ITL_BUCKETS_S, registry=r
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to last token", labels, buckets=_E2E_BUCKETS_S, registry=r
        )
        # vLLM exports no batch limit; routers read this one as they read SGLang's sglang:max_running_requests.
        self.max_num_seqs = Gauge(
            "shoal_replica_max_num_seqs",
            "Sequences the engine runs at once (its batch limit); past it requests wait for a slot",
            labels,
            registry=r,
        )
        self.cache_config = Gauge(
            "vllm:cache_config_info", "KV cache configuration", [*labels, "block_size", "num_gpu_blocks"], registry=r
        )
        self.spec_drafts = Counter(
            "vllm:spec_decode_num_drafts", "Speculative verifications: one sequence's drafts in one step", labels,
            registry=r,
        )  # fmt: skip
        self.spec_draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens verified", labels, registry=r
        )
        self.spec_accepted_tokens = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", labels, registry=r
        )
        self.spec_accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0 = first); positions past the drafter's k are tokens a "
            "grammar forced after its drafts",
            [*labels, "position"],
            registry=r,
        )
        self.model_name = model_name

    def add_capture(self, stats: Callable[[], CaptureStats]) -> None:
        """Export a capture writer's counters."""
        self.registry.register(_CaptureCollector(stats))


class _CaptureCollector(Collector):
    def __init__(self, stats: Callable[[], CaptureStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield CounterMetricFamily(
            "shoal_replica_capture_records", "Capture records written", value=s.num_records_written
        )
        yield CounterMetricFamily(
            "shoal_replica_capture_bytes", "Bytes of capture records written", value=s.num_bytes_written
        )
        yield CounterMetricFamily(
            "shoal_replica_capture_files_rotated", "Capture files closed at their size limit", value=s.num_files_rotated
        )
        dropped = CounterMetricFamily(
            "shoal_replica_capture_dropped", "Capture records dropped, by reason", labels=["reason"]
        )
        for reason in DROP_REASONS:
            dropped.add_metric([reason], s.num_dropped[reason])
        yield dropped


class SpeculationSummary:
    """Totals of verified drafts since the last summary line, for the log: vLLM's mean acceptance length (tokens a
    verifying step emits per sequence, 1 + accepted / drafts) and the acceptance rate of each draft position."""

    def __init__(self) -> None:
        self.num_drafts = 0
        self.num_accepted = 0
        self.accepted_per_position: list[int] = []

    def _reset(self) -> None:
        self.num_drafts = self.num_accepted = 0
        self.accepted_per_position = []

    def add(self, num_drafts: int, num_accepted: int, accepted_per_position: list[int]) -> None:
        self.num_drafts += num_drafts
        self.num_accepted += num_accepted
        if len(self.accepted_per_position) < len(accepted_per_position):
            self.accepted_per_position += [0] * (len(accepted_per_position) - len(self.accepted_per_position))
        for j, n in enumerate(accepted_per_position):
            self.accepted_per_position[j] += n

    def line(self) -> str | None:
        """The summary since the last call, or None if nothing was verified."""
        if not self.num_drafts:
            return None
        rates = " ".join(f"{n / self.num_drafts:.2f}" for n in self.accepted_per_position)
        text = (
            f"speculative decoding: mean acceptance length {1 + self.num_accepted / self.num_drafts:.2f} over "
            f"{self.num_drafts} verifications; acceptance by draft position {rates}"
        )
        self._reset()
        return text
