"""`RouterSettings`: every knob of `shoal router`, from the environment, a YAML file and CLI flags.

Precedence, highest first: CLI flags, `SHOAL_ROUTER_*` environment variables (nested with `__`, e.g.
`SHOAL_ROUTER_HEALTH__INTERVAL_S=1`), the YAML file named by `--config` or `SHOAL_ROUTER_CONFIG_FILE`, defaults.
The routing policy and the prefix index are the pure configs of `router.policy`, shared with the simulator.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from router.common.command_settings import CommandSettings
from router.policy.config import EstimatedTTFTConfig, PolicyConfig
from router.policy.hashing import DEFAULT_TEXT_BLOCK_SIZE, DEFAULT_TOKEN_BLOCK_SIZE
from router.policy.prefill_rate import PrefillRateEstimator
from router.policy.prefix_index import PrefixIndexConfig
from router.policy.service_time import ServiceTimeEstimator
from router.policy.session import SessionAffinityConfig
from router.service.redis_url import parse_redis_url
from router.service.replica_url import split_url


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class HashingSettings(_Section):
    text_block_size: int = Field(DEFAULT_TEXT_BLOCK_SIZE, gt=0)
    """Bytes per block of routing text (text mode). 64 bytes is about one 16-token KV block of English."""
    token_block_size: int = Field(DEFAULT_TOKEN_BLOCK_SIZE, gt=0)
    """Tokens per block when a prompt arrives as token ids; must equal the engines' KV block size (16 in vLLM)."""
    bytes_per_token: float = Field(4.0, gt=0)
    """Average UTF-8 bytes per token, to estimate prompt tokens from text. ~4 for English BPE vocabularies."""
    memo_entries: int = Field(16384, ge=0)
    """Chunks of 64 blocks whose hashes are remembered (`hashing.ChainMemo`), so a prefix seen before (a
    conversation's earlier turns, a system prompt) is not hashed again. Memory: ~2.9 KiB per chunk plus ~180 bytes
    for each of up to 4x as many chunks seen once; ~58 MiB at the default, which covers 64 MiB of prompt text.
    0 turns it off."""
    max_blocks: int = Field(8192, gt=0)
    """Hash at most this many leading blocks (512 KiB of text): bounds the router's CPU on huge prompts."""


class HealthSettings(_Section):
    interval_s: float = Field(2.0, gt=0)
    """Seconds between probes of a healthy replica."""
    unhealthy_interval_s: float = Field(0.5, gt=0)
    """Seconds between probes of an unhealthy replica: short, so a restarted replica is back within seconds."""
    timeout_s: float = Field(2.0, gt=0)
    """Per-probe timeout in seconds."""
    failure_threshold: int = Field(2, ge=1)
    """Consecutive failed probes that take a replica out of rotation."""
    success_threshold: int = Field(1, ge=1)
    """Consecutive good probes that put it back. 1: a replica that answers /health is ready to serve."""
    path: str = "/health"
    """Probe path; vLLM, SGLang and Shoal's replica all answer GET /health."""


class BreakerSettings(_Section):
    failure_threshold: int = Field(5, ge=1)
    """Consecutive failed requests (5xx or transport errors) that open a replica's circuit."""
    open_s: float = Field(2.0, ge=0)
    """Minimum seconds a circuit stays open; the first good probe after that closes it."""


class ScrapeSettings(_Section):
    enabled: bool = True
    """Scrape each replica's /metrics for engine queue and KV gauges (vLLM and SGLang names)."""
    interval_s: float = Field(2.0, gt=0)
    """Seconds between scrapes; the gauges lag by at most this much, router-local counts never lag."""
    timeout_s: float = Field(2.0, gt=0)
    path: str = "/metrics"
    infer_max_num_seqs: bool = True
    """For an engine that exports no batch limit (vLLM), take the most sequences it was seen running as its limit
    once a scrape sees requests queued beside running ones (`ReplicaState.set_gauges`), so that estimated_ttft
    prices the wait for a slot; replicas with no limit of their own take their peers' mean. On by default: without
    it, in front of vLLM a hot prefix stays on the replicas holding it while their slots queue (the live check in
    tests/integration/test_router_batch_slots.py). A full KV cache queues requests too, and then reads as a limit;
    never below the most the engine was seen running, so it prices no wait the engine did not show."""


class RetrySettings(_Section):
    max_attempts: int = Field(3, ge=1)
    """Replicas tried per request before giving up; retries happen only before any byte reached the client."""
    total_timeout_s: float = Field(30.0, gt=0)
    """Seconds after which no new attempt is started."""
    connect_timeout_s: float = Field(5.0, gt=0)
    """Seconds to open a connection to a replica."""


