"""Token distributions and sampling, batched over rows, without a host transfer.

`SamplingTensors` holds each row's temperature, top-k and top-p as tensors on the model's device, so
`probabilities(logits, tensors)` turns a step's logits into the distributions its tokens are drawn from in a few
batched ops, whatever mix of greedy and sampled requests the step has:
- temperature 0 (greedy): one-hot on the argmax (the first maximal id), so nothing downstream special-cases greedy
  rows: sampling from it, or accepting a draft against it, gives the argmax;
- otherwise softmax(logits / temperature) with every token outside the top-k (ties with the k-th kept) and outside
  the top-p nucleus of the renormalised top-k set to zero (the most likely token always stays).

`sample(probs, uniforms)` draws one token per row by the inverse CDF of one uniform in [0, 1): a draw is a pure
function of its uniform, so a seeded request's draws come from its own generator whatever else is in the batch, and
tests can enumerate draws exactly. Speculative acceptance (`replica.engine.rejection`) works on these distributions.

R = rows, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replica.engine.sampling import SamplingParams


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters on the device, built once per step."""

    temperature: torch.Tensor
    """[R] float32; 0 for greedy rows."""
    top_k: torch.Tensor
    """[R] int64; 0 for no cut."""
    top_p: torch.Tensor
    """[R] float32 in (0, 1]."""
    has_filter: bool
    """Whether any row cuts by top-k or top-p (else the sort is skipped)."""
    is_all_greedy: bool

    @classmethod
    def build(cls, params: list[SamplingParams], device: torch.device) -> SamplingTensors:
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            has_filter=any((p.top_k > 0 or p.top_p < 1.0) and not p.is_greedy for p in params),
            is_all_greedy=all(p.is_greedy for p in params),
        )

    def repeat(self, counts: list[int]) -> SamplingTensors:
        """Row i's parameters `counts[i]` times in a row (a request that verifies drafts samples several rows)."""
        if all(c == 1 for c in counts):
            return self
        repeats = torch.tensor(counts, device=self.temperature.device)
        return SamplingTensors(
            self.temperature.repeat_interleave(repeats),
            self.top_k.repeat_interleave(repeats),
            self.top_p.repeat_interleave(repeats),
            self.has_filter,
            self.is_all_greedy,
        )

    def select(self, rows: torch.Tensor) -> SamplingTensors:
        """The parameters of `rows` [S] int64, in that order."""
        return SamplingTensors(
            self.temperature[rows], self.top_k[rows], self.top_p[rows], self.has_filter, self.is_all_greedy
        )


def probabilities(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """logits [R, V] -> the distributions [R, V] (float32 rows summing to 1) that the rows' tokens come from."""
    greedy = params.temperature == 0
    onehot = torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    if params.is_all_greedy:
        return onehot
    # At least float32 (float64 stays float64, so exactness tests can run the same code at 1e-12).
    scaled = logits.to(torch.promote_types(logits.dtype, torch.float32)) / torch.where(
        greedy, 1.0, params.temperature
    ).unsqueeze(-1)
    if params.has_filter:
        scaled = _filter_top_k_top_p(scaled, params.top_k, params.top_p)
    return torch.where(greedy.unsqueeze(-1), onehot, scaled.softmax(-1))


def _filter_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Scaled logits [R, V] with everything outside each row's top-k and top-p set to -inf (vLLM's order: top-k
    first, then top-p over the renormalised top-k)."""
    vocab = scaled.shape[-1]
    ordered, order = scaled.sort(-1, descending=True)  # [R, V]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    kth = ordered.gather(-1, (k - 1).unsqueeze(-1))  # [R, 1]
    ordered = ordered.masked_fill(ordered < kth, -torch.inf)
    probs = ordered.softmax(-1)
    # A token is dropped when the tokens strictly before it already reach top_p (so the first always stays).
    ordered = ordered.masked_fill(probs.cumsum(-1) - probs >= top_p.unsqueeze(-1), -torch.inf)
    return torch.full_like(scaled, -torch.inf).scatter_(-1, order, ordered)


def sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [R, V] (non-negative, need not sum to 1), uniforms [R] in [0, 1) -> token ids [R] int64.

    The token is the first whose cumulative mass exceeds u * total mass, so a token of zero mass is never drawn;
    rounding that would carry the draw past the end is clamped to the last token with mass."""
    cdf = probs.cumsum(-1)  # [R, V]
    target = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)  # [R, 1]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    vocab = probs.shape[-1]
    last_with_mass = vocab - 1 - (probs > 0).flip(-1).to(torch.int8).argmax(-1)
    return torch.minimum(tokens, last_with_mass)


def draw(scores: torch.Tensor, params: SamplingTensors, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [R, V], uniforms [R] -> (tokens [R], the distributions [R, V] they were drawn from). A batch of
    greedy rows takes the argmax without the inverse-CDF walk: the same token, since its distribution is one-hot."""
    probs = probabilities(scores, params)
    if params.is_all_greedy:
        return scores.argmax(-1), probs
    return sample(probs, uniforms), probs


def draw_uniforms(
    generators: list[torch.Generator | None], count: int, default: torch.Generator, device: torch.device
) -> torch.Tensor:
    """[R, count] uniforms in [0, 1): a row with a generator of its own (a seeded request) draws from it, the
    others from `default`, in row order."""
    rows = [torch.rand(count, generator=g if g is not None else default, dtype=torch.float64) for g in generators]
    if not rows:
        return torch.empty(0, count, dtype=torch.float64, device=device)
    return torch.stack(rows).to(device)
