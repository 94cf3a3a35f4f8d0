"""The cheapest fleet that meets a service-level objective on a trace (`shoal simulate plan`).

Two stages, each a bounded set of ordinary runs of the scenario (`simulations.sweep`: worker processes, a failed
run named by its cell and the others kept):

1. Static fleets: for each routing policy, the fewest replicas in [lo, hi] whose run meets the objective, by
   bisection. It assumes a policy's figures do not get worse with more replicas; the policies' searches share
   rounds (one probe per policy per round, run in parallel), at most ceil(log2(hi - lo + 2)) runs a policy. The
   best policy needs the fewest replicas, then the fewest replica-seconds. Its answer n > lo comes with the run of
   n - 1 replicas, which missed: the search probed it.
2. Autoscaled fleets, for the best policy: Shoal's scaling policy (`scaling.PolicyFleet`) over a small grid of its
   target requests per replica, scale-up step (`scale_up.max_replicas`) and scale-down window
   (`scale_down.stabilization_window_s`), each run starting from the static answer's replicas (the fleet the
   autoscaler takes over) within [lo, hi]. The cheapest in replica-seconds that meets the objective stands beside
   the static fleet, and the plan is the cheaper of the two.

`helm_values` writes the plan as Helm values for `helm/shoal`; `simulations.plan_command` is the command around it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from autoscaler.policy import ScalingPolicyConfig
from simulations.objectives import FleetObjective
from simulations.scaling import AutoscaleConfig, FixedScalingConfig
from simulations.scenario import PolicyEntry, Scenario, build_workload
from simulations.simulation import Simulation
from simulations.sweep import Outcome, Progress, Run, run_sweep


@dataclass(frozen=True, slots=True)
class Scaling:
    """One point of the autoscaler grid."""

    target_requests_per_replica: float
    scale_up_replicas: int
    """`scale_up.max_replicas`: replicas the fleet may grow by per period."""
    stabilization_window_s: float
    """`scale_down.stabilization_window_s`: seconds of recommendations a scale-down may go to the highest of."""

    def describe(self) -> str:
        return (
            f"target {self.target_requests_per_replica:g}, step {self.scale_up_replicas}, "
            f"window {self.stabilization_window_s:g} s"
        )


@dataclass(frozen=True, slots=True)
class Candidate:
    """A fleet to run: a policy on `replicas` static replicas, or autoscaled from `replicas` with `scaling`."""

    policy: str
    """The label of the scenario's policy entry."""
    replicas: int
    scaling: Scaling | None = None

    @property
    def label(self) -> str:
        """Names the run (its cell) in progress lines, failures and the table."""
        if self.scaling is None:
            return f"{self.policy}, {self.replicas} replicas"
        return f"{self.policy}, autoscaled from {self.replicas}: {self.scaling.describe()}"


@dataclass(frozen=True, slots=True)
class Trial:
    """A candidate that ran: its summary and the bounds it missed, or the error that ended it."""

    candidate: Candidate
    summary: dict[str, Any] | None
    misses: tuple[str, ...] = ()
    error: str | None = None

    @property
    def is_met(self) -> bool:
        return self.error is None and not self.misses

    @property
    def replica_seconds(self) -> float:
        return float(self.summary["replica_seconds"]) if self.summary is not None else math.nan


