"""Leader election on a `coordination.k8s.io/v1` Lease: one autoscaler acts, the others wait.

The protocol is client-go's. Every write of the Lease is a PUT carrying the resourceVersion it was decided on, so
of two candidates that race, one wins and the other gets 409 Conflict and reads again.
- A follower reads the Lease every `retry_period_s`. It takes the Lease when nobody holds it, or when the record
  has not changed for the holder's `leaseDurationSeconds` as measured on the follower's own clock since it
  first saw that record (so clocks of different machines never get compared).
- The leader renews every `retry_period_s`. If no renewal has succeeded for `renew_deadline_s` since the last
  successful one was sent, or the Lease names another holder, leadership is lost: the work is cancelled and
  `run_with_leader_election` raises `LeadershipLost`, so the process exits non-zero and its pod restarts as a
  follower. Since `renew_deadline_s < lease_duration_s`, the old leader stops before any follower may take over.
- On a clean exit (the work returns, fails, or is cancelled) the leader releases the Lease (no holder, 1 s
  duration), so a follower takes over at its next read instead of after a lease duration.

`may_take(...)` is the follower's decision as a pure function of what it observed and `now`. The client is
synchronous: each call runs in a worker thread with a request timeout no longer than the time left to renew.

RBAC: `coordination.k8s.io` `leases`: get, create, update, in the autoscaler's namespace.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import urllib3
from kubernetes import client as k8s

from autoscaler.actuators.kubernetes import load_api_client

log = logging.getLogger("shoal.autoscaler.leader")

T = TypeVar("T")

_REQUEST_TIMEOUT_S = 10.0
"""Seconds a Lease read or write may take when no renew deadline is closer."""


class LeaseSettings(Protocol):
    """What leader election reads from `KubernetesSettings`."""

    @property
    def namespace(self) -> str: ...

    @property
    def lease_name(self) -> str: ...

    @property
    def lease_duration_s(self) -> float: ...

    @property
    def renew_deadline_s(self) -> float: ...

    @property
    def retry_period_s(self) -> float: ...


class LeadershipLost(RuntimeError):
    """This process was the leader and no longer is; it must stop acting (and exit)."""


@dataclass(frozen=True)
class Observed:
    """The Lease record as a follower last saw it change."""

    resource_version: str
    holder: str
    lease_duration_s: float
    since: float
    """When this record was first seen, on the observer's clock (seconds)."""


def may_take(observed: Observed, identity: str, now: float) -> bool:
    """Whether `identity` may write itself into the Lease: it holds it, nobody does, or the holder's record has
    not changed for its whole lease duration."""
    if not observed.holder or observed.holder == identity:
        return True
    return now >= observed.since + observed.lease_duration_s


