"""From a parsed request to a chosen replica: hash, match, select, record, and the load bookkeeping around it.

This is the only place the service touches the pure policy layer, so the simulator can mirror it step by step:

    chain   = memo.chain_text / chain_tokens(routing key, seed of the model)   # hashing.PromptChain
    hashes  = chain.prefix(index.holds)                 # as far as any replica could match
    eligible = pool.eligible_states(model), under hold.max_in_flight_per_replica   # admission.with_room
    matched = index.match(hashes, now)
    decision = policy.select(RouteRequest(hashes, prompt_tokens, tokens_per_block, matched), eligible, now)
    ... the request is written to the replica ...
    index.record(decision.replica, chain.complete(), now)   # approximate mode: the router's own prediction

A decision hashes a prompt only up to its first chunk that no replica holds, since chained hashes cannot match
past it; the rest of the prompt is hashed for the record once the request is on its way (`commit`, which the
proxy runs as soon as the request is written and before the event loop runs anything else, so the next decision
sees the record just as if it had been made before the request left).

In exact mode (a live KV-event stream from the chosen replica, `kv_events.py`), the record of a token-id prompt is
a predicted entry, short-lived: the engine's `stored` event makes it exact, and without one it expires. A text
prompt is hashed over bytes, which no engine event names, so its record stays approximate in either mode.

Load bookkeeping is router-local and exact: `begin` counts a request as waiting for its first byte with its
uncached prompt tokens (the prefill backlog), `first_byte` moves it to streaming and feeds the observed time to
the replica's prefill-rate estimate, `finish` forgets it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from router.policy.admission import free_slots, with_room
from router.policy.hashing import ChainMemo, PromptChain, namespace_seed
from router.policy.prefill_rate import PrefillRate, PrefillRateEstimator
from router.policy.prefix_index import PrefixIndex
from router.policy.routing_text import RoutingKey
from router.policy.session import SessionTable
from router.policy.types import Branch, Decision, Policy, RouteRequest
from router.service.pool import Replica, ReplicaPool
from router.service.settings import RouterSettings


@dataclass(slots=True)
class Prepared:
    """A request's routing inputs, computed once and reused across retries."""

    chain: PromptChain
    """The routing key's block hashes: `prepare` hashes what a decision needs, `commit` the rest."""
    prompt_tokens: int
    tokens_per_block: float
    model: str | None
    session_key: str | None
    max_output_tokens: int | None
    is_tokens: bool = False
    """Hashed over token ids (token mode), the units engines' KV events name."""

    @property
    def hashes(self) -> list[int]:
        """The block hashes computed so far (all of them once committed)."""
        return self.chain.hashes


@dataclass(slots=True)
class Ticket:
    """One attempt in flight on one replica."""

    replica: Replica
    decision: Decision
    uncached_tokens: int
    started: float
    tokens_ahead: int
    """Prefill backlog on the replica when this request joined it: part of what its first byte waited for."""
    is_waiting: bool = True
    is_done: bool = False
    ttfb_s: float | None = None
    """Time to the replica's first byte (its whole answer when not streamed), once it came."""


