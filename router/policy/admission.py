"""Admission at the router: a limit on the requests one router keeps in flight on each replica.

With a limit set (the live router's `hold.max_in_flight_per_replica`, the simulator's
`router.max_in_flight_per_replica`), a replica at the limit is not offered to the policy, and a request that finds
every replica at it waits at the router, in arrival order, until a slot frees anywhere. The queue then forms in one
place, where a waiting request takes whichever replica frees first (one queue before many servers), instead of
behind one replica's running generations while another replica finishes first (a queue per server). Set to the
engines' batch size, no request waits inside an engine, and the fleet's queueing delay is the M/G/c one.

0 means no limit: every eligible replica is offered, and the engines queue what they cannot run. The limit counts
this router's own requests (`ReplicaState.own_in_flight`), not those other routers of a fleet report: a router
holds a request until one of its own requests frees a slot, which only its own requests can tell it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from router.policy.types import ReplicaState

UNLIMITED = sys.maxsize


def with_room(states: Sequence[ReplicaState], limit: int) -> Sequence[ReplicaState]:
    """The replicas with fewer than `limit` requests in flight, in the given order; all of them when `limit` is 0
    (the same sequence, not a copy)."""
    if limit <= 0:
        return states
    return [s for s in states if s.own_in_flight < limit]


def free_slots(states: Sequence[ReplicaState], limit: int) -> int:
    """Requests `states` can take before every one is at `limit`: the sum of their room. Without a limit any
    replica takes any number (`UNLIMITED`), and no replica none."""
    if limit <= 0:
        return UNLIMITED if states else 0
    return sum(max(0, limit - s.own_in_flight) for s in states)