class LeaderElector:
    def __init__(
        self,
        settings: LeaseSettings,
        identity: str,
        *,
        api_client: k8s.ApiClient | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < settings.retry_period_s < settings.renew_deadline_s < settings.lease_duration_s:
            raise ValueError(
                "leader election needs 0 < retry_period_s < renew_deadline_s < lease_duration_s, got "
                f"{settings.retry_period_s}, {settings.renew_deadline_s}, {settings.lease_duration_s}"
            )
        if not identity:
            raise ValueError("leader election needs a non-empty identity (the pod name)")
        self.settings = settings
        self.identity = identity
        self.clock = clock
        self._owns_client = api_client is None
        self._api_client = api_client if api_client is not None else load_api_client()
        self._leases = k8s.CoordinationV1Api(self._api_client)
        self._observed: Observed | None = None
        self._lease: k8s.V1Lease | None = None
        """The Lease as last read or written: the base of the next conditional write."""
        self.renewed_at: float | None = None
        """When the last successful acquire or renew was sent, on `clock`; None while not leading."""

    def close(self) -> None:
        if self._owns_client:
            self._api_client.close()  # type: ignore[no-untyped-call]

    @property
    def is_leader(self) -> bool:
        return self.renewed_at is not None

    async def acquire(self) -> None:
        """Return once this candidate holds the Lease."""
        while True:
            if await self.try_acquire_or_renew():
                break
            await asyncio.sleep(self.settings.retry_period_s)
        log.info("%s is the leader (lease %s/%s)", self.identity, self.settings.namespace, self.settings.lease_name)

    async def keep_leading(self) -> None:
        """Renew until leadership is lost, then raise `LeadershipLost`. Never returns."""
        s = self.settings
        while True:
            await asyncio.sleep(s.retry_period_s)
            while True:
                assert self.renewed_at is not None
                left_s = self.renewed_at + s.renew_deadline_s - self.clock()
                if left_s <= 0:
                    self.renewed_at = None
                    raise LeadershipLost(f"{self.identity} could not renew the lease within {s.renew_deadline_s} s")
                if await self.try_acquire_or_renew(timeout_s=left_s):
                    break
                if self._observed is not None and self._observed.holder not in ("", self.identity):
                    self.renewed_at = None
                    raise LeadershipLost(f"{self.identity} lost the lease to {self._observed.holder}")
                await asyncio.sleep(min(s.retry_period_s, max(left_s, 0.0)))

    async def try_acquire_or_renew(self, *, timeout_s: float = _REQUEST_TIMEOUT_S) -> bool:
        """One read and, when allowed, one conditional write of the Lease; True when this candidate holds it."""
        s = self.settings
        started = self.clock()  # a write sent now lands after this: the leader's renewal counts from here
        try:
            lease = await self._call(self._leases.read_namespaced_lease, s.lease_name, s.namespace, timeout_s=timeout_s)
        except k8s.ApiException as exc:
            if exc.status != 404:
                log.warning("reading lease %s failed: HTTP %s %s", s.lease_name, exc.status, exc.reason)
                return False
            return await self._create(started, timeout_s)
        except (urllib3.exceptions.HTTPError, TimeoutError) as exc:
            log.warning("reading lease %s failed: %s", s.lease_name, exc)
            return False
        self._lease = lease
        self._observe(lease, self.clock())  # seen no earlier than now: a follower never counts from before the write
        assert self._observed is not None
        if not may_take(self._observed, self.identity, self.clock()):
            return False
        spec = lease.spec or k8s.V1LeaseSpec()
        now = _utcnow()
        is_transition = spec.holder_identity != self.identity
        lease.spec = k8s.V1LeaseSpec(
            holder_identity=self.identity,
            lease_duration_seconds=math.ceil(s.lease_duration_s),
            acquire_time=now if is_transition or spec.acquire_time is None else spec.acquire_time,
            renew_time=now,
            lease_transitions=(spec.lease_transitions or 0) + int(is_transition),
        )
        return await self._write(lease, started, timeout_s)

    async def release(self) -> None:
        """Give the Lease up (no holder, 1 s duration) if this candidate still holds it as last written."""
        lease, self.renewed_at = self._lease, None
        if lease is None or lease.spec is None or lease.spec.holder_identity != self.identity:
            return
        now = _utcnow()
        lease.spec = k8s.V1LeaseSpec(
            holder_identity="",
            lease_duration_seconds=1,
            acquire_time=now,
            renew_time=now,
            lease_transitions=lease.spec.lease_transitions,
        )
        s = self.settings
        try:
            await self._call(self._leases.replace_namespaced_lease, s.lease_name, s.namespace, lease)
        except (k8s.ApiException, urllib3.exceptions.HTTPError, TimeoutError) as exc:
            log.warning("%s could not release lease %s: %s", self.identity, s.lease_name, exc)
        else:
            log.info("%s released lease %s", self.identity, s.lease_name)

    # --- internals -----------------------------------------------------------------------------------------------

    async def _create(self, started: float, timeout_s: float) -> bool:
        s = self.settings
        now = _utcnow()
        body = k8s.V1Lease(
            metadata=k8s.V1ObjectMeta(name=s.lease_name, namespace=s.namespace),
            spec=k8s.V1LeaseSpec(
                holder_identity=self.identity,
                lease_duration_seconds=math.ceil(s.lease_duration_s),
                acquire_time=now,
                renew_time=now,
                lease_transitions=0,
            ),
        )
        try:
            lease = await self._call(self._leases.create_namespaced_lease, s.namespace, body, timeout_s=timeout_s)
        except (k8s.ApiException, urllib3.exceptions.HTTPError, TimeoutError) as exc:
            log.info("%s could not create lease %s: %s", self.identity, s.lease_name, exc)
            return False
        return self._won(lease, started)

    async def _write(self, lease: k8s.V1Lease, started: float, timeout_s: float) -> bool:
        s = self.settings
        try:
            written = await self._call(
                self._leases.replace_namespaced_lease, s.lease_name, s.namespace, lease, timeout_s=timeout_s
            )
        except k8s.ApiException as exc:
            if exc.status != 409:
                log.warning("writing lease %s failed: HTTP %s %s", s.lease_name, exc.status, exc.reason)
            return False
        except (urllib3.exceptions.HTTPError, TimeoutError) as exc:
            log.warning("writing lease %s failed: %s", s.lease_name, exc)
            return False
        return self._won(written, started)

    def _won(self, lease: k8s.V1Lease, started: float) -> bool:
        self._lease = lease
        self._observe(lease, self.clock())
        self.renewed_at = started  # the write may have landed any time after it was sent
        return True

    def _observe(self, lease: k8s.V1Lease, now: float) -> None:
        version = (lease.metadata.resource_version if lease.metadata else None) or ""
        if self._observed is not None and self._observed.resource_version == version:
            return
        spec = lease.spec or k8s.V1LeaseSpec()
        duration_s = float(spec.lease_duration_seconds or self.settings.lease_duration_s)
        self._observed = Observed(version, spec.holder_identity or "", duration_s, since=now)

    async def _call(self, fn: Callable[..., T], *args: Any, timeout_s: float = _REQUEST_TIMEOUT_S) -> T:
        timeout_s = max(min(timeout_s, _REQUEST_TIMEOUT_S), 0.05)
        return await asyncio.wait_for(asyncio.to_thread(fn, *args, _request_timeout=timeout_s), timeout_s + 0.5)


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


async def run_with_leader_election(
    settings: LeaseSettings,
    identity: str,
    run: Callable[[], Awaitable[None]],
    *,
    api_client: k8s.ApiClient | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Wait for the Lease, then run `run()` while holding it.

    Returns when `run()` returns, re-raises what it raises, and in both cases (and on cancellation) releases the
    Lease first. Raises `LeadershipLost`, after cancelling `run()`, when the Lease could not be renewed: the
    caller exits non-zero.
    """
    elector = LeaderElector(settings, identity, api_client=api_client, clock=clock)
    try:
        await elector.acquire()
        work = asyncio.create_task(_as_coroutine(run), name="leader-work")
        keeper = asyncio.create_task(elector.keep_leading(), name="leader-renew")
        try:
            await asyncio.wait({work, keeper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            work.cancel()
            keeper.cancel()
            await asyncio.wait({work, keeper})
        lost = None if keeper.cancelled() else keeper.exception()
        if lost is not None:
            log.error("%s", lost)
            raise lost
        work.result()
    finally:
        if elector.is_leader:
            await elector.release()
        elector.close()


async def _as_coroutine(run: Callable[[], Awaitable[None]]) -> None:
    await run()
