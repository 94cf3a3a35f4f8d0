"""The routing core: from a prompt to a chosen replica, and the load bookkeeping around it.

The router's service (router/service/routing.py) and the simulator (simulations/routing.py) both drive this one
object, so the simulator's verdicts are those of the router's own steps. Per attempt:

    prepared = core.prepare(key, model, session_key, max_output_tokens)   # hashes as far as a match can go
               core.prepare_hashes(hashes, prompt_tokens, session_key)     # or the caller's own hashes
    decision = core.choose(prepared, eligible, now)    # None: no eligible replica with room; the caller holds it
    ticket   = core.begin(decision, prepared, now)     # waiting for its first byte, uncached tokens on the backlog
    core.commit(prepared, decision, now, has_live_kv_events=...)   # once the request is on its way
    core.first_byte(ticket, now, is_stream=...)        # waiting -> streaming; a stream teaches the prefill rate
    core.finish(ticket, now)                           # a request answered teaches the service time

- choose: the replicas under `max_in_flight_per_replica` (`admission.with_room`); a session's pin while it holds
  (`session.SessionTable`); ONLY_REPLICA without asking the policy when one is left; else `policy.select` over
  the match of the prompt's hashes in the prefix index.
- commit: the prompt's record in the index, all of its hashes (`prepare` hashes only up to the first block no
  replica holds: chained hashes cannot match past it). Approximate mode records the router's own decision. A
  token-id prompt sent to a replica whose KV events are live is recorded as a short-lived prediction that the
  engine's `stored` events confirm (or, with `records_predictions` off, not at all: the events alone fill the
  index). A text prompt is hashed over bytes no engine event names, so its record stays approximate.
- first_byte: the replica's prefill-rate estimate (`prefill_rate`) learns from the time to first byte and the
  backlog ahead at routing time, only for a stream: the first byte of a whole answer comes after its decode, and
  says nothing of the prefill. A replica's first observation re-seeds the replicas never observed with the fleet's
  mean, so that cache misses do not all go to the one replica that learned a higher rate than the prior. A stream
  too short to teach the rate teaches the fixed per-request time instead (`service_time`); replicas never
  observed take the fleet's mean fixed time and slot time, as they do its rate.
- finish with `now`, once the replica answered (streamed or not): its duration and the requests it joined behind
  teach the replica's batch-slot terms (`service_time`), which `estimated_ttft` turns into a wait for a slot.

Other routers of a fleet (`sharing.PeerRouters`): their decisions are recorded as this router's own commits would be
(`record_peer`), their session pins remembered (`pin`), and their load added to the replicas' load views
(`set_peer_load`), which keep this router's own share apart (`own_load`) for what it publishes and for admission.

Eligibility (health, draining, models) is the driver's: it passes the eligible replicas' states to `choose`. Pure:
`now` comes from the caller; no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from router.policy.admission import free_slots, with_room
from router.policy.hashing import (
    DEFAULT_TEXT_BLOCK_SIZE,
    DEFAULT_TOKEN_BLOCK_SIZE,
    ChainMemo,
    PromptChain,
    namespace_seed,
)
from router.policy.kv_events import KVEvent
from router.policy.prefill_rate import PrefillRate, PrefillRateEstimator
from router.policy.prefix_index import PrefixIndex
from router.policy.routing_text import RoutingKey
from router.policy.service_time import ServiceTime, ServiceTimeEstimator
from router.policy.session import SessionAffinityConfig, SessionTable
from router.policy.types import Branch, Decision, Policy, ReplicaState, RouteRequest


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """What the core needs of its driver's settings (the router's `RouterSettings`, a scenario's `router`)."""

    text_block_size: int = DEFAULT_TEXT_BLOCK_SIZE
    """Bytes per block of routing text (text mode)."""
    token_block_size: int = DEFAULT_TOKEN_BLOCK_SIZE
    """Tokens per block of a token-id prompt; the engines' KV block size."""
    bytes_per_token: float = 4.0
    """Average UTF-8 bytes per token, to estimate a text prompt's tokens."""
    memo_entries: int = 16384
    """Chunks of hashes `ChainMemo` remembers; 0 turns it off."""
    max_blocks: int = 8192
    """Leading blocks of a prompt that are hashed, matched and recorded."""
    max_in_flight_per_replica: int = 0
    """Replicas at this many requests in flight are not offered to the policy; 0: no limit."""
    session: SessionAffinityConfig = field(default_factory=SessionAffinityConfig)
    prefill_rate: PrefillRateEstimator = field(default_factory=PrefillRateEstimator)
    service_time: ServiceTimeEstimator = field(default_factory=ServiceTimeEstimator)
    infer_max_num_seqs: bool = True
    """Take a replica's batch limit from scrapes that see requests queued beside running ones
    (`ReplicaState.set_gauges`), and give replicas with none of their own the mean of the known ones."""
    use_index: bool = True
    """Match and record prompts in the prefix index. Off only for a policy that reads neither the match nor the
    backlog it feeds (the simulator's index-blind baselines), whose choices do not depend on it."""
    records_predictions: bool = True
    """With a replica's KV events live, record a token-id prompt sent there as a short-lived prediction (True), or
    leave the index to the events alone (False)."""

    def __post_init__(self) -> None:
        for name in ("text_block_size", "token_block_size", "max_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RoutingConfig.{name} must be positive, got {getattr(self, name)}")
        if not self.bytes_per_token > 0:
            raise ValueError(f"RoutingConfig.bytes_per_token must be positive, got {self.bytes_per_token}")
        if self.memo_entries < 0 or self.max_in_flight_per_replica < 0:
            raise ValueError("RoutingConfig.memo_entries and max_in_flight_per_replica must be >= 0")


