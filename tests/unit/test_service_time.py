"""Batch slots and fixed per-request time: the estimator, the routing core that feeds it, and the policy's use of it."""

from __future__ import annotations

import pytest

from router.policy.estimated_ttft import EstimatedTTFT, EstimatedTTFTConfig, slot_wait_s, ttft_and_own_s
from router.policy.prefix_index import PrefixIndex, PrefixIndexConfig
from router.policy.routing_core import RoutingConfig, RoutingCore
from router.policy.service_time import ServiceTime, ServiceTimeEstimator
from router.policy.types import Branch, ReplicaState, RouteRequest

HOT = RouteRequest(hashes=list(range(32)), prompt_tokens=520, tokens_per_block=16.0, matched_blocks={"a": 32})
"""A short prompt whose 512-token prefix replica `a` holds: a cache hit that is cheap to recompute elsewhere."""


def fleet(**hot: object) -> list[ReplicaState]:
    replicas = [ReplicaState(rid, max_num_seqs=4, slot_s=0.5) for rid in ("a", "b", "c")]
    for name, value in hot.items():
        setattr(replicas[0], name, value)
    replicas[0].in_flight_at_scrape = replicas[0].in_flight  # its gauges were scraped with these requests there
    return replicas


def test_a_replica_at_its_batch_limit_with_a_queue_loses_a_cheap_cache_hit_to_an_idle_replica() -> None:
    replicas = fleet(in_flight=8, streaming=8, num_running=4, num_waiting=4)
    d = EstimatedTTFT(EstimatedTTFTConfig()).select(HOT, replicas, now=0.0)
    assert d.replica in ("b", "c")
    assert d.branch is Branch.SPILL_QUEUE
    # The wait it avoided: 8 ahead of 4 slots, 5 completions at 4 / 0.5 s per second.
    ttft_s, _ = ttft_and_own_s(HOT, replicas[0], replicas[0].prefill_tokens_per_s, EstimatedTTFTConfig())
    assert ttft_s >= 5 * 0.5 / 4


def test_with_a_free_batch_slot_affinity_holds() -> None:
    replicas = fleet(in_flight=3, streaming=3, num_running=3, num_waiting=0)
    d = EstimatedTTFT(EstimatedTTFTConfig()).select(HOT, replicas, now=0.0)
    assert (d.replica, d.branch) == ("a", Branch.CACHE_HIT)


def test_without_learned_service_terms_the_queue_is_invisible_and_the_hot_prefix_stays() -> None:
    replicas = fleet(in_flight=8, streaming=8, num_running=4, num_waiting=4, slot_s=None)
    d = EstimatedTTFT(EstimatedTTFTConfig()).select(HOT, replicas, now=0.0)
    assert (d.replica, d.branch) == ("a", Branch.CACHE_HIT)


def test_a_prefill_backlog_spill_is_still_a_plain_spill() -> None:
    replicas = fleet(in_flight=2, waiting=2, waiting_prompt_tokens=40_000)
    d = EstimatedTTFT(EstimatedTTFTConfig()).select(HOT, replicas, now=0.0)
    assert d.replica != "a" and d.branch is Branch.SPILL


def test_a_scrape_that_sees_a_queue_infers_a_batch_limit_that_later_running_counts_raise() -> None:
    r = ReplicaState("a")
    r.set_gauges(4, 6, None)
    assert r.max_num_seqs is None  # inferring is opt-in: a full KV cache queues requests too
    r.set_gauges(3, 0, None, infer_max_num_seqs=True)
    assert r.max_num_seqs is None
    r.set_gauges(2, 1, None, infer_max_num_seqs=True)  # a request between two steps
    r.set_gauges(4, 6, None, infer_max_num_seqs=True)
    r.set_gauges(3, 1, None, infer_max_num_seqs=True)
    assert r.max_num_seqs == 4
    r.set_gauges(9, 0, None, infer_max_num_seqs=True)  # more running than the inferred limit: it was too low
    assert r.max_num_seqs == 9
    r.set_gauges(1, 0, None, max_num_seqs=16)  # the engine's own figure wins
    assert r.batch_slots == 16.0


def test_learned_slots_are_never_fewer_than_the_engine_was_seen_running() -> None:
    # Durations that vary with output length read as queueing and teach about one slot; the engine ran 9 at once.
    r = ReplicaState("a", slot_s=2.4, learned_slots=1.1)
    r.set_gauges(9, 0, None)
    r.set_gauges(0, 0, None)  # later drained
    assert r.batch_slots == 9.0
    for _ in range(8):
        r.begin(100, now=0.0)
    assert slot_wait_s(r) == 0.0  # 8 there, 9 slots: no wait (1.1 slots would make it 17 s)


