"""`router.policy.session`: a session goes back to its replica unless that replica has become the bottleneck."""

from __future__ import annotations

from router.policy.session import SessionAffinityConfig, SessionTable
from router.policy.types import Branch, ReplicaState, RouteRequest


def request(session: str | None, matched: dict[str, int] | None = None) -> RouteRequest:
    return RouteRequest(
        hashes=[1, 2, 3], prompt_tokens=48, tokens_per_block=16.0, matched_blocks=matched or {}, session_key=session
    )


def fleet(*in_flight: int) -> list[ReplicaState]:
    return [ReplicaState(id=f"r{i}", in_flight=n) for i, n in enumerate(in_flight)]


def test_a_session_returns_to_its_replica_with_its_cached_prefix() -> None:
    table = SessionTable()
    assert table.decide(request("s1"), fleet(0, 0)) is None  # not pinned yet: the policy decides
    table.remember("s1", "r1")
    decision = table.decide(request("s1", {"r1": 2}), fleet(0, 3))
    assert decision is not None
    assert (decision.replica, decision.branch, decision.matched_blocks) == ("r1", Branch.SESSION, 2)
    assert decision.predicted_cached_tokens == 32
    assert table.decide(request(None), fleet(0, 3)) is None
    assert table.decide(request("other"), fleet(0, 3)) is None


def test_a_pin_to_a_replica_that_is_not_eligible_goes_to_the_policy() -> None:
    table = SessionTable()
    table.remember("s1", "r9")
    assert table.decide(request("s1"), fleet(0, 0)) is None


def test_a_pin_yields_when_its_replica_holds_far_more_than_the_mean() -> None:
    table = SessionTable(SessionAffinityConfig(max_in_flight_ratio=1.5, max_in_flight_excess=4))
    table.remember("s1", "r0")
    # Mean 5: the bound is 1.5 x 5 + 4 = 11.5.
    assert table.decide(request("s1"), fleet(11, 2, 2)) is not None
    # Mean 6: bound 13; 14 in flight on r0 is past it.
    assert table.decide(request("s1"), fleet(14, 2, 2)) is None


def test_one_idle_replica_does_not_release_every_pin() -> None:
    # Against the minimum (0) every pin here would yield; against the mean (7) none does.
    table = SessionTable()
    table.remember("s1", "r0")
    assert table.decide(request("s1"), fleet(10, 9, 9, 0)) is not None


def test_the_table_forgets_the_least_recently_used_session_first() -> None:
    table = SessionTable(SessionAffinityConfig(max_sessions=2))
    table.remember("a", "r0")
    table.remember("b", "r1")
    table.remember("a", "r0")  # a is used again: b is now the oldest
    table.remember("c", "r0")
    assert len(table) == 2
    assert table.decide(request("b"), fleet(0, 0)) is None
    assert table.decide(request("a"), fleet(0, 0)) is not None
