"""Configs with Hugging Face key aliases, and checkpoints in Hugging Face's Qwen3-MoE layout, loaded onto a model
built on the meta device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from replica.model.config import ConfigError, ModelConfig
from replica.model.loader import CheckpointError, init_weights, load_model, save_checkpoint, state_dict_hf
from replica.model.model import MoEForCausalLM

BASE = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "moe_intermediate_size": 16,
    "num_experts_per_tok": 2,
}


def test_expert_count_and_rope_aliases() -> None:
    a = ModelConfig.from_hf({**BASE, "num_experts": 8, "rope_theta": 1e6})
    b = ModelConfig.from_hf({**BASE, "num_local_experts": 8, "rope_parameters": {"rope_theta": 1e6}})
    c = ModelConfig.from_hf({**BASE, "n_routed_experts": 8, "rope_scaling": {"rope_theta": 1e6}})
    assert a == b == c
    assert a.num_experts == 8 and a.rope_theta == 1e6


def test_deepseek_style_config_has_sigmoid_router_and_shared_experts() -> None:
    cfg = ModelConfig.from_hf({**BASE, "n_routed_experts": 8, "n_shared_experts": 2, "scoring_func": "sigmoid"})
    assert cfg.router_kind == "sigmoid"
    assert cfg.shared_expert_intermediate_size == 2 * 16
    assert cfg.norm_topk_prob


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (BASE, "num_experts"),
        ({**BASE, "num_experts": 8, "num_key_value_heads": 3}, "multiple"),
        ({**BASE, "num_experts": 2, "num_experts_per_tok": 3}, "num_experts_per_tok"),
        ({k: v for k, v in BASE.items() if k != "hidden_size"} | {"num_experts": 8}, "hidden_size"),
    ],
)
def test_bad_configs_are_named(raw: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        ModelConfig.from_hf(raw)


def _model(**changes: object) -> MoEForCausalLM:
    cfg = ModelConfig.from_hf({**BASE, "num_experts": 4, **changes})
    model = MoEForCausalLM(cfg)
    init_weights(model, seed=3, std=0.2)
    return model.eval()


def test_round_trip_through_hugging_face_keys(tmp_path: Path) -> None:
    model = _model(model_type="qwen2_moe", shared_expert_intermediate_size=16)
    save_checkpoint(model, tmp_path)
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in keys
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in keys
    assert "model.layers.0.mlp.shared_expert.up_proj.weight" in keys
    assert json.loads((tmp_path / "config.json").read_text())["num_experts"] == 4
    loaded = load_model(tmp_path)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    model.use_serving_layout()  # as loaded: the same operand layouts, hence the same roundings
    with torch.no_grad():
        assert torch.equal(model.forward_train(ids)[0], loaded.forward_train(ids)[0])


def test_loaded_experts_are_stored_transposed_and_built_ones_row_major(tmp_path: Path) -> None:
    """Serving reads each expert weight as a contiguous [in, out] operand; training keeps the row-major layout
    that the demo model was built with. Logical shapes and values are the same, logits equal to rounding."""
    model = _model()
    save_checkpoint(model, tmp_path)
    loaded = load_model(tmp_path)
    for built, served in zip(model.decoder_layers, loaded.decoder_layers, strict=True):
        for name in ("gate_up", "down"):
            row_major, transposed = getattr(built.mlp.experts, name), getattr(served.mlp.experts, name)
            assert row_major.is_contiguous()
            assert transposed.transpose(1, 2).is_contiguous() and not transposed.is_contiguous()
            assert transposed.shape == row_major.shape and torch.equal(transposed, row_major)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model.forward_train(ids)[0], loaded.forward_train(ids)[0], rtol=1e-5, atol=1e-5)


def test_deepseek_names_load(tmp_path: Path) -> None:
    raw = {**BASE, "num_experts": 4, "scoring_func": "sigmoid", "shared_expert_intermediate_size": 16}
    model = _model(**raw)
    with torch.no_grad():
        model.model.layers[0].mlp.gate.bias.copy_(torch.tensor([0.5, -0.5, 0.0, 1.0]))
    # Written by hand: a sigmoid router is no architecture `save_checkpoint` writes.
    (tmp_path / "config.json").write_text(json.dumps(raw))
    tensors = state_dict_hf(model)
    renamed = {
        k.replace(".shared_expert.", ".shared_experts.").replace("mlp.gate.bias", "mlp.gate.e_score_correction_bias"): v
        for k, v in tensors.items()
    }
    save_file(renamed, str(tmp_path / "model.safetensors"))
    loaded = load_model(tmp_path)
    assert torch.equal(loaded.model.layers[0].mlp.gate.bias, torch.tensor([0.5, -0.5, 0.0, 1.0]))


def test_missing_and_unexpected_keys_are_named(tmp_path: Path) -> None:
    save_checkpoint(_model(), tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.gate_up"):
        load_model(tmp_path)
    tensors["model.layers.1.mlp.experts.2.up_proj.weight"] = torch.zeros(16, 32)
    tensors["model.layers.9.self_attn.q_proj.weight"] = torch.zeros(1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layers\.9"):
        load_model(tmp_path)


def test_wrong_shape_is_named(tmp_path: Path) -> None:
    save_checkpoint(_model(), tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(31)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight: shape \(31,\)"):
        load_model(tmp_path)


def test_folder_without_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json"):
        load_model(tmp_path)


def test_loading_the_demo_checkpoint_imports_no_compiler() -> None:
    """The constructors' random draws on the meta device would import torch._dynamo (about 1.2 s of a replica's
    start) and triton (whose bindings print leak reports at exit); loading skips them. A fresh process: this one has
    imported both already."""
    code = (
        "import sys\n"
        "from replica.loading import load_for_serving\n"
        "from replica.settings import ReplicaSettings\n"
        "load_for_serving(ReplicaSettings(model='demo'))\n"
        "print(sorted(m for m in ('torch._dynamo', 'triton') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
