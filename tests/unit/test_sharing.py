"""Routing records shared by a fleet of routers (router/policy/sharing.py): wire form, and peers' records applied
to a real RoutingCore on an injected clock."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from router.cli import main
from router.policy.admission import with_room
from router.policy.estimated_ttft import EstimatedTTFT, EstimatedTTFTConfig
from router.policy.prefix_index import PrefixIndex
from router.policy.routing_core import RoutingConfig, RoutingCore
from router.policy.routing_text import RoutingKey
from router.policy.sharing import (
    Batch,
    Drain,
    Load,
    PeerRouters,
    Pin,
    Routed,
    SharingError,
    decode_batch,
    encode_batch,
    merge_routed,
    own_loads,
)
from router.policy.types import Branch, ReplicaState
from router.service.settings import RouterSettings

TTL_S = 3.0


def make_core(*ids: str, max_in_flight: int = 0) -> RoutingCore:
    config = RoutingConfig(max_in_flight_per_replica=max_in_flight)
    core = RoutingCore(config, PrefixIndex(), EstimatedTTFT(EstimatedTTFTConfig()))
    for rid in ids:
        core.add_replica(ReplicaState(rid))
    return core


def test_a_batch_survives_the_wire() -> None:
    batch = Batch(
        "r1",
        7,
        (Routed("a", (0, 1, 2**64 - 1), True), Routed("b", (), False)),
        {"a": Load(3, 1, 500)},
        True,
        (Pin("s", "a"),),
        (Drain("b", True),),
    )
    assert decode_batch(encode_batch(batch)) == batch


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b"[]",
        b'{"v": 2, "router": "r", "seq": 1}',
        b'{"v": 1, "router": 3, "seq": 1}',
        b'{"v": 1, "router": "r", "seq": -1}',
        b'{"v": 1, "router": "r", "seq": 1, "routed": [["a", "!!", true]]}',
        b'{"v": 1, "router": "r", "seq": 1, "routed": [["a", "AAA=", true]]}',
        b'{"v": 1, "router": "r", "seq": 1, "loads": {"a": [1, 2]}}',
        b'{"v": 1, "router": "r", "seq": 1, "loads": {"a": [1, "x", 3]}}',
    ],
)
def test_a_malformed_batch_is_an_error(data: bytes) -> None:
    with pytest.raises(SharingError):
        decode_batch(data)


_TEXT, _TOKENS = 1000, 2000
"""Bases of the two kinds' hashes in the merge test: text and token-id prompts never share a block."""


def _path(parents: list[int], node: int, base: int) -> tuple[int, ...]:
    """Root-first path to `node` of a tree (`parents[i]` <= i, node 0 the root): chained prompts, shared prefixes."""
    path = []
    while node:
        path.append(base + node)
        node = parents[node - 1]
    return tuple(reversed(path))


def _index_state(index: PrefixIndex) -> tuple[object, ...]:
    """What `record` changes, entry order included (it is the eviction order), but for the shared blocks' bounds:
    lower bounds of their holders' deadlines, which may come out tighter from the merged records."""
    guesses = {rid: list(rep.guesses.items()) for rid, rep in index._replicas.items()}
    return guesses, [dict(s) for s in index._holders]


