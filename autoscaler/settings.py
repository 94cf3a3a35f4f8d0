"""`AutoscalerSettings`: every knob of `shoal autoscaler`, from CLI flags, the environment and a YAML file.

Precedence, highest first: CLI flags, `SHOAL_AUTOSCALER_*` environment variables (nested with `__`, e.g.
`SHOAL_AUTOSCALER_POLICY__MAX_REPLICAS=8`), the YAML file named by `--config` or `SHOAL_AUTOSCALER_CONFIG_FILE`,
defaults. The scaling policy is the pure `ScalingPolicyConfig`, shared with the simulator and the Helm chart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from autoscaler.policy.config import ScalingPolicyConfig
from router.common.command_settings import CommandSettings


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class KubernetesSettings(_Section):
    """The replica Deployment to scale, and the Lease that elects one active autoscaler."""

    namespace: str = "default"
    """Namespace of the Deployment, the router Service and the Lease. The Helm chart sets the release's."""
    deployment: str = "shoal-replica"
    """Name of the replica Deployment whose `scale` subresource is read and patched."""
    replica_port: int = Field(8000, ge=1, le=65535)
    """Container port of the replicas: a pod's base URL is http://<pod IP>:<port>, as the routers name it."""
    router_service: str | None = None
    """Service whose endpoints are the routers, so every router is scraped and told to drain; unset: only the
    static `routers` list is used."""
    lease_name: str = "shoal-autoscaler"
    """`coordination.k8s.io` Lease that elects the active autoscaler; the others wait as hot standbys."""
    lease_duration_s: float = Field(15.0, gt=0)
    """Seconds a leader's lease lasts without renewal before a standby may take it. client-go's default."""
    renew_deadline_s: float = Field(10.0, gt=0)
    """Seconds the leader keeps trying to renew before it gives up and exits. client-go's default."""
    retry_period_s: float = Field(2.0, gt=0)
    """Seconds between attempts to acquire or renew the lease. client-go's default."""

    @model_validator(mode="after")
    def _check(self) -> KubernetesSettings:
        if not self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError("need retry_period_s < renew_deadline_s < lease_duration_s")
        return self


class LocalSettings(_Section):
    """`shoal replica` processes on this machine, on consecutive loopback ports."""

    model: str = "demo"
    """Checkpoint folder, or `demo` (built into the cache directory on first use, by the first replica)."""
    served_model_name: str | None = None
    """Model name in the API; default: the replica's own (`shoal-demo` or the folder's name)."""
    host: str = "127.0.0.1"
    """Address the replicas listen on and the routers reach them at. Loopback: this actuator is for one machine."""
    base_port: int = Field(8100, ge=1, le=65535)
    """Port of the first replica slot; slot i listens on base_port + i."""
    max_replicas: int | None = Field(None, ge=1)
    """Replica processes this machine may run (port slots base_port .. base_port + max_replicas - 1); default:
    the policy's max_replicas. Set it to reserve a fixed port range whatever the policy's budget."""
    threads: int | None = Field(None, ge=1)
    """torch CPU threads per replica (`--threads`); default: the CPUs shared by the port slots."""
    replica_args: list[str] = Field(default_factory=list)
    """Extra arguments for every `shoal replica` (e.g. ["--quantization", "nvfp4"])."""
    command: list[str] | None = None
    """How to run `shoal` (e.g. ["/opt/venv/bin/shoal"]); default: the `shoal` beside this Python."""
    stop_timeout_s: float = Field(15.0, gt=0)
    """Seconds a replica gets to exit after SIGTERM before SIGKILL. It is drained first, so this only covers
    its shutdown (the replica's own graceful shutdown takes up to 10 s)."""
    log_dir: Path | None = None
    """Folder for one log file per replica; unset: replicas write to this process's stdout and stderr."""


_DEFAULT_TTFT = "histogram_quantile({quantile}, sum by (le) (rate(shoal_router_ttft_seconds_bucket{matchers}[1m])))"


