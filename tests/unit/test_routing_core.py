"""The routing core on its own: decisions, records and the load bookkeeping that both drivers rely on."""

from __future__ import annotations

import pytest

from router.policy.estimated_ttft import EstimatedTTFT, EstimatedTTFTConfig
from router.policy.hashing import hash_tokens, namespace_seed
from router.policy.prefill_rate import PrefillRateEstimator
from router.policy.prefix_index import PrefixIndex, PrefixIndexConfig
from router.policy.round_robin import RoundRobin, RoundRobinConfig
from router.policy.routing_core import RoutingConfig, RoutingCore
from router.policy.routing_text import RoutingKey
from router.policy.types import Branch, ReplicaState

MODEL = "m"


def make_core(**config: object) -> tuple[RoutingCore, list[ReplicaState]]:
    core = RoutingCore(RoutingConfig(**config), PrefixIndex(PrefixIndexConfig()), EstimatedTTFT(EstimatedTTFTConfig()))  # type: ignore[arg-type]
    states = [ReplicaState(rid) for rid in ("a", "b", "c")]
    for state in states:
        core.add_replica(state)
    return core, states


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_a_routed_prompt_is_recorded_and_the_next_one_follows_it() -> None:
    core, states = make_core()
    first = core.prepare(RoutingKey(token_ids=tokens(1024)), MODEL)
    decision = core.choose(first, states, 0.0)
    assert decision is not None and decision.branch is Branch.CACHE_MISS
    ticket = core.begin(decision, first, 0.0)
    core.commit(first, decision, 0.0)
    assert first.hashes == hash_tokens(tokens(1024), namespace_seed(MODEL), 16)
    core.first_byte(ticket, 0.1, is_stream=True)
    core.finish(ticket)
    again = core.prepare(RoutingKey(token_ids=tokens(1100)), MODEL)
    follow = core.choose(again, states, 1.0)
    assert follow is not None and (follow.replica, follow.branch) == (decision.replica, Branch.CACHE_HIT)
    assert follow.predicted_cached_tokens == 1024


def test_a_prompt_is_recorded_up_to_the_engines_last_whole_block() -> None:
    core, states = make_core()
    prompt = core.prepare(RoutingKey(token_ids=tokens(300)), MODEL)  # 18 router blocks: 2 whole 128-token blocks
    decision = core.choose(prompt, states, 0.0)
    assert decision is not None
    core.commit(prompt, decision, 0.0, engine_block_size=128)
    hashes = hash_tokens(tokens(300), namespace_seed(MODEL), 16)
    assert core.index.match(hashes, now=1.0) == {decision.replica: 16}  # vLLM caches only whole blocks
    assert core.cacheable(prompt, None) == hashes and core.cacheable(prompt, 16) == hashes
    assert core.cacheable(prompt, 24) == hashes  # not a multiple of the router's block: nothing to align to


def test_only_a_stream_teaches_the_prefill_rate_and_its_first_observation_seeds_the_others() -> None:
    core, states = make_core()
    prior = PrefillRateEstimator().prior_tokens_per_s
    prepared = core.prepare_hashes(list(range(64)), 1024)
    decision = core.choose(prepared, states, 0.0)
    assert decision is not None
    whole = core.begin(decision, prepared, 0.0)
    assert core.state(decision.replica).waiting_prompt_tokens == 1024
    core.first_byte(whole, 1.0, is_stream=False)  # a whole answer: its first byte came after the decode
    assert whole.ttfb_s == 1.0 and core.prefill_rate(decision.replica).num_observations == 0
    assert core.state(decision.replica).prefill_tokens_per_s == prior
    core.finish(whole)
    stream = core.begin(decision, prepared, 2.0)
    core.first_byte(stream, 2.0 + 1024 / 40_000, is_stream=True)
    learned = core.prefill_rate(decision.replica)
    assert learned.num_observations == 1 and learned.tokens_per_s == pytest.approx(40_000)
    for state in states:  # the unobserved replicas start from the fleet's observed mean, not the prior
        assert state.prefill_tokens_per_s == pytest.approx(40_000)
        if state.id != decision.replica:
            assert core.prefill_rate(state.id).num_observations == 0
    core.finish(stream)
    core.finish(stream)  # a second finish changes nothing
    assert [(s.in_flight, s.waiting, s.streaming, s.waiting_prompt_tokens) for s in states] == [(0, 0, 0, 0)] * 3


