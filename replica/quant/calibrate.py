"""Calibration for W4A4: which experts see tokens, and how large their activations get.

NVFP4 activations need a global scale per expert and input (`amax / (6 * 448)`), fixed ahead of serving. An expert
that saw no calibration tokens has no amax, and a scale guessed for it would clip or waste range the first time
real traffic reaches it, so calibration refuses to fix scales until every expert of every layer has seen at least
`min_tokens` tokens, and names those that have not. `allow_uncovered` overrides that, with a warning, and gives
uncovered experts the largest amax of their layer (a conservative scale: no clipping, coarser steps).

The observer hooks the experts' `observe(layer, expert, point, x)` call, so it sees exactly what each expert's two
matmuls receive: `gate_up` (the hidden state routed to the expert) and `down` (its SwiGLU output).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from replica.model.model import MoEForCausalLM
from replica.model.moe import Experts, ObservePoint

log = logging.getLogger(__name__)

SCALES_FORMAT = "shoal-nvfp4-activation-amax/v1"
POINTS: tuple[ObservePoint, ...] = ("gate_up", "down")


class CalibrationError(ValueError):
    """Calibration data that leaves experts uncovered, or a file that cannot be used."""


class ExpertStatsObserver:
    """Per (layer, expert): tokens seen and the absolute maximum of each input."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.token_counts = torch.zeros(num_layers, num_experts, dtype=torch.long)
        self.amax = {p: torch.zeros(num_layers, num_experts, dtype=torch.float32) for p in POINTS}

    def observe(self, layer: int, expert: int, point: ObservePoint, x: torch.Tensor) -> None:
        if point == "gate_up":
            self.token_counts[layer, expert] += x.shape[0]
        amax = self.amax[point]
        amax[layer, expert] = torch.maximum(amax[layer, expert], x.detach().abs().max().float())


@dataclass
class CalibrationResult:
    token_counts: torch.Tensor
    """[L, E] tokens each expert saw."""
    amax: dict[ObservePoint, torch.Tensor]
    """point -> [L, E] activation absolute maximum."""
    min_tokens: int
    num_requests: int
    num_tokens: int

    def uncovered(self) -> list[tuple[int, int, int]]:
        """(layer, expert, tokens) of every expert below `min_tokens`."""
        low = (self.token_counts < self.min_tokens).nonzero().tolist()
        return [(layer, expert, int(self.token_counts[layer, expert])) for layer, expert in low]

    def coverage_table(self) -> str:
        counts = self.token_counts
        lines = [
            f"{'layer':>5} {'min':>7} {'median':>7} {'max':>7} {'below ' + str(self.min_tokens):>9}  experts below"
        ]
        for layer in range(counts.shape[0]):
            row = counts[layer]
            low = [str(e) for e in (row < self.min_tokens).nonzero().flatten().tolist()]
            lines.append(
                f"{layer:>5} {int(row.min()):>7} {int(row.median()):>7} {int(row.max()):>7} {len(low):>9}  "
                f"{','.join(low) or '-'}"
            )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": SCALES_FORMAT,
            "min_tokens": self.min_tokens,
            "num_requests": self.num_requests,
            "num_tokens": self.num_tokens,
            "token_counts": self.token_counts.tolist(),
            "amax": {p: self.amax[p].tolist() for p in POINTS},
        }


def calibrate(
    model: MoEForCausalLM,
    prompts: Iterable[list[int]],
    *,
    min_tokens: int,
    allow_uncovered: bool = False,
) -> CalibrationResult:
    """Run the prompts through the model, record expert statistics, and check coverage (`check_coverage`)."""
    result = observe_experts(model, prompts, min_tokens=min_tokens)
    check_coverage(result, allow_uncovered=allow_uncovered)
    return result


