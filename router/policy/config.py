"""Routing policy configurations: one frozen pydantic model per policy, discriminated by `kind`.

The router's settings, the simulator's scenario files and the tests all parse the same `PolicyConfig`, so a
policy means the same thing wherever it runs. `kind` is the policy's name (`POLICY_NAMES`); unknown kinds and
unknown fields are errors, never silently ignored. `build_policy` turns a config into a policy object; the
policy modules import these models for their type hints only, so this module may import them all.

Baseline defaults are their sources' defaults (SGLang router CLI, Dynamo frontend, llm-d's default scheduler
profile); Shoal's own defaults say in their docstrings why they are what they are.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union, assert_never

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from router.policy.consistent_hash import ConsistentHash
from router.policy.dynamo_kv import DynamoKV
from router.policy.estimated_ttft import EstimatedTTFT
from router.policy.least_load import LeastLoad
from router.policy.llmd_weighted import LLMDWeighted
from router.policy.power_of_two import PowerOfTwo
from router.policy.random_choice import RandomChoice
from router.policy.round_robin import RoundRobin
from router.policy.sglang_cache_aware import SGLangCacheAware
from router.policy.types import Policy

POLICY_NAMES: tuple[str, ...] = (
    "estimated_ttft",
    "round_robin",
    "random",
    "least_load",
    "power_of_two",
    "consistent_hash",
    "sglang_cache_aware",
    "dynamo_kv",
    "llmd_weighted",
)
"""Every policy `kind`, Shoal's default first."""


class _PolicyModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class EstimatedTTFTConfig(_PolicyModel):
    """Shoal's default: minimise the predicted time to first token (see `estimated_ttft`)."""

    kind: Literal["estimated_ttft"] = "estimated_ttft"

    decode_s_per_seq_step: float = Field(default=0.00055, ge=0.0)
    """Seconds one decoding sequence adds to each engine step. A chunked-prefill engine runs every running
    sequence's next token in the same steps as the prefill chunks: one token of compute plus reading its KV. On
    the LLaMA-70B / 8 x A100 preset that is 0.11 ms + 15k tokens of context x 29 ns = ~0.55 ms; a smaller model
    or shorter contexts cost less. Multiplied by the steps the request waits (see `prefill_tokens_per_step`)."""

    prefill_tokens_per_step: int = Field(default=8192, gt=0)
    """Prompt tokens an engine prefills per step (vLLM V1's default `max_num_batched_tokens` for the online
    server), so that a request waits about 1 + (backlog + uncached) / this many steps, each lengthened by every
    decoding sequence."""

    attention_s_per_token_pair: float = Field(default=2.1e-9, ge=0.0)
    """Seconds of prefill per (query, key) token pair: causal attention, which a per-token rate cannot express
    and which makes a 64k-token prompt ~1.5x its linear prefill time. 4 x layers x hidden FLOPs per pair over the
    GPUs' attention throughput: for LLaMA-70B (80 x 8192) on 8 x A100 at ~50% of peak, 2.6 MFLOP / 1.25 PFLOPS =
    2.1 ns, the simulator preset's figure. Scale it with the model (about 0.3 ns for an 8B model on one GPU);
    0 turns the term off."""

    rate_noise_cv: float = Field(default=0.25, ge=0.0)
    """Coefficient of variation (fraction of the mean) that learned prefill rates show between identical
    replicas. Each rate is shrunk towards the fleet mean by the share of the fleet's variance this much noise
    explains (James-Stein). Simulated Mooncake runs on 16 identical replicas: the learned rates' CV averages
    0.19-0.20 (5.4k-9.8k tokens/s around 7.8k); 0.25 pools such a fleet entirely almost always, while a 5k and a
    20k replica keep 83% of their difference. 0 uses each replica's own rate."""

    fleet_cost_weight: float = Field(default=1.5, ge=0.0)
    """Seconds of cost per second of prefill a placement adds beyond the cheapest placement (dimensionless).
    Recomputed prefix work delays the requests queued after it: by about rho / (1 - rho) times the work at
    utilisation rho, 1.5 at rho = 0.6, the load at which affinity starts to decide the tail (near saturation on
    the Mooncake trace prefill needs ~57% of the fleet). On simulated Mooncake runs, 1 to 2 keep the hit ratio
    within 10% of the ceiling at both loads; 0 is the greedy per-request TTFT."""

    kv_pressure_s: float = Field(default=1.0, ge=0.0)
    """Seconds added when the KV cache is full (kv_usage 1.0). A request then waits for running sequences to
    finish and free blocks, or causes a preemption; 1 s is of the order of a sequence's remaining decode time,
    yet below a moderate prefill backlog, so pressure steers traffic away without vetoing a replica."""

    kv_pressure_threshold: float = Field(default=0.8, ge=0.0, lt=1.0)
    """KV usage fraction (0..1) below which the pressure term is 0. vLLM and SGLang count only blocks held by
    running requests as used (cached, unreferenced blocks are free), so below ~80% new work fits without
    preemption; above it the term grows quadratically to `kv_pressure_s` at 1.0."""

    tie_epsilon_s: float = Field(default=0.005, ge=0.0)
    """Seconds within which estimates count as tied. About one engine step: a smaller difference is not
    observable in TTFT, and spreading tied cache misses over idle replicas is worth more than it."""

    tie_rel_epsilon: float = Field(default=0.0, ge=0.0)
    """Fraction of the minimum cost added to `tie_epsilon_s`. 0: the noise of learned prefill rates, which this
    margin used to absorb, is pooled away (`rate_noise_cv`), and a relative margin would hand a long prompt to a
    replica with up to that fraction more backlog (2% of an 8 s prefill: 160 ms) for a smaller in-flight count."""

    max_queue_per_replica: int = Field(default=256, ge=1)
    """Hard cap on a replica's queue depth (requests): a replica at or past it is skipped while another is
    under it. vLLM's long-standing default max_num_seqs: past it new requests queue in the engine whatever
    their cache, so affinity has stopped paying."""


