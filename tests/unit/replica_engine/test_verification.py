"""Speculative verification emits exactly the tokens of plain decoding, and plain decoding follows the target.

Two facts make speculation exact, each checked here without the code under test computing the expected answer:
- Identity: for every draft sequence (all of them, not only those a drafter would draw) and many seeds, `verify`
  emits exactly the tokens that decoding one token at a time with the same keys emits, and keeps exactly the drafts
  that agree with them. Whatever the drafts, the output is plain decoding's: speculation cannot change its law, and
  a seeded request's text is the same with speculation on or off.
- Law: plain decoding's tokens (`sample` with `noise_keys` of the seed and the position) follow the target: the
  frequency of each token, and of each pair and triple of successive tokens, over 200,000 seeds is within sampling
  noise of the target's probability, tokens without mass never appear, and one key always gives one token.

A toy target p(. | prefix) and drafter q(. | prefix) over a small vocabulary are random tables.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from replica.engine.sampler import SamplingTensors, exponentials, noise_keys, probabilities, sample
from replica.engine.sampling import SamplingParams
from replica.engine.verification import verify

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


def keys_of(seeds: list[int], first: int, count: int) -> torch.Tensor:
    """[len(seeds), count] keys of positions first .. first + count - 1."""
    positions = torch.arange(first, first + count).expand(len(seeds), count)
    return noise_keys(torch.tensor(seeds, dtype=torch.long), positions)


def plain_decoding(p: dict[Prefix, torch.Tensor], start: Prefix, seed: int, length: int) -> list[int]:
    """`length` tokens after `start`, one at a time, each with the key of its position."""
    out: list[int] = []
    keys = keys_of([seed], len(start), length)[0]
    for j in range(length):
        out.append(int(sample(p[start + tuple(out)].unsqueeze(0), keys[j : j + 1])[0]))
    return out


def verify_every_draft(
    p: dict[Prefix, torch.Tensor],
    start: Prefix,
    k: int,
    num_drafts: int,
    seeds: list[int],
    vocab: int,
    *,
    shift: int = 0,
) -> list[tuple[Prefix, int, list[int], int]]:
    """`verify` on every draft sequence of `num_drafts` tokens (junk padding up to k) for every seed, in one batch:
    -> [(drafts, seed, emitted tokens, drafts kept)]. `shift` draws with the keys of later positions (a bug)."""
    rows = []
    pad = random.Random(1)
    for drafts in itertools.product(range(vocab), repeat=num_drafts):
        target = torch.stack([p[start + drafts[: min(j, num_drafts)]] for j in range(k + 1)])
        padded = list(drafts) + [pad.randrange(vocab) for _ in range(k - num_drafts)]
        rows += [(drafts, seed, target, padded) for seed in seeds]
    keys = keys_of([r[1] for r in rows], len(start) + shift, k + 1)
    tokens, num_emitted = verify(
        torch.stack([r[2] for r in rows]),
        torch.tensor([r[3] for r in rows], dtype=torch.long).view(len(rows), k),
        torch.full((len(rows),), num_drafts, dtype=torch.long),
        keys,
    )
    return [
        (drafts, seed, emitted[:n], n - 1)
        for (drafts, seed, _, _), emitted, n in zip(rows, tokens.tolist(), num_emitted.tolist(), strict=True)
    ]


def agreement(drafts: Prefix, tokens: list[int]) -> int:
    return next((j for j, (d, t) in enumerate(zip(drafts, tokens, strict=False)) if d != t), len(drafts))


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("zeros", [False, True], ids=["full-support", "disjoint-support"])
def test_verify_emits_the_tokens_of_plain_decoding_whatever_the_drafts(k: int, zeros: bool) -> None:
    vocab = 4 if k < 3 else 3
    rng = random.Random(k * 10 + zeros)
    p = random_table(vocab, k + 2, rng, zeros=zeros)
    start = (1, 0)
    seeds = list(range(48))
    plain = {seed: plain_decoding(p, start, seed, k + 1) for seed in seeds}
    kept_counts = set()
    for num_drafts in range(k + 1):  # fewer drafts than the batch's K: the padding must not matter
        for drafts, seed, emitted, kept in verify_every_draft(p, start, k, num_drafts, seeds, vocab):
            assert kept == agreement(drafts, plain[seed]), (drafts, seed)
            assert emitted == plain[seed][: kept + 1], (drafts, seed)
            kept_counts.add(kept)
    assert kept_counts == set(range(k + 1))  # every outcome, from no draft kept to all of them, was checked


def test_the_identity_check_catches_keys_of_the_wrong_positions() -> None:
    vocab, k = 3, 2
    p = random_table(vocab, k + 2, random.Random(5), zeros=False)
    seeds = list(range(32))
    plain = {seed: plain_decoding(p, (), seed, k + 1) for seed in seeds}
    rows = verify_every_draft(p, (), k, k, seeds, vocab, shift=1)
    assert sum(emitted != plain[seed][: len(emitted)] for _, seed, emitted, _ in rows) > len(rows) // 4


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """tokens [N, L] -> the frequency of each of the vocab**L sequences, in `itertools.product` order."""
    index = torch.zeros(tokens.shape[0], dtype=torch.long)
    for j in range(tokens.shape[1]):
        index = index * vocab + tokens[:, j]
    return torch.bincount(index, minlength=vocab ** tokens.shape[1]).double() / tokens.shape[0]


def assert_within_noise(observed: torch.Tensor, expected: torch.Tensor, n: int) -> None:
    """Each frequency within 5 standard deviations of its probability, and zero where the probability is zero."""
    sd = (expected * (1 - expected) / n).sqrt()
    assert bool(((observed - expected).abs() <= 5 * sd + 1e-12).all()), (observed, expected)


@pytest.mark.parametrize("zeros", [False, True], ids=["full-support", "disjoint-support"])
def test_plain_decoding_follows_the_target_joint(zeros: bool) -> None:
    vocab, length, n = 3, 3, 200_000
    p = random_table(vocab, length, random.Random(7 + zeros), zeros=zeros)
    seeds = torch.arange(n, dtype=torch.long) * 7919 + 11
    keys = noise_keys(seeds, torch.arange(5, 5 + length).expand(n, length))
    tokens = torch.zeros(n, length, dtype=torch.long)
    for j in range(length):  # every seed's j-th token given its own first j
        for prefix in itertools.product(range(vocab), repeat=j):
            rows = (tokens[:, :j] == torch.tensor(prefix, dtype=torch.long)).all(-1).nonzero().squeeze(-1)
            tokens[rows, j] = sample(p[prefix].expand(len(rows), vocab), keys[rows, j])
    for length_seen in (1, 2, 3):
        expected = torch.tensor(
            [
                math.prod(float(p[seq[:j]][t]) for j, t in enumerate(seq))
                for seq in itertools.product(range(vocab), repeat=length_seen)
            ],
            dtype=torch.float64,
        )
        assert_within_noise(frequencies(tokens[:, :length_seen], vocab), expected, n)


def test_keys_are_a_function_of_seed_and_position_and_give_independent_exponentials() -> None:
    a = noise_keys(torch.tensor([42, 42, 43]), torch.tensor([[7, 8], [7, 8], [7, 8]]))
    assert a[0].tolist() == a[1].tolist() and a[0, 0] != a[0, 1] and a[0, 0] != a[2, 0]
    e = exponentials(noise_keys(torch.arange(4000), torch.zeros(4000, 1, dtype=torch.long))[:, 0], 64)  # [N, V]
    assert bool((e > 0).all())
    assert abs(float(e.mean()) - 1.0) < 0.01 and abs(float(e.var()) - 1.0) < 0.03  # Exp(1): mean 1, variance 1
    corr = torch.corrcoef(torch.stack((e[:, :-1].flatten(), e[:, 1:].flatten())))[0, 1]
    assert abs(float(corr)) < 0.01  # neighbouring tokens' draws are uncorrelated


def test_drafts_drawn_with_the_same_keys_agree_at_least_as_often_as_the_coupling_bound() -> None:
    """d = sample(q, key) and y = sample(p, key) agree with probability at least (1 - TV) / (1 + TV); with keys of
    their own they agree only with probability sum_x p(x) q(x)."""
    vocab, n = 8, 100_000
    rng = random.Random(9)
    for _ in range(4):
        p, q = (random_table(vocab, 0, rng, zeros=False)[()] for _ in range(2))
        tv = 0.5 * float((p - q).abs().sum())
        keys = noise_keys(torch.arange(n, dtype=torch.long), torch.zeros(n, 1, dtype=torch.long))[:, 0]
        y = sample(p.expand(n, vocab), keys)
        coupled = float((sample(q.expand(n, vocab), keys) == y).double().mean())
        independent = float((sample(q.expand(n, vocab), keys + 1) == y).double().mean())
        assert coupled >= (1 - tv) / (1 + tv) - 0.005
        assert abs(independent - float(p @ q)) < 0.01
        assert coupled > independent


def test_greedy_target_keeps_exactly_the_argmax_prefix() -> None:
    logits = torch.tensor([[0.1, 2.0, 0.3], [1.5, 0.2, 0.1], [0.0, 0.0, 3.0], [0.2, 0.1, 0.0]])  # argmaxes 1, 0, 2, 0
    params = SamplingTensors.build([SamplingParams(temperature=0.0)] * 4, torch.device("cpu"))
    p = probabilities(logits, params).unsqueeze(0)
    for drafts, expected in [([1, 0, 2], [1, 0, 2, 0]), ([1, 2, 2], [1, 0]), ([0, 0, 2], [1])]:
        tokens, n = verify(p, torch.tensor([drafts]), torch.tensor([3]), None)
        assert tokens[0, : int(n[0])].tolist() == expected
        keyed, m = verify(p, torch.tensor([drafts]), torch.tensor([3]), keys_of([5], 0, 4))
        assert keyed[0, : int(m[0])].tolist() == expected  # a one-hot row gives its argmax whatever the key


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
    n = 20_000
    probs = torch.tensor([0.0, 1e-6, 0.0, 1.0 - 1e-6, 0.0], dtype=torch.float32).expand(n, 5)
    drawn = sample(probs, keys_of(list(range(n)), 0, 1)[:, 0])
    assert set(drawn.tolist()) <= {1, 3}
