"""A fleet on a virtual clock that obeys the policy's decisions, for the policy tests (STYLE.md 12).

Scale-ups create replicas that become ready `start_s` later (a cold start); scale-downs remove starting replicas
first, then ready ones. Each `tick` advances nothing by itself: `run` steps the clock by `interval_s` and asks the
demand function for the fleet's load at each step. Nothing sleeps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from autoscaler.policy import Action, Demand, Observation, ScaleDecision, ScalerState, ScalingPolicyConfig, decide


@dataclass
class VirtualFleet:
    config: ScalingPolicyConfig
    start_s: float = 120.0
    """Seconds from creation to ready. A replica that should never become ready gets `float('inf')`."""
    num_ready: int = 1
    now: float = 0.0
    starting: list[float] = field(default_factory=list)
    """Creation times of replicas not yet ready."""
    state: ScalerState = field(default_factory=ScalerState)
    history: list[tuple[float, ScaleDecision]] = field(default_factory=list)
    num_created: int = 0

    def tick(self, demand: Demand | None, *, metrics_age_s: float = 0.0) -> ScaleDecision:
        became_ready = [t for t in self.starting if self.now - t >= self.start_s]
        self.starting = [t for t in self.starting if self.now - t < self.start_s]
        self.num_ready += len(became_ready)
        observation = Observation(
            demand=demand, metrics_age_s=metrics_age_s, num_ready=self.num_ready, starting_since=tuple(self.starting)
        )
        decision, self.state = decide(observation, self.state, self.config, now=self.now)
        self.history.append((self.now, decision))
        if decision.num_overdue:
            # The controller removes replicas past their start deadline before they are replaced.
            self.starting = [t for t in self.starting if self.now - t < self.config.start_deadline_s]
        change = decision.target_replicas - decision.current_replicas
        if change > 0:
            self.starting += [self.now] * change
            self.num_created += change
        elif change < 0:
            for _ in range(-change):
                if self.starting:
                    self.starting.pop()
                else:
                    self.num_ready -= 1
        return decision

    def run(
        self,
        until: float,
        demand: Callable[[float], Demand | None],
        *,
        interval_s: float = 2.0,
        metrics_age_s: float = 0.0,
    ) -> list[ScaleDecision]:
        decisions = []
        while self.now < until:
            decisions.append(self.tick(demand(self.now), metrics_age_s=metrics_age_s))
            self.now += interval_s
        return decisions

    @property
    def size(self) -> int:
        return self.num_ready + len(self.starting)

    def actions(self, since: float = 0.0) -> list[tuple[float, Action, int]]:
        """(time, action, target) of every decision that changed the size."""
        return [(t, d.action, d.target_replicas) for t, d in self.history if t >= since and d.action != Action.HOLD]


def requests(n: float, **extra: float) -> Demand:
    return Demand(requests=n, **extra)
