"""The replica pool: who the replicas are, whether they may take traffic, and their live load.

A replica takes new requests when it is healthy, its circuit is closed and it is not draining. Health comes from
active probes (`HealthChecker`) and from passive marking: a refused connection takes a replica out of rotation at
once instead of after the next probe, and the prober then checks it at a short interval, so a restarted replica
is back within `unhealthy_interval_s` of its first good answer. The circuit breaker opens after consecutive
failed requests (5xx, transport errors) and closes on the first good probe after `open_s`.

State transitions take `now` from the caller; nothing here sleeps or does I/O. Listeners hear of replicas joining
and leaving the pool, whoever adds or removes them (the static list, the admin API, discovery): what follows a
replica's lifecycle, such as its KV-event stream, hooks in there.

Every routing decision needs the eligible replicas' load views (`eligible_states`). The pool keeps those lists by
model between requests and drops them when a replica joins or leaves, or when one of the properties eligibility
reads (`is_healthy`, `is_draining`, `circuit_open_until`, `model_cards`) is set to a different value: their setters
tell the pool, so `model_cards` is replaced, never changed in place.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from router.policy.types import ReplicaState
from router.service.replica_url import replica_id, split_url
from router.service.settings import BreakerSettings, HealthSettings

_MAX_CACHED_MODELS = 64
"""Models whose eligible lists the pool keeps at once (clients name the model, so the set is not bounded)."""


class Status(enum.StrEnum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    CIRCUIT_OPEN = "circuit_open"
    DRAINING = "draining"


@dataclass(slots=True, eq=False)
class Replica:
    url: str
    id: str
    state: ReplicaState
    """The load view the policies see (in-flight split, scraped gauges, learned prefill rate)."""
    host: str
    port: int
    base_path: str
    """Path prefix of the replica's API, usually empty (requests go to base_path + /v1/...)."""
    consecutive_probe_failures: int = 0
    consecutive_probe_successes: int = 0
    consecutive_request_failures: int = 0
    last_error: str | None = None
    probe_now: bool = False
    """Set by passive failure marking: the prober checks this replica on its next tick."""
    next_probe_at: float = 0.0
    probes_since_models: int = 0
    is_kv_capacity_configured: bool = False
    """The KV capacity came from the admin API: a scrape of the engine's cache size does not replace it."""
    kv_block_size: int | None = None
    """Tokens per KV block of the engine, from its scrapes (vLLM's `vllm:cache_config_info`); None until known."""
    has_live_kv_events: bool = False
    """True while the replica's KV-event stream is connected and in sync: its `stored` events will confirm what
    the router sends it, so the router records its own guesses as short-lived predictions only."""
    on_eligibility_change: Callable[[], None] | None = field(default=None, repr=False)
    """Called when an eligibility property takes a different value; the pool's hook."""
    _model_cards: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)
    _is_healthy: bool = field(default=False, repr=False)
    _is_draining: bool = field(default=False, repr=False)
    _circuit_open_until: float | None = field(default=None, repr=False)

    # --- what eligibility reads: set through these, so the pool hears of a change -------------------------

    @property
    def model_cards(self) -> dict[str, dict[str, Any]]:
        """The replica's /v1/models entries by model id; empty until known (then it is assumed to serve any).
        Replaced, never changed in place."""
        return self._model_cards

    @model_cards.setter
    def model_cards(self, value: dict[str, dict[str, Any]]) -> None:
        is_changed = value != self._model_cards
        self._model_cards = value
        if is_changed:
            self._eligibility_changed()

    @property
    def is_healthy(self) -> bool:
        """False until the first good probe: a replica joins rotation only once it answers."""
        return self._is_healthy

    @is_healthy.setter
    def is_healthy(self, value: bool) -> None:
        if value != self._is_healthy:
            self._is_healthy = value
            self._eligibility_changed()

    @property
    def is_draining(self) -> bool:
        return self._is_draining

    @is_draining.setter
    def is_draining(self, value: bool) -> None:
        if value != self._is_draining:
            self._is_draining = value
            self._eligibility_changed()

    @property
    def circuit_open_until(self) -> float | None:
        """Set while the circuit is open: the earliest `now` at which a good probe may close it."""
        return self._circuit_open_until

    @circuit_open_until.setter
    def circuit_open_until(self, value: float | None) -> None:
        if value != self._circuit_open_until:
            self._circuit_open_until = value
            self._eligibility_changed()

    def _eligibility_changed(self) -> None:
        if self.on_eligibility_change is not None:
            self.on_eligibility_change()

    @property
    def models(self) -> frozenset[str]:
        return frozenset(self.model_cards)

    @property
    def status(self) -> Status:
        if self.is_draining:
            return Status.DRAINING
        if not self.is_healthy:
            return Status.UNHEALTHY
        if self.circuit_open_until is not None:
            return Status.CIRCUIT_OPEN
        return Status.HEALTHY

    @property
    def is_eligible(self) -> bool:
        return self.is_healthy and not self.is_draining and self.circuit_open_until is None

    def serves(self, model: str | None) -> bool:
        cards = self.model_cards  # a dict look-up: this runs per replica on every request
        return model is None or not cards or model in cards

    # --- health and circuit transitions -----------------------------------------------------------------

    def probe_succeeded(self, health: HealthSettings, now: float) -> bool:
        """Record a good probe; returns True when this put the replica back into rotation."""
        was_eligible = self.is_eligible
        self.consecutive_probe_failures = 0
        self.consecutive_probe_successes += 1
        self.probe_now = False
        if self.consecutive_probe_successes >= health.success_threshold:
            self.is_healthy = True
            self.last_error = None
        if self.circuit_open_until is not None and now >= self.circuit_open_until:
            self.circuit_open_until = None
            self.consecutive_request_failures = 0
        return self.is_eligible and not was_eligible

    def probe_failed(self, health: HealthSettings, error: str) -> bool:
        """Record a failed probe; returns True when this took the replica out of rotation."""
        self.consecutive_probe_successes = 0
        self.consecutive_probe_failures += 1
        self.probe_now = False
        self.last_error = error
        if self.is_healthy and self.consecutive_probe_failures >= health.failure_threshold:
            self.is_healthy = False
            return True
        return False

    def mark_unreachable(self, error: str) -> bool:
        """Passive marking: a connection to the replica was refused or reset. Out of rotation at once."""
        was_healthy = self.is_healthy
        self.is_healthy = False
        self.consecutive_probe_successes = 0
        self.last_error = error
        self.probe_now = True
        return was_healthy

    def request_failed(self, breaker: BreakerSettings, now: float, error: str) -> bool:
        """Count a failed request; returns True when this opened the circuit."""
        self.consecutive_request_failures += 1
        self.last_error = error
        if self.circuit_open_until is None and self.consecutive_request_failures >= breaker.failure_threshold:
            self.circuit_open_until = now + breaker.open_s
            self.probe_now = True
            return True
        return False

    def request_succeeded(self) -> None:
        self.consecutive_request_failures = 0


