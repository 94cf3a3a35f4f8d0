"""Session affinity: a session's requests go back to the replica its previous request went to, unless that replica
has become the fleet's bottleneck.

A conversation or an agent episode resends its whole history on every turn, and the replica that served the
previous turn holds that history in its KV cache, so a pin is a cheap, index-free way to hit it (the live router
reads the key from `session_header`). A pin that never yields has a failure mode: a policy that places the first
requests of many sessions on one replica (a cache-aware policy does, for a shared system prompt) keeps every later
turn there too, and the imbalance compounds while other replicas idle (in simulation, agent episodes on 8 replicas
reached a TTFT p99 of 46 s under sglang_cache_aware: scenario 11 at seed 1, docs/simulation-results.md). So a pin
holds only while its replica's requests in flight stay within
`max_in_flight_ratio` x the eligible replicas' mean + `max_in_flight_excess`; beyond that the request goes to the
policy, which still sees the session's cached prefix through the prefix index. The mean, not the minimum: one idle
replica (just added, say) must not release every pin, and a policy that spreads sessions evenly should keep them
(docs/simulation-results.md, scenario 11, measures both).

Pure: the table is the only state, and the router and the simulator drive the same object.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from router.policy.types import Branch, Decision, ReplicaState, RouteRequest


class SessionAffinityConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    max_sessions: int = Field(default=100_000, ge=1)
    """Sessions remembered, least recently used forgotten first (a session costs ~150 bytes)."""
    max_in_flight_ratio: float = Field(default=1.5, ge=1.0)
    """A pin holds while its replica has at most this multiple of the eligible replicas' mean requests in flight
    (plus `max_in_flight_excess`). 1.5 is SGLang's cache-aware balance ratio: past it, the replica is a queue that
    is growing, which a cache hit does not repay."""
    max_in_flight_excess: int = Field(default=4, ge=0)
    """Requests in flight a pinned replica may have beyond `max_in_flight_ratio` x the mean: at small counts a
    ratio alone would release pins on noise (2 against a mean of 1)."""


class SessionTable:
    """Session key -> the replica its last request went to."""

    def __init__(self, config: SessionAffinityConfig | None = None) -> None:
        self.config = config or SessionAffinityConfig()
        self._replica_of: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._replica_of)

    def decide(self, request: RouteRequest, eligible: Sequence[ReplicaState]) -> Decision | None:
        """The pinned replica as a SESSION decision, or None: no session key, no pin, the pinned replica is not
        eligible, or it has more than `max_in_flight_ratio` x the mean + `max_in_flight_excess` requests in flight
        (the policy then decides)."""
        key = request.session_key
        if key is None:
            return None
        pinned = self._replica_of.get(key)
        if pinned is None:
            return None
        pinned_state = None
        total = 0
        for state in eligible:
            if state.id == pinned:
                pinned_state = state
            total += state.in_flight
        if pinned_state is None:
            return None
        cfg = self.config
        mean = total / len(eligible)
        if pinned_state.in_flight > mean * cfg.max_in_flight_ratio + cfg.max_in_flight_excess:
            return None
        return Decision(pinned, Branch.SESSION, request.matched_blocks.get(pinned, 0), request.cached_tokens(pinned))

    def remember(self, key: str, replica_id: str) -> None:
        table = self._replica_of
        table[key] = replica_id
        table.move_to_end(key)
        if len(table) > self.config.max_sessions:
            table.popitem(last=False)
