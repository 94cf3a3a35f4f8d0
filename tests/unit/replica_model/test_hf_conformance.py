"""Shoal's model against transformers, the reference: for each architecture the loader claims (Qwen3-MoE with and
without renormalised top-k weights and with attention bias, Qwen2-MoE, Mixtral), a random tiny transformers model
saved with `save_pretrained` (and as transformers holds it in memory, experts stacked) loads in Shoal with logits
equal to transformers' over 457 positions, both without a cache (`forward_train`) and through the paged cache (a
prefill chunk, a chunk after cached tokens and a decode step); and a checkpoint Shoal saves loads in transformers
with every key used and the same logits (but a biased Qwen3-MoE, which Shoal does not write: vLLM reads its bias
otherwise). DeepSeek-V3 is refused by name.

Weights are drawn wider than transformers' initialisation (std 0.02 leaves logits near zero, where any model
matches): norms and biases away from their neutral values, so that a norm or bias applied to the wrong rows, or
not at all, moves the logits by far more than the 1e-4 allowed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from replica.engine.runner import allocate_kv_caches
from replica.model.attention import AttentionBatch
from replica.model.config import ConfigError, ModelConfig
from replica.model.loader import init_weights, load_model, save_checkpoint
from replica.model.model import MoEForCausalLM

transformers = pytest.importorskip(
    "transformers", reason="transformers (the dev extra) is the reference these tests compare Shoal's logits with"
)

MAX_ABS_DIFF = 1e-4
"""FP32 logits of the same weights may differ by rounding only: summation order in matmuls and attention."""

SEQ_LENS = (160, 97, 200)
BLOCK_SIZE = 16
DIMS: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
EXPERTS, EXPERT_WIDTH, SHARED_WIDTH = 8, 32, 48


def _hf_config(arch: str) -> Any:
    """The transformers config of each case: its own defaults for everything DIMS does not set."""
    t = transformers
    if arch.startswith("qwen3_moe"):
        return t.Qwen3MoeConfig(
            **DIMS,
            num_experts=EXPERTS,
            moe_intermediate_size=EXPERT_WIDTH,
            norm_topk_prob=arch != "qwen3_moe-unnormalised",
            attention_bias=arch == "qwen3_moe-bias",
        )
    if arch == "qwen2_moe":  # norm_topk_prob and qkv_bias at transformers' defaults: False and True
        return t.Qwen2MoeConfig(
            **DIMS,
            num_experts=EXPERTS,
            moe_intermediate_size=EXPERT_WIDTH,
            shared_expert_intermediate_size=SHARED_WIDTH,
        )
    assert arch == "mixtral"
    return t.MixtralConfig(**DIMS, num_local_experts=EXPERTS, intermediate_size=EXPERT_WIDTH)


ARCHS = ["qwen3_moe", "qwen3_moe-unnormalised", "qwen3_moe-bias", "qwen2_moe", "mixtral"]


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter drawn from `seed`: matrices normal(0, 0.15), norms in [0.5, 1.5], biases normal(0, 0.5)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                values = torch.rand(param.shape, generator=gen) + 0.5
            elif name.endswith(".bias"):
                values = torch.randn(param.shape, generator=gen) * 0.5
            else:
                values = torch.randn(param.shape, generator=gen) * 0.15
            param.copy_(values)


def _hf_model(arch: str, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = _hf_config(arch)
    config._attn_implementation = "eager"  # the reference: plain softmax(q k^T / sqrt(d) + mask) v
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    return model.eval()


def _sequences(vocab_size: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab_size, (n,), generator=gen) for n in SEQ_LENS]


def _hf_logits(model: Any, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [model(input_ids=ids[None]).logits[0].float() for ids in seqs]


def _dense_logits(model: MoEForCausalLM, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [model.forward_train(ids[None])[0][0] for ids in seqs]


def _paged_logits(model: MoEForCausalLM, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every position's logits through the paged cache, all sequences in each of three steps: the first half of each
    as a prefill chunk, the rest but the last token as a chunk after its cached tokens, the last token as a batched
    decode step (the three ways `Attention` attends)."""
    config = model.config
    blocks_per_seq = -(-max(len(s) for s in seqs) // BLOCK_SIZE)
    tables = torch.arange(len(seqs) * blocks_per_seq).view(len(seqs), blocks_per_seq)  # [B, M]
    caches = allocate_kv_caches(
        config.num_hidden_layers,
        tables.numel() * BLOCK_SIZE,
        config.num_key_value_heads,
        config.head_dim,
        dtype=model.dtype,
        device=model.device,
    )
    steps = [
        [(0, len(s) // 2) for s in seqs],
        [(len(s) // 2, len(s) - 1) for s in seqs],
        [(len(s) - 1, len(s)) for s in seqs],
    ]
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in steps:
        positions = torch.cat([torch.arange(start, end) for start, end in step])
        owners = torch.cat([torch.full((end - start,), i) for i, (start, end) in enumerate(step)])
        batch = AttentionBatch.build(
            slot_mapping=tables[owners, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE,
            query_lens=[end - start for start, end in step],
            context_lens=[end for _, end in step],
            block_tables=tables,
            block_size=BLOCK_SIZE,
            dtype=model.dtype,
        )
        input_ids = torch.cat([seq[start:end] for seq, (start, end) in zip(seqs, step, strict=True)])
        with torch.inference_mode():
            logits = model.compute_logits(model(input_ids, positions, caches, batch))
        for i, rows in enumerate(torch.split(logits, [end - start for start, end in step])):
            out[i].append(rows)
    return [torch.cat(parts) for parts in out]


def _max_abs_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))


def _assert_meaningful(logits: list[torch.Tensor]) -> None:
    """Logits spread well beyond the tolerance, so that agreement within it says something."""
    assert min(float(x.std()) for x in logits) > 0.5


def _write_in_memory_layout(hf: Any, path: Path) -> None:
    """The checkpoint as transformers holds it in memory (experts stacked: `mlp.experts.gate_up_proj [E, 2I, H]`),
    which some tools write as it is."""
    path.mkdir()
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state and "model.layers.0.mlp.experts.down_proj" in state
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(hf.config.to_json_string(), encoding="utf-8")


@pytest.mark.parametrize("layout", ["save_pretrained", "in_memory"])
@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_checkpoint_loads_with_its_logits(arch: str, layout: str, tmp_path: Path) -> None:
    hf = _hf_model(arch)
    path = tmp_path / "ckpt"
    if layout == "save_pretrained":
        hf.save_pretrained(path)
        keys = set(load_file(str(path / "model.safetensors")))
        per_expert = (
            "model.layers.1.block_sparse_moe.experts.7.w2.weight"
            if arch == "mixtral"
            else "model.layers.1.mlp.experts.7.down_proj.weight"
        )
        assert per_expert in keys, "save_pretrained writes the hub's per-expert layout"
    else:
        _write_in_memory_layout(hf, path)
    seqs = _sequences(DIMS["vocab_size"])
    want = _hf_logits(hf, seqs)
    _assert_meaningful(want)

    model = load_model(path)
    if arch != "qwen3_moe-bias":  # which Shoal reads but does not write
        assert model.config.hf_model_type() == arch.split("-")[0]
    dense = _dense_logits(model, seqs)
    paged = _paged_logits(model, seqs)
    assert _max_abs_diff(dense, want) <= MAX_ABS_DIFF
    assert _max_abs_diff(paged, want) <= MAX_ABS_DIFF


def _shoal_config(arch: str) -> ModelConfig:
    """The Shoal config of each case, built without transformers: what `to_hf` must describe."""
    base = ModelConfig(**DIMS, num_experts=EXPERTS, moe_intermediate_size=EXPERT_WIDTH)
    changes: dict[str, dict[str, Any]] = {
        "qwen3_moe": {},
        "qwen3_moe-unnormalised": {"norm_topk_prob": False},
        "qwen3_moe-bias": {"qkv_bias": True, "o_proj_bias": True},
        "qwen2_moe": {
            "qk_norm": False,
            "qkv_bias": True,
            "shared_expert_intermediate_size": SHARED_WIDTH,
            "shared_expert_gate": True,
            "norm_topk_prob": False,
        },
        "mixtral": {"qk_norm": False, "rope_theta": 1e6},
    }
    return base.replace(**changes[arch])


def _shoal_model(arch: str, seed: int = 0) -> MoEForCausalLM:
    model = MoEForCausalLM(_shoal_config(arch))
    init_weights(model, seed=seed)
    _randomize(model, seed)
    return model.eval()


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "qwen3_moe-bias"])  # not written: vLLM drops o_proj.bias
def test_shoal_checkpoint_loads_in_transformers_with_every_key(arch: str, tmp_path: Path) -> None:
    model = _shoal_model(arch)
    save_checkpoint(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == arch.split("-")[0]

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True, attn_implementation="eager"
    )
    assert type(hf).__name__ == config["architectures"][0]
    assert hf.dtype == torch.float32
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[kind], f"{kind}: {info[kind]}"
    seqs = _sequences(DIMS["vocab_size"])
    want = _hf_logits(hf.eval(), seqs)
    _assert_meaningful(want)
    assert _max_abs_diff(_dense_logits(model, seqs), want) <= MAX_ABS_DIFF
    # And back: the config transformers read is the one Shoal wrote.
    assert ModelConfig.from_hf(hf.config.to_dict()) == model.config


def test_deepseek_v3_is_refused_for_its_attention(tmp_path: Path) -> None:
    config = transformers.DeepseekV3Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        first_k_dense_replace=0,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="multi-head latent attention"):
        load_model(tmp_path)
    with pytest.raises(ConfigError, match="multi-head latent attention"):
        ModelConfig.from_hf(config.to_dict())
