"""Routing policy configurations: the union of every policy's frozen pydantic model, discriminated by `kind`.

Each policy's config lives beside its policy (`EstimatedTTFTConfig` in estimated_ttft.py, ...); this module
gathers them. The router's settings, the simulator's scenario files and the tests all parse the same
`PolicyConfig`, so a policy means the same thing wherever it runs. `kind` is the policy's name (`POLICY_NAMES`);
unknown kinds and unknown fields are errors, never silently ignored. `build_policy` turns a config into a policy
object.

Baseline defaults are their sources' defaults (SGLang router CLI, Dynamo frontend, llm-d's default scheduler
profile); Shoal's own defaults say in their docstrings why they are what they are.
"""

from __future__ import annotations

from typing import Annotated, Any, Union, assert_never

from pydantic import Field, TypeAdapter

from router.policy.consistent_hash import ConsistentHash, ConsistentHashConfig
from router.policy.dynamo_kv import DynamoKV, DynamoKVConfig
from router.policy.estimated_ttft import EstimatedTTFT, EstimatedTTFTConfig
from router.policy.least_load import LeastLoad, LeastLoadConfig
from router.policy.llmd_weighted import LLMDWeighted, LLMDWeightedConfig
from router.policy.power_of_two import PowerOfTwo, PowerOfTwoConfig
from router.policy.random_choice import RandomChoice, RandomConfig
from router.policy.round_robin import RoundRobin, RoundRobinConfig
from router.policy.sglang_cache_aware import SGLangCacheAware, SGLangCacheAwareConfig
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

__all__ = [
    "POLICY_NAMES",
    "ConsistentHashConfig",
    "DynamoKVConfig",
    "EstimatedTTFTConfig",
    "LLMDWeightedConfig",
    "LeastLoadConfig",
    "PolicyConfig",
    "PowerOfTwoConfig",
    "RandomConfig",
    "RoundRobinConfig",
    "SGLangCacheAwareConfig",
    "build_policy",
    "parse_policy_config",
]


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