class PrometheusQueries(_Section):
    """PromQL instant queries, one per signal of the policy's `Demand`. Unset: the default shown, over the routers'
    fleet gauges (DESIGN.md contract 3) narrowed by `prometheus.selector`. A vector of several series is summed,
    so a query without `sum()` still counts every router; TTFT takes the largest series instead."""

    in_flight: str | None = None
    """Requests in flight to replicas, all routers. Default: `sum(shoal_router_in_flight{<selector>})`."""
    queue_depth: str | None = None
    """Requests waiting for their first byte, all routers. Default: `sum(shoal_router_queue_depth{<selector>})`."""
    held: str | None = None
    """Requests the routers hold while no replica can serve them. Default:
    `sum(shoal_router_held_requests{<selector>})`."""
    prefill_backlog_tokens: str | None = None
    """Uncached prompt tokens waiting for prefill, all routers. Default:
    `sum(shoal_router_prefill_backlog_tokens{<selector>})`."""
    ttft_s: str | None = None
    """Time to first token, seconds, at the policy's `ttft_quantile` (which replaces `{quantile}` in a query set
    here). Default: `histogram_quantile({quantile}, sum by (le) (rate(shoal_router_ttft_seconds_bucket{<selector>}
    [1m])))`; one minute holds four scrapes at Prometheus' common 15 s interval. No sample, or NaN (no request in
    the window), means no TTFT figure, as in a quiet round of the routers' scrape."""
    kv_usage: str | None = None
    """Sum over ready replicas of their KV cache fraction (0..1 each). Unset: not queried; the routers' admin API
    gives it, as with `source: routers`. Set it (e.g. `sum(vllm:kv_cache_usage_perc{namespace="llm"})`) when
    Prometheus scrapes the engines themselves. No sample means no KV figure."""
    arrivals_per_s: str | None = None
    """Requests reaching the routers per second, for the policy's `capacity.from_arrivals`. Unset: not queried,
    and that signal falls back to the requests in flight. Over the routers' own figures, arrivals are the answered
    rate plus the growth of those in flight and held: `sum(rate(shoal_router_requests_total{...}[1m])) +
    sum(deriv(shoal_router_in_flight{...}[1m])) + sum(deriv(shoal_router_held_requests{...}[1m]))`. No sample
    means no figure."""
    request_s: str | None = None
    """Mean whole-request time, seconds, for `capacity.from_arrivals`. Unset: not queried. Over the routers'
    figures: `sum(rate(shoal_router_request_seconds_sum{...}[1m])) /
    sum(rate(shoal_router_request_seconds_count{...}[1m]))`. No sample, or NaN (no request finished), means no
    figure."""

    routers_down: str | None = None
    """Router scrape targets Prometheus finds down. While any is, the sums above miss its requests (its series
    go stale and drop out of `sum()`), so the observation is missing and the policy holds, naming the count.
    Default: `count(up{<selector>} == 0)` (no series when none is down); `none`: no check."""

    def resolved(self, selector: str, ttft_quantile: float) -> dict[str, str]:
        """Every query to run, by `Demand` field name, defaults filled in."""
        matchers = "{" + selector + "}" if selector else ""
        queries = {
            "in_flight": self.in_flight or f"sum(shoal_router_in_flight{matchers})",
            "queue_depth": self.queue_depth or f"sum(shoal_router_queue_depth{matchers})",
            "held": self.held or f"sum(shoal_router_held_requests{matchers})",
            "prefill_backlog_tokens": self.prefill_backlog_tokens
            or f"sum(shoal_router_prefill_backlog_tokens{matchers})",
            "ttft_s": (self.ttft_s or _DEFAULT_TTFT.replace("{matchers}", matchers)).replace(
                "{quantile}", repr(ttft_quantile)
            ),
        }
        for name in ("kv_usage", "arrivals_per_s", "request_s"):
            if query := getattr(self, name):
                queries[name] = query
        if self.routers_down != "none":
            queries["routers_down"] = self.routers_down or f"count(up{matchers} == 0)"
        return queries


class PrometheusSettings(_Section):
    """A Prometheus HTTP API (`GET <url>/api/v1/query`): Prometheus itself, Thanos, Mimir, VictoriaMetrics."""

    url: str | None = None
    """Base URL of the API, path prefix included (http://prometheus.monitoring:9090, or
    https://mimir.example/prometheus); `/api/v1/query` is appended. Required with `source: prometheus`."""
    selector: str = ""
    """PromQL label matchers, without braces, that narrow the default queries to this fleet's routers (e.g.
    `namespace="llm",service="shoal-router"`). Empty: every router Prometheus scrapes, right only when it
    scrapes one fleet."""
    queries: PrometheusQueries = Field(default_factory=PrometheusQueries)
    """The query of each signal."""
    timeout_s: float = Field(5.0, gt=0)
    """Seconds one query may take, sent to Prometheus as its evaluation `timeout` too; a query that does not
    answer in time makes the observation missing. Longer than the routers' scrape: a query crosses more hops."""
    bearer_token: SecretStr | None = None
    """Sent as `Authorization: Bearer <token>` (a managed Prometheus, or one behind an auth proxy). Unset: no
    Authorization header."""
    headers: dict[str, str] = Field(default_factory=dict)
    """Extra HTTP headers of every query (e.g. {"X-Scope-OrgID": "tenant-1"} for Mimir or Cortex)."""
    max_sample_age_s: float = Field(30.0, gt=0)
    """A sample whose timestamp is older than this many seconds (against this machine's clock) makes the
    observation missing, naming its query. The policy's own `metrics.stale_after_s` (also 30 s): for an
    instant query Prometheus stamps the evaluation time, so an old stamp means a caching query frontend or a
    clock that drifted, and neither should drive a decision."""

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str | None) -> str | None:
        if url is None:
            return None
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"Prometheus URL must be http(s)://host[:port][/prefix], got {url!r}")
        return url.rstrip("/")