class LimitSettings(_Section):
    max_body_bytes: int = Field(32 * 1024 * 1024, gt=0)
    """Largest request body accepted (413 beyond). 32 MiB fits a 1M-token prompt with room to spare."""
    parse_off_loop_min_bytes: int = Field(256 * 1024, gt=0)
    """Request bodies of at least this many bytes are parsed in a child process (`router.service.body_parser`), so
    that one large body holds no other request up: parsing token ids on the event loop costs ~17 ms per MB. Where
    the router tokenizes (`tokenizer.models`), bodies up to `tokenizer.max_request_bytes` are parsed on the loop."""
    header_read_timeout_s: float = Field(30.0, gt=0)
    """Seconds allowed to receive a request's head once its first byte arrived (408 beyond)."""
    body_read_timeout_s: float = Field(30.0, gt=0)
    """Seconds allowed to receive a request body (408 beyond): stops slow-body clients tying up the router."""
    request_timeout_s: float = Field(1800.0, gt=0)
    """Seconds a whole request may take, streaming included; long generations need generous values."""
    keepalive_timeout_s: float = Field(75.0, gt=0)
    """Seconds an idle client connection is kept open (nginx's default), so idle sockets do not pile up."""
    unready_delay_s: float = Field(5.0, ge=0)
    """On SIGTERM, seconds to keep serving with /ready at 503 before draining, while load balancers (Kubernetes
    endpoints) stop sending new requests here. SIGINT (Ctrl-C) skips it."""
    upstream_idle_timeout_s: float = Field(600.0, gt=0)
    """Seconds a replica may stay silent mid-response (no byte) before the attempt fails. Generous: a
    non-streamed answer sends nothing until the whole generation is done."""
    shutdown_grace_s: float = Field(60.0, ge=0)
    """On SIGTERM, seconds to let in-flight requests finish before the process exits."""


class HoldSettings(_Section):
    max_requests: int = Field(1024, ge=0)
    """Requests that may wait at once while no replica can serve them (a cold start, a fleet-wide restart, scale
    from zero, or every replica at `max_in_flight_per_replica`); beyond it a request gets 503 at once. 0 turns
    holding off."""
    max_wait_s: float = Field(30.0, ge=0)
    """Seconds a held request waits for a replica before it gets 503 with Retry-After. Covers a replica restart;
    a cold start of a large model takes longer and is the autoscaler's to hide."""
    max_in_flight_per_replica: int = Field(0, ge=0)
    """Requests this router keeps in flight on one replica at once; 0 (the default) sets no limit. A request that
    finds every replica serving its model at the limit is held, in arrival order (within `max_requests` and
    `max_wait_s`), and goes to the first replica that frees a slot. Set it to the engines' batch size (vLLM's and
    `shoal replica`'s `--max-num-seqs`) so that queues form at the router, where a request takes whichever replica
    frees first, not behind one replica's long generations (`router.policy.admission`). A retry ignores it. The
    limit is per router: with several routers, divide the batch size among them."""


class DiscoverySettings(_Section):
    kind: Literal["static", "kubernetes"] = "static"
    """Where replicas come from besides the admin API. `static`: the `replicas` list only. `kubernetes`: the
    EndpointSlices of `service`, watched (router/service/discovery.py; RBAC: list and watch endpointslices).
    Static by default, so a router runs anywhere without a cluster."""
    namespace: str = "default"
    """Namespace of the replicas' Service. `default`, as kubectl's; the chart sets the release's namespace."""
    service: str | None = None
    """Name of the replicas' Service: its EndpointSlices carry the label `kubernetes.io/service-name=<service>`.
    Required for `kubernetes`; no default, since no name fits every install."""
    port_name: str | None = None
    """The Service port the replicas serve HTTP on, by name (e.g. `http`). None: the slices' only port, which is
    right for the usual one-port Service."""
    port: int | None = Field(None, ge=1, le=65535)
    """Replica port to use instead of the slices' own (a headless Service that lists no ports). None: take it
    from the slices, so the Service stays the one place that says it."""

    @model_validator(mode="after")
    def _check_service(self) -> DiscoverySettings:
        if self.kind == "kubernetes" and not self.service:
            raise ValueError("discovery.service is required when discovery.kind is 'kubernetes'")
        return self