def test_the_in_flight_limit_holds_first_attempts_only() -> None:
    core, states = make_core(max_in_flight_per_replica=1)
    prepared = core.prepare_hashes([1, 2], 32)
    for _ in range(3):
        decision = core.choose(prepared, states, 0.0)
        assert decision is not None
        core.begin(decision, prepared, 0.0)
    assert core.free_slots(states) == 0
    assert core.choose(prepared, states, 0.0) is None
    assert core.choose(prepared, states, 0.0, within_limit=False) is not None


def test_records_follow_the_replicas_kv_events() -> None:
    hashes = list(range(100, 140))
    for records_predictions, expected in ((True, {"a": 40}), (False, {})):
        core, states = make_core(records_predictions=records_predictions)
        prepared = core.prepare_hashes(hashes, 640)
        decision = core.choose(prepared, states[:1], 0.0)
        assert decision is not None and decision.branch is Branch.ONLY_REPLICA
        core.commit(prepared, decision, 0.0, has_live_kv_events=True)
        assert core.index.match(hashes, now=0.1) == expected
        assert core.index.match(hashes, now=60.0) == {}  # a prediction is short-lived
    # A text prompt is hashed over bytes no engine event names: approximate, whatever the events.
    core, states = make_core()
    text = core.prepare(RoutingKey(text=b"x" * 640), MODEL)
    decision = core.choose(text, states[:1], 0.0)
    assert decision is not None
    core.commit(text, decision, 0.0, has_live_kv_events=True)
    assert core.index.match(text.hashes, now=60.0) == {"a": 10}


def test_sessions_pin_and_the_index_can_be_left_out() -> None:
    core = RoutingCore(RoutingConfig(use_index=False), PrefixIndex(PrefixIndexConfig()), RoundRobin(RoundRobinConfig()))
    states = [ReplicaState(rid) for rid in ("a", "b")]
    for state in states:
        core.add_replica(state)
    pinned = core.choose(core.prepare_hashes([1], 16, "s"), states, 0.0)
    again = core.choose(core.prepare_hashes([1], 16, "s"), states, 1.0)
    other = core.choose(core.prepare_hashes([1], 16), states, 2.0)
    assert pinned is not None and again is not None and other is not None
    assert (again.replica, again.branch) == (pinned.replica, Branch.SESSION)
    prepared = core.prepare_hashes([1], 16)
    assert other.branch is Branch.ROUND_ROBIN
    decision = core.choose(prepared, states, 3.0)
    assert decision is not None
    core.commit(prepared, decision, 3.0)
    assert core.index.stats().num_blocks == 0


def test_a_replica_that_left_learns_nothing_and_a_crash_keeps_the_rate() -> None:
    core, states = make_core()
    prepared = core.prepare_hashes(list(range(64)), 1024)
    decision = core.choose(prepared, states, 0.0)
    assert decision is not None
    ticket = core.begin(decision, prepared, 0.0)
    core.commit(prepared, decision, 0.0)
    core.drop_cache(decision.replica)
    assert core.index.match(prepared.hashes, now=0.0) == {}
    core.first_byte(ticket, 0.05, is_stream=True)
    assert core.prefill_rate(decision.replica).num_observations == 1  # the crash kept the replica's rate
    later = core.choose(prepared, states, 1.0)
    assert later is not None
    ticket = core.begin(later, prepared, 1.0)
    core.remove_replica(later.replica)
    core.first_byte(ticket, 1.05, is_stream=True)  # its own state still balances; no rate is kept for it
    core.finish(ticket)
    assert (ticket.state.in_flight, ticket.state.streaming) == (0, 0)
    with pytest.raises(KeyError):
        core.prefill_rate(ticket.replica_id)


def test_prepared_hashes_stop_at_max_blocks_and_bad_configs_are_refused() -> None:
    core, _ = make_core(max_blocks=8)
    prepared = core.prepare_hashes(list(range(20)), 320)
    assert prepared.hashes == list(range(8)) and prepared.num_blocks == 8
    for bad in ({"max_blocks": 0}, {"token_block_size": 0}, {"bytes_per_token": 0.0}, {"memo_entries": -1}):
        with pytest.raises(ValueError, match="RoutingConfig"):
            RoutingConfig(**bad)  # type: ignore[arg-type]


def test_an_engines_cache_size_bounds_its_guesses_at_the_smallest_block() -> None:
    core, states = make_core(text_block_size=64, token_block_size=32)  # text blocks are 16 tokens at 4 bytes a token
    core.set_kv_capacity("a", 16 * 100)
    assert states[0].kv_capacity_blocks == 100
    core.record_peer("a", tokens(300), 0.0, predicted=False)
    assert core.index.stats().blocks_per_replica["a"] <= 100
    core.set_kv_capacity("gone", 1000)  # a replica that left: ignored
