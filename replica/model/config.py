"""Model configuration with Hugging Face key names, for the three architectures Shoal builds.

`ModelConfig.from_hf(dict)` reads the `config.json` of a Qwen3-MoE (`qwen3_moe`: per-head q/k norm, an optional
attention bias), Qwen2-MoE (`qwen2_moe`: q/k/v bias, a shared expert scaled by a sigmoid gate) or Mixtral
(`mixtral`) checkpoint; `model_type` decides the structure, as it does in transformers. A config without
`model_type` is read by its keys alone (aliases `num_experts` / `num_local_experts` / `n_routed_experts`,
`rope_theta` / `rope_parameters`, `scoring_func: sigmoid` for a DeepSeek-style router). Refused with a ConfigError
that says why: DeepSeek-V2/V3 (multi-head latent attention is not implemented), any other model type, and what
Shoal does not compute (dense layers between the MoE ones, a sliding window, scaled RoPE, an activation other than
SiLU). A `qwen3_moe` config with a shared expert (Shoal's own, older checkpoints) loads with a warning.

`to_hf()` writes the keys of the architecture the model is (`hf_model_type`), so that other tools load the folder as
that architecture (transformers does, tested); a model that is none of them (a Qwen3-MoE with a shared expert, a
sigmoid router) raises ConfigError rather than write a folder other tools would misread. Stdlib only: building a
config never imports torch.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

RouterKind = Literal["softmax", "sigmoid"]

HF_ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
"""model_type -> the class transformers builds for it: the architectures Shoal reads and writes."""

_MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32")

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config.json that cannot describe a model Shoal can build, or a model no Hugging Face config describes."""


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
    shared_expert_gate: bool = False
    """The shared expert's output is scaled per token by sigmoid(x w), w [H] (Qwen2-MoE's `shared_expert_gate`)."""
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
    qkv_bias: bool = False
    """The query, key and value projections add a bias (Qwen2-MoE; Qwen3-MoE with `attention_bias`)."""
    o_proj_bias: bool = False
    """The attention's output projection adds a bias (Qwen3-MoE with `attention_bias`)."""
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
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise ConfigError("shared_expert_gate without a shared expert (shared_expert_intermediate_size=0)")

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        reason = _unsupported(raw, model_type)
        if reason:
            raise ConfigError(reason)

        def pick(*names: str, default: Any = None) -> Any:
            for name in names:
                if raw.get(name) is not None:
                    return raw[name]
            return default

        num_experts = pick("num_experts", "num_local_experts", "n_routed_experts")
        if num_experts is None:
            raise ConfigError("config has no num_experts / num_local_experts / n_routed_experts: not an MoE model")
        # transformers' defaults for keys a config leaves out: Mixtral's differ from Qwen's
        default_theta, default_eps = (1e6, 1e-5) if model_type == "mixtral" else (10000.0, 1e-6)
        rope_theta = pick("rope_theta")
        if rope_theta is None:
            rope_theta = _rope_parameters(raw).get("rope_theta", default_theta)
        try:
            hidden = raw["hidden_size"]
            heads = raw["num_attention_heads"]
        except KeyError as exc:
            raise ConfigError(f"config is missing {exc.args[0]!r}") from None
        shared = pick("shared_expert_intermediate_size", default=0)
        if not shared and raw.get("n_shared_experts"):
            shared = raw["n_shared_experts"] * raw["moe_intermediate_size"]
        scoring = pick("scoring_func", default="softmax")
        # What model_type fixes, as transformers builds it; without one, Shoal's own keys.
        structure: dict[str, Any]
        if model_type == "qwen3_moe":
            bias = bool(raw.get("attention_bias", False))
            structure = {"qk_norm": True, "qkv_bias": bias, "o_proj_bias": bias}
            if shared:
                logger.warning(
                    "qwen3_moe config with shared_expert_intermediate_size=%d: Hugging Face's Qwen3-MoE has no "
                    "shared expert, so transformers and vLLM build this checkpoint without it; Shoal loads it whole",
                    shared,
                )
        elif model_type == "qwen2_moe":
            if not shared:
                raise ConfigError("a qwen2_moe config needs shared_expert_intermediate_size > 0: its shared expert")
            structure = {"qk_norm": False, "qkv_bias": bool(raw.get("qkv_bias", True)), "shared_expert_gate": True}
        elif model_type == "mixtral":
            structure = {"qk_norm": False, "norm_topk_prob": True}  # Mixtral always renormalises its top-k weights
        else:
            structure = {"qk_norm": pick("qk_norm", default=True)}
        try:
            values: dict[str, Any] = {
                "vocab_size": raw["vocab_size"],
                "hidden_size": hidden,
                "num_hidden_layers": raw["num_hidden_layers"],
                "num_attention_heads": heads,
                "num_key_value_heads": pick("num_key_value_heads", default=heads),
                "head_dim": pick("head_dim", default=hidden // heads),
                "moe_intermediate_size": pick("moe_intermediate_size", "intermediate_size"),
                "num_experts": num_experts,
                "num_experts_per_tok": raw["num_experts_per_tok"],
                "shared_expert_intermediate_size": shared,
                "router_kind": "sigmoid" if scoring == "sigmoid" else "softmax",
                "norm_topk_prob": pick("norm_topk_prob", default=scoring != "softmax"),
                "routed_scaling_factor": pick("routed_scaling_factor", default=1.0),
                "rms_norm_eps": pick("rms_norm_eps", default=default_eps),
                "rope_theta": float(rope_theta),
                "max_position_embeddings": pick("max_position_embeddings", default=4096),
                "tie_word_embeddings": pick("tie_word_embeddings", default=False),
                "bos_token_id": raw.get("bos_token_id"),
                "eos_token_id": raw.get("eos_token_id"),
            }
        except KeyError as exc:
            raise ConfigError(f"config is missing {exc.args[0]!r}") from None
        return cls(**(values | structure))

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        return cls.from_hf(json.loads(Path(path).read_text(encoding="utf-8")))

    def hf_model_type(self) -> str:
        """The Hugging Face architecture this model is, read from its structure: q/k norm without a shared expert is
        Qwen3-MoE, a gated shared expert Qwen2-MoE, neither Mixtral. ConfigError naming why when it is none, or
        when transformers and vLLM 0.32 would read its folder differently (their model files, compared)."""
        if self.router_kind != "softmax" or self.routed_scaling_factor != 1.0:
            raise ConfigError(
                "a sigmoid router or a routed scaling factor is DeepSeek-V3's, and DeepSeek-V3's attention is "
                "multi-head latent attention, which Shoal does not implement: no Hugging Face architecture fits"
            )
        if self.qk_norm:
            if self.shared_expert_intermediate_size:
                raise ConfigError(
                    "q/k norm with a shared expert is no Hugging Face architecture: Qwen3-MoE (q/k norm) has no "
                    "shared expert, so transformers and vLLM would build this model without it"
                )
            if self.qkv_bias or self.o_proj_bias:
                raise ConfigError(
                    "Qwen3-MoE's attention_bias is read two ways: transformers biases q, k, v and the output "
                    "projection, vLLM q, k and v only (it drops o_proj.bias)"
                )
            return "qwen3_moe"
        if self.o_proj_bias:
            raise ConfigError("an output projection bias is Qwen3-MoE's only, which normalises q and k (qk_norm)")
        if self.shared_expert_intermediate_size:
            if not self.shared_expert_gate:
                raise ConfigError(
                    "a shared expert without q/k norm is Qwen2-MoE's, whose shared expert has a sigmoid gate "
                    "(shared_expert_gate); one without the gate is no Hugging Face architecture"
                )
            if not self.qkv_bias:
                raise ConfigError("Qwen2-MoE without a q/k/v bias: vLLM's Qwen2-MoE always has one (qkv_bias)")
            if self.head_dim * self.num_attention_heads != self.hidden_size:
                raise ConfigError(
                    f"Qwen2-MoE with head_dim={self.head_dim} != hidden_size / num_attention_heads: vLLM's "
                    "Qwen2-MoE takes head_dim from them, not from the config"
                )
            return "qwen2_moe"
        if self.qkv_bias or not self.norm_topk_prob:
            raise ConfigError(
                "without q/k norm or a shared expert the model is Mixtral, which has no attention bias and always "
                "renormalises the top-k weights (norm_topk_prob)"
            )
        return "mixtral"

    def to_hf(self, *, dtype: str | None = None) -> dict[str, Any]:
        """The `config.json` of the architecture this model is (`hf_model_type`), weights in `dtype` (e.g.
        "bfloat16") if given."""
        model_type = self.hf_model_type()
        out: dict[str, Any] = {
            "architectures": [HF_ARCHITECTURES[model_type]],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "num_experts_per_tok": self.num_experts_per_tok,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if model_type == "mixtral":
            out |= {
                "num_local_experts": self.num_experts,
                "intermediate_size": self.moe_intermediate_size,
                "sliding_window": None,
            }
        else:
            out |= {
                "num_experts": self.num_experts,
                "moe_intermediate_size": self.moe_intermediate_size,
                "intermediate_size": self.moe_intermediate_size,  # a dense layer's width: every layer here is MoE
                "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "use_sliding_window": False,
            }
            if model_type == "qwen3_moe":
                out["attention_bias"] = False
            else:
                out["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
                out["qkv_bias"] = True
        if dtype is not None:
            out |= {"dtype": dtype, "torch_dtype": dtype}  # transformers 5 reads `dtype`, older tools `torch_dtype`
        return out

    def replace(self, **changes: Any) -> ModelConfig:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return ModelConfig(**values)

    @property
    def num_routed_expert_params(self) -> int:
        """Parameters in all routed experts: gate, up and down projections of every expert of every layer."""
        return self.num_hidden_layers * self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    return params if isinstance(params, dict) else {}


def _unsupported(raw: dict[str, Any], model_type: str | None) -> str | None:
    """Why Shoal cannot compute what this config describes, or None."""
    if model_type in _MLA_MODEL_TYPES or raw.get("kv_lora_rank") is not None:
        return (
            f"model_type {model_type!r}: its attention is multi-head latent attention (kv_lora_rank), which Shoal "
            f"does not implement; Shoal builds {', '.join(HF_ARCHITECTURES)}"
        )
    if model_type is not None and model_type not in HF_ARCHITECTURES:
        return f"model_type {model_type!r} is not one Shoal builds: {', '.join(HF_ARCHITECTURES)}"
    if raw.get("hidden_act", "silu") != "silu":
        return f"hidden_act={raw['hidden_act']!r}: Shoal's experts are SwiGLU (silu)"
    if raw.get("mlp_only_layers") or raw.get("decoder_sparse_step", 1) != 1:
        return "dense feed-forward layers (mlp_only_layers, decoder_sparse_step > 1) are not implemented"
    window = raw.get("sliding_window")
    if (
        raw.get("use_sliding_window")
        or "sliding_attention" in (raw.get("layer_types") or [])
        or (model_type == "mixtral" and window is not None and window < raw.get("max_position_embeddings", 4096))
    ):
        return "sliding-window attention is not implemented"
    params = _rope_parameters(raw)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        return f"RoPE scaling {rope_type!r} is not implemented (only the default rope_type)"
    return None