def observe_experts(model: MoEForCausalLM, prompts: Iterable[list[int]], *, min_tokens: int) -> CalibrationResult:
    """Run the prompts through the model and record every expert's token count and input amax."""
    c = model.config
    observer = ExpertStatsObserver(c.num_hidden_layers, c.num_experts)
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    for m in experts:
        m.observer = observer
    num_requests = num_tokens = 0
    try:
        with torch.inference_mode():
            for ids in prompts:
                ids = ids[: c.max_position_embeddings]
                model.forward_train(torch.tensor([ids], device=model.device))
                num_requests += 1
                num_tokens += len(ids)
    finally:
        for m in experts:
            m.observer = None
    return CalibrationResult(observer.token_counts, observer.amax, min_tokens, num_requests, num_tokens)


def check_coverage(result: CalibrationResult, *, allow_uncovered: bool) -> None:
    """Refuse (CalibrationError naming the experts) unless every expert saw `min_tokens`; or warn and fill in."""
    min_tokens = result.min_tokens
    uncovered = result.uncovered()
    if uncovered:
        named = ", ".join(f"layer {layer} expert {expert} ({count} tokens)" for layer, expert, count in uncovered[:10])
        more = f" and {len(uncovered) - 10} more" if len(uncovered) > 10 else ""
        message = (
            f"{len(uncovered)} experts saw fewer than {min_tokens} calibration tokens: {named}{more}. "
            "Add conversations that reach them"
        )
        if not allow_uncovered:
            raise CalibrationError(message + ", or pass --allow-uncovered to use their layer's largest amax.")
        log.warning("%s; using each layer's largest amax for them (--allow-uncovered)", message)
        for point in POINTS:
            amax = result.amax[point]
            layer_max = amax.max(dim=1, keepdim=True).values.expand_as(amax)
            low = result.token_counts < min_tokens
            amax[low] = layer_max[low]


def load_amax(path: str | Path) -> dict[ObservePoint, torch.Tensor]:
    """point -> [L, E] amax from a file `shoal replica calibrate` wrote."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CalibrationError(f"cannot read activation scales from {path}: {exc}") from None
    if data.get("format") != SCALES_FORMAT:
        raise CalibrationError(f"{path} is not a calibration file (format {data.get('format')!r})")
    return {p: torch.tensor(data["amax"][p], dtype=torch.float32) for p in POINTS}


def read_chat_prompts(path: Path, tokenizer: Any) -> list[list[int]]:
    """Token ids of each chat request (one JSON body per line) rendered with the chat template."""
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            body = json.loads(line)
            text = tokenizer.apply_chat_template(body["messages"], tools=body.get("tools"), add_generation_prompt=True)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise CalibrationError(f"{path}:{n}: not a chat request: {exc}") from None
        prompts.append(tokenizer.encode(text))
    if not prompts:
        raise CalibrationError(f"{path} holds no chat requests")
    return prompts


def run_calibration(
    *, model: str, chats: Path | None, out: Path, min_tokens: int, allow_uncovered: bool
) -> CalibrationResult:
    """`shoal replica calibrate`: load, calibrate, print the coverage table, write the file."""
    from replica.demo.build import ensure_demo_model
    from replica.demo.corpus import CALIBRATION_PATH
    from replica.model.loader import load_model
    from replica.tokenizer import Tokenizer

    folder = ensure_demo_model() if model == "demo" else Path(model)
    net = load_model(folder)
    tokenizer = Tokenizer.from_file(folder / "tokenizer.json")
    prompts = read_chat_prompts(chats or Path(CALIBRATION_PATH), tokenizer)
    print(f"calibrating on {len(prompts)} chat requests ({sum(map(len, prompts))} tokens)")
    result = observe_experts(net, prompts, min_tokens=min_tokens)
    print(result.coverage_table())
    check_coverage(result, allow_uncovered=allow_uncovered)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result.to_json()) + "\n", encoding="utf-8")
    print(f"activation amax of {result.token_counts.numel()} experts written to {out}")
    return result
