"""The fused serving paths against the plain computation from Hugging Face's separate weights: one QKV matmul with
q/k norm and RoPE applied to queries and keys together, the shared expert's one gate/up matmul, and the loader that
joins the separate checkpoint weights into them."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from replica.model.attention import Attention
from replica.model.config import ModelConfig
from replica.model.loader import init_weights, load_model, save_checkpoint, state_dict_hf
from replica.model.model import MoEForCausalLM
from replica.model.moe import SharedExpert

CONFIG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    moe_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=2,
    shared_expert_intermediate_size=24,
    max_position_embeddings=64,
)


def _plain_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _plain_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """HF's rotate_half RoPE from scratch: x [T, heads, D]."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(0, x.shape[-1], 2, dtype=torch.float32) / x.shape[-1])
    angles = positions.float()[:, None] * inv_freq  # [T, D/2]
    c, s = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _model() -> MoEForCausalLM:
    model = MoEForCausalLM(CONFIG)
    init_weights(model, seed=1, std=0.3)
    with torch.no_grad():  # norms away from ones, so q_norm's and k_norm's rows must not be swapped
        for layer in model.decoder_layers:
            assert layer.self_attn.q_norm is not None and layer.self_attn.k_norm is not None
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(-1.5, -0.5)
    return model.eval()


def test_fused_qkv_norm_and_rope_equal_the_separate_projections() -> None:
    model = _model()
    hf = state_dict_hf(model)  # q_proj, k_proj, v_proj as separate weights
    attn: Attention = model.decoder_layers[1].self_attn
    x = torch.randn(7, CONFIG.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([0, 1, 2, 3, 20, 21, 40])
    assert model.rotary is not None
    cos, sin = model.rotary(positions)
    with torch.no_grad():
        qk, v = attn.project(x, cos, sin)
    prefix = "model.layers.1.self_attn"
    q_want = F.linear(x, hf[f"{prefix}.q_proj.weight"]).view(7, 4, 8)
    k_want = F.linear(x, hf[f"{prefix}.k_proj.weight"]).view(7, 2, 8)
    v_want = F.linear(x, hf[f"{prefix}.v_proj.weight"]).view(7, 2, 8)
    q_want = _plain_rope(_plain_rms(q_want, hf[f"{prefix}.q_norm.weight"], CONFIG.rms_norm_eps), positions, 1e4)
    k_want = _plain_rope(_plain_rms(k_want, hf[f"{prefix}.k_norm.weight"], CONFIG.rms_norm_eps), positions, 1e4)
    torch.testing.assert_close(qk[:, :4], q_want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(qk[:, 4:], k_want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v, v_want, rtol=0, atol=0)


def test_fused_shared_expert_equals_separate_gate_and_up() -> None:
    model = _model()
    hf = state_dict_hf(model)
    shared = model.decoder_layers[0].mlp.shared_expert
    assert isinstance(shared, SharedExpert)
    x = torch.randn(5, CONFIG.hidden_size, generator=torch.Generator().manual_seed(1))
    prefix = "model.layers.0.mlp.shared_expert"
    gate = F.linear(x, hf[f"{prefix}.gate_proj.weight"])
    up = F.linear(x, hf[f"{prefix}.up_proj.weight"])
    want = F.linear(F.silu(gate) * up, hf[f"{prefix}.down_proj.weight"])
    with torch.no_grad():
        torch.testing.assert_close(shared(x), want, rtol=1e-5, atol=1e-6)


def test_loader_joins_separate_weights_into_the_fused_rows(tmp_path: Path) -> None:
    # A shared expert is written as Qwen2-MoE's: no q/k norm, a q/k/v bias, a gated shared expert.
    model = MoEForCausalLM(CONFIG.replace(qk_norm=False, qkv_bias=True, shared_expert_gate=True))
    init_weights(model, seed=1, std=0.3)
    save_checkpoint(model, tmp_path)
    hf = load_file(str(tmp_path / "model.safetensors"))
    assert not any("qkv_proj" in key or "gate_up_proj" in key for key in hf)
    loaded = load_model(tmp_path)
    fused = loaded.decoder_layers[0].self_attn.qkv_proj.weight
    prefix = "model.layers.0.self_attn"
    want = torch.cat([hf[f"{prefix}.{p}_proj.weight"] for p in ("q", "k", "v")])
    assert torch.equal(fused, want)
    bias = loaded.decoder_layers[0].self_attn.qkv_proj.bias
    assert bias is not None and torch.equal(bias, torch.cat([hf[f"{prefix}.{p}_proj.bias"] for p in ("q", "k", "v")]))
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(2))
    model.use_serving_layout()  # as loaded: the same operand layouts, hence the same roundings
    with torch.no_grad():
        assert torch.equal(model.forward_train(ids)[0], loaded.forward_train(ids)[0])