class KVEventSettings(_Section):
    source: Literal["none", "sse", "zmq"] = "none"
    """Where each replica's KV events come from, for the exact prefix index (router/service/kv_events.py).
    `none`: approximate mode, the index holds the router's own routing decisions. `sse`: Shoal's replica, `GET
    /v1/kv_events` (a snapshot, then every engine step's events). `zmq`: vLLM's ZMQ publisher
    (`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`). Off by default: stock
    engines publish nothing unless told to, and approximate mode works in front of any engine."""
    sse_path: str = "/v1/kv_events"
    """Path of the SSE stream on each replica's base URL; Shoal's replica serves it there."""
    zmq_sources_path: str = "/kv_event_sources"
    """Path on each replica's base URL where vLLM (>= 0.11) lists its publishers per data-parallel rank: endpoint,
    replay endpoint and topic, `*` standing for the replica's host. Several vLLMs on one host each name their own
    ports there. Where it answers nothing usable, `zmq_port`, `zmq_replay_port` and `zmq_topic` apply."""
    zmq_port: int = Field(5557, ge=1, le=65535)
    """Port of each replica's ZMQ PUB socket on the replica's own host, for engines without `zmq_sources_path`.
    5557: the port of vLLM's examples and of the chart's vLLM flags (`"endpoint": "tcp://*:5557"`)."""
    zmq_replay_port: int | None = Field(None, ge=1, le=65535)
    """Port of each replica's replay (ROUTER) socket, for engines without `zmq_sources_path`; None: no replay,
    so events lost to a gap or to a router restart demote the replica's entries to approximate ones."""
    zmq_topic: str = "kv-events"
    """Topic the router subscribes to (ZMQ matches it as a prefix) for engines without `zmq_sources_path`; must be
    the engine's `topic`. `kv-events`, as the chart configures vLLM. vLLM's own default topic is empty: set "" for
    engines started without one."""
    replay_timeout_s: float = Field(5.0, gt=0)
    """Seconds to wait for each message of a replay before the stream is restarted. A replay answers from the
    engine's memory; 5 s covers a busy engine's publisher thread."""
    reconnect_min_s: float = Field(0.2, gt=0)
    """Seconds before the first reconnection after a stream is lost; doubled (with jitter) per failed attempt. A
    replica that comes back into rotation is reconnected at once, so this only paces streams that fail while
    their replica answers its probes."""
    reconnect_max_s: float = Field(10.0, gt=0)
    """Upper bound, in seconds, on the wait between reconnection attempts: a replica that is down for long is
    retried every 10 s, a cost of nothing while exact mode stays at most that stale after it returns."""
    max_blocks_per_s: float = Field(20_000.0, gt=0)
    """Blocks per second one replica's events may apply to the index; beyond it the stream is read more slowly
    (TCP or ZMQ backpressure, then a gap and a resync) rather than stall the router's event loop. A block costs
    some 8 us (its router hash and the dict updates), so 20k/s is 16% of a core per stream, and 320k tokens/s of
    newly cached prefill, above what one GPU computes; a large snapshot is spread over seconds."""
    max_message_bytes: int = Field(256 * 1024 * 1024, gt=0)
    """Largest SSE message, in bytes, accepted before the stream is dropped as broken. A snapshot names every
    cached block in one message, some 230 bytes per 16-token block: 256 MiB covers a million blocks."""

    @model_validator(mode="after")
    def _check_backoff(self) -> KVEventSettings:
        if self.reconnect_max_s < self.reconnect_min_s:
            raise ValueError("kv_events.reconnect_max_s must be at least kv_events.reconnect_min_s")
        return self


class TokenizerSettings(_Section):
    models: dict[str, Path] = Field(default_factory=dict)
    """Served model name -> a folder with that model's `tokenizer.json` and `tokenizer_config.json` (its chat
    template, or in `chat_template.jinja` beside it). Chat and string prompts for these models route on token ids,
    the blocks the engines hash, so in exact mode the replicas' KV events match chat traffic
    (router/service/chat_tokenizer.py). Needs the `tokenize` extra. Empty by default: without a model's files the
    router hashes routing text, which works in front of any engine."""
    max_request_bytes: int = Field(512 * 1024, gt=0)
    """Request bodies larger than this route on text (counted as `oversized`): they would hold a core for long.
    512 KiB is some 128k tokens, the most a prompt is hashed over at the default `hashing.max_blocks`."""
    off_loop_min_bytes: int = Field(4 * 1024, ge=0)
    """Request bodies of at least this many bytes are tokenized on a worker thread, smaller ones on the event loop.
    The encode releases the GIL, so a thread keeps the loop serving other requests through a prompt's 2-13 ms
    (1k-8k tokens on the development machine, benchmarks/bench_chat_tokenize.py); below ~1k tokens the loop pauses
    under 2 ms and the thread hand-off is a larger share. 4 KiB is some 1k tokens; 0: every request on a thread."""
    exclude_tools_when_tool_choice_none: bool = True
    """Render no tools when `tool_choice` is `none`, as Shoal's replica does. vLLM renders them unless started
    with `--exclude-tools-when-tool-choice-none`: set False in front of a stock vLLM."""

    @field_validator("models")
    @classmethod
    def _check_folders(cls, models: dict[str, Path]) -> dict[str, Path]:
        for model, folder in models.items():
            if not (folder / "tokenizer.json").is_file():
                raise ValueError(f"tokenizer.models[{model!r}]: {folder} has no tokenizer.json")
        return models


