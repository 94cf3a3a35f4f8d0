"""Token distributions and sampling, batched over rows, without a host transfer on an accelerator.

`SamplingTensors` holds each row's temperature, top-k and top-p as tensors on the model's device, so
`probabilities(logits, tensors)` turns a step's logits into the distributions its tokens are drawn from in a few
batched ops, whatever mix of greedy and sampled requests the step has:
- temperature 0 (greedy): one-hot on the argmax (the first maximal id), so nothing downstream special-cases greedy
  rows: sampling from it, or accepting a draft against it, gives the argmax;
- otherwise softmax(logits / temperature) with every token outside the top-k (ties with the k-th kept) and outside
  the top-p nucleus of the renormalised top-k (ties with its last token kept) set to zero (the most likely token
  always stays).

`sample(probs, keys)` draws one token per row by an exponential race, argmax_x p(x) / E_x, where the E_x ~ Exp(1)
are a pure function of the row's key (a counter-based generator: splitmix64 of the key and x). Each token wins with
probability p(x) exactly (the Gumbel-max trick in another form), a token without mass never wins, and the key is
`noise_keys(seed, position)`: the sequence's seed and the position of the token being decided. So a draw never
depends on what else is in the batch or on how many draws came before it, and the same key decides a position
whether the target samples it, verifies a draft there, or a drafter drafts it (`replica.engine.verification`).

`Penalties` (presence, frequency, repetition) adjust the logits before any of that, from each row's own token
history (`apply_penalties`); `raw_logprobs` and `gather_logprobs` report the model's distribution.

R = rows, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from replica.engine.sampling import SamplingParams
from replica.model.host import decides_on_host


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

    @cached_property
    def drawing(self) -> torch.Tensor | None:
        """The rows that draw (temperature above 0), [D] int64; None when every row does. A host decision
        (`decides_on_host`), made once per step's tensors."""
        rows = (self.temperature != 0).nonzero().squeeze(-1)
        return None if len(rows) == len(self.temperature) else rows

    def select(self, rows: torch.Tensor) -> SamplingTensors:
        """The parameters of `rows` [S] int64, in that order."""
        return SamplingTensors(
            self.temperature[rows], self.top_k[rows], self.top_p[rows], self.has_filter, self.is_all_greedy
        )


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the model, and the most likely tokens at its position."""

    logprob: float
    top: list[tuple[int, float]]
    """(token id, logprob), most likely first; as many as the request asked for."""


@dataclass(frozen=True)
class Penalties:
    """Per-row penalty inputs on the device: what each row's history holds, and the three penalties."""

    output_counts: torch.Tensor
    """[R, V] float32: occurrences of each token in the row's generated tokens (drafts before the row included)."""
    seen: torch.Tensor
    """[R, V] bool: the token occurs in the prompt or in those generated tokens (for the repetition penalty)."""
    presence: torch.Tensor
    """[R] float32."""
    frequency: torch.Tensor
    """[R] float32."""
    repetition: torch.Tensor
    """[R] float32; 1 is off."""

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompts: list[list[int]],
        outputs: list[list[int]],
        vocab: int,
        device: torch.device,
    ) -> Penalties:
        """One row per entry: its parameters, its prompt and its generated tokens so far. The histories are
        counted on the host into index tensors and scattered on the device (one host-to-device copy each)."""
        rows = len(params)
        row_of = [r for r, out in enumerate(outputs) for _ in out]
        tokens = [t for out in outputs for t in out]
        counts = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        if tokens:
            flat = torch.tensor(row_of, dtype=torch.long) * vocab + torch.tensor(tokens, dtype=torch.long)
            counts.view(-1).index_add_(0, flat.to(device), torch.ones(len(tokens), device=device))
        seen = counts > 0
        prompt_rows = [
            r for r, (p, prompt) in enumerate(zip(params, prompts, strict=True)) if p.repetition_penalty != 1
        ]
        if prompt_rows:
            flat_prompt = [r * vocab + t for r in prompt_rows for t in prompts[r]]
            seen.view(-1)[torch.tensor(flat_prompt, dtype=torch.long, device=device)] = True
        return cls(
            output_counts=counts,
            seen=seen,
            presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device),
            frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device),
            repetition=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device),
        )


