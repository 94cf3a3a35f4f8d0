"""What the engine asks of a drafter: follow the target's steps, and propose the next tokens of some sequences.

A drafter keeps whatever state it needs in the engine's block layout: the same block tables and slots as the
target, in caches of its own, so a sequence's prefix-cached blocks serve its drafter too. Each step the engine
calls `ingest` with what the target ran (every token, prefill chunks and verified drafts alike, with the target's
layer outputs a block drafter asked for), then `propose` for the sequences that will verify drafts next step.

Proposals stay on the device: the engine moves the drafted tokens to the host together with the step's verified
tokens, in its one transfer, and keeps the proposal probabilities on the device for the next step's acceptance test.
A drafter draws draft j with the key the target uses for the same position (`ProposeRequest.keys`,
`sampler.draw`): the closer its distribution to the target's, the likelier the two draws agree, and a draft is
kept only where they do (`replica.engine.verification`). What it drafts never changes the output, only its speed.
Under a grammar a draft is drawn from the masked scores (`masked_scores`).

S = proposing sequences, k = drafts per sequence, V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from replica.engine.runner import StepInputs
from replica.engine.sampler import SamplingTensors


@dataclass(frozen=True)
class ProposeRequest:
    num_drafts: int
    """Drafts to propose for every sequence (a sequence that wants fewer uses the first ones)."""
    anchor_tokens: torch.Tensor
    """[S] int64: each sequence's last token, which the drafts follow; its keys are not cached yet."""
    anchor_positions: torch.Tensor
    """[S] int64: its position; the target has computed every position before it."""
    block_tables: torch.Tensor
    """[S, max_blocks] int64, padded; they cover the anchor plus `Drafter.lookahead_tokens` positions."""
    sampling: SamplingTensors
    """Each sequence's temperature, top-k and top-p: drafts are drawn from the drafter's scores under them."""
    keys: torch.Tensor
    """[S, k] int64: the noise keys of the k drafted positions (`sampler.noise_keys`)."""
    allowed: Callable[[int, torch.Tensor], torch.Tensor] | None = None
    """Grammar masks: `allowed(j, previous)` -> [S, V] bool, the tokens draft j may be (`previous` [S]: the drafts
    drawn at j - 1, the anchors for j = 0). Called once per position, in order, before drawing it; the drafter
    draws from its scores with the refused tokens at -inf."""


def masked_scores(request: ProposeRequest, position: int, previous: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """`scores` [S, V] of draft `position` under the request's grammar masks, if it has any."""
    if request.allowed is None:
        return scores
    return scores.masked_fill(~request.allowed(position, previous), -torch.inf)


@dataclass(frozen=True)
class Proposal:
    tokens: torch.Tensor
    """[S, k] int64 drafted tokens."""


class Drafter(Protocol):
    feature_layers: tuple[int, ...]
    """Target layers whose outputs `ingest` needs (empty for a drafter that reads tokens only)."""
    lookahead_tokens: int
    """Positions from the anchor on that `propose` writes to the drafter's cache."""
    vocab_size: int

    def ingest(self, inputs: StepInputs, features: torch.Tensor | None) -> None:
        """Follow one target step: the same tokens, positions and slots; features [T, F] of `feature_layers`."""

    def propose(self, request: ProposeRequest) -> Proposal: ...


def slots_at(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of `positions` [S] (or [S, n]) in each row's block table [S, max_blocks], on the device."""
    pos = positions if positions.dim() == 2 else positions.unsqueeze(-1)
    blocks = block_tables.gather(1, torch.div(pos, block_size, rounding_mode="floor"))
    slots = blocks * block_size + pos % block_size
    return slots if positions.dim() == 2 else slots.squeeze(-1)
