"""Speculation under a grammar is exact: the emitted tokens are those of decoding the masked target one at a time.

A toy vocabulary (a, b, c, ab and an end token) and a toy grammar, the regex ((ab|ba)c){2,}, compiled by
llguidance. A random table gives the target p(. | prefix). The path under test is the engine's: the drafter's masks
come from `DraftWalk` (the matcher advanced through the drafts so far), the target's from `verification_bitmasks`
and `target_allowed`, applied with `apply_allowed` before `probabilities`, and `verify` decides. For every draft
sequence the walk allows and many seeds, the emitted tokens must be exactly those of decoding one token at a time
from the masked, renormalised target with the same keys, whose law test_verification.py checks. The allowed sets
of that reference are computed here from the regex's language, not by llguidance. With forced drafts, the tokens
the grammar forces after the k drafts (`DraftWalk.end`) join them, and the masks the walk kept must equal
`verification_bitmasks`'.

Verifying against the unmasked target must fail the same check.
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
from replica.engine.sampler import SamplingTensors, probabilities
from replica.engine.sampling import SamplingParams
from replica.engine.sequence import Sequence
from replica.engine.verification import verify
from replica.grammar.matcher import GrammarCompiler, GrammarMatcher
from tests.unit.replica_engine.test_verification import Prefix, keys_of, plain_decoding, random_table

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


class MaskedTarget(dict[Prefix, torch.Tensor]):
    """The masked, renormalised target after `start`, row by row as plain decoding reaches them."""

    def __init__(self, p: dict[Prefix, torch.Tensor], start: Prefix) -> None:
        super().__init__()
        self.p, self.start = p, start

    def __missing__(self, prefix: Prefix) -> torch.Tensor:
        return masked(self.p[self.start + prefix], self.start + prefix)


def mismatches(
    p: dict[Prefix, torch.Tensor],
    k: int,
    start: Prefix,
    compiler: GrammarCompiler,
    *,
    max_forced: int = 0,
    unmasked_target: bool = False,
    seeds: range = range(24),
) -> tuple[int, int]:
    """-> (rows whose emitted tokens are not the masked target's plain decoding, rows checked), over every draft
    sequence of k tokens the walk allows after `start` and every seed. With `max_forced`, the tokens the grammar
    forces after the k drafts follow them as drafts. `unmasked_target`: verify against p without masks (a bug)."""
    seq = sequence_at(compiler, start)
    assert seq.grammar is not None
    state_before = mask_state(compiler, seq.grammar)
    width = k + max_forced
    plain = {seed: plain_decoding(MaskedTarget(p, start), (), seed, width + 1) for seed in seeds}
    bad = total = 0
    for drafted in itertools.product(range(VOCAB), repeat=k):
        walk = DraftWalk(compiler, [seq.grammar], CPU)
        previous = torch.tensor([start[-1] if start else EOS])
        drawable = True
        for j in range(k):
            if not bool(walk(j, previous)[0, drafted[j]]):
                drawable = False  # a draft the masked drafter never draws; the walk never consumes it
                break
            previous = torch.tensor([drafted[j]])
        if not drawable:
            walk.finish()
            assert mask_state(compiler, seq.grammar) == state_before, "the walk left the matcher moved"
            continue
        [(forced, walk_bitmask)] = walk.end([list(drafted)], [max_forced])
        walk.finish()
        assert mask_state(compiler, seq.grammar) == state_before, "the walk left the matcher moved"
        drafts = drafted + tuple(forced)
        n = len(drafts)
        seq.draft_token_ids = list(drafts)
        bitmasks = verification_bitmasks(compiler, [seq], [n])
        assert mask_state(compiler, seq.grammar) == state_before, "verification masks left the matcher moved"
        assert walk_bitmask.equal(bitmasks[seq.seq_id]), "the walk's masks are not the verification masks"
        allowed = target_allowed([seq], [n + 1], bitmasks, VOCAB, CPU)
        assert allowed is not None
        logits = torch.cat([logits_of(p[start + drafts[:j]]) for j in range(n + 1)])
        if not unmasked_target:
            logits = apply_allowed(logits, allowed)
        target_rows = probabilities(logits, SAMPLED.repeat([n + 1]))
        target = torch.stack([target_rows[min(j, n)] for j in range(width + 1)])  # padded as `decide` pads
        padded = list(drafts) + [0] * (width - n)
        tokens, num_emitted = verify(
            target.expand(len(seeds), width + 1, VOCAB),
            torch.tensor([padded] * len(seeds), dtype=torch.long).view(len(seeds), width),
            torch.full((len(seeds),), n, dtype=torch.long),
            keys_of(list(seeds), 0, width + 1),
        )
        for seed, emitted, count in zip(seeds, tokens.tolist(), num_emitted.tolist(), strict=True):
            bad += emitted[:count] != plain[seed][:count]
            total += 1
    return bad, total


def tables(k: int, start: Prefix, seed: int, max_forced: int = 0) -> dict[Prefix, torch.Tensor]:
    return random_table(VOCAB, len(start) + k + max_forced + 1, random.Random(seed), zeros=False)


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
def test_constrained_speculation_emits_the_masked_targets_tokens(k: int, start: Prefix) -> None:
    compiler = toy_compiler()
    p = tables(k, start, seed=100 * k + len(start))
    bad, total = mismatches(p, k, start, compiler)
    assert bad == 0 and total > 0


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
    """The tokens the grammar forces after the k drafts ("b" and "c" after "a") join them as drafts."""
    compiler = toy_compiler()
    max_forced = 2
    p = tables(k, start, seed=31 * k + len(start), max_forced=max_forced)
    bad, total = mismatches(p, k, start, compiler, max_forced=max_forced)
    assert bad == 0 and total > 0


@pytest.mark.parametrize("k", [2, 3])
def test_the_check_catches_verification_against_the_unmasked_target(k: int) -> None:
    compiler = toy_compiler()
    p = tables(k, (), seed=7 + k)
    assert mismatches(p, k, (), compiler)[0] == 0
    bad, total = mismatches(p, k, (), compiler, unmasked_target=True)
    assert bad > total // 10
