"""Mixture-of-experts feed-forward: router, routed experts, optional shared expert.

T = tokens, H = hidden size, I = one expert's hidden size, E = routed experts, A = experts per token.

The routed experts are stacked tensors (`gate_up [E, 2I, H]`, `down [E, H, I]`; for serving stored transposed in
memory, `use_serving_layout`) and run grouped by expert: the
(token, slot) pairs are sorted by expert id, each expert with work multiplies its rows once, and the results are
scattered back weighted. On the CPU at inference the grouped rows go through one `grouped_mm` per projection: each
expert's rows in one GEMM, as the expert-by-expert loop computes them (the same numbers, bit for bit, tested), in
two ops instead of ~12 per expert. Elsewhere (training, other devices, torch without `grouped_mm`) experts run in
one padded batched matmul while the padding is cheap, else one by one. A single token (a batch-1 decode step)
skips the grouping on a CPU: its A experts run one by one on views of their weights (the experts' ids are read
on the host, which on an accelerator would cost a transfer per layer).

`Experts.expert_forward(e, x)` is the one per-expert step; `replica.quant.NVFP4Experts` overrides only that (and
sets `has_stacked_weights` False), so quantized experts are drop-in with the same `forward(x, topk_ids, topk_weights)`.

An optional `observer` sees every expert's inputs (calibration counts tokens per expert and records activation
amax through it); it is None while serving.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from replica.model.config import ModelConfig
from replica.model.host import decides_on_host

ObservePoint = Literal["gate_up", "down"]

_HAS_GROUPED_MM = hasattr(F, "grouped_mm")  # torch >= 2.9; on the CPU it has no backward, so inference only


class ExpertObserver(Protocol):
    def observe(self, layer: int, expert: int, point: ObservePoint, x: torch.Tensor) -> None: ...


class TopKRouter(nn.Module):
    """Scores experts per token and picks the top A.

    softmax (Qwen3-MoE, Mixtral): p = softmax(x W^T); pick the top A of p; optionally renormalise to sum 1.
    sigmoid (DeepSeek-V3): s = sigmoid(x W^T); pick the top A of s + bias (the bias balances load and only
    steers the choice); weights are the unbiased s of the chosen experts, renormalised, times a scaling factor.
    """

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.kind = config.router_kind
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, dtype=dtype, device=device))
        self.bias: torch.Tensor | None
        if self.kind == "sigmoid":
            self.register_buffer(
                "bias", torch.zeros(config.num_experts, dtype=torch.float32, device=device), persistent=True
            )
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_ids [T, A] int64, topk_weights [T, A] float32, router_logits [T, E] float32)."""
        logits = F.linear(x, self.weight).float()  # [T, E]
        if self.kind == "softmax":
            scores = logits.softmax(dim=-1)
            weights, ids = scores.topk(self.top_k, dim=-1)
        else:
            scores = logits.sigmoid()
            assert self.bias is not None
            _, ids = (scores + self.bias).topk(self.top_k, dim=-1)
            weights = scores.gather(-1, ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        return ids, weights, logits


class Experts(nn.Module):
    """E routed SwiGLU experts in stacked BF16 (or FP32) tensors."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        layer: int = 0,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.layer = layer
        self.observer: ExpertObserver | None = None
        self.gate_up = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype, device=device)
        )
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device))

    has_stacked_weights = True
    """Whether `forward` may run all experts in one grouped or padded batched matmul (the BF16 weights are stacked
    tensors); subclasses that store experts otherwise (NVFP4) set it False and run expert by expert."""

    padded_waste_limit = 4.0
    """The padded path is taken while E * (most rows any expert got) <= this x the rows routed: it trades padding
    for one matmul per projection instead of one per expert, which on a CPU saves ~30 us per expert per layer."""

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_ids [T, A], topk_weights [T, A] -> [T, H] in x's dtype."""
        if x.shape[0] == 1 and self.has_stacked_weights and self.observer is None and decides_on_host(topk_ids):
            return self._forward_one_token(x, topk_ids, topk_weights)
        num_slots = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1)  # [S], S = T*A
        sorted_ids, order = flat_ids.sort(stable=True)  # slots grouped by expert
        counts_t = torch.bincount(flat_ids, minlength=self.num_experts)  # [E]
        flat_weights = topk_weights.reshape(-1, 1).to(torch.float32)
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        if self._can_group(x):
            return self._forward_grouped(x, order, counts_t, flat_weights, out, num_slots)
        if self.has_stacked_weights and self.observer is None:
            most_rows = int(counts_t.max())
            if self.num_experts * most_rows <= self.padded_waste_limit * flat_ids.numel():
                return self._forward_padded(x, sorted_ids, order, counts_t, most_rows, flat_weights, out, num_slots)
        start = 0
        for expert, count in enumerate(counts_t.tolist()):
            if count == 0:
                continue
            slots = order[start : start + count]
            start += count
            tokens = slots // num_slots
            y = self.expert_forward(expert, x[tokens])  # [n, H]
            out.index_add_(0, tokens, y.float() * flat_weights[slots])
        return out.to(x.dtype)

    def _forward_one_token(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """One token (a batch-1 decode step): its A experts one after the other, each on views of its weights.

        The same `expert_forward` and the same sum in increasing expert id as the expert-by-expert path (`index_add_`
        into zeros adds in that order), so the result is the same to the bit (tested). Gathering the A experts'
        weights for one batched matmul would copy them first, a strided copy in the serving layout that took
        longer than the matmuls.
        """
        ids, order = topk_ids[0].sort()  # [A], experts in increasing id
        weights = topk_weights[0, order].to(torch.float32).tolist()
        out = torch.zeros(1, x.shape[1], dtype=torch.float32, device=x.device)
        for expert, weight in zip(ids.tolist(), weights, strict=True):
            out += self.expert_forward(expert, x).float() * weight
        return out.to(x.dtype)

    def _can_group(self, x: torch.Tensor) -> bool:
        return (
            _HAS_GROUPED_MM
            and self.has_stacked_weights
            and self.observer is None
            and x.device.type == "cpu"
            and not torch.is_grad_enabled()
        )

    def _forward_grouped(
        self,
        x: torch.Tensor,
        order: torch.Tensor,
        counts: torch.Tensor,
        flat_weights: torch.Tensor,
        out: torch.Tensor,
        num_slots: int,
    ) -> torch.Tensor:
        """Every expert's rows in one grouped GEMM per projection; order [S] is the slot at each grouped position."""
        tokens = order // num_slots  # [S] token of each grouped row
        ends = counts.cumsum(0, dtype=torch.int32)  # [E] end of each expert's rows
        gate_up = F.grouped_mm(x[tokens], self.gate_up.transpose(1, 2), offs=ends)  # [S, 2I]
        gate, up = gate_up.chunk(2, dim=-1)  # [S, I] each
        y = F.grouped_mm(F.silu(gate) * up, self.down.transpose(1, 2), offs=ends)  # [S, H]
        out.index_add_(0, tokens, y.float() * flat_weights[order])
        return out.to(x.dtype)

    def _forward_padded(
        self,
        x: torch.Tensor,
        sorted_ids: torch.Tensor,
        order: torch.Tensor,
        counts: torch.Tensor,
        most_rows: int,
        flat_weights: torch.Tensor,
        out: torch.Tensor,
        num_slots: int,
    ) -> torch.Tensor:
        """All experts at once: rows scattered into [E, N, H] (N = most rows of any expert), two batched matmuls.
        sorted_ids [S] is the expert of each slot in grouped order, order [S] the slot at each grouped position."""
        starts = torch.cumsum(counts, 0) - counts  # [E] first grouped slot of each expert
        rows = torch.arange(order.numel(), device=x.device) - starts[sorted_ids]  # [S] row within its expert
        tokens = order // num_slots  # [S]
        padded = x.new_zeros(self.num_experts, most_rows, x.shape[1])  # [E, N, H]
        padded[sorted_ids, rows] = x[tokens]
        gate, up = torch.bmm(padded, self.gate_up.transpose(1, 2)).chunk(2, dim=-1)  # [E, N, I] each
        y = torch.bmm(F.silu(gate) * up, self.down.transpose(1, 2))  # [E, N, H]
        out.index_add_(0, tokens, y[sorted_ids, rows].float() * flat_weights[order])
        return out.to(x.dtype)

    def use_serving_layout(self) -> None:
        """Store the weights transposed in memory, logical shapes unchanged ([E, out, in], as Hugging Face stores
        experts): every matmul multiplies x [n, in] by the transposed weight, which then is a contiguous [in, out]
        operand. On the CPU that makes the routed experts of a step faster when their weights are out of cache, as
        between two uses of a layer while serving (benchmarks/bench_expert_layout.py). `load_model` applies it on
        the CPU; training keeps the row-major layout, so that a seed still names one demo model (the layouts round
        differently in the last bits)."""
        with torch.no_grad():
            for param in (self.gate_up, self.down):
                param.data = param.data.transpose(1, 2).contiguous().transpose(1, 2)

    def expert_forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """One expert's SwiGLU on its rows: x [n, H] -> [n, H]."""
        if self.observer is not None:
            self.observer.observe(self.layer, expert, "gate_up", x)
        gate, up = F.linear(x, self.gate_up[expert]).chunk(2, dim=-1)  # [n, I] each
        h = F.silu(gate) * up
        if self.observer is not None:
            self.observer.observe(self.layer, expert, "down", h)
        return F.linear(h, self.down[expert])


class SharedExpert(nn.Module):
    """A dense SwiGLU every token goes through (Qwen2-MoE, DeepSeek-V3); stays BF16 when experts are NVFP4.

    Gate and up projections are one matmul (`gate_up_proj`, rows gate | up), loaded from Hugging Face's
    `gate_proj` and `up_proj`.
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, *, dtype: torch.dtype, device: torch.device | str | None
    ) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False, dtype=dtype, device=device)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out: torch.Tensor = self.down_proj(F.silu(gate) * up)
        return out


class MoEBlock(nn.Module):
    """Router + routed experts (+ shared expert): the feed-forward of every decoder layer.

    Qwen2-MoE scales the shared expert's output per token by sigmoid(x w) (`shared_expert_gate`, w [1, H]).
    """

    def __init__(
        self, config: ModelConfig, *, layer: int, dtype: torch.dtype, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self.gate = TopKRouter(config, dtype=dtype, device=device)
        self.experts: Experts = Experts(
            config.num_experts,
            config.hidden_size,
            config.moe_intermediate_size,
            dtype=dtype,
            device=device,
            layer=layer,
        )
        self.shared_expert = (
            SharedExpert(config.hidden_size, config.shared_expert_intermediate_size, dtype=dtype, device=device)
            if config.shared_expert_intermediate_size
            else None
        )
        self.shared_expert_gate = (
            nn.Linear(config.hidden_size, 1, bias=False, dtype=dtype, device=device)
            if config.shared_expert_gate
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        return self.forward_with_routing(x)[0]

    def forward_with_routing(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (out [T, H], topk_ids [T, A], router_logits [T, E]): the routing for a balancing loss."""
        topk_ids, topk_weights, router_logits = self.gate(x)
        out: torch.Tensor = self.experts(x, topk_ids, topk_weights)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)  # [T, H]
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared  # [T, 1] * [T, H]
            out = out + shared
        return out, topk_ids, router_logits