def test_the_queue_is_the_routers_own_requests_now_plus_what_the_engine_counted_beyond_them() -> None:
    r = ReplicaState("a")
    for _ in range(6):
        r.begin(100, now=0.0)
    r.set_gauges(4, 4, None)  # 8 on the engine when the router had 6 there: 2 came from elsewhere
    assert r.queue_depth == 8
    for _ in range(5):
        r.finish(100, is_waiting=True)  # drained since the scrape: the engine's 8 are stale
    assert r.queue_depth == 3
    r.set_gauges(1, 0, None)  # fewer than the router's own (one not yet arrived): nothing foreign
    assert r.queue_depth == 1
    r.begin(100, now=1.0)
    assert r.queue_depth == 2


def test_known_slots_turn_every_duration_into_a_slot_time() -> None:
    est = ServiceTimeEstimator()
    state = ServiceTime()
    # B = 4, slot_s = 0.2: a request behind n others takes max(4, n + 1) * 0.2 / 4.
    for n in (0, 2, 7, 11, 3, 15):
        state = est.observe_finish(state, duration_s=max(4, n + 1) * 0.2 / 4, num_ahead=n, known_slots=4)
    assert state.slot_s == pytest.approx(0.2)
    assert state.slots is None


def test_unknown_slots_are_learned_from_the_durations_of_requests_that_queued() -> None:
    est = ServiceTimeEstimator(learn_slots=True)
    state = est.observe_finish(ServiceTime(), duration_s=0.2, num_ahead=0, known_slots=None)
    for n in (1, 2, 9, 13, 6, 21, 0, 17):
        state = est.observe_finish(state, duration_s=max(3, n + 1) * 0.2 / 3, num_ahead=n, known_slots=None)
    assert state.slot_s == pytest.approx(0.2)
    assert state.slots == pytest.approx(3.0)


def test_nonsense_durations_teach_nothing() -> None:
    est = ServiceTimeEstimator()
    state = ServiceTime(slot_s=0.2, num_slot_observations=3)
    assert est.observe_finish(state, duration_s=0.0, num_ahead=1, known_slots=None) is state
    assert est.observe_finish(state, duration_s=float("nan"), num_ahead=1, known_slots=4) is state
    assert est.observe_finish(state, duration_s=1.0, num_ahead=-1, known_slots=4) is state


def make_core(
    *, learn_slots: bool = False, learn_fixed: bool = False, infer_max_num_seqs: bool = False
) -> tuple[RoutingCore, list[ReplicaState]]:
    config = RoutingConfig(
        service_time=ServiceTimeEstimator(learn_slots=learn_slots, learn_fixed=learn_fixed),
        infer_max_num_seqs=infer_max_num_seqs,
    )
    core = RoutingCore(config, PrefixIndex(PrefixIndexConfig()), EstimatedTTFT(EstimatedTTFTConfig()))
    states = [ReplicaState(rid) for rid in ("a", "b", "c")]
    for state in states:
        core.add_replica(state)
    return core, states


def test_a_limit_inferred_on_one_replica_prices_the_slot_wait_on_its_peers_until_they_show_their_own() -> None:
    core, (a, b, c) = make_core(infer_max_num_seqs=True)
    core.set_gauges("a", 4, 2, None)
    assert a.max_num_seqs == 4
    assert (b.batch_slots, c.batch_slots) == (4.0, 4.0)  # neither has queued yet
    core.set_gauges("b", 6, 0, None)
    assert b.batch_slots == 6.0  # it ran 6: at least that many
    late = ReplicaState("d")
    core.add_replica(late)
    assert late.batch_slots == 4.0
    core.set_gauges("c", 8, 3, None)  # c's own, and the peers' mean moves
    assert (c.batch_slots, late.batch_slots) == (8.0, 6.0)


def test_without_inferring_an_exported_limit_is_not_lent_to_replicas_that_export_none() -> None:
    core, (a, b, _) = make_core()
    core.set_gauges("a", 4, 2, None, max_num_seqs=16)  # SGLang beside vLLM replicas: its limit is its own
    core.set_gauges("b", 4, 2, None)
    assert (a.batch_slots, b.max_num_seqs, b.batch_slots) == (16.0, None, None)