class MetricsSourceSettings(_Section):
    """Where the fleet's demand is read. Per-replica figures (in-flight requests and cached prefix, for the choice
    of a victim; KV usage unless `prometheus.queries.kv_usage` is set) always come from the routers' admin API,
    and drains always go through the routers: Prometheus lags by a scrape interval, and a victim must be picked
    on what the routers see now."""

    source: Literal["routers", "prometheus"] = "routers"
    """`routers`: scrape every router's /metrics and sum the fleet gauges (no other moving part). `prometheus`:
    query a Prometheus HTTP API that scrapes the routers (one query per signal instead of one scrape per router,
    and the same figures the dashboards show)."""
    prometheus: PrometheusSettings = Field(default_factory=PrometheusSettings)
    """Used when `source` is `prometheus`."""

    @model_validator(mode="after")
    def _check(self) -> MetricsSourceSettings:
        if self.source == "prometheus" and self.prometheus.url is None:
            raise ValueError("metrics.source is prometheus: set metrics.prometheus.url")
        return self


class AutoscalerSettings(CommandSettings):
    """Settings of `shoal autoscaler`."""

    model_config = SettingsConfigDict(
        env_prefix="SHOAL_AUTOSCALER_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
        use_attribute_docstrings=True,
    )

    actuator: Literal["local", "kubernetes"] = "local"
    """What is scaled: `local` replica processes on this machine, or a Kubernetes Deployment."""
    routers: list[str] = Field(default_factory=list)
    """Router base URLs (http://host:port) to scrape and to drain replicas through; with Kubernetes, the
    endpoints of `kubernetes.router_service` are added to them."""
    admin_token: SecretStr | None = None
    """Bearer token of the routers' admin API, needed to drain replicas before removing them, to register local
    ones and to see per-replica load. Without it `shoal autoscaler` runs only with `dry_run`."""
    interval_s: float = Field(2.0, gt=0)
    """Seconds between decisions. Knative's tick: the 6 s panic window then holds three observations."""
    scrape_timeout_s: float = Field(2.0, gt=0)
    """Seconds to wait for one router's answer; a router that does not answer makes the observation missing."""
    drain_timeout_s: float = Field(300.0, gt=0)
    """Seconds a drained replica may take to finish its in-flight requests before it is removed anyway. Five
    minutes covers long generations; the scale-down step keeps removals rare enough for that."""
    dry_run: bool = False
    """Observe and decide, log and export every decision, but change nothing."""
    host: str = "127.0.0.1"
    """Address of the /metrics endpoint. Loopback by default; containers set 0.0.0.0."""
    metrics_port: int = Field(9090, ge=0, le=65535)
    """Port of the /metrics endpoint (Prometheus' conventional port for a component's own metrics)."""
    log_level: str = "INFO"
    metrics: MetricsSourceSettings = Field(default_factory=MetricsSourceSettings)
    """Where demand is read: the routers' /metrics, or a Prometheus HTTP API."""
    policy: ScalingPolicyConfig = Field(default_factory=ScalingPolicyConfig)
    """The scaling policy; see autoscaler/policy/config.py for each parameter."""
    kubernetes: KubernetesSettings = Field(default_factory=KubernetesSettings)
    """Used when `actuator` is `kubernetes`."""
    local: LocalSettings = Field(default_factory=LocalSettings)
    """Used when `actuator` is `local`."""
    config_file: Path | None = None
    """YAML file with any of these settings; environment variables override it."""

    @field_validator("routers")
    @classmethod
    def _check_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"router URL must be http(s)://host[:port], got {url!r}")
        return [url.rstrip("/") for url in urls]

    @model_validator(mode="after")
    def _check(self) -> AutoscalerSettings:
        slots = self.local.max_replicas
        if self.actuator == "local" and slots is not None and self.policy.max_replicas > slots:
            raise ValueError(
                f"policy.max_replicas ({self.policy.max_replicas}) exceeds local.max_replicas "
                f"({self.local.max_replicas}), the port slots of this machine"
            )
        return self
