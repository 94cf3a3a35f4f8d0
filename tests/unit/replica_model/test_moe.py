"""The MoE feed-forward against a per-token reference: softmax and sigmoid routers, shared expert, and every way
the routed experts run (grouped, one token, padded) equal to the expert-by-expert path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from replica.model import moe
from replica.model.config import ModelConfig
from replica.model.moe import Experts, MoEBlock


def _block(router_kind: str, shared: int) -> MoEBlock:
    cfg = ModelConfig(
        vocab_size=10,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        moe_intermediate_size=24,
        num_experts=6,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=shared,
        router_kind=router_kind,  # type: ignore[arg-type]
        routed_scaling_factor=1.5 if router_kind == "sigmoid" else 1.0,
    )
    block = MoEBlock(cfg, layer=0, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        if block.gate.bias is not None:
            block.gate.bias.copy_(torch.randn(6, generator=g))
    return block


def _reference(block: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    logits = x @ block.gate.weight.T
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        if block.gate.kind == "softmax":
            probs = logits[t].softmax(-1)
            weights, ids = probs.topk(2)
        else:
            scores = logits[t].sigmoid()
            assert block.gate.bias is not None
            ids = (scores + block.gate.bias).topk(2).indices
            weights = scores[ids]
        weights = weights / weights.sum() * block.gate.scaling
        for w, e in zip(weights, ids, strict=True):
            gate, up = (x[t] @ block.experts.gate_up[e].T).chunk(2)
            out[t] += w * ((F.silu(gate) * up) @ block.experts.down[e].T)
    if block.shared_expert is not None:
        out += block.shared_expert(x)
    return out


@pytest.mark.parametrize(("router_kind", "shared"), [("softmax", 0), ("softmax", 40), ("sigmoid", 40)])
def test_block_matches_per_token_reference(router_kind: str, shared: int) -> None:
    block = _block(router_kind, shared)
    x = torch.randn(17, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(block(x), _reference(block, x), rtol=1e-5, atol=1e-5)


def _expert_by_expert(experts: Experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    experts.has_stacked_weights = False
    try:
        return experts(x, ids, weights)
    finally:
        del experts.has_stacked_weights  # back to the class's value


@pytest.mark.parametrize("num_tokens", [2, 3, 64])
def test_grouped_path_equals_expert_by_expert_to_the_bit(num_tokens: int) -> None:
    """On the CPU at inference every expert's rows go through one grouped GEMM: the same GEMMs as the loop."""
    block = _block("softmax", 0)
    x = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ids, weights, _ = block.gate(x)
        assert block.experts._can_group(x) == moe._HAS_GROUPED_MM
        grouped = block.experts(x, ids, weights)
        looped = _expert_by_expert(block.experts, x, ids, weights)
    assert torch.equal(grouped, looped)


@pytest.mark.parametrize(
    ("num_experts_per_tok", "dtype"), [(2, torch.float32), (3, torch.float32), (2, torch.bfloat16)]
)
@pytest.mark.parametrize("serving_layout", [False, True])
def test_one_token_path_equals_expert_by_expert_to_the_bit(
    num_experts_per_tok: int, dtype: torch.dtype, serving_layout: bool
) -> None:
    """A batch-1 decode step runs its experts one by one; the sum over them keeps the loop path's expert order."""
    experts = Experts(6, 32, 24, dtype=dtype)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    if serving_layout:
        experts.use_serving_layout()
    with torch.inference_mode():
        for _ in range(20):
            x = torch.randn(1, 32, generator=g).to(dtype)
            ids = torch.randperm(6, generator=g)[:num_experts_per_tok].unsqueeze(0)  # unsorted, as topk gives them
            weights = torch.rand(1, num_experts_per_tok, generator=g)
            assert torch.equal(experts(x, ids, weights), _expert_by_expert(experts, x, ids, weights))


@pytest.mark.parametrize("num_tokens", [1, 3, 64])
def test_padded_path_equals_expert_by_expert(num_tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where grouped GEMMs are not taken (training, other devices), the padded batched path."""
    monkeypatch.setattr(moe, "_HAS_GROUPED_MM", False)
    block = _block("softmax", 0)
    x = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(2))
    ids, weights, _ = block.gate(x)
    with torch.no_grad():
        padded = block.experts(x, ids, weights)
        looped = _expert_by_expert(block.experts, x, ids, weights)
    torch.testing.assert_close(padded, looped, rtol=1e-5, atol=1e-6)


def test_training_takes_a_differentiable_path() -> None:
    """grouped_mm has no backward on the CPU: with gradients on, the experts run padded or one by one."""
    block = _block("softmax", 0)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(5), requires_grad=True)
    ids, weights, _ = block.gate(x)
    assert not block.experts._can_group(x)
    block.experts(x, ids, weights).sum().backward()
    assert x.grad is not None and block.experts.gate_up.grad is not None


def test_skewed_routing_falls_back_to_expert_by_expert(monkeypatch: pytest.MonkeyPatch) -> None:
    """All tokens on one expert would pad the batch E-fold; the loop path must take it, with the same result."""
    monkeypatch.setattr(moe, "_HAS_GROUPED_MM", False)
    block = _block("softmax", 0)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(3))
    ids = torch.zeros(40, 2, dtype=torch.long)
    ids[:, 1] = 1
    weights = torch.full((40, 2), 0.5)
    calls: list[int] = []
    original = block.experts.expert_forward

    def counting(expert: int, rows: torch.Tensor) -> torch.Tensor:
        calls.append(expert)
        return original(expert, rows)

    block.experts.expert_forward = counting  # type: ignore[method-assign]
    block.experts.padded_waste_limit = 2.0  # 6 experts x 40 rows padded for 80 routed rows is 3x: over the limit
    with torch.no_grad():
        out = block.experts(x, ids, weights)
    assert sorted(calls) == [0, 1]
    gate_a, up_a = (x @ block.experts.gate_up[0].T).chunk(2, -1)
    gate_b, up_b = (x @ block.experts.gate_up[1].T).chunk(2, -1)
    want = (
        0.5 * (F.silu(gate_a) * up_a) @ block.experts.down[0].T
        + 0.5 * (F.silu(gate_b) * up_b) @ block.experts.down[1].T
    )
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
