"""Scenario files: one documented experiment each (`simulations/scenarios/NN_name.yaml`).

A scenario names a workload (`trace`), a fleet (an engine preset, optionally overridden, and a replica count), the
router's settings, the policies to compare, the SLO and a seed. Every model is frozen and forbids unknown fields,
so a typo in a scenario is an error, not a silent default. Policies are `router.policy.config` configurations
(`kind` plus that policy's parameters) with an optional `label`, so one kind can appear with several settings.

Fleet variants (`variants`) compare fleets rather than policies: each is a label and overrides of `fleet`, and
every policy runs on every variant (`runs`), rows labelled `variant: policy`. It is a list of overrides rather than
a list of whole fleets so that what a variant changes is all it states; the workload and the floor row come from
the scenario's own fleet, so a variant may not change the block size, `prefill_only` or `output_scale`.

Trace files: a relative `path` is taken from the traces directory that `shoal simulate --traces-dir DIR` or the
environment variable `SHOAL_TRACES_DIR` names (`resolve_trace_paths`), so scenario files name no machine's paths;
an absolute path is used as it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from router.policy.config import PolicyConfig, parse_policy_config
from router.policy.prefill_rate import PrefillRateEstimator
from router.policy.prefix_index import PrefixIndexConfig
from router.policy.service_time import ServiceTimeEstimator
from router.policy.session import SessionAffinityConfig
from simulations.metrics import SLOConfig
from simulations.routers import RoutersConfig
from simulations.routing import IndexMode
from simulations.scaling import AutoscaleConfig, FixedScalingConfig, ScalingConfig
from simulations.servegen import AzureLengths, ServeGenTraceConfig, ServeGenWorkload
from simulations.step_model import SimulatedEngineConfig, SpeculationConfig, StepModel, load_preset
from simulations.synthetic import (
    AgenticConfig,
    AgenticWorkload,
    SessionsConfig,
    SessionsWorkload,
    SharedPrefixConfig,
    SharedPrefixWorkload,
)
from simulations.traces import AzureWorkload, MooncakeWorkload
from simulations.workload import PrefillOnlyWorkload, ScaledOutputWorkload, Workload

DEFAULT_POLICIES = ("estimated_ttft", "sglang_cache_aware", "dynamo_kv", "least_load", "round_robin")
"""The five policies compared by default, Shoal's own first."""

TRACES_DIR_ENV = "SHOAL_TRACES_DIR"
"""The environment variable naming the directory that relative trace paths are taken from (`--traces-dir` wins)."""


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class MooncakeTraceConfig(_Model):
    kind: Literal["mooncake"] = "mooncake"
    path: Path
    speed: float = Field(default=1.0, gt=0.0)
    """Time compression: arrivals come `speed` times faster than recorded (2.0 doubles the rate)."""
    jitter_s: float = Field(default=0.001, ge=0.0)
    """Uniform offset added to each millisecond-bucketed timestamp before scaling: one bucket."""
    limit: int | None = Field(default=None, ge=1)
    """Replay only the first `limit` requests of the file (of its copies, when tiled)."""
    tiles: int | None = Field(default=1, ge=1)
    """Copies of the trace replayed back to back, each a period later with fresh block ids (`simulations.traces`):
    a longer input with the trace's shape, such as a day of a million requests. None (`null`): as many as `limit`
    takes, which must be set. 1 (the default): the trace once."""

    @model_validator(mode="after")
    def _tiles_end(self) -> Self:
        if self.tiles is None and self.limit is None:
            raise ValueError("`tiles: null` (as many copies as `limit` takes) needs a `limit`")
        return self


class AzureTraceConfig(_Model):
    kind: Literal["azure"] = "azure"
    path: Path
    speed: float = Field(default=1.0, gt=0.0)
    jitter_s: float = Field(default=0.0, ge=0.0)
    """The Azure timestamps are sub-millisecond already: no jitter by default."""
    limit: int | None = Field(default=None, ge=1)
    """Replay only the first `limit` requests of the file (of its copies, when tiled)."""
    tiles: int | None = Field(default=1, ge=1)
    """Copies of the trace replayed back to back, each a period later (`simulations.traces`); None (`null`): as
    many as `limit` takes, which must be set. 1 (the default): the trace once."""

    @model_validator(mode="after")
    def _tiles_end(self) -> Self:
        if self.tiles is None and self.limit is None:
            raise ValueError("`tiles: null` (as many copies as `limit` takes) needs a `limit`")
        return self


