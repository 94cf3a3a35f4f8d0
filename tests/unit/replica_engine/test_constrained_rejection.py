"""Speculation under a grammar is exact: the emitted tokens follow the target's masked, renormalised distribution.

A toy vocabulary (a, b, c, ab and an end token) and a toy grammar, the regex ((ab|ba)c){2,}, compiled by
llguidance. Random tables give the target p(. | prefix) and the drafter q(. | prefix). The path under test is the
engine's: the drafter's masks come from `DraftWalk` (the matcher advanced through the drafts drawn so far), each
draft is drawn from `probabilities` of the drafter's logits with `apply_allowed`, the target's masks from
`verification_bitmasks` and `target_allowed`, and `verify` decides. Every draft sequence (weighted by its masked q)
and every cell of the uniforms is enumerated as in test_rejection.py; the law of the emitted block, extended to
k + 1 tokens with the target's masked conditionals, must equal the joint of k + 1 tokens drawn one by one from the
masked target within 1e-12 in total variation. The allowed sets behind the expected law are computed here from the
regex's language, not by llguidance. With forced drafts, the tokens the grammar forces after the k drafts
(`DraftWalk.end`) join them with a one-hot q, and the masks the walk kept must equal `verification_bitmasks`'.

The variant that drafts from the unmasked q, cuts the block at its first draft the grammar refuses and verifies
against that unmasked q must fail the same check.
"""

from __future__ import annotations

import itertools
import random
import re

import llguidance
import pytest
import tokenizers
import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from replica.engine.constrain import DraftWalk, apply_allowed, target_allowed, verification_bitmasks
from replica.engine.rejection import verify
from replica.engine.sampler import SamplingTensors, probabilities
from replica.engine.sampling import SamplingParams
from replica.engine.sequence import Sequence
from replica.grammar.matcher import GrammarCompiler, GrammarMatcher
from tests.unit.replica_engine.test_rejection import Prefix, draw_cells, random_table, total_variation

TOKENS = ("a", "b", "c", "ab")
EOS = 4
VOCAB = len(TOKENS) + 1
REGEX = "((ab|ba)c){2,}"
LANGUAGE_12 = ["".join(units) for units in itertools.product(("abc", "bac"), repeat=4)]
"""Every string of the language with 12 characters: the texts of up to 10 characters that can start a string of the
language are exactly their prefixes (the blocks here reach at most 5 tokens, at most 8 characters)."""
CPU = torch.device("cpu")
SAMPLED = SamplingTensors.build([SamplingParams(temperature=1.0)], CPU)