@dataclass
class Planner:
    """Runs candidates of one scenario in batches and keeps every trial."""

    scenario: Scenario
    """The workload, fleet, router, per-request SLO and seed of every run; its scaling is replaced per candidate."""
    objective: FleetObjective
    traces_dir: Path | None
    jobs: int
    autoscale: AutoscaleConfig
    """Base of the autoscaled runs (start-up time, tick interval, other policy overrides); the grid and the
    bounds replace its policy, target, step, window, bounds and initial replicas."""
    on_done: Callable[[Outcome[Any]], None] | None = None
    on_progress: Callable[[str], Progress | None] | None = None
    ray_address: str | None = None
    """Runs go to the Ray cluster at this address (`sweep.run_sweep`); None: to local processes."""
    trials: list[Trial] = field(default_factory=list)

    def entry(self, policy: str) -> PolicyEntry:
        return next(e for e in self.scenario.policies if e.label == policy)

    def autoscale_config(self, replicas: int, scaling: Scaling, lo: int, hi: int) -> AutoscaleConfig:
        """The autoscaler of an autoscaled candidate: Shoal's policy within [lo, hi], starting at `replicas`."""
        shoal = dict(self.autoscale.shoal)
        shoal["scale_up"] = {**shoal.get("scale_up", {}), "max_replicas": scaling.scale_up_replicas}
        shoal["scale_down"] = {**shoal.get("scale_down", {}), "stabilization_window_s": scaling.stabilization_window_s}
        return self.autoscale.model_copy(
            update={
                "policy": "shoal",
                "min_replicas": lo,
                "max_replicas": hi,
                "target_requests_per_replica": scaling.target_requests_per_replica,
                "initial_replicas": replicas,
                "shoal": shoal,
            }
        )

    def scenario_of(self, candidate: Candidate, lo: int, hi: int) -> Scenario:
        fleet = self.scenario.fleet.model_copy(update={"num_replicas": candidate.replicas})
        autoscale = None
        if candidate.scaling is not None:
            autoscale = self.autoscale_config(candidate.replicas, candidate.scaling, lo, hi)
        return self.scenario.model_copy(
            update={"fleet": fleet, "autoscale": autoscale, "scaling": FixedScalingConfig(), "variants": []}
        )

    def run(self, candidates: Sequence[Candidate], lo: int, hi: int) -> list[Trial]:
        """Run `candidates` (`jobs` at once) and judge each against the objective, in their order."""
        runs = [
            Run(c.label, partial(_summary, self.scenario_of(c, lo, hi), self.entry(c.policy), self.traces_dir))
            for c in candidates
        ]
        outcomes = run_sweep(
            runs, jobs=self.jobs, on_done=self.on_done, on_progress=self.on_progress, ray_address=self.ray_address
        )
        trials = []
        for candidate, outcome in zip(candidates, outcomes, strict=True):
            if outcome.result is None:
                trials.append(Trial(candidate, None, error=outcome.error))
            else:
                trials.append(Trial(candidate, outcome.result, tuple(self.objective.misses(outcome.result))))
        self.trials += trials
        return trials


def _summary(scenario: Scenario, entry: PolicyEntry, traces_dir: Path | None, progress: Progress | None) -> Any:
    """A run's summary (`metrics.Recorder.summary`), all a plan keeps of it: small to send back from a worker."""
    workload = build_workload(scenario, traces_dir=traces_dir)
    return Simulation(scenario, entry, workload, on_finished=progress).run().summary


def bisection_runs(lo: int, hi: int) -> int:
    """The most runs the bisection of one policy over [lo, hi] takes: ceil(log2(hi - lo + 2)), the candidates
    being lo..hi and "none of them"."""
    return math.ceil(math.log2(hi - lo + 2))


@dataclass
class _Search:
    """One policy's bisection: the answer lies in [lo, hi]; hi past the upper bound means none meets."""

    lo: int
    hi: int
    failed: Trial | None = None

    @property
    def is_open(self) -> bool:
        return self.failed is None and self.lo < self.hi