TraceConfig = Annotated[
    MooncakeTraceConfig | AzureTraceConfig | ServeGenTraceConfig | SharedPrefixConfig | SessionsConfig | AgenticConfig,
    Field(discriminator="kind"),
]


class ResolvedFleet(NamedTuple):
    """A fleet's engine, step model and speculation, its preset's with the scenario's overrides applied."""

    engine: SimulatedEngineConfig
    step_model: StepModel
    speculation: SpeculationConfig | None
    """None, or one whose `is_enabled` is False: plain decoding."""


class FleetConfig(_Model):
    preset: str = "llama70b_8xa100"
    """Engine preset: a name in simulations/presets/ or a path to a preset file."""
    num_replicas: int = Field(default=16, ge=1)
    """Replicas at the start (all ready at time 0)."""
    engine: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the preset's `engine` fields (say, num_kv_blocks)."""
    step_model: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the preset's `step_model` coefficients."""
    speculation: dict[str, Any] | None = Field(default_factory=dict)
    """Overrides of the preset's `speculation` fields (`step_model.SpeculationConfig`), or all of them for a preset
    without speculation. `null`: no speculation, whatever the preset has. `{}` (the default): the preset's."""
    step_time_factors: list[Annotated[float, Field(gt=0.0)]] = Field(default_factory=list)
    """Step-time multipliers of the first replicas, in the order they are created (r000, r001, ...): `[2.0]` makes
    r000 twice as slow at every step as the others (`StepModel.scaled`; a speculating replica's drafting costs are
    not scaled), a fleet of unlike GPUs or one replica on a throttled or shared device. Replicas past the list run
    at 1. Empty (the default): every replica alike."""
    output_scale: float = Field(default=1.0, gt=0.0)
    """Every request's output is this many times the trace's (rounded, at least one token): decode-heavy traffic on
    the same prompts and arrivals. Output tokens beyond what the workload knows (a conversation's next turn
    resends the recorded answer) are not cacheable. 1 (the default): the trace's lengths."""
    prefill_only: bool = False
    """Replicas are the prefill instances of a disaggregated deployment (Mooncake, Dynamo, llm-d P/D): each
    computes a prompt and its first token, then hands the request to decode instances, which are not simulated.
    Every request's output is cut to that one token; the prompt's blocks stay in the prefill instance's prefix
    cache. TTFT is then queueing plus prefill, and end-to-end latency equals TTFT."""

    def resolve(self) -> ResolvedFleet:
        preset = load_preset(self.preset)
        engine = SimulatedEngineConfig.model_validate({**preset.engine.model_dump(), **self.engine})
        step_model = StepModel.model_validate({**preset.step_model.model_dump(), **self.step_model})
        speculation = preset.speculation
        if self.speculation is None:
            speculation = None
        elif self.speculation:
            base = speculation.model_dump() if speculation is not None else {}
            speculation = SpeculationConfig.model_validate({**base, **self.speculation})
        return ResolvedFleet(engine, step_model, speculation)


def with_block_size(engine: SimulatedEngineConfig, block_size: int) -> dict[str, int]:
    """Engine overrides for KV blocks of `block_size` tokens holding as many tokens as `engine`'s (rounded down to
    whole blocks): `shoal simulate --block-size`. The router hashes blocks of the same size. Coarser blocks make
    a run faster and lighter (the prefix index, the KV cache and the hashing work per block) and change what it
    models: a prompt hits only whole blocks, and a sequence holds whole blocks. A Mooncake trace names 512-token
    blocks (its engines' own), so 512 loses only the hits inside a prompt's last, partial block."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    tokens = engine.num_kv_blocks * engine.block_size
    if tokens < block_size:
        raise ValueError(f"a block of {block_size} tokens is more than the engine's KV cache ({tokens} tokens)")
    return {"block_size": block_size, "num_kv_blocks": tokens // block_size}


_MERGED_FLEET_FIELDS = ("engine", "step_model", "speculation")
"""Fleet fields that are mappings of overrides: a variant's merge into the scenario's."""


class FleetVariant(_Model):
    """One fleet of a comparison of fleets: the scenario's `fleet` with some fields changed."""

    label: str
    """Names the variant's rows (`label: policy`) in the table and results.json."""
    fleet: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the scenario's `fleet`: `engine`, `step_model` and `speculation` mappings merge into the
    scenario's (`speculation: null` turns it off); any other field (`preset`, `num_replicas`) replaces it.
    `prefill_only` and `output_scale` cannot change, as the variants share one workload."""

    @field_validator("fleet")
    @classmethod
    def _same_workload(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in ("prefill_only", "output_scale"):
            if key in value:
                raise ValueError(f"a variant cannot change `{key}`: every variant replays the same workload")
        return value

    def apply(self, fleet: FleetConfig) -> FleetConfig:
        """`fleet` with this variant's overrides."""
        return merge_fleet(fleet, self.fleet)