@dataclass(slots=True)
class Prepared:
    """A request's routing inputs, computed once and reused across retries."""

    hashes: list[int]
    """The block hashes computed so far: as far as a decision needs, all of them once committed."""
    num_blocks: int
    """Blocks of the whole routing key (at most `max_blocks`), hashed or not."""
    prompt_tokens: int
    tokens_per_block: float
    model: str | None = None
    session_key: str | None = None
    """Read by session affinity; None unless the driver reads sessions (the router's `session_header`)."""
    max_output_tokens: int | None = None
    is_tokens: bool = True
    """Hashed over token ids (token mode), the units engines' KV events name."""
    chain: PromptChain | None = None
    """Hashes the rest on `commit`; None when `hashes` are all of them."""

    def complete(self) -> list[int]:
        """All of the routing key's hashes."""
        return self.hashes if self.chain is None else self.chain.complete()


@dataclass(slots=True)
class Ticket:
    """One attempt in flight on one replica."""

    replica_id: str
    state: ReplicaState
    decision: Decision
    uncached_tokens: int
    started: float
    tokens_ahead: int
    """Prefill backlog on the replica when this request joined it: part of what its first byte waited for."""
    num_ahead: int = 0
    """Requests in flight on the replica (all routers') when this one joined it: what it may queue behind."""
    is_waiting: bool = True
    is_done: bool = False
    ttfb_s: float | None = None
    """Time to the replica's first byte (its whole answer when not streamed), once it came."""


@dataclass(slots=True)
class _Tracked:
    state: ReplicaState
    rate: PrefillRate
    service: ServiceTime = field(default_factory=ServiceTime)


