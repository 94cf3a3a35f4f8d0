"""The router's in-flight limit per replica (`router.policy.admission`)."""

from __future__ import annotations

from router.policy.admission import UNLIMITED, free_slots, with_room
from router.policy.types import ReplicaState


def _states(*in_flight: int) -> list[ReplicaState]:
    return [ReplicaState(f"r{i}", in_flight=n) for i, n in enumerate(in_flight)]


def test_replicas_at_the_limit_are_not_offered_and_free_slots_add_up() -> None:
    states = _states(0, 3, 4, 6)
    assert [s.id for s in with_room(states, 4)] == ["r0", "r1"]
    assert free_slots(states, 4) == 4 + 1
    assert free_slots(_states(4, 5), 4) == 0


def test_without_a_limit_every_replica_is_offered_and_only_an_empty_fleet_is_full() -> None:
    states = _states(100, 0)
    assert with_room(states, 0) is states
    assert free_slots(states, 0) == UNLIMITED
    assert free_slots([], 0) == 0