def merge_fleet(fleet: FleetConfig, overrides: dict[str, Any]) -> FleetConfig:
    """`fleet` with `overrides`: the `engine`, `step_model` and `speculation` mappings merge into the fleet's, any
    other field replaces it."""
    data = fleet.model_dump()
    for key, value in overrides.items():
        current = data.get(key)
        if key in _MERGED_FLEET_FIELDS and isinstance(value, dict) and isinstance(current, dict):
            data[key] = {**current, **value}
        else:
            data[key] = value
    return FleetConfig.model_validate(data)


class RouterConfig(_Model):
    index_mode: IndexMode = "approximate"
    """approximate: the router records its decisions (what the live router does today); exact: the engines' KV
    events fill the index; exact_predicted: events plus short-lived records of each decision."""
    index: PrefixIndexConfig = Field(default_factory=PrefixIndexConfig)
    prefill_rate: PrefillRateEstimator = Field(default_factory=PrefillRateEstimator)
    scrape_interval_s: float | None = Field(default=2.0, gt=0.0)
    """Seconds between scrapes of the engines' gauges (the live router's default); None: no scraping, policies
    see router-local counts only."""
    kv_event_delay_s: float = Field(default=0.01, ge=0.0)
    """Seconds from an engine step to its KV events reaching the router (exact modes): a ZMQ or Redis hop."""
    sweep_interval_s: float = Field(default=5.0, gt=0.0)
    """Seconds between sweeps of expired index entries (the live router's interval)."""
    hold_max_wait_s: float = Field(default=30.0, ge=0.0)
    """Seconds a request may wait at the router while no replica is ready before it fails (counted as rejected):
    the live router's `hold.max_wait_s`."""
    max_in_flight_per_replica: int = Field(default=0, ge=0)
    """Requests the router keeps in flight on one replica at once; beyond it requests wait at the router, in
    arrival order, for the first replica to free a slot (`router.policy.admission`): the live router's
    `hold.max_in_flight_per_replica`. 0: no limit (the default), engines queue what they cannot run."""
    max_blocks: int = Field(default=8192, ge=1)
    """Leading blocks of a prompt the router hashes (the live router's `hashing.max_blocks`)."""
    session_affinity: bool = False
    """Read each request's conversation or agent episode (`Request.session`) as the live router reads its
    `session_header`: a session goes back to the replica its previous request went to while that one is eligible
    (branch `session`), and consistent_hash keys its ring on the session instead of the first block. Off by
    default, as `session_header` is in the live router; workloads without sessions are unaffected."""
    overhead_s: float = Field(default=0.0, ge=0.0)
    """Seconds the serving path adds to every request's first token and end, beyond the engine's steps: the HTTP
    hops client -> router -> replica and back, and the server's event loop. 0: not modelled. A few milliseconds on
    a GPU fleet's network; `benchmarks/sim_vs_live.py` measures it on the live stack (one-token requests)."""
    overhead_s_per_prompt_token: float = Field(default=0.0, ge=0.0)
    """Seconds the serving path adds per prompt token, on top of `overhead_s`: reading, validating and hashing the
    prompt at the router and at the replica. 0: not modelled. `benchmarks/sim_vs_live.py` measures it with a long
    prompt sent twice, the second time a cache hit."""
    service_time: ServiceTimeEstimator = Field(default_factory=ServiceTimeEstimator)
    """How the router learns each replica's batch slots and fixed per-request time from latencies
    (`router.policy.service_time`: `learn_slots`, `learn_fixed`, both off by default; the live router's
    `service_time`)."""
    infer_max_num_seqs: bool = True
    """Take a replica's batch limit from a scrape that sees requests queued beside running ones
    (`ReplicaState.set_gauges`). On by default, as the live router's `scrape.infer_max_num_seqs`."""
    session: SessionAffinityConfig = Field(default_factory=SessionAffinityConfig)
    """When a pin yields to the policy (its replica overloaded) and how many sessions are remembered: the live
    router's `session_affinity` settings."""
    index_for_index_blind: bool = False
    """Keep the prefix index for policies that never read it (round_robin, random, least_load, power_of_two,
    consistent_hash): their decisions are the same either way, so it only costs time, but it gives them a
    predicted hit ratio to report."""
    is_capacity_known: bool = False
    """Tell the router each replica's KV capacity, as `POST /admin/replicas {"kv_capacity_blocks"}` does: it bounds
    the approximate index per replica, and dynamo_kv then counts active blocks as scraped KV usage x capacity.
    Off by default, as for replicas given by URL (`shoal router --replica`): the index's default capacity, and
    dynamo_kv's router-local estimate."""