class RoutingCore:
    """Routing decisions and load bookkeeping over the replicas that joined (`add_replica`)."""

    def __init__(self, config: RoutingConfig, index: PrefixIndex, policy: Policy) -> None:
        self.config = config
        self.index = index
        self.policy = policy
        self.sessions = SessionTable(config.session)
        self._memo = ChainMemo(max_entries=config.memo_entries)
        self._seeds: dict[str | None, bytes] = {}
        self._replicas: dict[str, _Tracked] = {}

    # --- replicas --------------------------------------------------------------------------------------------

    def add_replica(self, state: ReplicaState) -> None:
        """A replica joined: its load view is `state` (the driver's object, which policies will be shown); it
        starts at the fleet's mean observed prefill rate, or the prior."""
        rate = self._unobserved_rate()
        service = self._unobserved_service()
        self._replicas[state.id] = _Tracked(state, rate, service)
        state.prefill_tokens_per_s = rate.tokens_per_s
        state.set_service(service.slot_s, service.slots, service.fixed_s)
        if self.config.infer_max_num_seqs and state.max_num_seqs is None:
            state.peer_max_num_seqs = self._peer_batch_limit()
        self.index.add_replica(state.id, state.kv_capacity_blocks)

    def remove_replica(self, replica_id: str) -> None:
        """The replica left: its index entries and learned rate go."""
        self._replicas.pop(replica_id, None)
        self.index.remove_replica(replica_id)

    def set_kv_capacity(self, replica_id: str, capacity_tokens: float) -> None:
        """The engine's KV cache holds `capacity_tokens` (its scraped cache size): the replica's guesses are
        bounded by that many index blocks, at the fewest tokens a block of either kind holds (a text block's
        estimate or a token block), so no block the engine can still hold is evicted from the index for it."""
        tracked = self._replicas.get(replica_id)
        if tracked is None:
            return
        cfg = self.config
        tokens_per_block = min(cfg.text_block_size / cfg.bytes_per_token, float(cfg.token_block_size))
        blocks = max(1, int(capacity_tokens / tokens_per_block))
        if blocks != tracked.state.kv_capacity_blocks:
            tracked.state.kv_capacity_blocks = blocks
            self.index.add_replica(replica_id, blocks)

    def drop_cache(self, replica_id: str) -> None:
        """The replica went away unexpectedly (a crash loses its KV cache): forget what it held. Its learned
        prefill rate is kept: a restarted replica runs on the same hardware."""
        tracked = self._replicas.get(replica_id)
        self.index.remove_replica(replica_id)
        if tracked is not None:
            self.index.add_replica(replica_id, tracked.state.kv_capacity_blocks)

    def state(self, replica_id: str) -> ReplicaState:
        return self._replicas[replica_id].state

    def set_gauges(
        self,
        replica_id: str,
        num_running: int | None,
        num_waiting: int | None,
        kv_usage: float | None,
        max_num_seqs: int | None = None,
    ) -> None:
        """A scrape of the replica's engine gauges (`ReplicaState.set_gauges`). With `infer_max_num_seqs`, when a
        replica's batch limit becomes known or changes, the replicas with none of their own take the mean of the
        known ones: as with prefill rates, a pool's replicas are usually one deployment, and a limit each replica
        would otherwise infer only from a queue of its own is a queue on each."""
        tracked = self._replicas.get(replica_id)
        if tracked is None:
            return
        infer = self.config.infer_max_num_seqs
        before = tracked.state.max_num_seqs
        tracked.state.set_gauges(num_running, num_waiting, kv_usage, max_num_seqs, infer_max_num_seqs=infer)
        if infer and tracked.state.max_num_seqs != before:
            self._share_batch_limits()

    def _share_batch_limits(self) -> None:
        peer = self._peer_batch_limit()
        for other in self._replicas.values():
            if other.state.max_num_seqs is None and other.state.peer_max_num_seqs != peer:
                other.state.peer_max_num_seqs = peer

    def _peer_batch_limit(self) -> float | None:
        limits = [t.state.max_num_seqs for t in self._replicas.values() if t.state.max_num_seqs is not None]
        return sum(limits) / len(limits) if limits else None

    def prefill_rate(self, replica_id: str) -> PrefillRate:
        """The replica's learned prefill rate (`prefill_rate.PrefillRate`)."""
        return self._replicas[replica_id].rate

    def apply_kv_events(self, replica_id: str, events: Sequence[KVEvent], seed: bytes, now: float) -> None:
        """A replica's KV events reached the router (exact mode): they update its entries in the index."""
        if replica_id not in self._replicas or not self.config.use_index:
            return
        for event in events:
            self.index.apply(replica_id, event, seed=seed, now=now)

    # --- other routers of a fleet (`sharing`) --------------------------------------------------------------------

    def has_replica(self, replica_id: str) -> bool:
        return replica_id in self._replicas

    def record_peer(self, replica_id: str, hashes: Sequence[int], now: float, *, predicted: bool) -> bool:
        """Another router sent a prompt with these hashes to the replica: record it as `commit` would have.
        False when the replica has not joined here (yet)."""
        if replica_id not in self._replicas:
            return False
        if self.config.use_index and hashes and not (predicted and not self.config.records_predictions):
            self.index.record(replica_id, hashes, now=now, predicted=predicted)
        return True

    def pin(self, session_key: str, replica_id: str) -> None:
        """Another router pinned the session to the replica."""
        self.sessions.remember(session_key, replica_id)

    def set_peer_load(self, replica_id: str, in_flight: int, waiting: int, waiting_prompt_tokens: int) -> None:
        """The other routers' requests on the replica, summed (`ReplicaState.set_peer_load`); policies see the
        sum of theirs and this router's own."""
        tracked = self._replicas.get(replica_id)
        if tracked is not None:
            tracked.state.set_peer_load(in_flight, waiting, waiting_prompt_tokens)

    def own_load(self, replica_id: str) -> tuple[int, int, int]:
        """This router's own (in flight, waiting, waiting prompt tokens) on the replica."""
        s = self._replicas[replica_id].state
        return s.own_in_flight, s.own_waiting, s.own_waiting_prompt_tokens

    # --- decisions ---------------------------------------------------------------------------------------------

    def prepare(
        self,
        key: RoutingKey,
        model: str | None,
        session_key: str | None = None,
        max_output_tokens: int | None = None,
    ) -> Prepared:
        """Hash a request's routing key (tokens or text) as far as any replica could match it."""
        seed = self._seeds.get(model)
        if seed is None:
            seed = self._seeds[model] = namespace_seed(model or "")
        cfg = self.config
        if key.token_ids is not None:
            chain = self._memo.chain_tokens(
                key.token_ids, seed, cfg.token_block_size, max_blocks=cfg.max_blocks, packed=key.packed
            )
            prompt_tokens = key.length
            tokens_per_block = float(cfg.token_block_size)
            is_tokens = True
        else:
            text = key.text or b""
            chain = self._memo.chain_text(text, seed, cfg.text_block_size, max_blocks=cfg.max_blocks)
            prompt_tokens = math.ceil(key.length / cfg.bytes_per_token)
            tokens_per_block = cfg.text_block_size / cfg.bytes_per_token
            is_tokens = False
        if cfg.use_index:
            chain.prefix(self.index.holds)
        return Prepared(
            chain.hashes,
            chain.num_blocks,
            prompt_tokens,
            tokens_per_block,
            model,
            session_key,
            max_output_tokens,
            is_tokens,
            chain,
        )

    def prepare_hashes(
        self,
        hashes: Sequence[int],
        prompt_tokens: int,
        session_key: str | None = None,
        *,
        model: str | None = None,
        max_output_tokens: int | None = None,
    ) -> Prepared:
        """A token-id prompt whose block hashes (`config.token_block_size` tokens each) the caller computed."""
        routed = list(hashes[: self.config.max_blocks])
        return Prepared(
            routed,
            len(routed),
            prompt_tokens,
            float(self.config.token_block_size),
            model,
            session_key,
            max_output_tokens,
        )

    def choose(
        self, prepared: Prepared, eligible: Sequence[ReplicaState], now: float, *, within_limit: bool = True
    ) -> Decision | None:
        """Pick a replica among `eligible` (joined replicas' states), or None when there is none; `within_limit`:
        only among those under `max_in_flight_per_replica`. The caller `begin`s and `commit`s a decision it acts
        on."""
        states = with_room(eligible, self.config.max_in_flight_per_replica) if within_limit else eligible
        if not states:
            return None
        hashes = prepared.hashes
        matched = self.index.match(hashes, now=now) if hashes and self.config.use_index else {}
        request = RouteRequest(
            hashes=hashes,
            prompt_tokens=prepared.prompt_tokens,
            tokens_per_block=prepared.tokens_per_block,
            matched_blocks=matched,
            session_key=prepared.session_key,
            max_output_tokens=prepared.max_output_tokens,
            num_blocks=prepared.num_blocks,
        )
        session_key = prepared.session_key
        decision = self.sessions.decide(request, states) if session_key is not None else None
        if decision is None:
            if len(states) == 1:
                only = states[0].id
                decision = Decision(only, Branch.ONLY_REPLICA, matched.get(only, 0), request.cached_tokens(only))
            else:
                decision = self.policy.select(request, states, now=now)
        if session_key is not None:
            self.sessions.remember(session_key, decision.replica)
        return decision

    def free_slots(self, eligible: Sequence[ReplicaState]) -> int:
        """Requests `eligible` can take now without passing the in-flight limit (`admission.free_slots`); 0 means
        a first attempt would be held."""
        return free_slots(eligible, self.config.max_in_flight_per_replica)

    def commit(
        self,
        prepared: Prepared,
        decision: Decision,
        now: float,
        *,
        has_live_kv_events: bool = False,
        engine_block_size: int | None = None,
    ) -> None:
        """Record the prompt on the replica `decision` sent it to (module docstring), hashing what `prepare` left
        unhashed. Once per attempt, `now` as given to `choose`; `has_live_kv_events`: that replica's KV-event
        stream is connected and in sync; `engine_block_size`: its KV block in tokens where known."""
        if not self.config.use_index:
            return
        hashes = self.cacheable(prepared, engine_block_size)
        if not hashes:
            return
        is_predicted = prepared.is_tokens and has_live_kv_events
        if is_predicted and not self.config.records_predictions:
            return
        self.index.record(decision.replica, hashes, now=now, predicted=is_predicted)

    def cacheable(self, prepared: Prepared, engine_block_size: int | None) -> list[int]:
        """The prompt's block hashes an engine with `engine_block_size`-token blocks can hold: a token prompt's up
        to its last whole engine block (vLLM's CPU blocks are 128 tokens, the router's 16), else all of them."""
        hashes = prepared.complete()
        block = self.config.token_block_size
        if prepared.is_tokens and engine_block_size and engine_block_size > block and engine_block_size % block == 0:
            span = engine_block_size // block
            return hashes[: len(hashes) // span * span]
        return hashes

    # --- load bookkeeping ----------------------------------------------------------------------------------------

    def begin(self, decision: Decision, prepared: Prepared, now: float) -> Ticket:
        """The request goes to `decision.replica` (a joined replica): count it as waiting for its first byte."""
        state = self._replicas[decision.replica].state
        uncached = max(0, prepared.prompt_tokens - decision.predicted_cached_tokens)
        ticket = Ticket(
            decision.replica, state, decision, uncached, now, state.waiting_prompt_tokens, state.queue_depth
        )
        state.begin(uncached, now)
        return ticket

    def first_byte(self, ticket: Ticket, now: float, *, is_stream: bool) -> float:
        """The replica answered; returns the time to first byte. A stream teaches the prefill-rate estimate."""
        ttfb_s = now - ticket.started
        ticket.ttfb_s = ttfb_s
        if ticket.is_waiting and not ticket.is_done:
            ticket.is_waiting = False
            ticket.state.first_byte(ticket.uncached_tokens)
            tracked = self._replicas.get(ticket.replica_id)
            if is_stream and tracked is not None and tracked.state is ticket.state:
                self._learn(tracked, ticket, ttfb_s)
        return ttfb_s

    def finish(self, ticket: Ticket, now: float | None = None) -> None:
        """The attempt is over (answered, failed or abandoned); once per ticket, later calls do nothing. With `now`,
        an attempt the replica answered (it had a first byte) teaches the replica's service time."""
        if ticket.is_done:
            return
        ticket.is_done = True
        ticket.state.finish(ticket.uncached_tokens, is_waiting=ticket.is_waiting)
        ticket.is_waiting = False
        if now is None or ticket.ttfb_s is None:
            return
        tracked = self._replicas.get(ticket.replica_id)
        if tracked is None or tracked.state is not ticket.state:
            return
        service = self.config.service_time.observe_finish(
            tracked.service,
            duration_s=now - ticket.started,
            num_ahead=ticket.num_ahead,
            known_slots=tracked.state.max_num_seqs,
        )
        self._set_service(tracked, service)

    def service_time(self, replica_id: str) -> ServiceTime:
        """The replica's learned service terms (`service_time.ServiceTime`)."""
        return self._replicas[replica_id].service

    def _set_service(self, tracked: _Tracked, service: ServiceTime) -> None:
        before = tracked.service
        if service is before:
            return
        tracked.service = service
        tracked.state.set_service(service.slot_s, service.slots, service.fixed_s)
        if (before.num_fixed_observations == 0 < service.num_fixed_observations) or (
            before.num_slot_observations == 0 < service.num_slot_observations
        ):
            # As with prefill rates: a replica never observed takes the fleet's mean, or the one that learned a
            # fixed cost would look slower than replicas that merely have not shown theirs yet.
            start = self._unobserved_service()
            for other in self._replicas.values():
                s = other.service
                if s.num_fixed_observations == 0 or s.num_slot_observations == 0:
                    fixed_s = start.fixed_s if s.num_fixed_observations == 0 else s.fixed_s
                    slot_s = start.slot_s if s.num_slot_observations == 0 else s.slot_s
                    other.service = replace(s, fixed_s=fixed_s, slot_s=slot_s)
                    other.state.set_service(slot_s, s.slots, fixed_s)

    def _unobserved_service(self) -> ServiceTime:
        """The service terms of a replica never observed: the means of the observed replicas' (module docstring)."""
        services = [t.service for t in self._replicas.values()]
        fixed = [s.fixed_s for s in services if s.num_fixed_observations > 0]
        slot = [s.slot_s for s in services if s.num_slot_observations > 0 and s.slot_s is not None]
        return ServiceTime(
            slot_s=sum(slot) / len(slot) if slot else None, fixed_s=sum(fixed) / len(fixed) if fixed else 0.0
        )

    def _learn(self, tracked: _Tracked, ticket: Ticket, ttfb_s: float) -> None:
        slots = tracked.state.batch_slots
        had_free_slot = ticket.num_ahead < (slots if slots is not None else 1)
        self._set_service(
            tracked,
            self.config.service_time.observe_first_byte(
                tracked.service,
                ttfb_s=ttfb_s,
                work_tokens=ticket.uncached_tokens + ticket.tokens_ahead,
                tokens_per_s=tracked.rate.tokens_per_s,
                had_free_slot=had_free_slot,
            ),
        )
        before = tracked.rate
        tracked.rate = self.config.prefill_rate.update(
            before,
            uncached_tokens=ticket.uncached_tokens,
            ttfb_s=ttfb_s - tracked.service.fixed_s,
            queue_tokens_ahead=ticket.tokens_ahead,
        )
        if tracked.rate is before:
            return
        tracked.state.prefill_tokens_per_s = tracked.rate.tokens_per_s
        if before.num_observations == 0:
            # A replica's first observation moves the fleet mean the most: re-seed the unobserved replicas then,
            # not on every stream (that walk over the replicas is O(replicas)).
            start = self._unobserved_rate()
            for other in self._replicas.values():
                if other.rate.num_observations == 0:
                    other.rate = start
                    other.state.prefill_tokens_per_s = start.tokens_per_s

    def _unobserved_rate(self) -> PrefillRate:
        return self.config.prefill_rate.initial(t.rate for t in self._replicas.values())
