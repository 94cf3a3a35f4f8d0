"""Penalised sampling is exact, with speculation and without: checked over a 4-token vocabulary.

A toy target gives logits L(. | output so far) from a random table. The reference, written here, penalises them as
OpenAI and vLLM define it: a token seen in the prompt or the output has a positive logit divided by the repetition
penalty and a negative one multiplied by it; then each token loses the frequency penalty once per occurrence in the
output and the presence penalty once if it occurs there at all. Its softmax (at the request's temperature) is the
distribution each token must follow. The path under test is the engine's: `decide.row_penalties` (row j of a
verifying sequence counts its output plus the drafts before row j), `apply_penalties`, `probabilities` and
`verify`. For every draft sequence (k = 1, 2; k = 0 is plain sampling) and many seeds, the emitted tokens must be
exactly those of decoding the reference one token at a time with the same keys, whose law test_verification.py
checks. Penalties, temperatures and logits are float32-exact values, so float64 arithmetic on both sides agrees to
rounding.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from replica.engine.decide import row_penalties
from replica.engine.sampler import SamplingTensors, apply_penalties, probabilities
from replica.engine.sampling import SamplingParams
from replica.engine.sequence import Sequence
from replica.engine.verification import verify
from tests.unit.replica_engine.test_verification import Prefix, keys_of, plain_decoding

VOCAB = 4
PROMPT = [0, 0, 2]
OUTPUT = (1, 2)
"""Tokens already generated before the step: 2 is in the prompt and the output, 3 in neither."""
CPU = torch.device("cpu")
PENALTIES = [
    {"presence_penalty": 0.75},
    {"frequency_penalty": 0.5},
    {"repetition_penalty": 1.5},
    {"presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.25, "temperature": 0.75},
]


def random_logits(depth: int, rng: random.Random) -> dict[Prefix, torch.Tensor]:
    """L(. | output) for every output extending OUTPUT by up to `depth` tokens: multiples of 1/8 in [-3, 3], both
    signs, so that the repetition penalty's two branches both act."""
    return {
        OUTPUT + tail: torch.tensor([rng.randrange(-24, 25) / 8 for _ in range(VOCAB)], dtype=torch.float64)
        for n in range(depth + 1)
        for tail in itertools.product(range(VOCAB), repeat=n)
    }


def reference(logits: dict[Prefix, torch.Tensor], output: Prefix, params: SamplingParams) -> torch.Tensor:
    x = logits[output].clone()
    for t in range(VOCAB):
        if t in PROMPT or t in output:
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
        x[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty * (t in output)
    return (x / params.temperature).softmax(-1)


class Reference(dict[Prefix, torch.Tensor]):
    """The reference's distribution after OUTPUT + each tail, computed as plain decoding reaches it."""

    def __init__(self, logits: dict[Prefix, torch.Tensor], params: SamplingParams) -> None:
        super().__init__()
        self.logits, self.params = logits, params

    def __missing__(self, tail: Prefix) -> torch.Tensor:
        return reference(self.logits, OUTPUT + tail, self.params)


def mismatches(
    logits: dict[Prefix, torch.Tensor],
    params: SamplingParams,
    k: int,
    *,
    drafts_in_history: bool = True,
    seeds: range = range(32),
) -> tuple[int, int]:
    """-> (rows whose emitted tokens are not the reference's plain decoding, rows checked), over every draft
    sequence of k tokens and every seed. Without `drafts_in_history` every row is penalised by the committed output
    alone (what the engine must not do)."""
    sampling = SamplingTensors.build([params], CPU)
    plain = {seed: plain_decoding(Reference(logits, params), (), seed, k + 1) for seed in seeds}
    bad = total = 0
    for drafts in itertools.product(range(VOCAB), repeat=k):
        seq = Sequence(0, list(PROMPT), params, arrival_s=0.0)
        seq.token_ids.extend(OUTPUT)
        seq.draft_token_ids = list(drafts) if drafts_in_history else []
        penalties = row_penalties([seq], [k + 1], VOCAB, CPU)
        if not drafts_in_history:
            penalties = row_penalties([seq] * (k + 1), [1] * (k + 1), VOCAB, CPU)
        raw = torch.stack([logits[OUTPUT + drafts[:j]] for j in range(k + 1)])
        target = probabilities(apply_penalties(raw, penalties), sampling.repeat([k + 1]))  # [k + 1, V]
        tokens, num_emitted = verify(
            target.expand(len(seeds), k + 1, VOCAB),
            torch.tensor([list(drafts)] * len(seeds), dtype=torch.long).view(len(seeds), k),
            torch.full((len(seeds),), k, dtype=torch.long),
            keys_of(list(seeds), 0, k + 1),
        )
        for seed, emitted, n in zip(seeds, tokens.tolist(), num_emitted.tolist(), strict=True):
            bad += emitted[:n] != plain[seed][:n]
            total += 1
    return bad, total


@pytest.mark.parametrize("k", [0, 1, 2], ids=["no-speculation", "k1", "k2"])
@pytest.mark.parametrize("changes", PENALTIES, ids=lambda c: "+".join(c))
def test_penalised_tokens_are_the_penalised_softmax_decoded_one_at_a_time(k: int, changes: dict) -> None:
    params = SamplingParams(**{"temperature": 1.0, **changes})
    logits = random_logits(k, random.Random(11 * k + len(changes)))
    bad, total = mismatches(logits, params, k)
    assert bad == 0 and total > 0


def test_the_check_catches_rows_penalised_without_the_drafts_before_them() -> None:
    params = SamplingParams(temperature=1.0, frequency_penalty=0.5, repetition_penalty=1.5)
    logits = random_logits(2, random.Random(3))
    assert mismatches(logits, params, 2)[0] == 0
    bad, total = mismatches(logits, params, 2, drafts_in_history=False)
    assert bad > 0 and total > 0  # rows after a kept draft draw from a wrong distribution
