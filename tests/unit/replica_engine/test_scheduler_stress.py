"""Many concurrent requests in a small cache: preemption, chunked prefill, prefix sharing, arrivals and aborts
between steps, all driven by one seeded random generator.

Afterwards every request has finished exactly once, the cache is empty, the KV events describe the cache, and
every greedy or seeded request produced what it produces alone in a roomy engine: preemption and recomputation,
prefix hits and batch companions must not change a request's output.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from replica.engine.engine import EngineConfig, LLMEngine, StepResult
from replica.engine.sampling import SamplingParams
from replica.engine.sequence import FinishReason
from replica.model.model import MoEForCausalLM
from router.policy.kv_events import AllCleared, BlockRemoved, BlockStored
from tests.unit.replica_engine.conftest import Run, drive, greedy

NUM_REQUESTS = 60
EOS = 0
SMALL = EngineConfig(num_blocks=24, block_size=4, max_num_batched_tokens=24, max_num_seqs=12)
"""96 token slots for up to 12 sequences of up to 46 tokens: decoding sequences run out of blocks."""


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    params: SamplingParams

    @property
    def is_reproducible(self) -> bool:
        return self.params.is_greedy or self.params.seed is not None


def make_requests(rng: random.Random) -> list[Request]:
    prefixes = [[rng.randrange(1, 128) for _ in range(n)] for n in (12, 17, 9)]
    requests = []
    for _ in range(NUM_REQUESTS):
        if rng.random() < 0.5:
            prompt = rng.choice(prefixes) + [rng.randrange(1, 128) for _ in range(rng.randint(1, 10))]
        else:
            prompt = [rng.randrange(1, 128) for _ in range(rng.randint(2, 30))]
        max_tokens = rng.randint(1, 16)
        kind = rng.random()
        if kind < 0.7:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=rng.random() < 0.5)
        elif kind < 0.85:
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0, top_k=20, seed=rng.randrange(2**32))
        else:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.8)
        requests.append(Request(prompt, params))
    return requests


def run_alone(model: MoEForCausalLM, request: Request) -> list[int]:
    e = LLMEngine(model, EngineConfig(num_blocks=16, block_size=4, enable_prefix_caching=False), eos_token_ids=[EOS])
    seq_id = e.add_request(request.prompt, request.params)
    return drive(e).tokens[seq_id]


@pytest.mark.parametrize("seed", [0, 1])
def test_stress_preemption_aborts_and_prefix_sharing(model: MoEForCausalLM, seed: int) -> None:
    rng = random.Random(seed)
    requests = make_requests(rng)
    engine = LLMEngine(model, SMALL, eos_token_ids=[EOS])
    bm = engine.block_manager
    ids: dict[int, Request] = {}
    pending = list(requests)
    aborted: set[int] = set()
    preempted: set[int] = set()
    cached: set[int] = set()  # the hashes a KV-event subscriber knows
    run = Run()

    def add(n: int) -> None:
        for request in pending[:n]:
            ids[engine.add_request(request.prompt, request.params)] = request
        del pending[:n]

    def between_steps(e: LLMEngine, result: StepResult) -> None:
        for event in result.events:
            if isinstance(event, AllCleared):
                cached.clear()
            elif isinstance(event, BlockRemoved):
                cached.difference_update(event.block_hashes)
            else:
                assert isinstance(event, BlockStored)
                assert event.parent_hash is None or event.parent_hash in cached
                cached.update(event.block_hashes)
        assert cached == set(bm.hash_to_block)
        if result.num_preempted:
            preempted.update(s.seq_id for s in e.scheduler.waiting if s.num_preemptions)
        live = [i for i in ids if i not in run.finals and i not in aborted]
        if live and rng.random() < 0.12:
            victim = rng.choice(live)
            aborted.add(victim)
            e.abort(victim)
        if run.finals and rng.random() < 0.05:
            e.abort(rng.choice(list(run.finals)))  # already finished: ignored
        if pending and (rng.random() < 0.5 or not e.has_work):
            add(rng.randint(1, 3))

    add(25)
    drive(engine, max_steps=1500, between_steps=between_steps, run=run)

    assert not pending and len(ids) == NUM_REQUESTS
    assert set(run.finals) == set(ids), "a request never finished"
    for seq_id, final in run.finals.items():
        assert (final.finish_reason is FinishReason.ABORT) == (seq_id in aborted), seq_id
        assert final.num_output_tokens == len(run.tokens[seq_id])
        assert final.num_output_tokens <= ids[seq_id].params.max_tokens
    # The run exercised what it claims to.
    assert engine.num_preemptions > 0
    assert any(o.num_cached_tokens > 0 for o in run.finals.values()), "no prefix hit"
    assert 5 <= len(aborted) < NUM_REQUESTS // 2
    # The cache is empty and consistent.
    assert not engine.has_work and engine.num_running == engine.num_waiting == 0
    assert bm.num_free_blocks == SMALL.num_blocks and not any(bm.ref_counts)
    engine.check_invariants()
    snapshot: set[int] = set()
    for event in bm.snapshot_events():
        if isinstance(event, BlockStored):
            snapshot.update(event.block_hashes)
    assert snapshot == cached == set(bm.hash_to_block)

    # Greedy and seeded requests produce what they produce alone; aborted ones a prefix of it.
    checked_preempted = 0
    for seq_id, request in ids.items():
        if not request.is_reproducible:
            continue
        alone = run_alone(model, request)
        got = run.tokens[seq_id]
        if seq_id in aborted:
            assert got == alone[: len(got)], seq_id
        else:
            assert got == alone, seq_id
            checked_preempted += seq_id in preempted
    assert checked_preempted > 0, "no preempted request ran to completion"


def test_no_preemption_when_every_token_fits(model: MoEForCausalLM) -> None:
    """3 blocks of 4 hold both requests to the end: 7 + 2 - 1 tokens computed (2 blocks) and 3 + 2 - 1 (1 block)."""
    engine = LLMEngine(model, EngineConfig(num_blocks=3, block_size=4, max_num_batched_tokens=64, max_num_seqs=4))
    a = engine.add_request(list(range(1, 8)), greedy(2))
    b = engine.add_request(list(range(10, 13)), greedy(2))
    run = drive(engine)
    assert {run.finals[a].finish_reason, run.finals[b].finish_reason} == {FinishReason.LENGTH}
    assert engine.num_preemptions == 0
