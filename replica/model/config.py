"""Model configuration with Hugging Face key names.

`ModelConfig.from_hf(dict)` reads a Qwen3-MoE, Qwen2-MoE, Mixtral or DeepSeek-V3 style `config.json`, accepting
the aliases those families use (`num_experts` / `num_local_experts` / `n_routed_experts`, `rope_theta` /
`rope_parameters`), and `to_hf()` writes Qwen3-MoE keys back, so a Shoal checkpoint folder opens in other tools.
Stdlib only: building a config never imports torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

RouterKind = Literal["softmax", "sigmoid"]


class ConfigError(ValueError):
    """A config.json that cannot describe a model Shoal can build."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int
    """Hidden width of one routed expert."""
    num_experts: int
    num_experts_per_tok: int
    shared_expert_intermediate_size: int = 0
    """Hidden width of the shared expert (0: none)."""
    router_kind: RouterKind = "softmax"
    """`softmax` (Qwen, Mixtral) or `sigmoid` with a score-correction bias (DeepSeek-V3)."""
    norm_topk_prob: bool = True
    """Renormalise the chosen experts' weights to sum to 1."""
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    qk_norm: bool = True
    """Qwen3 normalises queries and keys per head before RoPE."""
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..{self.num_experts}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.router_kind not in ("softmax", "sigmoid"):
            raise ConfigError(f"router_kind must be softmax or sigmoid, not {self.router_kind!r}")

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        def pick(*names: str, default: Any = None) -> Any:
            for name in names:
                if raw.get(name) is not None:
                    return raw[name]
            return default

        num_experts = pick("num_experts", "num_local_experts", "n_routed_experts")
        if num_experts is None:
            raise ConfigError("config has no num_experts / num_local_experts / n_routed_experts: not an MoE model")
        rope_theta = pick("rope_theta")
        if rope_theta is None:
            params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
            rope_theta = params.get("rope_theta", 10000.0)
        try:
            hidden = raw["hidden_size"]
            heads = raw["num_attention_heads"]
        except KeyError as exc:
            raise ConfigError(f"config is missing {exc.args[0]!r}") from None
        shared = pick("shared_expert_intermediate_size", default=0)
        if not shared and raw.get("n_shared_experts"):
            shared = raw["n_shared_experts"] * raw["moe_intermediate_size"]
        scoring = pick("scoring_func", default="softmax")
        try:
            return cls(
                vocab_size=raw["vocab_size"],
                hidden_size=hidden,
                num_hidden_layers=raw["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=pick("num_key_value_heads", default=heads),
                head_dim=pick("head_dim", default=hidden // heads),
                moe_intermediate_size=pick("moe_intermediate_size", "intermediate_size"),
                num_experts=num_experts,
                num_experts_per_tok=raw["num_experts_per_tok"],
                shared_expert_intermediate_size=shared,
                router_kind="sigmoid" if scoring == "sigmoid" else "softmax",
                norm_topk_prob=pick("norm_topk_prob", default=scoring != "softmax"),
                routed_scaling_factor=pick("routed_scaling_factor", default=1.0),
                rms_norm_eps=pick("rms_norm_eps", default=1e-6),
                rope_theta=float(rope_theta),
                max_position_embeddings=pick("max_position_embeddings", default=4096),
                qk_norm=pick("qk_norm", default=raw.get("model_type", "qwen3_moe") == "qwen3_moe"),
                tie_word_embeddings=pick("tie_word_embeddings", default=False),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_id=raw.get("eos_token_id"),
            )
        except KeyError as exc:
            raise ConfigError(f"config is missing {exc.args[0]!r}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        return cls.from_hf(json.loads(Path(path).read_text(encoding="utf-8")))

    def to_hf(self) -> dict[str, Any]:
        out = asdict(self)
        out["model_type"] = "qwen3_moe"
        out["architectures"] = ["Qwen3MoeForCausalLM"]
        out["scoring_func"] = out.pop("router_kind")
        return out

    def replace(self, **changes: Any) -> ModelConfig:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return ModelConfig(**values)

    @property
    def num_routed_expert_params(self) -> int:
        """Parameters in all routed experts: gate, up and down projections of every expert of every layer."""
        return self.num_hidden_layers * self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size