def apply_penalties(logits: torch.Tensor, penalties: Penalties | None) -> torch.Tensor:
    """logits [R, V] -> penalised logits (a copy), in vLLM's order: repetition (divide a positive logit of a seen
    token, multiply a negative one), then frequency (times the count) and presence (once) over generated tokens."""
    if penalties is None:
        return logits
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    rep = penalties.repetition.to(x.dtype).unsqueeze(-1)
    x = torch.where(penalties.seen, torch.where(x > 0, x / rep, x * rep), x)
    counts = penalties.output_counts.to(x.dtype)
    x = x - penalties.frequency.to(x.dtype).unsqueeze(-1) * counts
    return x - penalties.presence.to(x.dtype).unsqueeze(-1) * (counts > 0).to(x.dtype)


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] -> log_softmax in float32: the model's own distribution, before penalties, grammar masks,
    temperature and top-k/top-p (vLLM's default "raw_logprobs")."""
    return logits.float().log_softmax(-1)


def gather_logprobs(
    logprobs: torch.Tensor, tokens: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logprobs [..., V], tokens [...] -> (the tokens' logprobs [...], the top `num_top` logprobs [..., num_top]
    and their ids [..., num_top]), all on the device."""
    chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    top = logprobs.topk(num_top, dim=-1) if num_top else None
    if top is None:
        empty = logprobs.new_zeros(*logprobs.shape[:-1], 0)
        return chosen, empty, empty.long()
    return chosen, top.values, top.indices


def probabilities(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """logits [R, V] -> the distributions [R, V] (float32 rows summing to 1) that the rows' tokens come from; a
    greedy row is one-hot, whatever its neighbours. On a CPU the temperature, filters and softmax run on the drawing
    rows only (`SamplingTensors.drawing`)."""
    onehot = torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    if params.is_all_greedy:
        return onehot
    # At least float32 (float64 stays float64, so exactness tests can run the same code at 1e-12).
    dtype = torch.promote_types(logits.dtype, torch.float32)
    if not decides_on_host(logits):
        greedy = params.temperature == 0
        scaled = logits.to(dtype) / torch.where(greedy, 1.0, params.temperature).unsqueeze(-1)
        if params.has_filter:
            scaled = _sorted_filter(scaled, params.top_k, params.top_p)
        return torch.where(greedy.unsqueeze(-1), onehot, scaled.softmax(-1))
    rows = params.drawing
    drawing = params if rows is None else params.select(rows)
    scaled = (logits if rows is None else logits[rows]).to(dtype) / drawing.temperature.unsqueeze(-1)
    if params.has_filter:
        scaled = _ranked_filter(scaled, drawing.top_k, drawing.top_p)
    if rows is None:
        return scaled.softmax(-1)
    out = onehot.to(dtype)
    out[rows] = scaled.softmax(-1)
    return out


NUCLEUS_CANDIDATES = 256
"""Tokens ranked per row (`topk`) to find a top-p nucleus; a row whose nucleus is larger is sorted whole. Ranking a
few hundred of 2,048 costs a quarter of sorting them all."""


def _ranked_filter(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Scaled logits [R, V] with everything outside each row's top-k and top-p set to -inf (vLLM's order: top-k
    first, then top-p over the renormalised top-k). A token is dropped by top-p when the tokens ranked before it
    already reach top_p, so the first always stays; a token tied with the last one kept stays too. top_p 1 keeps
    every token. Ranks `NUCLEUS_CANDIDATES` tokens of a row, and sorts the rows whose nucleus is larger (host
    decisions: the CPU's way)."""
    vocab = scaled.shape[-1]
    has_top_k = top_k > 0
    if bool(has_top_k.any()):
        k = top_k.clamp(min=1, max=vocab)
        ranked = scaled.topk(int(k[has_top_k].max()), dim=-1).values  # [R, K] descending
        kth = ranked.gather(-1, (k.clamp(max=ranked.shape[-1]) - 1).unsqueeze(-1))  # [R, 1]
        scaled = scaled.masked_fill((scaled < kth) & has_top_k.unsqueeze(-1), -torch.inf)
    has_top_p = top_p < 1.0
    if not bool(has_top_p.any()):
        return scaled
    probs = scaled.softmax(-1)
    ranked = probs.topk(min(vocab, NUCLEUS_CANDIDATES), dim=-1).values  # [R, C] descending
    before = ranked.cumsum(-1) - ranked  # the mass ranked before each candidate
    dropped = before >= top_p.unsqueeze(-1)
    found = dropped.any(-1) | (ranked.shape[-1] == vocab)
    if not bool(found[has_top_p].all()):  # a nucleus past the candidates: rank those rows whole
        rows = (has_top_p & ~found).nonzero().squeeze(-1)
        whole = probs[rows].sort(-1, descending=True).values
        widened = torch.zeros(len(probs), vocab, dtype=probs.dtype, device=probs.device)
        widened[:, : ranked.shape[-1]] = ranked
        widened[rows] = whole
        ranked = widened
        before = ranked.cumsum(-1) - ranked
        dropped = before >= top_p.unsqueeze(-1)
    num_kept = (~dropped).sum(-1, keepdim=True)  # >= 1: nothing is ranked before the first
    last_kept = ranked.gather(-1, num_kept - 1)  # [R, 1]
    cut = (probs < last_kept) & has_top_p.unsqueeze(-1)
    return scaled.masked_fill(cut, -torch.inf)


def _sorted_filter(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`_ranked_filter` by a sort of every row, without a host decision (an accelerator's way); tied tokens at the
    nucleus' edge are kept or dropped as the sort orders them."""
    vocab = scaled.shape[-1]
    ordered, order = scaled.sort(-1, descending=True)  # [R, V]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    kth = ordered.gather(-1, (k - 1).unsqueeze(-1))  # [R, 1]
    ordered = ordered.masked_fill(ordered < kth, -torch.inf)
    probs = ordered.softmax(-1)
    dropped = (probs.cumsum(-1) - probs >= top_p.unsqueeze(-1)) & (top_p < 1.0).unsqueeze(-1)
    ordered = ordered.masked_fill(dropped, -torch.inf)
    return torch.full_like(scaled, -torch.inf).scatter_(-1, order, ordered)


_GAMMA = 0x9E3779B97F4A7C15 - 2**64
"""splitmix64's increment (as a signed int64: tensor arithmetic wraps modulo 2**64)."""
_MIX_1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX_2 = 0x94D049BB133111EB - 2**64


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 tensors (`>>` is arithmetic: it copies the sign bit)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, elementwise on int64 tensors: a bijection whose outputs look independent."""
    z = (z ^ _shift_right(z, 30)) * _MIX_1
    z = (z ^ _shift_right(z, 27)) * _MIX_2
    return z ^ _shift_right(z, 31)


def noise_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """seeds [S] int64, positions [S, n] int64 -> keys [S, n] int64: the key of the draw that decides the token at
    each position (its index in the sequence, prompt included) of a sequence drawing with that seed."""
    return _mix(_mix(seeds).unsqueeze(-1) + positions * _GAMMA)


def exponentials(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys [R] int64 -> [R, V] float64 draws of Exp(1), independent across tokens and keys: -log of a uniform in
    (0, 1) made of 53 bits of splitmix64(key + (x + 1) * gamma)."""
    return _exponential(keys.unsqueeze(-1), torch.arange(vocab, dtype=torch.long, device=keys.device))


def _exponential(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The draw of `exponentials` for each (key, token) pair, elementwise (broadcasting)."""
    bits = _shift_right(_mix(keys + (tokens + 1) * _GAMMA), 11)
    return -torch.log((bits.to(torch.float64) + 0.5) * 2.0**-53)


def sample(probs: torch.Tensor, keys: torch.Tensor | None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """probs [R, V] (non-negative, need not sum to 1), keys [R] int64 -> token ids [R] int64: argmax_x p(x) / E_x.
    keys None: every row is one-hot (greedy), and the token is its argmax without drawing anything. `rows` [D]
    int64: only these rows draw, the others are one-hot and take their argmax (the same token, at no cost)."""
    if keys is None:
        return probs.argmax(-1)
    if rows is None:
        return _race(probs, keys)
    tokens = probs.argmax(-1)
    tokens[rows] = _race(probs[rows], keys[rows])
    return tokens


def _race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """argmax_x p(x) / E_x per row. A token without mass scores 0 and never wins, so where most have none (a top-p
    nucleus) only the others draw: the same scores, and the first best token of each row, as over the vocabulary."""
    num_rows, vocab = probs.shape
    support = probs > 0
    if not decides_on_host(probs) or 4 * int(support.sum()) > support.numel():
        return (probs.to(torch.float64) / exponentials(keys, vocab)).argmax(-1)
    row, token = support.nonzero(as_tuple=True)  # row by row, tokens in increasing order
    score = probs[row, token].to(torch.float64) / _exponential(keys[row], token)
    best = torch.full((num_rows,), -torch.inf, dtype=torch.float64, device=probs.device)
    best = best.scatter_reduce(0, row, score, "amax")
    is_best = score == best[row]
    first = torch.full((num_rows,), vocab, dtype=torch.long, device=probs.device)
    return first.scatter_reduce(0, row[is_best], token[is_best], "amin")


def draw(scores: torch.Tensor, params: SamplingTensors, keys: torch.Tensor) -> torch.Tensor:
    """scores [R, V], keys [R] -> tokens [R], drawn from `probabilities(scores, params)` (a batch of greedy rows
    takes the argmax: the same token, since its distributions are one-hot)."""
    if params.is_all_greedy:
        return scores.argmax(-1)
    return sample(probabilities(scores, params), keys, params.drawing if decides_on_host(scores) else None)