@settings(max_examples=200, deadline=None)
@given(
    parents=st.tuples(*(st.integers(0, i) for i in range(30))).map(list),
    earlier=st.lists(st.tuples(st.sampled_from("ab"), st.integers(1, 30)), max_size=10),
    decisions=st.lists(st.tuples(st.sampled_from("ab"), st.integers(0, 30), st.booleans()), max_size=40),
)
def test_merged_decisions_record_as_the_decisions_in_turn(
    parents: list[int], earlier: list[tuple[str, int]], decisions: list[tuple[str, int, bool]]
) -> None:
    """A batch's merged `Routed` records leave a peer's index as the decisions recorded one by one at the same
    `now`: the same entries, deadlines and touch order, and the same matches before and after they expire."""
    one_by_one, merged = PrefixIndex(), PrefixIndex()
    for index in (one_by_one, merged):
        for rid in "ab":
            index.add_replica(rid)
        for rid, node in earlier:
            index.record(rid, _path(parents, node, _TEXT), now=0.0)
    routed = [(rid, _path(parents, node, _TOKENS if t else _TEXT), t) for rid, node, t in decisions]
    for rid, hashes, is_tokens in routed:
        if hashes:
            one_by_one.record(rid, hashes, now=5.0, predicted=is_tokens)
    records = merge_routed(routed)
    assert len(records) == len({(rid, t) for rid, h, t in routed if h})
    for record in records:
        merged.record(record.replica, record.hashes, now=5.0, predicted=record.is_tokens)
    # The two kinds' entries of a replica interleave in another order (they share no block, so no ancestor).
    assert _index_state(merged)[1:] == _index_state(one_by_one)[1:]
    for rid in "ab":
        for kind in (_TEXT, _TOKENS):
            of_kind = [[e for e in _index_state(x)[0][rid] if e[0] - e[0] % 1000 == kind] for x in (merged, one_by_one)]
            assert of_kind[0] == of_kind[1]
    ttl_s = one_by_one.config.ttl_s
    for now in (6.0, ttl_s + 2.0, ttl_s + 6.0):  # the predicted ones live; the earlier ones expired; all expired
        for node in range(31):
            for base in (_TEXT, _TOKENS):
                hashes = _path(parents, node, base)
                assert merged.match(hashes, now=now) == one_by_one.match(hashes, now=now)


def test_a_peers_decision_is_a_hit_here() -> None:
    core = make_core("a", "b")
    prepared = core.prepare(RoutingKey(text=b"x" * 4096), "m")
    view = PeerRouters(core, load_ttl_s=TTL_S)
    view.apply(Batch("peer", 1, (Routed("b", tuple(prepared.complete()), False),)), now=1.0)
    again = core.prepare(RoutingKey(text=b"x" * 4096 + b" more"), "m")
    decision = core.choose(again, [core.state("a"), core.state("b")], now=1.5)
    assert decision is not None and (decision.replica, decision.branch) == ("b", Branch.CACHE_HIT)


def test_records_for_an_unknown_replica_are_counted_and_left_out() -> None:
    core = make_core("a")
    applied = PeerRouters(core, load_ttl_s=TTL_S).apply(Batch("p", 1, (Routed("zz", (1, 2), False),)), now=0.0)
    assert applied.num_unknown == 1 and core.index.stats().num_blocks == 0


def test_load_is_the_sum_over_routers_and_own_counts_stay_apart() -> None:
    core = make_core("a", "b")
    view = PeerRouters(core, load_ttl_s=TTL_S)
    prepared = core.prepare(RoutingKey(text=b"y" * 100), "m")
    decision = core.choose(prepared, [core.state("a")], now=0.0)
    assert decision is not None
    ticket = core.begin(decision, prepared, now=0.0)
    view.apply(Batch("p1", 1, loads={"a": Load(2, 1, 100)}), now=0.1)
    view.apply(Batch("p2", 1, loads={"a": Load(3, 3, 300), "b": Load(1, 0, 0)}), now=0.1)
    a = core.state("a")
    assert (a.in_flight, a.peer_in_flight, a.own_in_flight) == (6, 5, 1)
    assert a.waiting == 1 + 4 and a.streaming == 5 - 4
    assert core.state("b").in_flight == 1
    assert own_loads(core, ["a", "b"]) == {"a": Load(1, 1, ticket.uncached_tokens), "b": Load()}
    # A peer's new counts replace its old ones; its own finish leaves the peers' share alone.
    view.apply(Batch("p1", 2, loads={"a": Load(0, 0, 0)}), now=0.2)
    core.finish(ticket)
    assert (a.in_flight, a.own_in_flight, a.waiting, a.waiting_prompt_tokens) == (3, 0, 3, 300)


def test_a_complete_load_table_clears_the_replicas_it_leaves_out() -> None:
    core = make_core("a", "b")
    view = PeerRouters(core, load_ttl_s=TTL_S)
    view.apply(Batch("p", 1, loads={"a": Load(2, 0, 0), "b": Load(1, 0, 0)}), now=0.0)
    view.apply(Batch("p", 2, loads={"b": Load(1, 0, 0)}, is_complete=True), now=0.1)
    assert (core.state("a").in_flight, core.state("b").in_flight) == (0, 1)
    assert view.num_entries == 1


