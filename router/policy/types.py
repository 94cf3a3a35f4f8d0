"""The vocabulary shared by every routing policy, the live router and the simulator.

A driver (the router's service, or the simulator) builds a `RouteRequest` (block hashes, estimated prompt
tokens, and the per-replica prefix match from the `PrefixIndex`) and a `ReplicaState` per eligible replica,
then calls `policy.select(request, replicas, now=now)`. The `Decision` names the replica and the `Branch` that
explains why; drivers count branches in metrics and tests assert on them.

Only eligible replicas are passed: healthy, not draining, serving the requested model. `replicas` is never
empty; a driver with no eligible replica does not call the policy.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel, ConfigDict


class Branch(enum.StrEnum):
    """Why a replica was chosen. Values are stable: they are metric labels and response headers."""

    CACHE_HIT = "cache_hit"
    """The chosen replica holds (part of) the prompt prefix and that is why it won."""
    CACHE_MISS = "cache_miss"
    """No replica holds a useful prefix; the least-loaded (or cheapest) replica was chosen."""
    SPILL = "spill"
    """A replica held a longer prefix, but its prefill backlog (or speed) made another replica the better choice."""
    SPILL_QUEUE = "spill_queue"
    """A replica held a longer prefix, but its queue for batch slots made another replica the better choice: without
    its slot wait it would have won."""
    IMBALANCE = "imbalance"
    """Load imbalance overrode cache affinity (sglang_cache_aware's switch)."""
    OVERLOADED = "overloaded"
    """Every replica was past its hard queue cap; the least bad one was chosen."""
    SESSION = "session"
    """Session affinity (a session-key header) picked the replica."""
    ONLY_REPLICA = "only_replica"
    """There was a single eligible replica."""
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    LEAST_LOAD = "least_load"
    POWER_OF_TWO = "power_of_two"
    CONSISTENT_HASH = "consistent_hash"


@dataclass(slots=True)
class ReplicaState:
    """What a policy may know of one replica at decision time.

    Router-local counts are exact and current; scraped gauges lag by up to a scrape interval and are None until
    the first successful scrape (or for engines that do not export them).
    """

    id: str
    in_flight: int = 0
    """Requests this router has sent and not yet finished."""
    waiting: int = 0
    """Of `in_flight`, those still waiting for their first byte (the prefill backlog)."""
    waiting_prompt_tokens: int = 0
    """Uncached prompt tokens of the `waiting` requests, as predicted when they were routed."""
    streaming: int = 0
    """Of `in_flight`, those streaming output (decoding)."""
    num_running: int | None = None
    """Scraped: sequences the engine is running (vllm:num_requests_running, sglang:num_running_reqs)."""
    num_waiting: int | None = None
    """Scraped: sequences queued in the engine (vllm:num_requests_waiting, sglang:num_queue_reqs)."""
    kv_usage: float | None = None
    """Scraped: fraction of the KV cache in use, 0..1 (vllm:kv_cache_usage_perc, sglang:token_usage)."""
    prefill_tokens_per_s: float = 10_000.0
    """Learned prefill rate of this replica, tokens per second (see `prefill_rate.PrefillRateEstimator`)."""
    kv_capacity_blocks: int | None = None
    """KV cache size in index blocks, when known (from settings or the engine)."""
    last_selected: float = float("-inf")
    """`now` of the last time a policy chose this replica (least-recently-chosen tie break)."""
    max_num_seqs: int | None = None
    """The engine's batch slots (sequences it runs at once), when known: scraped (SGLang's
    sglang:max_running_requests, Shoal's shoal_replica_max_num_seqs), or (`infer_max_num_seqs`) the largest running
    count seen once a scrape saw requests queued in the engine. None: unknown."""
    most_running: int = 0
    """The largest scraped `num_running`: the engine has at least this many batch slots."""
    peer_max_num_seqs: float | None = None
    """For a replica with no `max_num_seqs` of its own: the mean of the other replicas' (`RoutingCore.set_gauges`),
    so that a limit inferred on one replica of a pool prices the slot wait on its peers before each has queued."""
    slot_s: float | None = None
    """Learned mean seconds a request holds a batch slot here (`service_time`); None until one finished."""
    learned_slots: float | None = None
    """Batch slots learned from latencies (`service_time`), used when `max_num_seqs` is unknown."""
    fixed_s: float = 0.0
    """Learned seconds of each first byte that no prefill token explains (`service_time`)."""
    peer_in_flight: int = 0
    """Of `in_flight`, the requests other routers reported (router fleet, `sharing`); 0 for a router alone."""
    peer_waiting: int = 0
    """Of `waiting`, those other routers reported."""
    peer_waiting_prompt_tokens: int = 0
    """Of `waiting_prompt_tokens`, those other routers reported."""
    in_flight_at_scrape: int = 0
    """`in_flight` when the engine's gauges were last set: what of the engine's count was this router's own."""

    def begin(self, uncached_tokens: int, now: float) -> None:
        """A request was sent here: it waits for its first byte with `uncached_tokens` of prefill."""
        self.in_flight += 1
        self.waiting += 1
        self.waiting_prompt_tokens += uncached_tokens
        self.last_selected = now

    def first_byte(self, uncached_tokens: int) -> None:
        """A request `begin` counted got its first byte: it moves from waiting to streaming."""
        self.waiting -= 1
        self.waiting_prompt_tokens -= uncached_tokens
        self.streaming += 1

    def finish(self, uncached_tokens: int, *, is_waiting: bool) -> None:
        """A request `begin` counted ended, still waiting for its first byte or streaming."""
        self.in_flight -= 1
        if is_waiting:
            self.waiting -= 1
            self.waiting_prompt_tokens -= uncached_tokens
        else:
            self.streaming -= 1

    def set_gauges(
        self,
        num_running: int | None,
        num_waiting: int | None,
        kv_usage: float | None,
        max_num_seqs: int | None = None,
        infer_max_num_seqs: bool = False,
    ) -> None:
        """The engine's gauges, as a scrape of its metrics read them; `max_num_seqs` when the engine exports its
        batch limit. With `infer_max_num_seqs`, once a scrape sees requests queued beside running ones, the largest
        running count seen is the limit (a request that arrived between two steps queues briefly, so the count of
        that scrape can be far below it). The caller decides (`RoutingConfig.infer_max_num_seqs`); an engine whose
        KV cache is full queues too, and then that concurrency reads as its limit."""
        self.num_running = num_running
        self.num_waiting = num_waiting
        self.kv_usage = kv_usage
        self.in_flight_at_scrape = self.in_flight
        if num_running is not None and num_running > self.most_running:
            self.most_running = num_running
        if max_num_seqs is not None and max_num_seqs > 0:
            self.max_num_seqs = max_num_seqs
        elif infer_max_num_seqs and self.most_running and (num_waiting or self.max_num_seqs is not None):
            self.max_num_seqs = self.most_running

    def set_service(self, slot_s: float | None, learned_slots: float | None, fixed_s: float) -> None:
        """The learned service terms (`service_time.ServiceTime`)."""
        self.slot_s = slot_s
        self.learned_slots = learned_slots
        self.fixed_s = fixed_s

    @property
    def batch_slots(self) -> float | None:
        """Batch slots the policy assumes: the engine's known limit, else the learned one, else the peers' (either
        at least the most the engine was seen running), else None."""
        if self.max_num_seqs is not None:
            return float(self.max_num_seqs)
        slots = self.learned_slots if self.learned_slots is not None else self.peer_max_num_seqs
        if slots is None:
            return None
        most = self.most_running
        return slots if slots >= most else float(most)  # max(slots, most), without the builtin's cost

    def set_peer_load(self, in_flight: int, waiting: int, waiting_prompt_tokens: int) -> None:
        """Other routers' requests here, summed: they replace the previous peer share of the load fields, so that
        policies see the fleet's load while this router's own `begin`/`finish` keep counting its own."""
        d_in_flight = in_flight - self.peer_in_flight
        d_waiting = waiting - self.peer_waiting
        self.in_flight += d_in_flight
        self.waiting += d_waiting
        self.streaming += d_in_flight - d_waiting
        self.waiting_prompt_tokens += waiting_prompt_tokens - self.peer_waiting_prompt_tokens
        self.peer_in_flight = in_flight
        self.peer_waiting = waiting
        self.peer_waiting_prompt_tokens = waiting_prompt_tokens

    @property
    def own_in_flight(self) -> int:
        """Requests in flight that this router sent."""
        return self.in_flight - self.peer_in_flight

    @property
    def own_waiting(self) -> int:
        return self.waiting - self.peer_waiting

    @property
    def own_waiting_prompt_tokens(self) -> int:
        return self.waiting_prompt_tokens - self.peer_waiting_prompt_tokens

    @property
    def queue_depth(self) -> int:
        """Best estimate of requests queued or running on the replica: this router's own (exact and current) plus
        those the engine counted beyond them at its last scrape (sent by clients or routers this one does not
        hear from). The engine's count alone lags a scrape interval: a replica that drained since looks busy."""
        engine = (self.num_running or 0) + (self.num_waiting or 0)
        foreign = engine - self.in_flight_at_scrape
        return self.in_flight + foreign if foreign > 0 else self.in_flight


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """One request as policies see it."""

    hashes: Sequence[int]
    """Chained block hashes of the routing key (router.policy.hashing), at least as far as any replica matches."""
    prompt_tokens: int
    """Prompt length in tokens (estimated from bytes in text mode)."""
    tokens_per_block: float
    """Tokens one block stands for: the block size in token mode, bytes per block / bytes per token in text mode."""
    matched_blocks: Mapping[str, int] = field(default_factory=dict)
    """Prefix match per replica id, in blocks, from `PrefixIndex.match`; absent means 0."""
    session_key: str | None = None
    """Session-affinity key (a header), when the client sent one."""
    max_output_tokens: int | None = None
    """The request's max_tokens, when given (a decode-length hint)."""
    num_blocks: int | None = None
    """Blocks of the whole routing key when `hashes` holds only their prefix (the live router hashes up to the
    first block no replica holds, `hashing.PromptChain`); None: `len(hashes)`."""

    @property
    def total_blocks(self) -> int:
        """Blocks of the whole routing key, hashed or not."""
        return len(self.hashes) if self.num_blocks is None else self.num_blocks

    def cached_tokens(self, replica_id: str) -> int:
        """Predicted cached prompt tokens on a replica, never more than the prompt."""
        cached = int(self.matched_blocks.get(replica_id, 0) * self.tokens_per_block)
        return cached if cached < self.prompt_tokens else self.prompt_tokens


@dataclass(frozen=True, slots=True)
class Decision:
    """A routing decision and why it was taken."""

    replica: str
    branch: Branch
    matched_blocks: int = 0
    """Blocks of the prompt predicted to be cached on the chosen replica."""
    predicted_cached_tokens: int = 0
    predicted_ttft_s: float | None = None
    """The policy's estimate of time to first token on the chosen replica, when it makes one."""


class PolicyConfigModel(BaseModel):
    """Base of every policy's configuration (each beside its policy): frozen, unknown fields an error, every field
    documented by its docstring. `router.policy.config` gathers them into one union discriminated by `kind`."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class Policy(Protocol):
    """A routing policy. Implementations may keep their own state (a round-robin cursor, a seeded RNG), but no
    I/O, no clock of their own and no globals."""

    name: str

    def select(self, request: RouteRequest, replicas: Sequence[ReplicaState], *, now: float) -> Decision: ...