def search_replicas(
    planner: Planner,
    policies: Sequence[str],
    lo: int,
    hi: int,
    *,
    on_round: Callable[[int], None] | None = None,
) -> dict[str, Trial | None]:
    """Each policy's trial at the fewest replicas in [lo, hi] that meets the objective; None for a policy none
    meets, or whose search a failed run ended (that trial is in `planner.trials`). `on_round(n)` after each round:
    at most n runs are left."""
    searches = {policy: _Search(lo, hi + 1) for policy in policies}
    found: dict[str, Trial] = {}
    for _ in range(bisection_runs(lo, hi)):
        probes = [Candidate(p, (s.lo + s.hi) // 2) for p, s in searches.items() if s.is_open]
        if not probes:
            break
        for trial in planner.run(probes, lo, hi):
            search = searches[trial.candidate.policy]
            if trial.error is not None:
                search.failed = trial
            elif trial.is_met:
                search.hi = trial.candidate.replicas
                found[trial.candidate.policy] = trial
            else:
                search.lo = trial.candidate.replicas + 1
        if on_round is not None:
            on_round(sum(bisection_runs(s.lo, s.hi - 1) for s in searches.values() if s.is_open))
    return {p: found.get(p) if s.failed is None and s.hi <= hi else None for p, s in searches.items()}


def best_static(answers: dict[str, Trial | None]) -> Trial | None:
    """The policy needing the fewest replicas, then the fewest replica-seconds; None when none meets."""
    met = [trial for trial in answers.values() if trial is not None]
    return min(met, key=lambda t: (t.candidate.replicas, t.replica_seconds), default=None)


def scaling_grid(targets: Sequence[float], steps: Sequence[int], windows_s: Sequence[float]) -> list[Scaling]:
    return [Scaling(t, s, w) for t in targets for s in steps for w in windows_s]


def cheapest(trials: Sequence[Trial]) -> Trial | None:
    """The trial that meets the objective with the fewest replica-seconds; None when none does."""
    return min((t for t in trials if t.is_met), key=lambda t: t.replica_seconds, default=None)


# ---- The plan as Helm values ----------------------------------------------------------------------------------

_HELM_POLICY_KEYS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("min_replicas",): ("minReplicas",),
    ("max_replicas",): ("maxReplicas",),
    ("target_requests_per_replica",): ("targetRequestsPerReplica",),
    ("scale_to_zero", "enabled"): ("scaleToZero", "enabled"),
    ("scale_to_zero", "idle_s"): ("scaleToZero", "idleSeconds"),
    ("target_ttft_s",): ("shoal", "targetTtftSeconds"),
    ("capacity", "from_arrivals"): ("shoal", "capacity", "fromArrivals"),
    ("capacity", "learn_target"): ("shoal", "capacity", "learnTarget"),
}
"""Settings of `ScalingPolicyConfig` that the chart's `autoscaling` values carry (helm/shoal/values.yaml); any
other goes to `autoscaling.shoal.extraEnv` as `SHOAL_AUTOSCALER_POLICY__...`."""
_ALWAYS_WRITTEN = {("min_replicas",), ("max_replicas",), ("target_requests_per_replica",)}
"""Written whatever their value: the chart's defaults for them are not the policy's."""


def helm_values(policy: PolicyEntry, replicas: int, autoscale: AutoscaleConfig | None) -> dict[str, Any]:
    """Values for `helm/shoal` that deploy the plan: the routing policy (`router.config.policy`, the router's
    `policy` setting), the static replica count (`replicas.replicas`) and, for an autoscaled plan, Shoal's
    autoscaler with the policy that was simulated, setting for setting (`autoscaling`; settings the chart has no
    key for, and the tick interval, as environment variables of the autoscaler). Without `autoscale`:
    `autoscaling.mode: none`, the static fleet."""
    config = policy.config
    values: dict[str, Any] = {
        "router": {
            "config": {"policy": {"kind": config.kind, **config.model_dump(mode="json", exclude_defaults=True)}}
        },
        "replicas": {"replicas": replicas},
    }
    if autoscale is None:
        values["autoscaling"] = {"mode": "none"}
        return values
    scaling: dict[str, Any] = {"mode": "shoal"}
    env = [{"name": "SHOAL_AUTOSCALER_INTERVAL_S", "value": _env_text(autoscale.interval_s)}]
    chosen = autoscale.policy_config("shoal").model_dump(mode="json")
    defaults = ScalingPolicyConfig().model_dump(mode="json")
    for path, value in _leaves(chosen):
        if path not in _ALWAYS_WRITTEN and value == _at(defaults, path):
            continue
        if path in _HELM_POLICY_KEYS:
            *parents, leaf = _HELM_POLICY_KEYS[path]
            node = scaling
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = value
        else:
            name = "SHOAL_AUTOSCALER_POLICY__" + "__".join(part.upper() for part in path)
            env.append({"name": name, "value": _env_text(value)})
    scaling.setdefault("shoal", {})["extraEnv"] = env
    values["autoscaling"] = scaling
    return values


def _leaves(node: dict[str, Any], path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    out: list[tuple[tuple[str, ...], Any]] = []
    for key, value in node.items():
        if isinstance(value, dict):
            out += _leaves(value, (*path, key))
        else:
            out.append(((*path, key), value))
    return out


def _at(node: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        node = node[key]
    return node


def _env_text(value: Any) -> str:
    """An environment variable's text that pydantic-settings reads back as `value`."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