class PoolListener(Protocol):
    """Told, synchronously and in order, of each replica that joins or leaves the pool. `replica_added` runs inside
    `ReplicaPool.add`, before its caller has indexed the replica: work that needs the index belongs in a task."""

    def replica_added(self, replica: Replica) -> None: ...

    def replica_removed(self, replica: Replica) -> None: ...


class ReplicaPool:
    """Replicas by id, in insertion order."""

    def __init__(self) -> None:
        self._replicas: dict[str, Replica] = {}
        self._listeners: list[PoolListener] = []
        self._eligible_states: dict[str | None, list[ReplicaState]] = {}
        """`eligible_states(model)` by model, until a replica joins, leaves or changes eligibility."""

    def add_listener(self, listener: PoolListener) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: PoolListener) -> None:
        self._listeners.remove(listener)

    def __iter__(self) -> Iterator[Replica]:
        return iter(list(self._replicas.values()))

    def __len__(self) -> int:
        return len(self._replicas)

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._replicas

    def get(self, replica_id: str) -> Replica | None:
        return self._replicas.get(replica_id)

    def add(self, url: str, *, name: str | None = None, kv_capacity_blocks: int | None = None) -> Replica:
        url = url.rstrip("/")
        rid = name or replica_id(url)
        existing = self._replicas.get(rid)
        if existing is not None:
            if existing.url != url:
                raise ValueError(f"replica id {rid!r} is already used by {existing.url}")
            existing.is_draining = False
            return existing
        host, port, base_path = split_url(url)
        replica = Replica(
            url=url,
            id=rid,
            state=ReplicaState(id=rid, kv_capacity_blocks=kv_capacity_blocks),
            host=host,
            port=port,
            base_path=base_path,
        )
        replica.probe_now = True
        replica.is_kv_capacity_configured = kv_capacity_blocks is not None
        replica.on_eligibility_change = self._eligible_states.clear
        self._replicas[rid] = replica
        self._eligible_states.clear()
        for listener in self._listeners:
            listener.replica_added(replica)
        return replica

    def remove(self, replica_id: str) -> Replica | None:
        replica = self._replicas.pop(replica_id, None)
        if replica is not None:
            replica.on_eligibility_change = None
            self._eligible_states.clear()
            for listener in self._listeners:
                listener.replica_removed(replica)
        return replica

    def eligible(self, model: str | None, exclude: Iterable[str] = ()) -> list[Replica]:
        """Replicas that may take a request for `model` (`Replica.is_eligible` and `Replica.serves`), except
        `exclude`. The two predicates are inlined, on the properties' own fields: this runs per replica on every
        retry and after every change of eligibility."""
        excluded = set(exclude) if exclude else ()
        return [
            r
            for r in self._replicas.values()
            if r._is_healthy
            and not r._is_draining
            and r._circuit_open_until is None
            and (model is None or not r._model_cards or model in r._model_cards)
            and r.id not in excluded
        ]

    def eligible_states(self, model: str | None, exclude: Iterable[str] = ()) -> Sequence[ReplicaState]:
        """The load views of `eligible(model, exclude)`, in pool order. Without `exclude` (a first attempt) the
        list is kept until eligibility changes (module docstring) and shared between calls: read it, never
        change it."""
        if exclude:
            return [r.state for r in self.eligible(model, exclude)]
        states = self._eligible_states.get(model)
        if states is None:
            if len(self._eligible_states) >= _MAX_CACHED_MODELS:
                self._eligible_states.clear()
            states = self._eligible_states[model] = [r.state for r in self.eligible(model)]
        return states

    def is_model_known(self, model: str) -> bool:
        """False only when every replica has reported its models and none serves `model`."""
        if not self._replicas:
            return False
        return any(r.serves(model) for r in self._replicas.values())
