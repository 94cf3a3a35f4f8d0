"""The contract between the controller and what it scales.

The controller owns the decisions and the drain: it asks the actuator what exists (`observe`), grows the fleet
(`scale_up`), and, to shrink it, picks a victim, drains it through every router's admin API, and only then calls
`scale_down(victim, ...)`, which removes exactly that replica. An actuator never picks victims itself.

Replica phases: `starting` (created, not yet ready: capacity on its way, never serving capacity), `ready`,
`failed` (crashed, or still not ready after its start deadline), `terminating` (being removed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

ReplicaPhase = Literal["starting", "ready", "failed", "terminating"]


@dataclass(frozen=True)
class ReplicaInfo:
    name: str
    """Pod name, or the local replica's id."""
    url: str | None
    """Base URL the routers use (http://10.1.2.3:8000); None while the replica has no address yet."""
    phase: ReplicaPhase
    created_s: float
    """When the replica was created, on the actuator's clock (Unix seconds), for start deadlines."""


class ActuatorError(RuntimeError):
    """The actuator could not carry out a change (API error, conflict that persisted, process failed to start)."""


class Actuator(Protocol):
    async def observe(self) -> list[ReplicaInfo]:
        """Every replica that exists now, in any phase."""
        ...

    async def desired_replicas(self) -> int:
        """The replica count the actuator is currently asked to hold (the Deployment's spec.replicas)."""
        ...

    async def scale_up(self, target: int) -> None:
        """Grow to `target` replicas (target > the current desired count)."""
        ...

    async def scale_down(self, victim: ReplicaInfo, target: int) -> None:
        """Remove exactly `victim` (already drained by the controller) and hold `target` replicas."""
        ...