class RequestLogSettings(_Section):
    path: Path | None = None
    """File the per-request JSON lines are appended to; None: standard error, beside the router's other logs."""
    max_pending_lines: int = Field(65536, gt=0)
    """Lines that may wait for the writer thread; beyond it new lines are dropped and counted
    (`shoal_router_request_log_dropped_total`), so a slow disk never slows requests. 65536 lines, some 20 MiB, is
    several seconds of the router's peak rate."""
    flush_interval_s: float = Field(0.2, gt=0)
    """Seconds between the writer's batches (sooner once 512 lines wait): lines reach the sink at most this late."""


# --- Router fleet: several routers share one view through Redis (router/service/fleet.py) ----------------------


def check_redis_url(url: str) -> str:
    """A Redis URL of a form `router.service.redis_url` connects to (standalone, Sentinel or Cluster); ValueError
    naming what is wrong otherwise."""
    parse_redis_url(url)
    return url


class FleetSettings(_Section):
    namespace: str = Field("shoal", min_length=1, pattern=r"^[^{}]+$")
    """Prefix of the Redis keys this fleet uses (`{<namespace>}:fleet:*`, a hash tag so that a Redis Cluster keeps
    them in one slot): routers with the same namespace share one view. One Redis may serve several fleets under
    different namespaces."""
    flush_interval_s: float = Field(0.05, gt=0)
    """Seconds between two batches a router publishes: 50 ms keeps peers' views well within the one second the
    fleet's load must agree in, at some 20 Redis writes per second per router."""
    max_batch_records: int = Field(256, ge=1)
    """Records that make a batch go out before `flush_interval_s` has passed, so a burst does not make one huge
    stream entry."""
    max_queued_records: int = Field(8192, ge=1)
    """Records waiting to be published at most; past it new records are dropped and counted
    (`shoal_router_fleet_records_dropped_total`): a Redis that is down or slow never grows the router's memory."""
    heartbeat_s: float = Field(0.5, gt=0)
    """Seconds between batches that carry the router's whole load table even when nothing changed, so that a peer
    that missed a batch, or started since, has it within this long."""
    load_ttl_s: float = Field(3.0, gt=0)
    """Seconds after a router's last batch at which its load stops counting at the others: a router that died
    stops counting this long after. Several heartbeats, so a slow write or two does not drop a live router."""
    stream_max_len: int = Field(5_000, ge=1)
    """Entries (batches) the routing-records stream keeps, trimmed approximately (XADD MAXLEN ~): bounds Redis's
    memory. A batch of 10 decisions of 64 blocks and a 64-replica load table takes some 10.5 KB in Redis
    (`benchmarks/bench_fleet.py`), so the default holds about 50 MB, some minutes of a busy fleet's decisions."""
    max_replay_entries: int = Field(2_000, ge=0)
    """Newest stream entries a starting router applies before it reports ready. Applying a 64-block decision
    costs some 50-75 us (decode and index record), so 2,000 batches of 10 fit in `load_timeout_s`; the newest
    are the prefixes most likely to come back."""
    load_timeout_s: float = Field(2.0, gt=0)
    """Seconds a starting router waits for Redis to load the shared state; past it, or with Redis down, it starts
    on what it has (nothing, at worst) and catches up when Redis answers."""
    command_timeout_s: float = Field(0.5, gt=0)
    """Seconds a Redis command may take before it counts as an outage (socket timeout): never waited on by a
    request, only by the router's background tasks."""
    read_block_s: float = Field(0.5, gt=0)
    """Seconds one XREAD waits for peers' batches before it asks again."""
    retry_s: float = Field(0.5, gt=0)
    """Seconds between attempts to reach Redis during an outage."""


