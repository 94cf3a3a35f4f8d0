"""Speculative acceptance is exact: checked by enumerating every draft and every cell of the uniform draws.

A toy target p(. | prefix) and drafter q(. | prefix) over a small vocabulary are random tables. For every draft
sequence (weighted by its probability under q) and every cell of the uniforms (each acceptance uniform splits at
p/q, the final uniform at the cumulative sums of every distribution the final token could come from), `verify` is
called once at the cell's midpoint and its emitted tokens are weighted by the cell's width. The emitted block,
extended to K+1 tokens with the target's own conditionals, must be distributed exactly as K+1 tokens sampled one by
one from the target: total variation below 1e-12 in float64. The grid only says where to evaluate; the expected
answer is the target's joint, computed without any of the code under test.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence

import pytest
import torch

from replica.engine.rejection import verify
from replica.engine.sampler import SamplingTensors, probabilities, sample
from replica.engine.sampling import SamplingParams

Prefix = tuple[int, ...]


def random_table(vocab: int, depth: int, rng: random.Random, *, zeros: bool) -> dict[Prefix, torch.Tensor]:
    """p(. | prefix) for every prefix up to `depth` tokens; with `zeros`, some tokens get no mass."""
    table = {}
    for n in range(depth + 1):
        for prefix in itertools.product(range(vocab), repeat=n):
            weights = [rng.random() ** 2 for _ in range(vocab)]
            if zeros:
                for i in rng.sample(range(vocab), rng.randrange(vocab - 1)):
                    weights[i] = 0.0
            row = torch.tensor(weights, dtype=torch.float64)
            table[prefix] = row / row.sum()
    return table


def breakpoints(dist: torch.Tensor) -> list[float]:
    total = float(dist.sum())
    return [float(c) / total for c in dist.cumsum(0)] if total > 0 else []


def cells(points: list[float]) -> list[tuple[float, float]]:
    """(midpoint, width) of the cells [0, 1) splits into at `points`."""
    edges = sorted({0.0, 1.0, *(min(max(x, 0.0), 1.0) for x in points)})
    return [((a + b) / 2, b - a) for a, b in itertools.pairwise(edges) if b > a]


def draw_cells(
    target: torch.Tensor, qs: Sequence[torch.Tensor], drafts: Sequence[int], num_drafts: int
) -> Iterator[tuple[list[float], float, float]]:
    """Every cell of one verification's uniform draws: (acceptance uniforms, final uniform, the cell's probability).

    `target` holds the K+1 target rows, `qs[j]` the draft distribution the j-th of the `num_drafts` real drafts was
    told to come from; positions past them accept nothing and take one cell. Each acceptance uniform splits at
    p/q, the final one at the cumulative sums of every distribution the final token can come from."""
    accept_cells = [
        cells([float(target[j][d] / qs[j][d])]) if j < num_drafts else [(0.5, 1.0)] for j, d in enumerate(drafts)
    ]
    final_points: list[float] = []
    for j in range(len(target)):
        final_points += breakpoints(target[j])
        if j < num_drafts:
            final_points += breakpoints((target[j] - qs[j]).clamp_min(0))
    for accept in itertools.product(*accept_cells):
        for u_final, final_width in cells(final_points):
            width = final_width
            for _, accept_width in accept:
                width *= accept_width
            yield [u for u, _ in accept], u_final, width


def emitted_distribution(
    p: dict[Prefix, torch.Tensor],
    q: dict[Prefix, torch.Tensor],
    vocab: int,
    k: int,
    num_drafts: int,
    *,
    reported_q: dict[Prefix, torch.Tensor] | None = None,
) -> dict[Prefix, float]:
    """Exact law of one verification step's emitted tokens, extended to k+1 tokens with the target's conditionals.

    Drafts are drawn from q; verify is told `reported_q` (default: q, the honest case)."""
    told = reported_q or q
    rows = []  # (target [K+1, V], reported draft probs [K, V], drafts [K], accept u [K], final u, weight)
    pad_rng = random.Random(1)
    for drafts in itertools.product(range(vocab), repeat=num_drafts):
        weight = 1.0
        for j, token in enumerate(drafts):
            weight *= float(q[drafts[:j]][token])
        if weight == 0:
            continue
        target = torch.stack([p[drafts[: min(j, num_drafts)]] for j in range(k + 1)])
        qs = [told[drafts[:j]] for j in range(num_drafts)]
        # Padding past num_drafts holds junk: verify must ignore it.
        padded_tokens = list(drafts) + [pad_rng.randrange(vocab) for _ in range(k - num_drafts)]
        padded_q = qs + [torch.full((vocab,), 1.0 / vocab, dtype=torch.float64) for _ in range(k - num_drafts)]
        for accept_us, u_final, width in draw_cells(target, qs, padded_tokens, num_drafts):
            rows.append((target, padded_q, padded_tokens, accept_us, u_final, weight * width))
    tokens, num_emitted = verify(
        torch.stack([r[0] for r in rows]),
        torch.stack([torch.stack(r[1]) if r[1] else torch.empty(0, vocab, dtype=torch.float64) for r in rows]),
        torch.tensor([r[2] for r in rows], dtype=torch.long).view(len(rows), k),
        torch.full((len(rows),), num_drafts, dtype=torch.long),
        torch.tensor([r[3] for r in rows], dtype=torch.float64).view(len(rows), k),
        torch.tensor([r[4] for r in rows], dtype=torch.float64),
    )
    law: dict[Prefix, float] = {}
    for row, emitted, n in zip(rows, tokens.tolist(), num_emitted.tolist(), strict=True):
        assert 1 <= n <= num_drafts + 1
        prefix = tuple(emitted[:n])
        for tail in itertools.product(range(vocab), repeat=k + 1 - n):
            w = row[5]
            seq = prefix
            for token in tail:
                w *= float(p[seq][token])
                seq = (*seq, token)
            law[seq] = law.get(seq, 0.0) + w
    return law


def target_joint(p: dict[Prefix, torch.Tensor], vocab: int, length: int) -> dict[Prefix, float]:
    joint = {}
    for seq in itertools.product(range(vocab), repeat=length):
        w = 1.0
        for j, token in enumerate(seq):
            w *= float(p[seq[:j]][token])
        joint[seq] = w
    return joint


def total_variation(a: dict[Prefix, float], b: dict[Prefix, float]) -> float:
    return 0.5 * sum(abs(a.get(s, 0.0) - b.get(s, 0.0)) for s in set(a) | set(b))


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("zeros", [False, True], ids=["full-support", "disjoint-support"])
def test_emitted_tokens_follow_the_target_exactly(k: int, zeros: bool) -> None:
    vocab = 4 if k < 3 else 3
    rng = random.Random(k * 10 + zeros)
    p = random_table(vocab, k, rng, zeros=zeros)
    q = random_table(vocab, k, rng, zeros=zeros)
    expected = target_joint(p, vocab, k + 1)
    for num_drafts in range(k + 1):  # fewer drafts than the batch's K: the padding must not matter
        law = emitted_distribution(p, q, vocab, k, num_drafts)
        assert abs(sum(law.values()) - 1.0) < 1e-12
        assert total_variation(law, expected) < 1e-12, f"k={k}, {num_drafts} drafts"


def test_the_harness_catches_a_drafter_that_misreports_q() -> None:
    """The check can fail: drafts drawn from q but verified against another q (here uniform) are biased."""
    vocab, k = 3, 2
    rng = random.Random(5)
    p = random_table(vocab, k, rng, zeros=False)
    q = random_table(vocab, k, rng, zeros=False)
    uniform = {prefix: torch.full((vocab,), 1.0 / vocab, dtype=torch.float64) for prefix in q}
    expected = target_joint(p, vocab, k + 1)
    assert total_variation(emitted_distribution(p, q, vocab, k, k), expected) < 1e-12
    assert total_variation(emitted_distribution(p, q, vocab, k, k, reported_q=uniform), expected) > 1e-3


def test_greedy_target_accepts_exactly_the_argmax_prefix() -> None:
    logits = torch.tensor(
        [[[0.1, 2.0, 0.3], [1.5, 0.2, 0.1], [0.0, 0.0, 3.0], [0.2, 0.1, 0.0]]], dtype=torch.float32
    )  # argmaxes 1, 0, 2, 0
    params = SamplingTensors.build([SamplingParams(temperature=0.0)] * 4, torch.device("cpu"))
    p = probabilities(logits[0], params).unsqueeze(0)
    for drafts, expected in [([1, 0, 2], [1, 0, 2, 0]), ([1, 2, 2], [1, 0]), ([0, 0, 2], [1])]:
        q = torch.nn.functional.one_hot(torch.tensor([drafts]), 3).double()
        tokens, n = verify(
            p.double(),
            q,
            torch.tensor([drafts]),
            torch.tensor([3]),
            torch.rand(1, 3, dtype=torch.float64),
            torch.rand(1, dtype=torch.float64),
        )
        assert tokens[0, : int(n[0])].tolist() == expected


def test_probabilities_apply_temperature_top_k_top_p_per_row() -> None:
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0, -1.0]] * 4)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=2),  # ties with the 2nd are kept: tokens 0, 1, 2
        SamplingParams(temperature=0.5, top_p=0.5),  # the nucleus of softmax(2x) is token 0 alone
        SamplingParams(temperature=2.0),
    ]
    probs = probabilities(logits, SamplingTensors.build(params, torch.device("cpu")))
    assert probs[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    top3 = torch.tensor([2.0, 1.0, 1.0]).softmax(-1)
    torch.testing.assert_close(probs[1], torch.cat((top3, torch.zeros(2))))
    assert probs[2].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(probs[3], (logits[3] / 2).softmax(-1))
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))


def test_sample_never_draws_a_token_without_mass() -> None:
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0]] * 3, dtype=torch.float32)
    u = torch.tensor([0.0, 0.29, 1.0 - 2**-53], dtype=torch.float64)
    assert sample(probs, u).tolist() == [1, 1, 3]