class PolicyEntry(_Model):
    label: str
    config: PolicyConfig


class Scenario(_Model):
    name: str = "adhoc"
    description: str = ""
    trace: TraceConfig | None = None
    """The workload; None when the caller passes one to `Simulation` itself."""
    fleet: FleetConfig = Field(default_factory=FleetConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    routers: RoutersConfig = Field(default_factory=RoutersConfig)
    """How many routers share the fleet and whether they share their views (`simulations.routers`); each has the
    `router` settings. One by default."""
    policies: list[PolicyEntry] = Field(default_factory=lambda: [policy_entry(p) for p in DEFAULT_POLICIES])
    variants: list[FleetVariant] = Field(default_factory=list)
    """Fleets to compare, each run with every policy (see the module docstring). Empty (the default): the one
    `fleet`, and rows labelled by policy alone."""
    slo: SLOConfig = Field(default_factory=SLOConfig)
    scaling: ScalingConfig = Field(default_factory=FixedScalingConfig, discriminator="kind")
    autoscale: AutoscaleConfig | None = None
    """An autoscaling policy (shoal, hpa, keda, static) driving the fleet instead of `scaling`; its `startup_s`
    replaces the engine's. The SLO its runs are judged by is `slo`."""
    seed: int = 0
    """Seed of the policies' random choices, of the trace's timestamp jitter and of a ServeGen curve's arrivals and
    lengths (synthetic workloads carry their own `seed`)."""
    decode_steps_per_event: int = Field(default=64, ge=1)
    """Decode-only steps a replica may run as one event while no request waits (a request arriving meanwhile
    cuts it at the step boundary it arrives in). Timings are those of single steps; only the KV blocks for the
    steps are allocated at its start. 1 simulates every step as its own event; so does a replica that speculates,
    whose steps emit a random number of tokens."""
    sample_interval_s: float = Field(default=10.0, gt=0.0)
    """Seconds between time-series samples (queue depth, hit ratio, replicas)."""

    @model_validator(mode="after")
    def _one_scaler(self) -> Scenario:
        if self.autoscale is not None and not isinstance(self.scaling, FixedScalingConfig):
            raise ValueError("set either `scaling` or `autoscale`, not both")
        return self

    @model_validator(mode="after")
    def _variants_apply(self) -> Scenario:
        labels = [variant.label for variant in self.variants]
        if len(set(labels)) != len(labels):
            raise ValueError(f"variant labels must differ, got {labels}")
        for variant in self.variants:
            variant.apply(self.fleet)  # an override naming no fleet field fails here, not mid-run
        return self

    def runs(self) -> list[tuple[Scenario, PolicyEntry]]:
        """Every (scenario, policy) to simulate: each policy on the fleet, or on each variant's fleet in turn with
        its rows labelled `variant: policy`."""
        if not self.variants:
            return [(self, entry) for entry in self.policies]
        out: list[tuple[Scenario, PolicyEntry]] = []
        for variant in self.variants:
            scenario = self.model_copy(update={"fleet": variant.apply(self.fleet), "variants": []})
            for entry in self.policies:
                out.append((scenario, entry.model_copy(update={"label": f"{variant.label}: {entry.label}"})))
        return out

    @field_validator("policies", mode="before")
    @classmethod
    def _entries(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        return [policy_entry(item) if isinstance(item, str | dict) else item for item in value]


def policy_entry(item: str | dict[str, Any]) -> PolicyEntry:
    """A policy from a kind name, or from a mapping of `kind`, its parameters and an optional `label`."""
    if isinstance(item, str):
        return PolicyEntry(label=item, config=parse_policy_config({"kind": item}))
    data = dict(item)
    if "config" in data:
        return PolicyEntry.model_validate(data)
    label = data.pop("label", None)
    config = parse_policy_config(data)
    return PolicyEntry(label=label or config.kind, config=config)


def load_scenario(path: str | Path) -> Scenario:
    """A scenario from YAML; relative trace paths stay relative until `resolve_trace_paths`."""
    with Path(path).open() as f:
        return Scenario.model_validate(yaml.safe_load(f))


def trace_file(path: Path, traces_dir: Path | None) -> Path:
    """A trace file's path: an absolute one as it is, a relative one under `traces_dir`. A missing file, or a
    relative one with no directory, is a ValueError that names the file, the directory looked in and the
    `shoal simulate fetch-traces` command that downloads it."""
    from simulations.fetch import fetch_command

    how = f"pass `shoal simulate --traces-dir DIR` or set {TRACES_DIR_ENV}"
    if path.is_absolute():
        resolved = path
    elif traces_dir is None:
        raise ValueError(
            f"trace file {str(path)!r} is relative to the traces directory, which is not set: {how} "
            f"(`{fetch_command(None, path)}` downloads the public traces into DIR)"
        )
    else:
        resolved = traces_dir / path
    if not resolved.is_file():
        if path.is_absolute():
            raise ValueError(f"trace file {str(resolved)!r} not found")
        raise ValueError(
            f"trace file {str(path)!r} not found: no {str(resolved)!r} in the traces directory {str(traces_dir)!r} "
            f"(--traces-dir or {TRACES_DIR_ENV}); download it with `{fetch_command(traces_dir, path)}`"
        )
    return resolved


def resolve_trace_paths(trace: TraceConfig, traces_dir: Path | None) -> TraceConfig:
    """`trace` with its file paths (the trace's, and a ServeGen curve's Azure lengths) made usable: see
    `trace_file`. Synthetic workloads name no file and come back unchanged."""
    if isinstance(trace, MooncakeTraceConfig | AzureTraceConfig):
        return trace.model_copy(update={"path": trace_file(trace.path, traces_dir)})
    if isinstance(trace, ServeGenTraceConfig):
        update: dict[str, Any] = {"path": trace_file(trace.path, traces_dir)}
        if isinstance(trace.lengths, AzureLengths):
            update["lengths"] = trace.lengths.model_copy(update={"path": trace_file(trace.lengths.path, traces_dir)})
        return trace.model_copy(update=update)
    return trace


def build_workload(scenario: Scenario, *, traces_dir: Path | None = None) -> Workload:
    """The scenario's workload, in blocks of its engine's block size (outputs scaled by the fleet's `output_scale`,
    one output token each for a prefill-only fleet); relative trace paths are taken from `traces_dir`."""
    workload = _build_trace_workload(scenario, traces_dir)
    if scenario.fleet.output_scale != 1.0:
        workload = ScaledOutputWorkload(workload, scenario.fleet.output_scale)
    return PrefillOnlyWorkload(workload) if scenario.fleet.prefill_only else workload


def _build_trace_workload(scenario: Scenario, traces_dir: Path | None) -> Workload:
    if scenario.trace is None:
        raise ValueError("the scenario names no trace")
    trace = resolve_trace_paths(scenario.trace, traces_dir)
    block_size = scenario.fleet.resolve().engine.block_size
    if isinstance(trace, MooncakeTraceConfig):
        return MooncakeWorkload(
            trace.path,
            block_size=block_size,
            speed=trace.speed,
            jitter_s=trace.jitter_s,
            seed=scenario.seed,
            limit=trace.limit,
            tiles=trace.tiles,
        )
    if isinstance(trace, AzureTraceConfig):
        return AzureWorkload(
            trace.path,
            block_size=block_size,
            speed=trace.speed,
            jitter_s=trace.jitter_s,
            seed=scenario.seed,
            limit=trace.limit,
            tiles=trace.tiles,
        )
    if isinstance(trace, ServeGenTraceConfig):
        return ServeGenWorkload.from_config(trace, seed=scenario.seed, block_size=block_size)
    if isinstance(trace, SharedPrefixConfig):
        return SharedPrefixWorkload(trace, block_size=block_size)
    if isinstance(trace, SessionsConfig):
        return SessionsWorkload(trace, block_size=block_size)
    return AgenticWorkload(trace, block_size=block_size)