class RoundRobinConfig(_PolicyModel):
    """Cycle through replicas in id order (see `round_robin`)."""

    kind: Literal["round_robin"] = "round_robin"


class RandomConfig(_PolicyModel):
    """A uniformly random replica, from the policy's seeded generator (see `random_choice`)."""

    kind: Literal["random"] = "random"


class LeastLoadConfig(_PolicyModel):
    """Join the shortest queue (see `least_load`)."""

    kind: Literal["least_load"] = "least_load"


class PowerOfTwoConfig(_PolicyModel):
    """The better of two random choices (see `power_of_two`)."""

    kind: Literal["power_of_two"] = "power_of_two"


class ConsistentHashConfig(_PolicyModel):
    """A ketama hash ring over the session key or the first block hash (see `consistent_hash`)."""

    kind: Literal["consistent_hash"] = "consistent_hash"

    virtual_nodes: int = Field(default=160, ge=1)
    """Points on the ring per replica. 160 is ketama's (and vllm-router's) default: 40 MD5 digests of 4 points
    each, which keeps the load spread within a few percent."""


class SGLangCacheAwareConfig(_PolicyModel):
    """SGLang router's `cache_aware` policy (see `sglang_cache_aware`). Defaults are sglang-router's CLI."""

    kind: Literal["sglang_cache_aware"] = "sglang_cache_aware"

    cache_threshold: float = Field(default=0.3, ge=0.0, le=1.0)
    """Prefix match ratio (matched / prompt tokens) above which the best-matching replica is chosen.
    `--cache-threshold`, default 0.3."""

    balance_abs_threshold: int = Field(default=64, ge=0)
    """Requests: the load is imbalanced only if max - min load exceeds this. `--balance-abs-threshold`, 64."""

    balance_rel_threshold: float = Field(default=1.5, ge=0.0)
    """Ratio: the load is imbalanced only if max load exceeds this times min load. `--balance-rel-threshold`,
    1.5."""


