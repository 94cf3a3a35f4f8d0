"""Which Hugging Face architecture a config is, both ways: `model_type` decides the structure `from_hf` builds,
configs Shoal cannot compute are refused with the reason, and `to_hf` writes the architecture a model's structure
is, or refuses a model that none describes before anything is written. (The logits of each architecture against
transformers are `test_hf_conformance`'s.)"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from replica.model.config import ConfigError, ModelConfig
from replica.model.loader import init_weights, save_checkpoint
from replica.model.model import MoEForCausalLM

DIMS: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_experts_per_tok": 2,
}
QWEN3 = {**DIMS, "model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 16, "intermediate_size": 64}
QWEN2 = {**QWEN3, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 24}
MIXTRAL = {**DIMS, "model_type": "mixtral", "num_local_experts": 4, "intermediate_size": 16}


def test_model_type_decides_the_structure() -> None:
    # Keys of Shoal's own (qk_norm) never override what the architecture is.
    qwen3 = ModelConfig.from_hf({**QWEN3, "qk_norm": False})
    assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.o_proj_bias, qwen3.shared_expert_intermediate_size) == (
        True,
        False,
        False,
        0,
    )
    assert not qwen3.norm_topk_prob and qwen3.moe_intermediate_size == 16  # transformers' default; not the dense 64
    biased = ModelConfig.from_hf({**QWEN3, "attention_bias": True, "norm_topk_prob": True})
    assert biased.qkv_bias and biased.o_proj_bias and biased.norm_topk_prob

    qwen2 = ModelConfig.from_hf({**QWEN2, "qk_norm": True})
    assert (qwen2.qk_norm, qwen2.qkv_bias, qwen2.o_proj_bias, qwen2.shared_expert_gate) == (False, True, False, True)
    assert qwen2.shared_expert_intermediate_size == 24 and not qwen2.norm_topk_prob
    assert not ModelConfig.from_hf({**QWEN2, "qkv_bias": False}).qkv_bias

    mixtral = ModelConfig.from_hf({**MIXTRAL, "norm_topk_prob": False, "sliding_window": None})
    assert (mixtral.qk_norm, mixtral.qkv_bias, mixtral.shared_expert_intermediate_size) == (False, False, 0)
    assert mixtral.norm_topk_prob, "Mixtral always renormalises its top-k weights"
    assert (mixtral.num_experts, mixtral.moe_intermediate_size) == (4, 16)
    assert (mixtral.rope_theta, mixtral.rms_norm_eps) == (1e6, 1e-5), "transformers' Mixtral defaults"
    assert (qwen3.rope_theta, qwen3.rms_norm_eps) == (1e4, 1e-6)


DEEPSEEK_V3 = {
    **DIMS,
    "model_type": "deepseek_v3",
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "moe_intermediate_size": 16,
    "scoring_func": "sigmoid",
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
}


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (DEEPSEEK_V3, "multi-head latent attention"),
        ({**DEEPSEEK_V3, "model_type": "deepseek_v2"}, "multi-head latent attention"),
        ({**QWEN3, "model_type": "olmoe"}, "'olmoe' is not one Shoal builds"),
        ({**QWEN2, "use_sliding_window": True}, "sliding-window"),
        ({**MIXTRAL, "sliding_window": 64, "max_position_embeddings": 4096}, "sliding-window"),
        ({**QWEN3, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
        ({**QWEN3, "mlp_only_layers": [0]}, "dense feed-forward"),
        ({**QWEN2, "decoder_sparse_step": 2}, "dense feed-forward"),
        ({**MIXTRAL, "hidden_act": "gelu"}, "silu"),
        ({**QWEN2, "shared_expert_intermediate_size": 0}, "shared expert"),
    ],
)
def test_configs_shoal_cannot_compute_are_refused_with_the_reason(raw: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        ModelConfig.from_hf(raw)


def test_a_window_longer_than_any_sequence_is_no_window() -> None:
    ModelConfig.from_hf({**MIXTRAL, "sliding_window": 4096, "max_position_embeddings": 4096})


def test_qwen3_moe_with_a_shared_expert_loads_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Shoal's demo checkpoints were written so; other tools build them without the shared expert."""
    with caplog.at_level(logging.WARNING, logger="replica.model.config"):
        config = ModelConfig.from_hf({**QWEN3, "shared_expert_intermediate_size": 24})
    assert config.shared_expert_intermediate_size == 24 and config.qk_norm
    assert "no shared expert" in caplog.text
    with pytest.raises(ConfigError, match=r"Qwen3-MoE \(q/k norm\) has no shared expert"):
        config.to_hf()


@pytest.mark.parametrize("raw", [QWEN3, QWEN2, MIXTRAL], ids=lambda r: r["model_type"])
def test_to_hf_writes_the_architecture_back(raw: dict[str, Any]) -> None:
    config = ModelConfig.from_hf(raw)
    written = config.to_hf(dtype="bfloat16")
    assert written["model_type"] == raw["model_type"] == config.hf_model_type()
    assert written["dtype"] == written["torch_dtype"] == "bfloat16"
    assert ModelConfig.from_hf(written) == config


BASE = ModelConfig(**DIMS, num_experts=4, moe_intermediate_size=16)


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"shared_expert_intermediate_size": 24}, "q/k norm with a shared expert"),
        ({"router_kind": "sigmoid"}, "multi-head latent attention"),
        ({"routed_scaling_factor": 2.5}, "routed scaling factor"),
        ({"qkv_bias": True, "o_proj_bias": True}, "read two ways"),
        ({"qkv_bias": True}, "read two ways"),
        ({"qk_norm": False, "shared_expert_intermediate_size": 24}, "sigmoid gate"),
        ({"qk_norm": False, "shared_expert_intermediate_size": 24, "shared_expert_gate": True}, "q/k/v bias"),
        (
            {"qk_norm": False, "qkv_bias": True, "shared_expert_intermediate_size": 24, "shared_expert_gate": True}
            | {"head_dim": 16},
            "takes head_dim",
        ),
        ({"qk_norm": False, "o_proj_bias": True}, "output projection bias"),
        ({"qk_norm": False, "qkv_bias": True}, "Mixtral"),
        ({"qk_norm": False, "norm_topk_prob": False}, "Mixtral"),
    ],
)
def test_a_model_no_architecture_describes_is_not_written(
    changes: dict[str, Any], fragment: str, tmp_path: Path
) -> None:
    model = MoEForCausalLM(BASE.replace(**changes))
    init_weights(model, seed=0)
    with pytest.raises(ConfigError, match=fragment):
        save_checkpoint(model, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
