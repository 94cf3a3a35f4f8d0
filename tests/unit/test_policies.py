"""Routing policies: the chosen replica and the branch in situations where the answer matters."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from router.policy.config import (
    POLICY_NAMES,
    ConsistentHashConfig,
    DynamoKVConfig,
    EstimatedTTFTConfig,
    LeastLoadConfig,
    LLMDWeightedConfig,
    PolicyConfig,
    PowerOfTwoConfig,
    RandomConfig,
    RoundRobinConfig,
    SGLangCacheAwareConfig,
    build_policy,
    parse_policy_config,
)
from router.policy.consistent_hash import ConsistentHash
from router.policy.dynamo_kv import DynamoKV
from router.policy.estimated_ttft import EstimatedTTFT, pooled_rates, ttft_and_own_s
from router.policy.least_load import LeastLoad
from router.policy.llmd_weighted import LLMDWeighted
from router.policy.power_of_two import PowerOfTwo
from router.policy.random_choice import RandomChoice
from router.policy.round_robin import RoundRobin
from router.policy.sglang_cache_aware import SGLangCacheAware
from router.policy.types import Branch, Decision, Policy, ReplicaState, RouteRequest


def request(
    prompt_tokens: int = 4096,
    matched: Mapping[str, int] | None = None,
    *,
    tokens_per_block: float = 16.0,
    first_hash: int = 1,
    session_key: str | None = None,
) -> RouteRequest:
    num_blocks = int(prompt_tokens // tokens_per_block)
    return RouteRequest(
        hashes=[first_hash + i for i in range(num_blocks)],
        prompt_tokens=prompt_tokens,
        tokens_per_block=tokens_per_block,
        matched_blocks=dict(matched or {}),
        session_key=session_key,
    )


def fleet(*ids: str, **fields: object) -> list[ReplicaState]:
    return [ReplicaState(id=i, **fields) for i in ids]  # type: ignore[arg-type]


def by_id(replicas: Sequence[ReplicaState]) -> dict[str, ReplicaState]:
    return {r.id: r for r in replicas}


def route(policy: Policy, req: RouteRequest, replicas: Sequence[ReplicaState], now: float = 0.0) -> Decision:
    return policy.select(req, replicas, now=now)


def record(replicas: Sequence[ReplicaState], chosen: str, now: float) -> None:
    """What a driver does after a decision: the request is in flight, waiting for its first byte."""
    by_id(replicas)[chosen].begin(0, now)


# estimated_ttft ------------------------------------------------------------------------------------------------


def ttft(**overrides: object) -> EstimatedTTFT:
    return EstimatedTTFT(EstimatedTTFTConfig(**overrides))  # type: ignore[arg-type]


def test_estimated_ttft_picks_the_cached_replica_when_load_is_equal() -> None:
    replicas = fleet("a", "b", "c")
    by_id(replicas)["b"].last_selected = 5.0  # the most recently used: a tie break would avoid it
    d = route(ttft(), request(4096, {"b": 200}), replicas, now=6.0)
    assert (d.replica, d.branch) == ("b", Branch.CACHE_HIT)
    assert d.matched_blocks == 200
    assert d.predicted_cached_tokens == 3200
    # 896 uncached tokens at the prior rate, plus their causal attention over the 3,200 cached and each other.
    assert d.predicted_ttft_s == pytest.approx(896 / 10_000 + 2.1e-9 * 896 * (3200 + 896 / 2))


def test_estimated_ttft_spills_when_the_cached_replica_has_a_big_prefill_backlog() -> None:
    replicas = fleet("a", "b", "c")
    busy = by_id(replicas)["b"]
    busy.in_flight = busy.waiting = 10
    busy.waiting_prompt_tokens = 50_000
    d = route(ttft(), request(4096, {"b": 200}), replicas)
    assert d.replica in {"a", "c"}
    assert d.branch is Branch.SPILL
    assert d.matched_blocks == 0


def test_estimated_ttft_spreads_cache_misses_over_idle_replicas() -> None:
    replicas = fleet("a", "b", "c", "d")
    policy = ttft()
    chosen = []
    for step in range(4):
        d = route(policy, request(2048, first_hash=100 * step), replicas, now=float(step))
        assert d.branch is Branch.CACHE_MISS
        record(replicas, d.replica, now=float(step))
        chosen.append(d.replica)
    assert sorted(chosen) == ["a", "b", "c", "d"]


def test_estimated_ttft_spreads_cache_misses_despite_prefill_rate_noise() -> None:
    replicas = [
        ReplicaState(id=i, prefill_tokens_per_s=rate)
        for i, rate in (("a", 10_000.0), ("b", 9_900.0), ("c", 10_150.0), ("d", 9_950.0))
    ]
    policy = ttft()
    chosen = []
    for step in range(4):
        d = route(policy, request(2048, first_hash=100 * step), replicas, now=float(step))
        record(replicas, d.replica, now=float(step))
        chosen.append(d.replica)
    assert sorted(chosen) == ["a", "b", "c", "d"]


def test_estimated_ttft_hard_cap_skips_a_full_replica() -> None:
    replicas = fleet("a", "b")
    by_id(replicas)["b"].in_flight = 8
    d = route(ttft(max_queue_per_replica=8), request(4096, {"b": 250}), replicas)
    assert (d.replica, d.branch) == ("a", Branch.SPILL)


def test_estimated_ttft_hard_cap_counts_the_engine_queue() -> None:
    replicas = fleet("a", "b")
    full = by_id(replicas)["b"]
    full.num_running, full.num_waiting = 6, 2
    d = route(ttft(max_queue_per_replica=8), request(4096, {"b": 250}), replicas)
    assert (d.replica, d.branch) == ("a", Branch.SPILL)


def test_estimated_ttft_all_over_the_cap_is_overloaded_and_takes_the_best_estimate() -> None:
    replicas = fleet("a", "b", "c", in_flight=9)
    d = route(ttft(max_queue_per_replica=8), request(4096, {"c": 200}), replicas)
    assert (d.replica, d.branch) == ("c", Branch.OVERLOADED)


def test_estimated_ttft_prefers_the_faster_replica_for_a_long_uncached_prompt() -> None:
    replicas = [
        ReplicaState(id="slow", prefill_tokens_per_s=5_000.0),
        ReplicaState(id="fast", prefill_tokens_per_s=20_000.0),
    ]
    d = route(ttft(), request(8192), replicas)
    assert (d.replica, d.branch) == ("fast", Branch.CACHE_MISS)
    # Even 1,024 cached tokens do not make the slow replica worth it for 8k tokens.
    d = route(ttft(), request(8192, {"slow": 64}), replicas)
    assert (d.replica, d.branch) == ("fast", Branch.SPILL)


def test_estimated_ttft_avoids_decode_load_and_kv_pressure() -> None:
    replicas = fleet("a", "b")
    by_id(replicas)["a"].streaming = 100
    assert route(ttft(), request(1024), replicas).replica == "b"

    replicas = fleet("a", "b")
    by_id(replicas)["a"].num_running = 100  # another router's load, seen through the scrape
    assert route(ttft(), request(1024), replicas).replica == "b"

    replicas = fleet("a", "b")
    by_id(replicas)["a"].kv_usage = 0.99
    by_id(replicas)["b"].kv_usage = 0.5
    assert route(ttft(), request(1024), replicas).replica == "b"


def test_estimated_ttft_kv_pressure_below_the_threshold_does_not_override_a_cache_hit() -> None:
    replicas = fleet("a", "b")
    by_id(replicas)["a"].kv_usage = 0.75
    by_id(replicas)["b"].kv_usage = 0.1
    d = route(ttft(), request(4096, {"a": 128}), replicas)
    assert (d.replica, d.branch) == ("a", Branch.CACHE_HIT)


def test_estimated_ttft_single_replica() -> None:
    d = route(ttft(), request(1000), fleet("only", in_flight=500))
    assert (d.replica, d.branch) == ("only", Branch.ONLY_REPLICA)
    assert d.predicted_ttft_s == pytest.approx(0.1 + 2.1e-9 * 1000 * 500)


def holder_and_idle(backlog_tokens: int, backlog_requests: int) -> list[ReplicaState]:
    """`a` holds 15,360 tokens of a 16,384-token prompt behind a prefill backlog; `b` is idle and holds none."""
    replicas = fleet("a", "b")
    holder = by_id(replicas)["a"]
    holder.in_flight = holder.waiting = backlog_requests
    holder.waiting_prompt_tokens = backlog_tokens
    return replicas


def test_estimated_ttft_fleet_cost_keeps_a_prefix_behind_a_moderate_queue() -> None:
    # At 10k tokens/s: `a` costs 3.0 s of backlog + 0.3 s of its attention + 0.14 s of own prefill = 3.45 s;
    # `b`, busy decoding one stream, answers sooner (1.92 s) but recomputes 15,360 tokens the fleet already holds:
    # 1.78 s, x 1.5 = 2.68 s.
    replicas = holder_and_idle(30_000, 3)
    other = by_id(replicas)["b"]
    other.in_flight = other.streaming = 1
    d = route(ttft(), request(16_384, {"a": 960}), replicas)
    assert (d.replica, d.branch) == ("a", Branch.CACHE_HIT)
    assert d.predicted_ttft_s == pytest.approx(3.45, abs=0.01)  # the TTFT, not the cost
    # The greedy per-request estimate (no fleet cost) spills to the other replica.
    d = route(ttft(fleet_cost_weight=0.0), request(16_384, {"a": 960}), replicas)
    assert (d.replica, d.branch) == ("b", Branch.SPILL)


def test_estimated_ttft_charges_no_fleet_cost_on_an_idle_replica() -> None:
    # As above with `b` idle: no request there waits behind the recomputation, so the request takes the sooner
    # first token (1.92 s against 3.45 s) and the prefix gets a second copy; charged, it would stay on `a`.
    replicas = holder_and_idle(30_000, 3)
    d = route(ttft(), request(16_384, {"a": 960}), replicas)
    assert (d.replica, d.branch) == ("b", Branch.SPILL)
    assert d.predicted_ttft_s == pytest.approx(1.92, abs=0.01)
    d = route(ttft(charges_idle_replicas=True), request(16_384, {"a": 960}), replicas)
    assert (d.replica, d.branch) == ("a", Branch.CACHE_HIT)


def test_estimated_ttft_fleet_cost_does_not_hold_a_prefix_behind_a_long_queue() -> None:
    # Twice the backlog: 6.0 + 0.63 + 0.14 = 6.77 s on `a`, against 1.92 + 2.68 = 4.60 s on `b`.
    replicas = holder_and_idle(60_000, 6)
    d = route(ttft(), request(16_384, {"a": 960}), replicas)
    assert (d.replica, d.branch) == ("b", Branch.SPILL)
    assert d.predicted_ttft_s == pytest.approx(1.92, abs=0.01)


def test_estimated_ttft_pools_the_learned_rates_of_like_replicas() -> None:
    # Rates 7,000 and 9,500 tokens/s (CV 0.15, within `rate_noise_cv`) are noise: both count as 8,250, and the
    # smaller backlog wins. Taken at face value, `b`'s higher rate would hide its 2,000 more tokens of backlog.
    replicas = [
        ReplicaState(id="a", prefill_tokens_per_s=7_000.0, waiting=1, in_flight=1, waiting_prompt_tokens=2_000),
        ReplicaState(id="b", prefill_tokens_per_s=9_500.0, waiting=1, in_flight=1, waiting_prompt_tokens=4_000),
    ]
    assert route(ttft(), request(32_768), replicas).replica == "a"
    assert route(ttft(rate_noise_cv=0.0), request(32_768), replicas).replica == "b"
    cv = EstimatedTTFTConfig().rate_noise_cv
    assert pooled_rates(replicas, cv) == pytest.approx([8_250.0, 8_250.0])
    # Rates four times apart are a real difference and mostly kept (83% of each deviation).
    slow_fast = [ReplicaState(id=i, prefill_tokens_per_s=rate) for i, rate in (("s", 5_000.0), ("f", 20_000.0))]
    assert pooled_rates(slow_fast, cv) == pytest.approx([6_302.0, 18_698.0], rel=1e-3)


def test_estimated_ttft_decode_cost_grows_with_the_steps_a_prompt_waits() -> None:
    # `a` runs 400 decoding sequences, `b` none but 0.4 s of prefill backlog. Each decode lengthens every step the
    # new prompt waits, so they cost a long prompt more than a short one.
    replicas = fleet("a", "b")
    by_id(replicas)["a"].streaming = 400
    by_id(replicas)["b"].waiting_prompt_tokens = 4_000
    by_id(replicas)["b"].waiting = by_id(replicas)["b"].in_flight = 1
    # 400 decodes x 0.55 ms x (1 + 1,024 / 8,192) steps = 0.25 s < 0.4 s of backlog: the short prompt goes to `a`.
    assert route(ttft(), request(1_024), replicas).replica == "a"
    # A 64k-token prompt waits 9 steps: 400 x 0.55 ms x 9 = 2.0 s > 0.4 s (+ 2 steps' decodes): it goes to `b`.
    assert route(ttft(), request(65_536), replicas).replica == "b"


def test_estimated_ttft_identical_idle_replicas_tie_and_take_turns() -> None:
    # Equal costs even without a tie margin: the least recently chosen wins, so 64 misses go to 64 replicas.
    policy = ttft(tie_epsilon_s=0.0)
    replicas = fleet(*(f"r{i:02d}" for i in range(64)))
    chosen = []
    for step in range(64):
        d = route(policy, request(8_192, first_hash=100 * step), replicas, now=float(step))
        by_id(replicas)[d.replica].last_selected = float(step)
        chosen.append(d.replica)
    assert sorted(chosen) == sorted(r.id for r in replicas)


def test_estimated_ttft_sees_a_field_written_directly_at_the_next_decision() -> None:
    policy = ttft()
    replicas = fleet("a", "b")
    assert route(policy, request(4_000), replicas).replica == "a"
    replicas[0].waiting_prompt_tokens = 200_000  # 20 s of backlog, written without any method
    replicas[0].waiting = replicas[0].in_flight = 1
    assert route(policy, request(4_000), replicas).replica == "b"
    replicas[1] = ReplicaState(id="b", waiting_prompt_tokens=400_000, waiting=1, in_flight=1)  # another object
    assert route(policy, request(4_000), replicas).replica == "a"


def test_estimated_ttft_a_cost_at_the_edge_of_the_tie_margin_is_tied() -> None:
    # `a` costs more by its backlog and wins a tie (nothing in flight); `b` streams one request. Both match
    # nothing at the same rate, so no fleet cost separates them: each cost is its ttft.
    replicas = [ReplicaState(id="a", waiting_prompt_tokens=1_000), ReplicaState(id="b", in_flight=1, streaming=1)]
    req = request(4_096)
    config = EstimatedTTFTConfig()
    costs = [ttft_and_own_s(req, r, r.prefill_tokens_per_s, config)[0] for r in replicas]
    # Margins that end at `a`'s cost and one float short of it (differences of costs within a factor of two are
    # exact, and so are the sums back).
    gap = costs[0] - costs[1]
    assert 0.05 < gap < 0.2
    assert route(ttft(tie_epsilon_s=gap), req, replicas).replica == "a"
    short_gap = math.nextafter(costs[0], 0.0) - costs[1]
    assert route(ttft(tie_epsilon_s=short_gap), req, replicas).replica == "b"


# round_robin, random, least_load, power_of_two ------------------------------------------------------------------


def test_round_robin_is_fair_and_cyclic() -> None:
    policy = RoundRobin(RoundRobinConfig())
    replicas = fleet("c", "a", "b")
    chosen = [route(policy, request(), replicas).replica for _ in range(30)]
    assert chosen[:6] == ["a", "b", "c", "a", "b", "c"]
    assert Counter(chosen) == {"a": 10, "b": 10, "c": 10}
    assert route(policy, request(), replicas).branch is Branch.ROUND_ROBIN


def test_round_robin_keeps_its_place_when_the_set_changes() -> None:
    policy = RoundRobin(RoundRobinConfig())
    assert [route(policy, request(), fleet("r1", "r2", "r3")).replica for _ in range(2)] == ["r1", "r2"]
    # r3 leaves and r4 joins: the rotation continues after r2 instead of restarting at r1.
    assert [route(policy, request(), fleet("r1", "r2", "r4")).replica for _ in range(3)] == ["r4", "r1", "r2"]
    # The last chosen replica leaves: the next one in id order takes over.
    assert route(policy, request(), fleet("r1", "r4")).replica == "r4"


def test_random_is_seeded_and_uniform() -> None:
    replicas = fleet("a", "b", "c", "d")
    one, two = RandomChoice(RandomConfig(), seed=7), RandomChoice(RandomConfig(), seed=7)
    seq_one = [route(one, request(), replicas).replica for _ in range(400)]
    seq_two = [route(two, request(), replicas).replica for _ in range(400)]
    assert seq_one == seq_two
    other = RandomChoice(RandomConfig(), seed=8)
    assert [route(other, request(), replicas).replica for _ in range(400)] != seq_one
    counts = Counter(seq_one)
    assert set(counts) == {"a", "b", "c", "d"}
    assert all(60 <= n <= 140 for n in counts.values())
    assert route(one, request(), replicas).branch is Branch.RANDOM


def test_least_load_takes_the_shortest_queue_and_rotates_ties() -> None:
    policy = LeastLoad(LeastLoadConfig())
    replicas = fleet("a", "b", "c")
    by_id(replicas)["a"].in_flight = 3
    by_id(replicas)["b"].num_waiting = 2  # seen through the scrape only
    d = route(policy, request(), replicas)
    assert (d.replica, d.branch) == ("c", Branch.LEAST_LOAD)

    idle = fleet("a", "b", "c")
    assert [route(policy, request(), idle).replica for _ in range(4)] == ["a", "b", "c", "a"]


def test_power_of_two_with_two_replicas_always_takes_the_less_loaded() -> None:
    replicas = fleet("a", "b")
    by_id(replicas)["a"].in_flight = 5
    by_id(replicas)["b"].in_flight = 3
    for seed in range(50):
        d = route(PowerOfTwo(PowerOfTwoConfig(), seed=seed), request(), replicas)
        assert (d.replica, d.branch) == ("b", Branch.POWER_OF_TWO)


def test_power_of_two_never_takes_the_most_loaded_and_favours_light_replicas() -> None:
    replicas = [ReplicaState(id=f"r{load}", in_flight=load) for load in range(8)]
    policy = PowerOfTwo(PowerOfTwoConfig(), seed=3)
    counts = Counter(route(policy, request(), replicas).replica for _ in range(2000))
    assert "r7" not in counts  # worse than any partner it could be paired with
    assert counts["r0"] > counts["r3"] > counts["r6"]
    again = PowerOfTwo(PowerOfTwoConfig(), seed=3)
    assert Counter(route(again, request(), replicas).replica for _ in range(2000)) == counts


# consistent_hash --------------------------------------------------------------------------------------------------


def ring_assignments(policy: ConsistentHash, replicas: Sequence[ReplicaState], keys: Sequence[str]) -> dict[str, str]:
    return {k: route(policy, request(session_key=k), replicas).replica for k in keys}


def test_consistent_hash_adding_a_replica_moves_about_one_in_n_keys_all_to_it() -> None:
    keys = [f"session-{i}" for i in range(3000)]
    policy = ConsistentHash(ConsistentHashConfig())
    ten = [ReplicaState(id=f"replica-{i}") for i in range(10)]
    before = ring_assignments(policy, ten, keys)
    after = ring_assignments(policy, [*ten, ReplicaState(id="replica-new")], keys)
    moved = [k for k in keys if before[k] != after[k]]
    assert 0.05 < len(moved) / len(keys) < 0.14  # ~1/11
    assert {after[k] for k in moved} == {"replica-new"}

    # Removing a replica moves only its own keys.
    without = ring_assignments(policy, ten[1:], keys)
    assert all(without[k] == before[k] for k in keys if before[k] != "replica-0")


def test_consistent_hash_spreads_keys_and_ignores_input_order() -> None:
    keys = [f"user-{i}" for i in range(3000)]
    replicas = [ReplicaState(id=f"replica-{i}") for i in range(10)]
    policy = ConsistentHash(ConsistentHashConfig())
    assignment = ring_assignments(policy, replicas, keys)
    assert all(150 < n < 450 for n in Counter(assignment.values()).values())
    assert ring_assignments(ConsistentHash(ConsistentHashConfig()), replicas[::-1], keys) == assignment


def test_consistent_hash_keys_on_session_then_first_block() -> None:
    policy = ConsistentHash(ConsistentHashConfig())
    replicas = [ReplicaState(id=f"replica-{i}") for i in range(10)]
    # Same first block, different rest: same replica.
    a = route(policy, RouteRequest(hashes=[42, 1, 2], prompt_tokens=48, tokens_per_block=16), replicas)
    b = route(policy, RouteRequest(hashes=[42, 7, 8, 9], prompt_tokens=64, tokens_per_block=16), replicas)
    assert a.replica == b.replica
    assert a.branch is Branch.CONSISTENT_HASH
    # First blocks spread over the fleet.
    spread = {route(policy, request(first_hash=1000 * i), replicas).replica for i in range(200)}
    assert len(spread) == 10
    # A session key overrides the prompt.
    by_session = {route(policy, request(first_hash=1000 * i, session_key="s"), replicas).replica for i in range(50)}
    assert len(by_session) == 1


# sglang_cache_aware -----------------------------------------------------------------------------------------------


def sglang() -> SGLangCacheAware:
    return SGLangCacheAware(SGLangCacheAwareConfig())


@pytest.mark.parametrize(
    ("min_load", "max_load", "is_imbalanced"),
    [
        (10, 74, False),  # difference 64 is not > 64
        (10, 75, True),
        (130, 195, False),  # 195 is not > 1.5 * 130
        (130, 196, True),
        (0, 64, False),
        (0, 65, True),
    ],
)
def test_sglang_imbalance_switch_boundaries(min_load: int, max_load: int, is_imbalanced: bool) -> None:
    replicas = [ReplicaState(id="cached", in_flight=max_load), ReplicaState(id="idle", in_flight=min_load)]
    d = route(sglang(), request(4096, {"cached": 256}), replicas)
    if is_imbalanced:
        assert (d.replica, d.branch) == ("idle", Branch.IMBALANCE)
    else:
        assert (d.replica, d.branch) == ("cached", Branch.CACHE_HIT)


def test_sglang_cache_threshold_boundary_is_strict() -> None:
    replicas = [ReplicaState(id="cached", in_flight=2), ReplicaState(id="idle", in_flight=1)]
    # 30 blocks of 10 tokens of a 1000-token prompt: a match rate of exactly 0.3 is a miss.
    d = route(sglang(), request(1000, {"cached": 30}, tokens_per_block=10), replicas)
    assert (d.replica, d.branch) == ("idle", Branch.CACHE_MISS)
    d = route(sglang(), request(1000, {"cached": 31}, tokens_per_block=10), replicas)
    assert (d.replica, d.branch) == ("cached", Branch.CACHE_HIT)


def test_sglang_cache_hit_goes_to_the_longest_match() -> None:
    replicas = fleet("a", "b", "c")
    d = route(sglang(), request(4096, {"a": 100, "b": 200, "c": 150}), replicas)
    assert (d.replica, d.branch) == ("b", Branch.CACHE_HIT)
    assert d.matched_blocks == 200


def test_sglang_miss_spreads_over_least_loaded_and_least_recent() -> None:
    replicas = fleet("a", "b", "c")
    policy = sglang()
    chosen = []
    for step in range(3):
        d = route(policy, request(1024, first_hash=10 * step), replicas, now=float(step))
        assert d.branch is Branch.CACHE_MISS
        record(replicas, d.replica, now=float(step))
        chosen.append(d.replica)
    assert sorted(chosen) == ["a", "b", "c"]


# dynamo_kv --------------------------------------------------------------------------------------------------------


def dynamo(seed: int = 0, **overrides: object) -> DynamoKV:
    return DynamoKV(DynamoKVConfig(**overrides), seed=seed)  # type: ignore[arg-type]


def kv_fleet(active_blocks: Mapping[str, int], capacity_blocks: int = 1000) -> list[ReplicaState]:
    return [
        ReplicaState(id=i, kv_usage=blocks / capacity_blocks, kv_capacity_blocks=capacity_blocks)
        for i, blocks in active_blocks.items()
    ]


def test_dynamo_argmin_of_prefill_plus_active_blocks() -> None:
    # 64-block request. a: 50 cached, 40 active -> 14 + 40 = 54. b: 0 cached, 0 active -> 64.
    d = route(dynamo(), request(1024, {"a": 50}), kv_fleet({"a": 40, "b": 0}))
    assert (d.replica, d.branch) == ("a", Branch.CACHE_HIT)
    # a: 14 + 60 = 74 > 64.
    d = route(dynamo(), request(1024, {"a": 50}), kv_fleet({"a": 60, "b": 0}))
    assert (d.replica, d.branch) == ("b", Branch.SPILL)
    # A heavier overlap weight makes the cache win again: 2 * 14 + 60 = 88 < 2 * 64.
    d = route(dynamo(overlap_score_weight=2.0), request(1024, {"a": 50}), kv_fleet({"a": 60, "b": 0}))
    assert (d.replica, d.branch) == ("a", Branch.CACHE_HIT)
    # Weight 0 ignores the cache: pure load balancing.
    d = route(dynamo(overlap_score_weight=0.0), request(1024, {"a": 64}), kv_fleet({"a": 1, "b": 0}))
    assert (d.replica, d.branch) == ("b", Branch.SPILL)


def test_dynamo_estimates_active_blocks_from_router_counts_without_kv_gauges() -> None:
    replicas = fleet("a", "b")
    by_id(replicas)["a"].streaming = 2  # 2 * 1024 tokens = 128 blocks
    d = route(dynamo(), request(1024, {"a": 32}), replicas)
    assert (d.replica, d.branch) == ("b", Branch.SPILL)
    replicas = fleet("a", "b")
    by_id(replicas)["b"].waiting_prompt_tokens = 16 * 40  # 40 blocks of backlog
    d = route(dynamo(), request(1024, {"a": 0}), replicas)
    assert (d.replica, d.branch) == ("a", Branch.CACHE_MISS)


def test_dynamo_zero_temperature_breaks_exact_ties_at_random_with_its_seed() -> None:
    replicas = fleet("a", "b", "c")
    policy, again = dynamo(seed=1), dynamo(seed=1)
    seq = [route(policy, request(1024), replicas).replica for _ in range(60)]
    assert set(seq) == {"a", "b", "c"}
    assert [route(again, request(1024), replicas).replica for _ in range(60)] == seq


def test_dynamo_softmax_sampling_is_seeded_and_favours_the_cheaper() -> None:
    replicas = kv_fleet({"a": 0, "b": 20, "c": 40})
    one, two = dynamo(seed=5, temperature=0.5), dynamo(seed=5, temperature=0.5)
    seq_one = [route(one, request(1024), replicas).replica for _ in range(600)]
    seq_two = [route(two, request(1024), replicas).replica for _ in range(600)]
    assert seq_one == seq_two
    # Normalised costs 0, 0.5, 1 at T = 0.5: probabilities ~0.67, 0.24, 0.09.
    counts = Counter(seq_one)
    assert counts["a"] > 2 * counts["b"]
    assert counts["b"] > 1.5 * counts["c"] > 0
    # Costs are normalised by their range, as in Dynamo: scaling every cost changes nothing.
    scaled = dynamo(seed=5, temperature=0.5)
    wide = kv_fleet({"a": 0, "b": 200, "c": 400})
    assert [route(scaled, request(1024), wide).replica for _ in range(600)] == seq_one
    # Temperature 0 is the argmin, every time.
    argmin = dynamo(seed=5)
    assert {route(argmin, request(1024), replicas).replica for _ in range(50)} == {"a"}


# llmd_weighted ----------------------------------------------------------------------------------------------------


def test_llmd_weights_trade_prefix_against_queue_and_kv() -> None:
    def two() -> list[ReplicaState]:
        return [
            ReplicaState(id="cached", num_waiting=8, kv_usage=0.9),  # queue 0, kv 0.1, prefix 1
            ReplicaState(id="idle", num_waiting=0, kv_usage=0.1),  # queue 1, kv 0.9, prefix 0
        ]

    req = request(1024, {"cached": 64})
    # Defaults 2/2/3: cached 2*0 + 2*0.1 + 3*1 = 3.2 < idle 2*1 + 2*0.9 = 3.8.
    d = route(LLMDWeighted(LLMDWeightedConfig()), req, two())
    assert (d.replica, d.branch) == ("idle", Branch.SPILL)
    # Prefix weight 5: cached 5.2 > 3.8.
    d = route(LLMDWeighted(LLMDWeightedConfig(prefix_weight=5.0)), req, two())
    assert (d.replica, d.branch) == ("cached", Branch.CACHE_HIT)
    # With equal queues a half match (0.5 * 3 = 1.5) outweighs a small KV difference (0.1 * 2)...
    replicas = [
        ReplicaState(id="cached", num_waiting=1, kv_usage=0.3),
        ReplicaState(id="idle", num_waiting=1, kv_usage=0.2),
    ]
    d = route(LLMDWeighted(LLMDWeightedConfig()), request(1024, {"cached": 32}), replicas)
    assert (d.replica, d.branch) == ("cached", Branch.CACHE_HIT)
    # ...but one more waiting request costs the whole queue weight (2), min-max normalised.
    by_id(replicas)["cached"].num_waiting = 2
    d = route(LLMDWeighted(LLMDWeightedConfig()), request(1024, {"cached": 32}), replicas)
    assert (d.replica, d.branch) == ("idle", Branch.SPILL)


def test_llmd_queue_score_is_min_max_normalised() -> None:
    # Queues 100 and 101 score 1 and 0 (the whole queue weight), outweighing a KV difference of 0.4 (0.8).
    replicas = [
        ReplicaState(id="a", num_waiting=101, kv_usage=0.1),
        ReplicaState(id="b", num_waiting=100, kv_usage=0.5),
    ]
    assert route(LLMDWeighted(LLMDWeightedConfig()), request(1024), replicas).replica == "b"
    # Equal queues score alike; the KV term decides.
    replicas = [ReplicaState(id="a", waiting=3, kv_usage=0.1), ReplicaState(id="b", waiting=3, kv_usage=0.5)]
    d = route(LLMDWeighted(LLMDWeightedConfig()), request(1024), replicas)
    assert (d.replica, d.branch) == ("a", Branch.CACHE_MISS)


def test_llmd_breaks_ties_at_random_with_its_seed() -> None:
    replicas = fleet("a", "b", "c")
    seq = [route(LLMDWeighted(LLMDWeightedConfig(), seed=s), request(1024), replicas).replica for s in range(30)]
    assert set(seq) == {"a", "b", "c"}
    again = [route(LLMDWeighted(LLMDWeightedConfig(), seed=s), request(1024), replicas).replica for s in range(30)]
    assert again == seq


# config and every policy ------------------------------------------------------------------------------------------


def test_config_parses_dicts_by_kind() -> None:
    cfg = parse_policy_config({"kind": "sglang_cache_aware", "cache_threshold": 0.5})
    assert isinstance(cfg, SGLangCacheAwareConfig)
    assert (cfg.cache_threshold, cfg.balance_abs_threshold, cfg.balance_rel_threshold) == (0.5, 64, 1.5)
    assert isinstance(parse_policy_config({"kind": "random"}), RandomConfig)
    assert parse_policy_config({"kind": "consistent_hash"}) == ConsistentHashConfig(virtual_nodes=160)


def test_config_defaults_are_the_sources_defaults() -> None:
    assert POLICY_NAMES[0] == "estimated_ttft"
    assert DynamoKVConfig().overlap_score_weight == 1.0
    assert DynamoKVConfig().temperature == 0.0
    llmd = LLMDWeightedConfig()
    assert (llmd.queue_weight, llmd.kv_cache_weight, llmd.prefix_weight) == (2.0, 2.0, 3.0)


def test_config_nests_in_settings_with_the_default_kind() -> None:
    class Settings(BaseModel):
        policy: PolicyConfig = EstimatedTTFTConfig()

    assert Settings().policy.kind == "estimated_ttft"
    assert isinstance(Settings.model_validate({"policy": {"kind": "dynamo_kv"}}).policy, DynamoKVConfig)


@pytest.mark.parametrize(
    "data",
    [
        {"kind": "round_robin", "seed": 1},  # unknown field
        {"kind": "estimated_ttft", "tie_epsilon": 0.01},  # misspelt field
        {"kind": "nope"},  # unknown kind
        {"cache_threshold": 0.3},  # no kind
        {"kind": "sglang_cache_aware", "cache_threshold": 1.5},  # out of range
        {"kind": "estimated_ttft", "kv_pressure_threshold": 1.0},  # would divide by zero
    ],
)
def test_config_rejects_bad_input(data: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        parse_policy_config(data)


def test_config_is_frozen() -> None:
    cfg = EstimatedTTFTConfig()
    with pytest.raises(ValidationError):
        cfg.tie_epsilon_s = 1.0


def test_every_config_field_documents_itself() -> None:
    for name in POLICY_NAMES:
        model = type(parse_policy_config({"kind": name}))
        assert model.__doc__
        for field_name, info in model.model_fields.items():
            if field_name != "kind":
                assert info.description, f"{model.__name__}.{field_name} has no docstring"


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_build_policy_for_every_name(name: str) -> None:
    policy = build_policy(parse_policy_config({"kind": name}), seed=3)
    assert policy.name == name
    replicas = fleet("a", "b", "c")
    d = route(policy, request(1024, {"b": 10}), replicas)
    assert d.replica in {"a", "b", "c"}
    assert d.matched_blocks == (10 if d.replica == "b" else 0)
    single = route(policy, request(1024, {"b": 10}), fleet("b"))
    assert (single.replica, single.branch, single.matched_blocks) == ("b", Branch.ONLY_REPLICA, 10)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_is_deterministic_for_a_seed(name: str) -> None:
    config = parse_policy_config({"kind": name})
    replicas = [ReplicaState(id=f"r{i}", in_flight=i % 3, kv_usage=0.1 * (i % 4)) for i in range(6)]

    def run(policy: Policy) -> list[str]:
        return [route(policy, request(512 + 16 * i, {"r2": i % 5}), replicas, now=float(i)).replica for i in range(40)]

    assert run(build_policy(config, seed=11)) == run(build_policy(config, seed=11))


def test_policies_never_read_the_clock_only_now() -> None:
    # The same inputs at wildly different `now` give the same choice (the driver owns last_selected).
    for name in POLICY_NAMES:
        config = parse_policy_config({"kind": name})
        replicas = fleet("a", "b", "c")
        early = route(build_policy(config, seed=1), request(1024, {"c": 20}), replicas, now=0.0)
        late = route(build_policy(config, seed=1), request(1024, {"c": 20}), replicas, now=1e9)
        assert early == late, name
        assert math.isfinite(early.predicted_ttft_s or 0.0)


@given(
    st.lists(
        st.tuples(
            st.integers(0, 50_000),  # waiting_prompt_tokens
            st.integers(0, 64),  # streaming
            st.none() | st.integers(0, 64),  # num_running
            st.none() | st.floats(0.0, 1.0),  # kv_usage
            st.floats(100.0, 100_000.0),  # prefill_tokens_per_s
            st.integers(0, 40),  # matched blocks
        ),
        min_size=2,
        max_size=8,
    ),
    st.integers(1, 20_000),
)
def test_estimated_ttft_takes_a_replica_within_the_tie_margin_of_the_least_estimate(
    rows: list[tuple[int, int, int | None, float | None, float, int]], prompt_tokens: int
) -> None:
    # Without the fleet cost, a replica's cost is its estimate: none is more than `tie_epsilon_s` below the choice's.
    config = EstimatedTTFTConfig(fleet_cost_weight=0.0)
    replicas = [
        ReplicaState(
            id=f"r{i}", waiting_prompt_tokens=w, streaming=s, num_running=n, kv_usage=kv, prefill_tokens_per_s=rate
        )
        for i, (w, s, n, kv, rate, _) in enumerate(rows)
    ]
    request = RouteRequest(
        hashes=[1],
        prompt_tokens=prompt_tokens,
        tokens_per_block=16.0,
        matched_blocks={f"r{i}": row[5] for i, row in enumerate(rows)},
    )
    chosen = EstimatedTTFT(config).select(request, replicas, now=0.0)
    rates = pooled_rates(replicas, config.rate_noise_cv)
    estimates = {r.id: ttft_and_own_s(request, r, rate, config)[0] for r, rate in zip(replicas, rates, strict=True)}
    assert chosen.predicted_ttft_s == estimates[chosen.replica]
    assert estimates[chosen.replica] <= min(estimates.values()) + config.tie_epsilon_s
