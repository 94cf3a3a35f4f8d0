"""Penalised sampling is exact, with speculation and without: checked by enumeration over a 4-token vocabulary.

A toy target gives logits L(. | output so far) from a random table. The reference, written here, penalises them as
OpenAI and vLLM define it: a token seen in the prompt or the output has a positive logit divided by the repetition
penalty and a negative one multiplied by it; then each token loses the frequency penalty once per occurrence in the
output and the presence penalty once if it occurs there at all. Its softmax (at the request's temperature) is the
distribution each token must follow. The path under test is the engine's: `decide.row_penalties` (row j of a
verifying sequence counts its output plus the drafts before row j), `apply_penalties`, `probabilities` and
`verify`. Every draft sequence of a random drafter q (k = 1, 2) and every cell of the uniforms is enumerated as in
test_rejection.py, k = 0 being plain sampling; the law of the emitted block, extended to k + 1 tokens with the
reference's conditionals, must equal the reference's joint within 1e-12 in total variation. Penalties, temperatures
and logits are float32-exact values, so float64 arithmetic on both sides agrees to rounding.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from replica.engine.decide import row_penalties
from replica.engine.rejection import verify
from replica.engine.sampler import SamplingTensors, apply_penalties, probabilities
from replica.engine.sampling import SamplingParams
from replica.engine.sequence import Sequence
from tests.unit.replica_engine.test_rejection import Prefix, draw_cells, random_table, total_variation

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


def reference_joint(logits: dict[Prefix, torch.Tensor], params: SamplingParams, length: int) -> dict[Prefix, float]:
    joint = {}
    for tail in itertools.product(range(VOCAB), repeat=length):
        w = 1.0
        for j, t in enumerate(tail):
            w *= float(reference(logits, OUTPUT + tail[:j], params)[t])
        joint[tail] = w
    return joint


def emitted_law(
    logits: dict[Prefix, torch.Tensor],
    q: dict[Prefix, torch.Tensor],
    params: SamplingParams,
    k: int,
    *,
    drafts_in_history: bool = True,
) -> dict[Prefix, float]:
    """Exact law of one step's emitted tokens after OUTPUT, extended to k + 1 tokens with the reference. Without
    `drafts_in_history` every row is penalised by the committed output alone (what the engine must not do)."""
    sampling = SamplingTensors.build([params], CPU)
    rows = []
    for drafts in itertools.product(range(VOCAB), repeat=k):
        weight = 1.0
        for j, t in enumerate(drafts):
            weight *= float(q[drafts[:j]][t])
        seq = Sequence(0, list(PROMPT), params, arrival_s=0.0)
        seq.token_ids.extend(OUTPUT)
        seq.draft_token_ids = list(drafts) if drafts_in_history else []
        penalties = row_penalties([seq], [k + 1], VOCAB, CPU)
        if not drafts_in_history:
            penalties = row_penalties([seq] * (k + 1), [1] * (k + 1), VOCAB, CPU)
        raw = torch.stack([logits[OUTPUT + drafts[:j]] for j in range(k + 1)])
        target = probabilities(apply_penalties(raw, penalties), sampling.repeat([k + 1]))  # [k + 1, V]
        qs = [q[drafts[:j]] for j in range(k)]
        for accept_us, u_final, width in draw_cells(target, qs, drafts, k):
            rows.append((target, qs, list(drafts), accept_us, u_final, weight * width))
    tokens, num_emitted = verify(
        torch.stack([r[0] for r in rows]),
        torch.stack([torch.stack(r[1]) if r[1] else torch.empty(0, VOCAB, dtype=torch.float64) for r in rows]),
        torch.tensor([r[2] for r in rows], dtype=torch.long).view(len(rows), k),
        torch.full((len(rows),), k, dtype=torch.long),
        torch.tensor([r[3] for r in rows], dtype=torch.float64).view(len(rows), k),
        torch.tensor([r[4] for r in rows], dtype=torch.float64),
    )
    law: dict[Prefix, float] = {}
    for row, emitted, n in zip(rows, tokens.tolist(), num_emitted.tolist(), strict=True):
        blocks = [(tuple(emitted[:n]), row[5])]
        for _ in range(k + 1 - n):
            blocks = [
                ((*b, t), w * float(reference(logits, OUTPUT + b, params)[t])) for b, w in blocks for t in range(VOCAB)
            ]
        for b, w in blocks:
            law[b] = law.get(b, 0.0) + w
    return law


@pytest.mark.parametrize("k", [0, 1, 2], ids=["no-speculation", "k1", "k2"])
@pytest.mark.parametrize("changes", PENALTIES, ids=lambda c: "+".join(c))
def test_penalised_tokens_follow_the_softmax_of_the_penalised_logits(k: int, changes: dict) -> None:
    params = SamplingParams(**{"temperature": 1.0, **changes})
    rng = random.Random(11 * k + len(changes))
    logits = random_logits(k, rng)
    q = random_table(VOCAB, k, rng, zeros=False)
    law = emitted_law(logits, q, params, k)
    assert abs(sum(law.values()) - 1.0) < 1e-12
    assert total_variation(law, reference_joint(logits, params, k + 1)) < 1e-12


def test_the_harness_catches_rows_penalised_without_the_drafts_before_them() -> None:
    params = SamplingParams(temperature=1.0, frequency_penalty=0.5, repetition_penalty=1.5)
    rng = random.Random(3)
    logits = random_logits(2, rng)
    q = random_table(VOCAB, 2, rng, zeros=False)
    expected = reference_joint(logits, params, 3)
    assert total_variation(emitted_law(logits, q, params, 2), expected) < 1e-12
    assert total_variation(emitted_law(logits, q, params, 2, drafts_in_history=False), expected) > 1e-3