def test_whole_answers_behind_a_two_slot_engine_teach_its_slots_and_then_the_hot_prefix_spills() -> None:
    core, states = make_core(learn_slots=True)
    prepared = core.prepare_hashes(list(range(32)), 520)
    first = core.choose(prepared, states, 0.0)
    assert first is not None
    hot = first.replica
    core.commit(prepared, first, 0.0)
    # Ten requests sent to the hot replica at once, none streamed; it serves 2 at a time, 0.3 s each (FIFO).
    tickets = [core.begin(first, prepared, 0.0) for _ in range(10)]
    for i, ticket in enumerate(tickets):
        done = (i // 2 + 1) * 0.3
        core.first_byte(ticket, done, is_stream=False)
        core.finish(ticket, done)
    service = core.service_time(hot)
    assert service.slot_s == pytest.approx(0.3)
    # The model spreads completions evenly (B / slot_s per second); this engine frees its slots in pairs.
    assert service.slots == pytest.approx(2.0, rel=0.1)
    # With six cache hits streaming on it, the hot replica's slot queue now costs more than a cold prefill.
    hit = core.choose(prepared, states, 4.0)
    assert hit is not None and (hit.replica, hit.branch) == (hot, Branch.CACHE_HIT)
    for _ in range(6):
        core.first_byte(core.begin(hit, prepared, 4.0), 4.01, is_stream=True)
    d = core.choose(prepared, states, 4.0)
    assert d is not None and d.replica != hot and d.branch is Branch.SPILL_QUEUE


def test_short_streams_teach_the_fixed_time_and_the_prefill_rate_is_learned_net_of_it() -> None:
    core, states = make_core(learn_fixed=True)
    rid = states[0].id
    decision = core.choose(core.prepare_hashes([], 16), [states[0]], 0.0)
    assert decision is not None
    t = 0.0
    for _ in range(4):  # 16-token prompts, alone on the replica: 0.1 s fixed + 16 / 10k s prefill
        ticket = core.begin(decision, core.prepare_hashes([], 16), t)
        core.first_byte(ticket, t + 0.1 + 16 / 10_000, is_stream=True)
        core.finish(ticket, t + 0.2)
        t += 1.0
    assert core.service_time(rid).fixed_s == pytest.approx(0.1, rel=0.02)
    # Replicas never observed take the fleet's mean, so the one that learned a fixed cost does not look slower.
    assert states[1].fixed_s == states[2].fixed_s == pytest.approx(0.1, rel=0.02)
    long = core.prepare_hashes([], 4000)
    ticket = core.begin(decision, long, t)
    core.first_byte(ticket, t + 0.1 + 4000 / 20_000, is_stream=True)
    assert core.prefill_rate(rid).tokens_per_s == pytest.approx(20_000, rel=0.02)
    assert states[0].fixed_s == pytest.approx(0.1, rel=0.02)


LONG = RouteRequest(hashes=list(range(1_700)), prompt_tokens=27_500, tokens_per_block=16.0, matched_blocks={"a": 1_700})
"""An agent step whose 27,200-token context replica `a` holds: 2.7 s to recompute at 10k tokens/s."""


def unexported_limit_fleet(hot_in_flight: int) -> list[ReplicaState]:
    """Engines that export no batch limit (vLLM), each sequence holding its slot for a minute; `a` has
    `hot_in_flight` requests, the others 100."""
    replicas = [
        ReplicaState(rid, prefill_tokens_per_s=10_000.0, slot_s=60.0, in_flight=100, streaming=100)
        for rid in ("a", "b", "c")
    ]
    replicas[0].in_flight = replicas[0].streaming = hot_in_flight
    return replicas


def test_past_the_assumed_limit_a_long_cached_context_waits_for_a_slot_that_turns_over_fast() -> None:
    # 257 in flight on 256 assumed slots: 2 completions, at 256 / 60 s per second, 0.47 s; a recompute is 2.7 s.
    replicas = unexported_limit_fleet(257)
    d = EstimatedTTFT(EstimatedTTFTConfig()).select(LONG, replicas, now=0.0)
    assert (d.replica, d.branch) == ("a", Branch.CACHE_HIT)
    assert d.predicted_ttft_s is not None and d.predicted_ttft_s >= 2 * 60.0 / 256
    # A hard cap at the limit, as before `assumed_batch_slots`, sends it to recompute elsewhere.
    capped = EstimatedTTFTConfig(assumed_batch_slots=None, max_queue_per_replica=256)
    assert EstimatedTTFT(capped).select(LONG, replicas, now=0.0).replica != "a"


def test_past_the_assumed_limit_a_long_slot_queue_spills_and_says_so() -> None:
    # 300 in flight: 45 completions, 10.5 s, more than recomputing 27k tokens on a replica with free slots.
    d = EstimatedTTFT(EstimatedTTFTConfig()).select(LONG, unexported_limit_fleet(300), now=0.0)
    assert d.replica != "a" and d.branch is Branch.SPILL_QUEUE
