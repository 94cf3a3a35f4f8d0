"""Sampling parameters, seeded sampling, and how requests finish (stop tokens, EOS, max_tokens, context length)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

import pytest
import torch

from replica.engine.engine import EngineConfig, LLMEngine, RequestError
from replica.engine.sampler import (
    NUCLEUS_CANDIDATES,
    SamplingTensors,
    _ranked_filter,
    _sorted_filter,
    draw,
    exponentials,
    noise_keys,
    probabilities,
    sample,
)
from replica.engine.sampling import SamplingError, SamplingParams
from replica.engine.sequence import FinishReason
from replica.engine.verification import verify
from replica.model import host
from replica.model.model import MoEForCausalLM
from tests.unit.replica_engine.conftest import Run, drive, greedy

PROMPT = [11, 42, 7, 99, 3, 64, 20]
CONFIG = EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)


def run_alone(model: MoEForCausalLM, params: SamplingParams, *, eos: tuple[int, ...] = (), **changes: Any) -> Run:
    e = LLMEngine(model, replace(CONFIG, **changes), eos_token_ids=eos)
    e.add_request(PROMPT, params)
    return drive(e)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"stop": ("",)}, "empty"),
        ({"stop": tuple("abcde")}, "at most 4"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": 21}, "top_logprobs"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
    ],
)
def test_invalid_sampling_params(changes: dict[str, object], message: str) -> None:
    with pytest.raises(SamplingError, match=message):
        SamplingParams(**changes)  # type: ignore[arg-type]


def test_boundary_sampling_params_are_valid() -> None:
    p = SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0, stop=tuple("abcd"), seed=0)
    assert p.is_greedy
    assert not SamplingParams(temperature=2.0, top_p=1e-6, top_k=1, seed=2**63 - 1).is_greedy


def test_seeded_sampling_is_reproducible_and_independent_of_companions(model: MoEForCausalLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = run_alone(model, params).tokens[0]

    # Another engine (another engine seed), with companions before and after it that sample from the engine's
    # generator, one with its own seed, and a greedy one, all in the same steps.
    e = LLMEngine(model, replace(CONFIG, seed=99))
    e.add_request([5, 6, 7], SamplingParams(max_tokens=20, temperature=1.5, ignore_eos=True))
    seq_id = e.add_request(PROMPT, params)
    e.add_request(PROMPT, SamplingParams(max_tokens=20, temperature=1.0, seed=1, ignore_eos=True))
    e.add_request([1] * 9, greedy(20))
    batched = drive(e)
    assert batched.tokens[seq_id] == alone

    # The seed matters: another seed draws another sequence (12 draws at temperature 1 do not all coincide).
    other = run_alone(model, replace(params, seed=4321)).tokens[0]
    assert other != alone


def test_unseeded_sampling_follows_the_engine_seed(model: MoEForCausalLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    assert run_alone(model, params, seed=3).tokens[0] == run_alone(model, params, seed=3).tokens[0]
    assert run_alone(model, params, seed=3).tokens[0] != run_alone(model, params, seed=4).tokens[0]


def test_top_k_one_is_greedy(model: MoEForCausalLM) -> None:
    expected = run_alone(model, greedy(10)).tokens[0]
    assert len(set(expected)) > 1
    for seed in (0, 1):
        sampled = SamplingParams(max_tokens=10, temperature=2.0, top_k=1, seed=seed, ignore_eos=True)
        assert run_alone(model, sampled).tokens[0] == expected


def test_tiny_top_p_is_greedy(model: MoEForCausalLM) -> None:
    expected = run_alone(model, greedy(10)).tokens[0]
    sampled = SamplingParams(max_tokens=10, temperature=2.0, top_p=1e-6, seed=5, ignore_eos=True)
    assert run_alone(model, sampled).tokens[0] == expected


@pytest.fixture(scope="module")
def greedy_tokens(model: MoEForCausalLM) -> list[int]:
    return run_alone(model, greedy(10)).tokens[0]


def first_new(tokens: list[int]) -> int:
    """An index i > 0 whose token does not occur before it (so stopping on it stops exactly there)."""
    return next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])


def test_stop_token_ids_finish_with_stop(model: MoEForCausalLM, greedy_tokens: list[int]) -> None:
    i = first_new(greedy_tokens)
    run = run_alone(model, greedy(10, stop_token_ids=frozenset({greedy_tokens[i]})))
    assert run.tokens[0] == greedy_tokens[: i + 1]  # the stop token is returned; the server decides what to show
    assert run.finals[0].finish_reason is FinishReason.STOP
    assert run.finals[0].num_output_tokens == i + 1


def test_stop_token_ids_apply_even_with_ignore_eos(model: MoEForCausalLM, greedy_tokens: list[int]) -> None:
    i = first_new(greedy_tokens)
    params = greedy(10, stop_token_ids=frozenset({greedy_tokens[i]}))
    assert params.ignore_eos
    run = run_alone(model, params, eos=(greedy_tokens[i],))
    assert run.tokens[0] == greedy_tokens[: i + 1] and run.finals[0].finish_reason is FinishReason.STOP


def test_eos_finishes_with_stop_unless_ignored(model: MoEForCausalLM, greedy_tokens: list[int]) -> None:
    i = first_new(greedy_tokens)
    eos = (greedy_tokens[i], 127 if greedy_tokens[i] != 127 else 126)
    honoured = run_alone(model, SamplingParams(max_tokens=10, temperature=0.0), eos=eos)
    assert honoured.tokens[0] == greedy_tokens[: i + 1] and honoured.finals[0].finish_reason is FinishReason.STOP
    ignored = run_alone(model, greedy(10), eos=eos)
    assert ignored.tokens[0] == greedy_tokens and ignored.finals[0].finish_reason is FinishReason.LENGTH


def test_max_tokens_finishes_with_length(model: MoEForCausalLM, greedy_tokens: list[int]) -> None:
    for max_tokens in (1, 4):
        run = run_alone(model, greedy(max_tokens))
        assert run.tokens[0] == greedy_tokens[:max_tokens]
        assert run.finals[0].finish_reason is FinishReason.LENGTH
        assert [o.finished for o in run.outputs[0]] == [False] * (max_tokens - 1) + [True]


def test_max_model_len_caps_output(model: MoEForCausalLM, greedy_tokens: list[int]) -> None:
    run = run_alone(model, greedy(100), max_model_len=len(PROMPT) + 3)
    assert run.tokens[0] == greedy_tokens[:3]
    assert run.finals[0].finish_reason is FinishReason.LENGTH


def test_cache_size_caps_the_context(model: MoEForCausalLM) -> None:
    e = LLMEngine(model, EngineConfig(num_blocks=4, block_size=4, max_num_batched_tokens=64, max_num_seqs=2))
    assert e.max_model_len == 16
    with pytest.raises(RequestError, match="context is 16 tokens"):
        e.add_request(list(range(16)), greedy(5))
    seq_id = e.add_request(list(range(15)), greedy(5))
    run = drive(e)
    assert len(run.tokens[seq_id]) == 1 and run.finals[seq_id].finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "empty"),
        ([5, -1], "token id -1"),
        ([5, 128], "token id 128"),
        (list(range(20)), "context is 20 tokens"),
    ],
)
def test_validate_rejects_bad_prompts(model: MoEForCausalLM, prompt: list[int], message: str) -> None:
    e = LLMEngine(model, replace(CONFIG, max_model_len=20))
    with pytest.raises(RequestError, match=message):
        e.validate(prompt, greedy(1))
    with pytest.raises(RequestError, match=message):
        e.add_request(prompt, greedy(1))
    assert not e.has_work
    e.validate(list(range(19)), greedy(1))  # the longest prompt that leaves room for one token


def test_abort_finishes_with_abort_and_frees_blocks(model: MoEForCausalLM) -> None:
    config = replace(CONFIG, max_num_seqs=1)
    e = LLMEngine(model, config)
    running = e.add_request(PROMPT, greedy(50))
    waiting = e.add_request(PROMPT, greedy(50))
    e.step()
    assert (e.num_running, e.num_waiting) == (1, 1)
    queued = e.add_request(PROMPT, greedy(50))  # still in the inbox when aborted
    for seq_id in (running, waiting, queued, 12345):  # unknown ids are ignored
        e.abort(seq_id)
    result = e.step()
    assert {o.seq_id: (o.finish_reason, o.new_token_ids, o.finished) for o in result.outputs} == {
        seq_id: (FinishReason.ABORT, [], True) for seq_id in (running, waiting, queued)
    }
    assert not e.has_work and e.block_manager.num_free_blocks == config.num_blocks
    e.abort(running)  # a finished id is ignored
    assert e.step().outputs == []


CPU = torch.device("cpu")
T = TypeVar("T")
MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_p=0.9, seed=1),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.3, top_k=5, seed=2),
    SamplingParams(temperature=0.5, seed=3),
    SamplingParams(temperature=0.0),
]


@pytest.fixture
def accelerator_way(monkeypatch: pytest.MonkeyPatch) -> Callable[[Callable[[], T]], T]:
    """Runs a call the way the sampler runs on an accelerator (no host decisions), on this CPU."""

    def run(call: Callable[[], T]) -> T:
        with monkeypatch.context() as patch:
            patch.setattr(host, "HOST_DECISIONS_ON_CPU", False)
            return call()

    return run


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_mixed_batch_gives_what_every_row_computed_would(
    dtype: torch.dtype, accelerator_way: Callable[[Callable[[], torch.Tensor]], torch.Tensor]
) -> None:
    """On a CPU greedy rows skip the temperature, filters, softmax and noise of the others, a nucleus is ranked and
    only its tokens draw; every distribution and token is the one of the accelerator's way, which computes every
    row and sorts, bit for bit."""
    generator = torch.Generator().manual_seed(0)
    params = SamplingTensors.build(MIXED, CPU)
    drawing = params.drawing
    assert drawing is not None and drawing.tolist() == [1, 3, 4]
    assert SamplingTensors.build(MIXED[1:2], CPU).drawing is None  # every row draws: no subset
    for trial in range(20):
        logits = torch.randn(len(MIXED), 512, generator=generator, dtype=dtype) * 3
        keys = noise_keys(torch.arange(len(MIXED)) + 100 * trial, torch.full((len(MIXED), 1), trial)).squeeze(-1)
        assert torch.equal(probabilities(logits, params), accelerator_way(partial(probabilities, logits, params)))
        assert torch.equal(draw(logits, params, keys), accelerator_way(partial(draw, logits, params, keys)))


def test_verify_with_greedy_rows_marked_emits_what_it_emits_without() -> None:
    generator = torch.Generator().manual_seed(1)
    num_seqs, k, vocab = 6, 3, 64
    logits = torch.randn(num_seqs * (k + 1), vocab, generator=generator)
    greedy = torch.tensor([True, False, True, False, False, True])
    temperature = torch.where(greedy, 0.0, 0.9)
    no_cut = torch.zeros(num_seqs, dtype=torch.long), torch.ones(num_seqs)
    params = SamplingTensors(temperature, *no_cut, has_filter=False, is_all_greedy=False)
    target = probabilities(logits, params.repeat([k + 1] * num_seqs)).view(num_seqs, k + 1, vocab)
    drafts = torch.randint(0, vocab, (num_seqs, k), generator=generator)
    drafts[:, 0] = target[:, 0].argmax(-1)  # some drafts agree, so acceptance is exercised
    keys = noise_keys(torch.arange(num_seqs), torch.arange(k + 1).expand(num_seqs, k + 1))
    num_drafts = torch.full((num_seqs,), k)
    assert [t.tolist() for t in verify(target, drafts, num_drafts, keys, ~greedy)] == [
        t.tolist() for t in verify(target, drafts, num_drafts, keys)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_filter_keeps_what_a_sort_of_every_row_keeps(dtype: torch.dtype) -> None:
    """Over peaked and flat rows (nuclei of 1 to 2,000 tokens, past the ranked candidates too), with and without
    top-k: the tokens a sort of every row keeps; top_p 1 keeps the whole top-k."""
    generator = torch.Generator().manual_seed(0)
    num_flat = 0
    for trial in range(200):
        rows, vocab = 12, 2048
        scaled = torch.randn(rows, vocab, generator=generator, dtype=dtype) * (0.3, 1.0, 3.0, 10.0)[trial % 4]
        top_k = torch.randint(0, 3, (rows,), generator=generator) * torch.randint(1, 400, (rows,), generator=generator)
        nucleus = torch.rand(rows, generator=generator, dtype=dtype) * 0.99 + 0.01
        top_p = torch.where(torch.rand(rows, generator=generator) < 0.3, 1.0, nucleus)
        kept = torch.isfinite(_ranked_filter(scaled, top_k, top_p))
        assert torch.equal(kept, torch.isfinite(_sorted_filter(scaled, top_k, top_p)))
        k = torch.where(top_k > 0, top_k, 2048)
        assert torch.equal(kept.sum(-1)[top_p == 1], k[top_p == 1])  # no ties among random floats
        num_flat += int((kept.sum(-1)[top_p < 1] > NUCLEUS_CANDIDATES).sum())
    assert num_flat > 20  # rows whose nucleus is past the ranked candidates, sorted whole


def test_a_race_over_a_nucleus_is_the_race_over_the_vocabulary() -> None:
    """Where most tokens have no mass, only the others draw; the winner is the one the race over every token
    picks."""
    generator = torch.Generator().manual_seed(0)
    num_sparse = 0
    for trial in range(60):
        rows, vocab = 40, 2048
        top_p = float(torch.rand(1, generator=generator)) * 0.98 + 0.01
        params = [SamplingParams(temperature=0.9, top_p=top_p, top_k=trial % 3 * 20) for _ in range(rows)]
        probs = probabilities(torch.randn(rows, vocab, generator=generator) * 3, SamplingTensors.build(params, CPU))
        keys = noise_keys(torch.arange(rows) + trial, torch.full((rows, 1), trial)).squeeze(-1)
        over_vocabulary = (probs.double() / exponentials(keys, vocab)).argmax(-1)
        assert torch.equal(sample(probs, keys), over_vocabulary)
        num_sparse += int(4 * (probs > 0).sum() <= probs.numel())
    assert num_sparse > 30  # most trials took the nucleus path