def toy_compiler() -> GrammarCompiler:
    backend = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(TOKENS)}, merges=[("a", "b")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<e>", special=True)])
    return GrammarCompiler(backend.to_str(), vocab_size=VOCAB, eos_token_ids=[EOS])


def hand_allowed(prefix: Prefix) -> list[bool]:
    """Tokens that keep the text a prefix of some string of the language, and the end token once it is one."""
    text = "".join(TOKENS[t] for t in prefix)
    is_complete = re.fullmatch(REGEX, text) is not None
    return [any(w.startswith(text + TOKENS[t]) for w in LANGUAGE_12) for t in range(EOS)] + [is_complete]


def masked(table: torch.Tensor, prefix: Prefix) -> torch.Tensor:
    allowed = torch.tensor(hand_allowed(prefix), dtype=torch.float64)
    row = table * allowed
    return row / row.sum()


def logits_of(dist: torch.Tensor) -> torch.Tensor:
    return dist.log().unsqueeze(0)  # [1, V] float64; zero mass -> -inf


def sequence_at(compiler: GrammarCompiler, start: Prefix) -> Sequence:
    seq = Sequence(0, [EOS], SamplingParams(), arrival_s=0.0)
    seq.grammar = compiler.matcher(llguidance.LLMatcher.grammar_from_regex(REGEX))
    for token in start:
        assert seq.grammar.consume(token)
    seq.token_ids.extend(start)
    return seq


def mask_state(compiler: GrammarCompiler, matcher: GrammarMatcher) -> list[int]:
    return compiler.fill_masks([(matcher, 0, ())], 1)[0].tolist()


def emitted_law(
    p: dict[Prefix, torch.Tensor],
    q: dict[Prefix, torch.Tensor],
    k: int,
    start: Prefix,
    compiler: GrammarCompiler,
    *,
    cut_unmasked: bool = False,
    max_forced: int = 0,
) -> dict[Prefix, float]:
    """Exact law of one step's emitted tokens after `start`, extended to k + max_forced + 1 tokens with the masked
    target. With `max_forced`, the tokens the grammar forces after the k drafts follow them as one-hot drafts."""
    seq = sequence_at(compiler, start)
    assert seq.grammar is not None
    state_before = mask_state(compiler, seq.grammar)
    width = k + max_forced
    rows = []
    for drafted in itertools.product(range(VOCAB), repeat=k):
        walk_bitmask = None
        if cut_unmasked:
            qs = [q[start + drafted[:j]] for j in range(k)]
            n = next((j for j in range(k) if not hand_allowed(start + drafted[:j])[drafted[j]]), k)
            drafts = drafted
        else:
            walk = DraftWalk(compiler, [seq.grammar], CPU)
            qs, previous = [], torch.tensor([start[-1] if start else EOS])
            for j in range(k):
                mask = walk(j, previous)
                qs.append(probabilities(apply_allowed(logits_of(q[start + drafted[:j]]), mask), SAMPLED)[0])
                if qs[j][drafted[j]] == 0:
                    break  # a draft the masked drafter never draws: weight 0, and the walk never consumes it
                previous = torch.tensor([drafted[j]])
            if len(qs) < k or qs[-1][drafted[-1]] == 0:
                walk.finish()
                assert mask_state(compiler, seq.grammar) == state_before, "the walk left the matcher moved"
                continue
            [(forced, walk_bitmask)] = walk.end([list(drafted)], [max_forced])
            walk.finish()
            assert mask_state(compiler, seq.grammar) == state_before, "the walk left the matcher moved"
            qs += [torch.nn.functional.one_hot(torch.tensor(t), VOCAB).double() for t in forced]
            drafts = drafted + tuple(forced)
            n = len(drafts)
        weight = 1.0
        for j, token in enumerate(drafted):
            weight *= float(qs[j][token])
        if weight == 0:
            continue
        seq.draft_token_ids = list(drafts[:n])
        bitmasks = verification_bitmasks(compiler, [seq], [n])
        assert mask_state(compiler, seq.grammar) == state_before, "verification masks left the matcher moved"
        if walk_bitmask is not None:
            assert walk_bitmask.equal(bitmasks[seq.seq_id]), "the walk's masks are not the verification masks"
        allowed = target_allowed([seq], [n + 1], bitmasks, VOCAB, CPU)
        assert allowed is not None
        logits = torch.cat([logits_of(p[start + drafts[:j]]) for j in range(n + 1)])
        target_rows = probabilities(apply_allowed(logits, allowed), SAMPLED.repeat([n + 1]))
        target = torch.stack([target_rows[min(j, n)] for j in range(width + 1)])  # padded as `decide` pads
        padded = list(drafts) + [0] * (width - len(drafts))
        q_rows = torch.stack([*qs, *(torch.zeros(VOCAB, dtype=torch.float64) for _ in range(width - len(qs)))])
        for accept_us, u_final, cell_width in draw_cells(target, q_rows, padded, n):
            rows.append((target, q_rows, padded, n, accept_us, u_final, weight * cell_width))
    tokens, num_emitted = verify(
        torch.stack([r[0] for r in rows]),
        torch.stack([r[1] for r in rows]),
        torch.tensor([r[2] for r in rows], dtype=torch.long),
        torch.tensor([r[3] for r in rows], dtype=torch.long),
        torch.tensor([r[4] for r in rows], dtype=torch.float64),
        torch.tensor([r[5] for r in rows], dtype=torch.float64),
    )
    law: dict[Prefix, float] = {}
    for row, emitted, count in zip(rows, tokens.tolist(), num_emitted.tolist(), strict=True):
        seqs = [(tuple(emitted[:count]), row[6])]
        for _ in range(width + 1 - count):  # extend with the masked target's conditionals
            extended = [((*s, t), w * float(masked(p[start + s], start + s)[t])) for s, w in seqs for t in range(VOCAB)]
            seqs = [(s, w) for s, w in extended if w]
        for s, w in seqs:
            law[s] = law.get(s, 0.0) + w
    return law


def masked_joint(p: dict[Prefix, torch.Tensor], start: Prefix, length: int) -> dict[Prefix, float]:
    joint = {}
    for s in itertools.product(range(VOCAB), repeat=length):
        w = 1.0
        for j, token in enumerate(s):
            w *= float(masked(p[start + s[:j]], start + s[:j])[token])
            if not w:
                break
        if w:
            joint[s] = w
    return joint


def tables(
    k: int, start: Prefix, seed: int, max_forced: int = 0
) -> tuple[dict[Prefix, torch.Tensor], dict[Prefix, torch.Tensor]]:
    rng = random.Random(seed)
    depth = len(start) + k + max_forced
    return random_table(VOCAB, depth, rng, zeros=False), random_table(VOCAB, depth, rng, zeros=False)


def test_the_toy_grammar_masks_are_the_languages() -> None:
    """llguidance's masks for the toy grammar equal the allowed sets the expected law is built from."""
    compiler = toy_compiler()
    seq = sequence_at(compiler, ())
    assert seq.grammar is not None
    for depth in range(4):
        for prefix in itertools.product(range(VOCAB), repeat=depth):
            if not all(hand_allowed(prefix[:j])[prefix[j]] for j in range(depth)):
                continue
            seq.draft_token_ids = list(prefix)
            bitmasks = verification_bitmasks(compiler, [seq], [depth])
            allowed = target_allowed([seq], [depth + 1], bitmasks, VOCAB, CPU)
            assert allowed is not None
            assert allowed[depth].tolist() == hand_allowed(prefix), prefix


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("start", [(), (3,), (1, 0)], ids=["start", "after-ab", "after-b-a"])
def test_constrained_speculation_follows_the_masked_target_exactly(k: int, start: Prefix) -> None:
    compiler = toy_compiler()
    p, q = tables(k, start, seed=100 * k + len(start))
    law = emitted_law(p, q, k, start, compiler)
    assert abs(sum(law.values()) - 1.0) < 1e-12
    assert total_variation(law, masked_joint(p, start, k + 1)) < 1e-12


def test_the_walk_reads_the_tokens_the_grammar_forces_after_the_drafts() -> None:
    compiler = toy_compiler()
    seq = sequence_at(compiler, ())
    assert seq.grammar is not None
    walk = DraftWalk(compiler, [seq.grammar], CPU)
    walk(0, torch.tensor([EOS]))
    walk(1, torch.tensor([0]))  # the first draft was "a": "b" then "c" must follow
    [(forced, bitmask)] = walk.end([[0]], [3])
    walk.finish()
    assert forced == [1, 2]
    seq.draft_token_ids = [0, 1, 2]
    assert bitmask.equal(verification_bitmasks(compiler, [seq], [3])[seq.seq_id])


@pytest.mark.parametrize(("k", "start"), [(1, ()), (2, ()), (1, (1, 0))], ids=["k1-start", "k2-start", "k1-after-b-a"])
def test_forced_drafts_after_the_drafters_keep_speculation_exact(k: int, start: Prefix) -> None:
    """The tokens the grammar forces after the k drafts ("b" and "c" after "a") join them with a one-hot q."""
    compiler = toy_compiler()
    max_forced = 2
    p, q = tables(k, start, seed=31 * k + len(start), max_forced=max_forced)
    law = emitted_law(p, q, k, start, compiler, max_forced=max_forced)
    assert abs(sum(law.values()) - 1.0) < 1e-12
    assert total_variation(law, masked_joint(p, start, k + max_forced + 1)) < 1e-12


@pytest.mark.parametrize("k", [2, 3])
def test_the_harness_catches_cutting_at_the_first_invalid_draft_with_unmasked_q(k: int) -> None:
    compiler = toy_compiler()
    p, q = tables(k, (), seed=7 + k)
    expected = masked_joint(p, (), k + 1)
    assert total_variation(emitted_law(p, q, k, (), compiler), expected) < 1e-12
    biased = emitted_law(p, q, k, (), compiler, cut_unmasked=True)
    assert abs(sum(biased.values()) - 1.0) < 1e-12
    assert total_variation(biased, expected) > 1e-3
