"""The engine's side of the OpenAI surface: penalties, logprobs, stop strings and token ids, and n choices.

References are computed without the code under test: penalised greedy decoding by re-running the whole sequence
through the dense model and adjusting its logits by hand, logprobs as the dense model's log_softmax.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from replica.engine.engine import EngineConfig, LLMEngine
from replica.engine.sampling import SamplingParams
from replica.engine.sequence import FinishReason
from replica.model.loader import init_weights
from replica.model.model import MoEForCausalLM
from replica.tokenizer import IncrementalDetokenizer, Tokenizer, train_bpe
from router.policy.kv_events import BlockStored
from tests.unit.replica_engine.conftest import TINY, dense_logits, drive, greedy
from tests.unit.replica_engine.test_speculative_engine import (
    count_host_transfers,
    model_drafter,
    perturbed,
)

CONFIG = EngineConfig(num_blocks=200, block_size=4, max_num_batched_tokens=24, max_num_seqs=8)
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(128) for _ in range(n)] for n in (5, 19, 3, 11)]


def penalised_dense_greedy(
    model: MoEForCausalLM, prompt: list[int], n: int, *, presence: float, frequency: float, repetition: float
) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        logits = dense_logits(model, prompt + out)[-1].double()
        for token in set(prompt + out):
            logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
        for token in set(out):
            logits[token] -= frequency * out.count(token) + presence
        out.append(int(logits.argmax()))
    return out


PENALTIES = [
    {"presence_penalty": 1.5},
    {"frequency_penalty": 0.8},
    {"repetition_penalty": 1.6},
    {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3},
]


@pytest.mark.parametrize("changes", PENALTIES, ids=lambda c: "+".join(c))
def test_penalised_greedy_matches_a_hand_penalised_dense_reference(model: MoEForCausalLM, changes: dict) -> None:
    engine = LLMEngine(model, CONFIG)
    params = greedy(14, **changes)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    engine.add_request(PROMPTS[1], greedy(14))  # an unpenalised companion in the same steps
    r = drive(engine)
    kwargs = {
        "presence": changes.get("presence_penalty", 0.0),
        "frequency": changes.get("frequency_penalty", 0.0),
        "repetition": changes.get("repetition_penalty", 1.0),
    }
    for seq_id, prompt in zip(ids, PROMPTS, strict=True):
        assert r.tokens[seq_id] == penalised_dense_greedy(model, prompt, 14, **kwargs)


def test_penalties_change_what_a_repetitive_greedy_sequence_emits(model: MoEForCausalLM) -> None:
    plain = drive_one(model, greedy(30))
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself
    penalised = drive_one(model, greedy(30, frequency_penalty=2.0, presence_penalty=2.0))
    assert penalised != plain
    assert len(set(penalised)) > len(set(plain))


def drive_one(model: MoEForCausalLM, params: SamplingParams, **engine_kwargs: object) -> list[int]:
    engine = LLMEngine(model, CONFIG, **engine_kwargs)  # type: ignore[arg-type]
    seq_id = engine.add_request(PROMPTS[0], params)
    return drive(engine).tokens[seq_id]


@pytest.mark.parametrize("changes", PENALTIES, ids=lambda c: "+".join(c))
def test_penalised_greedy_is_the_same_with_speculation(model: MoEForCausalLM, changes: dict) -> None:
    """Each verified row is penalised from the counts as of its position, drafts before it included."""
    params = greedy(16, **changes)
    plain = LLMEngine(model, CONFIG)
    plain_ids = [plain.add_request(p, params) for p in PROMPTS]
    expected = drive(plain)
    for drafter in (model_drafter(model, 3), model_drafter(perturbed(model, 0.05), 3)):
        spec = LLMEngine(model, replace(CONFIG, num_speculative_tokens=3, adaptive_speculation=False), drafter=drafter)
        spec_ids = [spec.add_request(p, params) for p in PROMPTS]
        got = drive(spec)
        assert sum(s.speculation.num_accepted_tokens for s in got.steps) > 0
        assert [got.tokens[i] for i in spec_ids] == [expected.tokens[i] for i in plain_ids]


def logprobs_of(run_outputs: list, seq_id: int) -> list:
    return [lp for out in run_outputs[seq_id] for lp in (out.logprobs or [])]


@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_are_the_raw_model_distribution_with_and_without_speculation(model: MoEForCausalLM, k: int) -> None:
    drafter = model_drafter(perturbed(model, 0.05), k) if k else None
    engine = LLMEngine(model, replace(CONFIG, num_speculative_tokens=k, adaptive_speculation=False), drafter=drafter)
    # Temperature and a penalty change what is drawn, not what is reported: the model's own log_softmax.
    params = [greedy(10, logprobs=5), greedy(10, logprobs=0, presence_penalty=1.0), greedy(10)]
    ids = [engine.add_request(PROMPTS[i], p) for i, p in enumerate(params)]
    r = drive(engine)
    for seq_id, prompt, p in zip(ids, PROMPTS[: len(params)], params, strict=True):
        lps = logprobs_of(r.outputs, seq_id)
        if p.logprobs is None:
            assert lps == []
            continue
        tokens = r.tokens[seq_id]
        assert len(lps) == len(tokens)
        reference = dense_logits(model, prompt + tokens).log_softmax(-1)[len(prompt) - 1 : -1]
        for j, (token, lp) in enumerate(zip(tokens, lps, strict=True)):
            assert lp.logprob == pytest.approx(float(reference[j, token]), abs=1e-4)
            assert len(lp.top) == p.logprobs
            top = reference[j].topk(p.logprobs)
            assert [t for t, _ in lp.top] == top.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_logprobs_and_penalties_keep_one_host_transfer_per_step(model: MoEForCausalLM) -> None:
    engine = LLMEngine(
        model, replace(CONFIG, num_speculative_tokens=3), drafter=model_drafter(perturbed(model, 0.05), 3)
    )
    for i, p in enumerate(PROMPTS):
        engine.add_request(
            p, SamplingParams(max_tokens=10, temperature=0.8, seed=i, logprobs=i * 5, repetition_penalty=1.2)
        )
    while engine.has_work:
        with count_host_transfers() as calls:
            result = engine.step()
        assert calls == (["tolist"] if any(o.new_token_ids for o in result.outputs) else []), calls


def stored_hashes(steps: list) -> list[int]:
    return [h for s in steps for e in s.events if isinstance(e, BlockStored) for h in e.block_hashes]


@pytest.mark.parametrize("k", [0, 3])
def test_a_stop_token_mid_draft_commits_nothing_after_it(model: MoEForCausalLM, k: int) -> None:
    full = drive_one(model, greedy(20))
    stop = full[9]
    cut = full[: full.index(stop) + 1]
    engine = LLMEngine(
        model,
        replace(CONFIG, num_speculative_tokens=k, adaptive_speculation=False),
        drafter=model_drafter(model, k) if k else None,  # the target drafting for itself: drafts run past the stop
    )
    seq_id = engine.add_request(PROMPTS[0], greedy(20, stop_token_ids=frozenset({stop})))
    r = drive(engine)
    assert r.tokens[seq_id] == cut
    assert r.finals[seq_id].finish_reason is FinishReason.STOP
    plain = LLMEngine(model, CONFIG)
    plain.add_request(PROMPTS[0], greedy(len(cut)))
    assert stored_hashes(r.steps) == stored_hashes(drive(plain).steps)


WORDS = "the cat sat on a mat and then the dog ran far away from home while birds sang"


@pytest.fixture(scope="module")
def text_model() -> tuple[MoEForCausalLM, Tokenizer]:
    rng = random.Random(0)
    words = WORDS.split(" ")
    texts = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(50)]
    tokenizer = train_bpe(texts, vocab_size=512)
    m = MoEForCausalLM(replace(TINY, vocab_size=tokenizer.vocab_size))
    init_weights(m, seed=0, std=0.2)
    return m.eval(), tokenizer


@pytest.mark.parametrize("k", [0, 3])
def test_a_stop_string_ends_the_sequence_at_the_token_that_completes_it(
    text_model: tuple[MoEForCausalLM, Tokenizer], k: int
) -> None:
    model, tokenizer = text_model
    prompt = tokenizer.encode("the cat sat on")
    plain = LLMEngine(model, CONFIG, tokenizer=tokenizer)
    seq_id = plain.add_request(prompt, greedy(24))
    full = drive(plain).tokens[seq_id]
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(t) for t in full]
    # A stop string spanning two tokens' text: the end of one piece and the start of the next non-empty one.
    i = next(i for i in range(1, len(pieces)) if pieces[i].strip("\ufffd") and pieces[i - 1].strip("\ufffd"))
    stop = pieces[i - 1][-2:] + pieces[i][:2]
    assert "\ufffd" not in stop
    text = "".join(pieces)
    at = text.index(stop) + len(stop)
    ends = next(n for n in range(1, len(full) + 1) if len("".join(pieces[:n])) >= at)
    assert ends < len(full)
    engine = LLMEngine(
        model,
        replace(CONFIG, num_speculative_tokens=k, adaptive_speculation=False),
        tokenizer=tokenizer,
        drafter=model_drafter(model, k, CONFIG) if k else None,
    )
    seq_id = engine.add_request(prompt, greedy(24, stop=(stop, "zzzz")))
    r = drive(engine)
    assert r.tokens[seq_id] == full[:ends]
    assert r.finals[seq_id].finish_reason is FinishReason.STOP


def test_stop_strings_need_a_tokenizer(model: MoEForCausalLM) -> None:
    with pytest.raises(ValueError, match="stop strings"):
        LLMEngine(model, CONFIG).add_request([1, 2], greedy(3, stop=("x",)))


def test_n_choices_prefill_the_prompt_once(model: MoEForCausalLM) -> None:
    prompt = [_rng.randrange(128) for _ in range(30)]
    engine = LLMEngine(model, CONFIG)
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(3)]
    ids = engine.add_group(prompt, params)
    r = drive(engine)
    # 30 prompt tokens once; each other choice finds 7 blocks of 4 cached and computes the last 2 prompt tokens.
    decode_tokens = 3 * (6 - 1)
    assert sum(s.num_batched_tokens for s in r.steps) == 30 + 2 * 2 + decode_tokens
    assert [r.finals[i].num_cached_tokens for i in ids] == [0, 28, 28]
    assert all(len(r.tokens[i]) == 6 for i in ids)
    assert len({tuple(r.tokens[i]) for i in ids}) > 1  # their own seeds
    # Each choice is what the same seed gives alone.
    for i, p in zip(ids, params, strict=True):
        alone = LLMEngine(model, CONFIG)
        j = alone.add_request(prompt, p)
        assert drive(alone).tokens[j] == r.tokens[i]


def test_aborting_a_waiting_choice_and_the_first_one(model: MoEForCausalLM) -> None:
    engine = LLMEngine(model, CONFIG)
    ids = engine.add_group(PROMPTS[1], [greedy(5)] * 3)
    engine.abort(ids[1])
    engine.abort(ids[0])
    r = drive(engine)
    assert r.finals[ids[0]].finish_reason is FinishReason.ABORT
    assert r.finals[ids[1]].finish_reason is FinishReason.ABORT
    assert r.finals[ids[2]].finish_reason is FinishReason.LENGTH
    assert len(r.tokens[ids[2]]) == 5


def test_prompt_logprobs_are_the_models_over_the_prompt_even_when_it_is_cached(model: MoEForCausalLM) -> None:
    """A 19-token prompt in chunks of 8 (budget), first alone, then again while its blocks are in the prefix
    cache: the second one computes the prompt in full, and both report the dense model's log_softmax."""
    engine = LLMEngine(model, replace(CONFIG, max_num_batched_tokens=8))
    prompt = PROMPTS[1]
    reference = dense_logits(model, prompt).log_softmax(-1)[:-1]  # position p gives token p + 1
    for round_ in range(2):
        seq_id = engine.add_request(prompt, greedy(3, prompt_logprobs=2))
        r = drive(engine)
        first = r.outputs[seq_id][0]
        assert first.num_cached_tokens == 0, round_
        assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(prompt) - 1
        assert all(o.prompt_logprobs is None for o in r.outputs[seq_id][1:])
        for p, lp in enumerate(first.prompt_logprobs):
            assert lp.logprob == pytest.approx(float(reference[p, prompt[p + 1]]), abs=1e-4)
            top = reference[p].topk(2)
            assert [t for t, _ in lp.top] == top.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    plain = engine.add_request(prompt, greedy(3))
    assert drive(engine).finals[plain].num_cached_tokens == 16  # the cache did hold the prompt's blocks
