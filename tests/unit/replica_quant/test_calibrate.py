"""Calibration refuses to fix W4A4 scales while an expert is uncovered, names it, and its scales serve W4A4."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from replica.model.config import ModelConfig
from replica.model.loader import init_weights
from replica.model.model import MoEForCausalLM
from replica.quant.calibrate import CalibrationError, calibrate, load_amax, observe_experts
from replica.quant.experts import NVFP4Experts, quantize_model_experts

UNREACHABLE = (1, 5)  # (layer, expert)


def _model(*, block: tuple[int, int] | None) -> MoEForCausalLM:
    cfg = ModelConfig(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        router_kind="sigmoid",
    )
    model = MoEForCausalLM(cfg)
    init_weights(model, seed=1, std=0.3)
    if block is not None:
        layer, expert = block
        with torch.no_grad():
            model.model.layers[layer].mlp.gate.bias[expert] = -1e4  # never among the top-k
    return model.eval()


def _prompts(n: int = 24, length: int = 48) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 96, (length,), generator=g).tolist() for _ in range(n)]


def test_every_expert_covered_gives_positive_amax() -> None:
    result = calibrate(_model(block=None), _prompts(), min_tokens=4)
    assert result.uncovered() == []
    assert result.token_counts.sum(dim=1).tolist() == [24 * 48 * 2] * 2  # each token reaches 2 experts per layer
    for amax in result.amax.values():
        assert bool((amax > 0).all())


def test_refuses_and_names_the_unreachable_expert() -> None:
    with pytest.raises(CalibrationError, match=r"layer 1 expert 5 \(0 tokens\)") as info:
        calibrate(_model(block=UNREACHABLE), _prompts(), min_tokens=4)
    assert "--allow-uncovered" in str(info.value)
    assert "1 experts" in str(info.value)


def test_override_warns_and_uses_the_layers_largest_amax(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        result = calibrate(_model(block=UNREACHABLE), _prompts(), min_tokens=4, allow_uncovered=True)
    assert "layer 1 expert 5" in caplog.text
    layer, expert = UNREACHABLE
    for amax in result.amax.values():
        assert amax[layer, expert] == amax[layer].max() > 0


def test_coverage_table_lists_the_uncovered_expert() -> None:
    result = observe_experts(_model(block=UNREACHABLE), _prompts(), min_tokens=4)
    rows = result.coverage_table().splitlines()
    assert rows[2].split()[0] == "1" and rows[2].split()[-1] == "5"
    assert rows[1].split()[-1] == "-"


def test_scales_file_round_trip_and_w4a4_serving(tmp_path: Path) -> None:
    model = _model(block=None)
    result = calibrate(model, _prompts(), min_tokens=4)
    path = tmp_path / "scales.json"
    path.write_text(json.dumps(result.to_json()))
    amax = load_amax(path)
    assert torch.equal(amax["down"], result.amax["down"])
    reference, weights_only = _model(block=None), _model(block=None)
    ids = torch.tensor([_prompts(1, 32)[0]])
    assert quantize_model_experts(model, mode="w4a4", activation_amax=amax) == 2
    assert all(m.has_activation_scales for m in model.modules() if isinstance(m, NVFP4Experts))
    quantize_model_experts(weights_only, mode="w4a16")
    with torch.no_grad():
        want = reference.forward_train(ids)[0]
        w4a4_error = ((model.forward_train(ids)[0] - want).norm() / want.norm()).item()
        w4a16_error = ((weights_only.forward_train(ids)[0] - want).norm() / want.norm()).item()
    # Quantizing activations too adds noise of the same order as quantizing weights (measured: 0.32 vs 0.25 on this
    # random model), never an order of magnitude more, which a wrong activation scale would give.
    assert w4a4_error < 1.5 * w4a16_error, (w4a4_error, w4a16_error)


def test_load_amax_rejects_other_files(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CalibrationError, match="not a calibration file"):
        load_amax(path)
    with pytest.raises(CalibrationError, match="cannot read"):
        load_amax(tmp_path / "missing.json")