class RouterSettings(CommandSettings):
    """Settings of `shoal router`."""

    model_config = SettingsConfigDict(
        env_prefix="SHOAL_ROUTER_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
        use_attribute_docstrings=True,
        hide_input_in_errors=True,  # a rejected redis_url or admin_token is a secret: errors name it masked, if at all
    )

    host: str = "127.0.0.1"
    """Address to listen on. Loopback by default; containers set 0.0.0.0."""
    port: int = Field(8000, ge=0, le=65535)
    reuse_port: bool = False
    """Bind with SO_REUSEPORT so several router processes share one port (the kernel spreads connections)."""
    workers: int = Field(1, ge=1, le=64)
    """Router processes on the one port (SO_REUSEPORT), for throughput beyond one core; with more than one, set
    `redis_url` so that they share one view of the fleet (router/service/workers.py)."""
    replicas: list[str] = Field(default_factory=list)
    """Static replica base URLs (http://host:port). More can be added through the admin API. Replicas speak plain
    HTTP/1.1 inside the cluster; TLS belongs at the router's ingress."""
    policy: PolicyConfig = Field(default_factory=EstimatedTTFTConfig)
    """Routing policy, chosen by `kind`; see router/policy/config.py for each policy's parameters."""
    index: PrefixIndexConfig = Field(default_factory=PrefixIndexConfig)
    prefill_rate: PrefillRateEstimator = Field(default_factory=PrefillRateEstimator)
    """How each replica's prefill rate is learned from streamed times to first token (estimated_ttft uses it)."""
    service_time: ServiceTimeEstimator = Field(default_factory=ServiceTimeEstimator)
    """How each replica's slot time, and (opt-in: `learn_slots`, `learn_fixed`) its batch slots and fixed
    per-request time, are learned from request durations (router/policy/service_time.py)."""
    hashing: HashingSettings = Field(default_factory=HashingSettings)
    health: HealthSettings = Field(default_factory=HealthSettings)
    breaker: BreakerSettings = Field(default_factory=BreakerSettings)
    scrape: ScrapeSettings = Field(default_factory=ScrapeSettings)
    retry: RetrySettings = Field(default_factory=RetrySettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    hold: HoldSettings = Field(default_factory=HoldSettings)
    discovery: DiscoverySettings = Field(default_factory=DiscoverySettings)
    """How replicas are found: the static list, or a Kubernetes Service's EndpointSlices."""
    kv_events: KVEventSettings = Field(default_factory=KVEventSettings)
    """Exact mode: each replica's KV events feed the prefix index (off by default: approximate mode)."""
    tokenizer: TokenizerSettings = Field(default_factory=TokenizerSettings)
    """Per model, the tokenizer and chat template that make chat prompts route on token ids."""
    session_header: str | None = None
    """Header whose value pins a session to one replica (e.g. x-session-id); off when unset."""
    session_affinity: SessionAffinityConfig = Field(default_factory=SessionAffinityConfig)
    """With `session_header`: when a session's pin yields to the policy (its replica overloaded), and how many
    sessions are remembered (`router/policy/session.py`)."""
    admin_token: SecretStr | None = None
    """Bearer token for /admin/*. Without one the admin API is disabled (404), never open."""
    seed: int = 0
    """Seed of the policies' random choices, for reproducible runs."""
    log_requests: bool = True
    """Log one JSON line per request (route branch, replica, timings), written off the request path."""
    request_log: RequestLogSettings = Field(default_factory=RequestLogSettings)
    """Where the per-request lines go, and how far the writer may fall behind."""
    config_file: Path | None = None
    """YAML file with any of these settings; environment variables override it."""

    # --- Router fleet (router/service/fleet.py) ---
    redis_url: str | None = None
    """Redis shared by a fleet of routers: each publishes its routing records there and applies the others'.
    Standalone: redis://[[user]:password@]host:port/db, rediss://, unix://; Sentinel (follows a failover):
    redis+sentinel://[[user]:password@]host:port[,host:port...]/SERVICE[/DB]; Cluster:
    redis+cluster://[[user]:password@]host:port[,host:port...]; rediss+ for TLS (router/service/redis_url.py).
    None: this router works alone, on its own view."""
    fleet: FleetSettings = Field(default_factory=FleetSettings)
    """With `redis_url`: how records are batched, capped and expired."""

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, url: str | None) -> str | None:
        return None if url is None else check_redis_url(url)

    @field_validator("replicas")
    @classmethod
    def _check_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            split_url(url)
        return [url.rstrip("/") for url in urls]