class DynamoKVConfig(_PolicyModel):
    """NVIDIA Dynamo's KV router cost (see `dynamo_kv`). Defaults are Dynamo's frontend defaults."""

    kind: Literal["dynamo_kv"] = "dynamo_kv"

    overlap_score_weight: float = Field(default=1.0, ge=0.0)
    """Weight of the prefill blocks against the active (decode) blocks, `--kv-overlap-score-weight`, default
    1.0. 0 ignores the prefix cache (pure load balancing)."""

    temperature: float = Field(default=0.0, ge=0.0)
    """Softmax sampling temperature over normalised costs, `--router-temperature`, default 0 (argmin)."""

    streaming_seq_tokens: int = Field(default=1024, ge=0)
    """Tokens of KV one streaming request is assumed to hold when a replica's KV usage or capacity is unknown.
    Dynamo tracks each active sequence's blocks itself; Shoal's router knows only counts, so it charges a round
    figure for a chat turn's prompt plus output."""


class LLMDWeightedConfig(_PolicyModel):
    """llm-d inference scheduler's default scorer weights (see `llmd_weighted`)."""

    kind: Literal["llmd_weighted"] = "llmd_weighted"

    queue_weight: float = Field(default=2.0, ge=0.0)
    """Weight of queue-scorer (waiting queue, min-max normalised). llm-d's default profile: 2."""

    kv_cache_weight: float = Field(default=2.0, ge=0.0)
    """Weight of kv-cache-utilization-scorer (1 - KV usage). llm-d's default profile: 2."""

    prefix_weight: float = Field(default=3.0, ge=0.0)
    """Weight of prefix-cache-scorer (matched fraction of the request's blocks). llm-d's default profile: 3."""


PolicyConfig = Annotated[
    Union[  # noqa: UP007 - a discriminated union needs the Union form inside Annotated
        EstimatedTTFTConfig,
        RoundRobinConfig,
        RandomConfig,
        LeastLoadConfig,
        PowerOfTwoConfig,
        ConsistentHashConfig,
        SGLangCacheAwareConfig,
        DynamoKVConfig,
        LLMDWeightedConfig,
    ],
    Field(discriminator="kind"),
]
"""Any policy's configuration; `kind` selects the model. The default is `EstimatedTTFTConfig()`."""

DEFAULT_POLICY_CONFIG: PolicyConfig = EstimatedTTFTConfig()
"""Shoal's default policy, with its default parameters (frozen, so safe to share)."""

_POLICY_CONFIG_ADAPTER: TypeAdapter[PolicyConfig] = TypeAdapter(PolicyConfig)


def parse_policy_config(data: Any) -> PolicyConfig:
    """Validate a mapping (from YAML, JSON or a scenario file) into the config its `kind` names."""
    return _POLICY_CONFIG_ADAPTER.validate_python(data)


def build_policy(config: PolicyConfig, *, seed: int = 0) -> Policy:
    """A fresh policy object for `config`; `seed` feeds the policies that sample at random."""
    match config:
        case EstimatedTTFTConfig():
            return EstimatedTTFT(config)
        case RoundRobinConfig():
            return RoundRobin(config)
        case RandomConfig():
            return RandomChoice(config, seed=seed)
        case LeastLoadConfig():
            return LeastLoad(config)
        case PowerOfTwoConfig():
            return PowerOfTwo(config, seed=seed)
        case ConsistentHashConfig():
            return ConsistentHash(config)
        case SGLangCacheAwareConfig():
            return SGLangCacheAware(config)
        case DynamoKVConfig():
            return DynamoKV(config, seed=seed)
        case LLMDWeightedConfig():
            return LLMDWeighted(config, seed=seed)
        case _:
            assert_never(config)