def test_a_silent_router_stops_counting_after_the_ttl() -> None:
    core = make_core("a")
    view = PeerRouters(core, load_ttl_s=TTL_S)
    view.apply(Batch("p", 1, loads={"a": Load(4, 0, 0)}), now=10.0)
    assert view.expire(10.0 + TTL_S - 0.01) == [] and core.state("a").in_flight == 4
    view.apply(Batch("p", 2), now=12.0)  # any batch keeps the router alive
    assert view.expire(10.0 + TTL_S + 0.5) == [] and core.state("a").in_flight == 4
    assert view.expire(12.0 + TTL_S) == ["p"]
    assert core.state("a").in_flight == 0 and view.peers == ()


def test_a_replayed_load_counts_only_for_what_is_left_of_its_ttl() -> None:
    core = make_core("a")
    view = PeerRouters(core, load_ttl_s=TTL_S)
    view.apply(Batch("dead", 9, loads={"a": Load(5, 0, 0)}), now=0.0, age_s=TTL_S + 1)
    assert core.state("a").in_flight == 0 and view.peers == ()
    view.apply(Batch("p", 3, loads={"a": Load(2, 0, 0)}), now=0.0, age_s=TTL_S - 1)
    assert core.state("a").in_flight == 2
    view.expire(1.0)
    assert core.state("a").in_flight == 0


def test_a_missing_batch_is_a_gap() -> None:
    view = PeerRouters(make_core("a"), load_ttl_s=TTL_S)
    assert not view.apply(Batch("p", 5), now=0.0).is_gap  # the first batch seen starts the count
    assert not view.apply(Batch("p", 6), now=0.0).is_gap
    assert view.apply(Batch("p", 8), now=0.0).is_gap
    assert not view.apply(Batch("p", 9), now=0.0).is_gap


def test_pins_and_drains() -> None:
    core = make_core("a", "b")
    applied = PeerRouters(core, load_ttl_s=TTL_S).apply(
        Batch("p", 1, pins=(Pin("s1", "b"),), drains=(Drain("a", True),)), now=0.0
    )
    assert applied.drains == (Drain("a", True),)
    prepared = core.prepare(RoutingKey(text=b"z" * 64), "m", session_key="s1")
    decision = core.choose(prepared, [core.state("a"), core.state("b")], now=0.0)
    assert decision is not None and (decision.replica, decision.branch) == ("b", Branch.SESSION)


def test_admission_counts_only_this_routers_own_requests() -> None:
    core = make_core("a", max_in_flight=2)
    PeerRouters(core, load_ttl_s=TTL_S).apply(Batch("p", 1, loads={"a": Load(10, 0, 0)}), now=0.0)
    assert list(with_room([core.state("a")], 2)) == [core.state("a")]
    assert core.free_slots([core.state("a")]) == 2


def test_a_non_positive_ttl_is_an_error() -> None:
    with pytest.raises(ValueError, match="load_ttl_s"):
        PeerRouters(make_core(), load_ttl_s=0)


# --- settings of the fleet ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "redis://10.0.0.1:6379/0",
        "rediss://h:6380",
        "unix:///run/redis.sock",
        "redis+sentinel://h:26379/mymaster",
        "redis+cluster://h:7000",
    ],
)
def test_standalone_sentinel_and_cluster_redis_urls_are_accepted(url: str) -> None:
    assert RouterSettings(redis_url=url).redis_url == url


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+sentinel://h:26379", "service"),
        ("http://h:6379", "the scheme must be"),
        ("h:6379", "has no scheme"),
    ],
)
def test_other_redis_urls_are_a_clear_error(url: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RouterSettings(redis_url=url)


def test_the_redis_url_comes_from_the_environment_and_the_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SHOAL_ROUTER_REDIS_URL", "redis://127.0.0.1:1/0")
    assert RouterSettings().redis_url == "redis://127.0.0.1:1/0"
    assert main(["router", "--redis-url", "sentinel://h"]) == 2
    assert "the scheme must be" in capsys.readouterr().err