class RoutingCore:
    def __init__(
        self,
        settings: RouterSettings,
        pool: ReplicaPool,
        index: PrefixIndex,
        policy: Policy,
        prefill_rate: PrefillRateEstimator,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.index = index
        self.policy = policy
        self.prefill_rate = prefill_rate
        self.sessions = SessionTable(settings.session_affinity)
        self._memo = ChainMemo(max_entries=settings.hashing.memo_entries)
        self._seeds: dict[str | None, bytes] = {}

    def prepare(
        self, key: RoutingKey, model: str | None, session_key: str | None, max_output_tokens: int | None
    ) -> Prepared:
        seed = self._seeds.get(model)
        if seed is None:
            seed = self._seeds[model] = namespace_seed(model or "")
        h = self.settings.hashing
        if key.token_ids is not None:
            chain = self._memo.chain_tokens(
                key.token_ids, seed, h.token_block_size, max_blocks=h.max_blocks, packed=key.packed
            )
            chain.prefix(self.index.holds)
            return Prepared(
                chain, len(key.token_ids), float(h.token_block_size), model, session_key, max_output_tokens, True
            )
        text = key.text or b""
        chain = self._memo.chain_text(text, seed, h.text_block_size, max_blocks=h.max_blocks)
        chain.prefix(self.index.holds)
        prompt_tokens = math.ceil(len(text) / h.bytes_per_token)
        return Prepared(
            chain, prompt_tokens, h.text_block_size / h.bytes_per_token, model, session_key, max_output_tokens
        )

    def choose(
        self, prepared: Prepared, exclude: Sequence[str], now: float, *, within_limit: bool = True
    ) -> Decision | None:
        """Pick a replica among the eligible ones, or None when there is none; `within_limit`: only among those
        under `hold.max_in_flight_per_replica`. The caller `commit`s a decision it acts on."""
        states = self.pool.eligible_states(prepared.model, exclude)
        if within_limit:
            states = with_room(states, self.settings.hold.max_in_flight_per_replica)
        if not states:
            return None
        matched = self.index.match(prepared.hashes, now=now) if prepared.hashes else {}
        request = RouteRequest(
            hashes=prepared.hashes,
            prompt_tokens=prepared.prompt_tokens,
            tokens_per_block=prepared.tokens_per_block,
            matched_blocks=matched,
            session_key=prepared.session_key,
            max_output_tokens=prepared.max_output_tokens,
            num_blocks=prepared.chain.num_blocks,
        )
        decision = None
        if prepared.session_key is not None:  # only with `session_header` set (the proxy reads it)
            decision = self.sessions.decide(request, states)
        if decision is None:
            if len(states) == 1:
                only = states[0].id
                cached = request.cached_tokens(only)
                decision = Decision(only, Branch.ONLY_REPLICA, matched.get(only, 0), cached)
            else:
                decision = self.policy.select(request, states, now=now)
        if prepared.session_key is not None:
            self.sessions.remember(prepared.session_key, decision.replica)
        return decision

    def free_slots(self, model: str | None) -> int:
        """Requests the replicas serving `model` can take now without passing the in-flight limit
        (`admission.free_slots`); 0 means a first attempt would be held."""
        return free_slots(self.pool.eligible_states(model), self.settings.hold.max_in_flight_per_replica)

    def commit(self, prepared: Prepared, decision: Decision, now: float) -> None:
        """Record the prompt on the replica `decision` sent it to, hashing what `prepare` left unhashed. Once per
        attempt, `now` as given to `choose`."""
        hashes = prepared.chain.complete()
        if hashes:
            chosen = self.pool.get(decision.replica)
            is_confirmed = prepared.is_tokens and chosen is not None and chosen.has_live_kv_events
            self.index.record(decision.replica, hashes, now=now, predicted=is_confirmed)

    # --- load bookkeeping ---------------------------------------------------------------------------------

    def begin(self, replica: Replica, decision: Decision, prepared: Prepared, now: float) -> Ticket:
        s = replica.state
        uncached = max(0, prepared.prompt_tokens - decision.predicted_cached_tokens)
        ticket = Ticket(replica, decision, uncached, now, s.waiting_prompt_tokens)
        s.in_flight += 1
        s.waiting += 1
        s.waiting_prompt_tokens += uncached
        s.last_selected = now
        return ticket

    def first_byte(self, ticket: Ticket, now: float, *, is_stream: bool) -> float:
        """The replica answered; returns the time to first byte. Streams teach the prefill-rate estimate."""
        ttfb_s = now - ticket.started
        ticket.ttfb_s = ttfb_s
        if ticket.is_waiting:
            s = ticket.replica.state
            s.waiting -= 1
            s.waiting_prompt_tokens -= ticket.uncached_tokens
            s.streaming += 1
            ticket.is_waiting = False
            if is_stream:
                replica = ticket.replica
                before = replica.prefill_rate
                replica.prefill_rate = self.prefill_rate.update(
                    before,
                    uncached_tokens=ticket.uncached_tokens,
                    ttfb_s=ttfb_s,
                    queue_tokens_ahead=ticket.tokens_ahead,
                )
                s.prefill_tokens_per_s = replica.prefill_rate.tokens_per_s
                if before.num_observations == 0 and replica.prefill_rate is not before:
                    # A replica's first observation moves the fleet mean the most: re-seed the unobserved
                    # replicas then, not on every stream (that walk over the pool is O(replicas)).
                    self._share_rate_with_unobserved()
        return ttfb_s

    def finish(self, ticket: Ticket) -> None:
        if ticket.is_done:
            return
        ticket.is_done = True
        s = ticket.replica.state
        s.in_flight -= 1
        if ticket.is_waiting:
            s.waiting -= 1
            s.waiting_prompt_tokens -= ticket.uncached_tokens
            ticket.is_waiting = False
        else:
            s.streaming -= 1

    def add_replica(self, replica: Replica) -> None:
        replica.prefill_rate = self._unobserved_rate()
        replica.state.prefill_tokens_per_s = replica.prefill_rate.tokens_per_s
        self.index.add_replica(replica.id, replica.state.kv_capacity_blocks)

    def _unobserved_rate(self) -> PrefillRate:
        return self.prefill_rate.initial(r.prefill_rate for r in self.pool)

    def _share_rate_with_unobserved(self) -> None:
        start = self._unobserved_rate()
        for replica in self.pool:
            if replica.prefill_rate.num_observations == 0:
                replica.prefill_rate = start
                replica.state.prefill_tokens_per_s = start.tokens_per_s

    def remove_replica(self, replica_id: str) -> None:
        """The replica left the pool: its index entries go."""
        self.index.remove_replica(replica_id)

    def drop_cache(self, replica_id: str) -> None:
        """The replica went away unexpectedly (a crash loses its KV cache): forget what it held. Its learned
        prefill rate is kept: a restarted replica runs on the same hardware."""
        replica = self.pool.get(replica_id)
        self.index.remove_replica(replica_id)
        if replica is not None:
            self.index.add_replica(replica.id, replica.state.kv_capacity_blocks)
