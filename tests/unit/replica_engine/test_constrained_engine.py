"""Constrained requests in the engine: valid output with and without speculation, greedy output that speculation
does not change, matchers that hold exactly the committed tokens after every step, and a grammar that dead-ends
ending its own request with an error while the rest of the batch finishes.

The tiny random model writes through a byte-level ASCII tokenizer (`grammar_support`); its output is whatever the
grammar lets through, so only the masks make it JSON.
"""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import llguidance
import pytest

from replica.engine.drafting import Drafter
from replica.engine.engine import LLMEngine, StepResult
from replica.engine.sampling import SamplingParams
from replica.engine.sequence import FinishReason
from replica.grammar.formats import json_schema_grammar
from replica.model.model import MoEForCausalLM
from tests.unit.replica_engine.conftest import Run, drive
from tests.unit.replica_engine.grammar_support import ascii_compiler, decode
from tests.unit.replica_engine.test_speculative_engine import CONFIG, PROMPTS, drafters, model_drafter, perturbed

SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["order", "quote", "invoice"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 500},
        "note": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["kind", "count", "note", "tags"],
    "additionalProperties": False,
}
GRAMMAR = json_schema_grammar(SCHEMA)


def run_constrained(
    model: MoEForCausalLM,
    params: SamplingParams,
    *,
    drafter: Drafter | None = None,
    k: int = 0,
    prompts: list[list[int]] = PROMPTS,
    check_matchers: bool = True,
    max_forced_drafts: int = CONFIG.max_forced_drafts,
) -> tuple[Run, list[int], LLMEngine]:
    compiler = ascii_compiler()
    config = replace(CONFIG, num_speculative_tokens=k, adaptive_speculation=False, max_forced_drafts=max_forced_drafts)
    engine = LLMEngine(model, config, drafter=drafter, grammar=compiler)
    ids = [engine.add_request(p, params) for p in prompts]

    def matchers_hold_committed_tokens(engine: LLMEngine, _: StepResult) -> None:
        for seq in engine.scheduler.running:
            assert seq.grammar is not None and seq.params.grammar is not None
            fresh = compiler.matcher(seq.params.grammar)
            for token in seq.output_token_ids:
                assert fresh.consume(token)
            here = compiler.fill_masks([(seq.grammar, 0, ())], 1)
            assert compiler.fill_masks([(fresh, 0, ())], 1).equal(here), f"request {seq.seq_id}"
            assert fresh.is_accepting == seq.grammar.is_accepting

    return drive(engine, between_steps=matchers_hold_committed_tokens if check_matchers else None), ids, engine


def assert_valid(r: Run, ids: list[int]) -> None:
    for i in ids:
        assert r.finals[i].finish_reason is FinishReason.STOP, (i, decode(r.tokens[i]))
        jsonschema.validate(json.loads(decode(r.tokens[i])), SCHEMA)


def test_greedy_constrained_output_is_the_same_with_and_without_speculation(model: MoEForCausalLM) -> None:
    params = SamplingParams(max_tokens=120, temperature=0.0, grammar=GRAMMAR)
    plain, plain_ids, _ = run_constrained(model, params)
    assert_valid(plain, plain_ids)
    for name, drafter in drafters(model, 3).items():
        spec, ids, _ = run_constrained(model, params, drafter=drafter, k=3, check_matchers=name == "perturbed")
        assert [spec.tokens[i] for i in ids] == [plain.tokens[i] for i in plain_ids], name
        assert sum(s.speculation.num_drafts for s in spec.steps) > 0, name


def test_forced_drafts_go_past_the_drafters_k_and_change_no_greedy_token(model: MoEForCausalLM) -> None:
    """The schema's keys and punctuation, forced by the grammar, are verified as drafts after the drafter's k:
    some step verifies more than k drafts of the one request, and its greedy output is the same without them."""
    params = SamplingParams(max_tokens=120, temperature=0.0, grammar=GRAMMAR)
    k = 3
    runs = {}
    for max_forced in (0, 8):
        drafter = model_drafter(perturbed(model, 0.05), k)
        runs[max_forced], ids, _ = run_constrained(
            model, params, drafter=drafter, k=k, prompts=PROMPTS[:1], max_forced_drafts=max_forced
        )
        most = max(s.speculation.num_draft_tokens for s in runs[max_forced].steps)
        assert most > k if max_forced else most == k
    assert runs[8].tokens[ids[0]] == runs[0].tokens[ids[0]]
    assert len(runs[8].steps) < len(runs[0].steps)


@pytest.mark.parametrize("kind", ["perturbed", "random-block"])
def test_sampled_constrained_output_is_valid_under_speculation(model: MoEForCausalLM, kind: str) -> None:
    drafter = drafters(model, 3)[kind]
    params = SamplingParams(max_tokens=160, temperature=1.0, seed=5, grammar=GRAMMAR)
    r, ids, _ = run_constrained(model, params, drafter=drafter, k=3)
    assert_valid(r, ids)
    accepted = sum(s.speculation.num_accepted_tokens for s in r.steps)
    assert accepted > 0  # drafts drawn under the grammar are accepted, not only the bonus tokens


def test_a_grammar_that_dead_ends_ends_its_request_with_an_error_and_the_batch_goes_on(model: MoEForCausalLM) -> None:
    # "a" then an endless chain of "b"s with no way out: llguidance's parser runs past its item limit and fails.
    dead_end = llguidance.LLMatcher.grammar_from_lark('start: "a" x\nx: "b" x')
    compiler = ascii_compiler()
    k = 3
    engine = LLMEngine(
        model,
        replace(CONFIG, num_speculative_tokens=k, adaptive_speculation=False),
        drafter=model_drafter(perturbed(model, 0.05), k),
        grammar=compiler,
    )
    good = [engine.add_request(p, SamplingParams(max_tokens=120, temperature=0.0, grammar=GRAMMAR)) for p in PROMPTS]
    bad = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=50, temperature=0.0, grammar=dead_end))
    plain = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    r = drive(engine)
    assert r.finals[bad].finish_reason is FinishReason.ERROR
    assert r.finals[bad].error, "the error names the problem"
    assert decode(r.tokens[bad]) in ("", "a")
    assert_valid(r, good)
    assert len(r.tokens[plain]) == 20
