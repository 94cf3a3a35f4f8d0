"""Autoscaling policies in the simulator: replica-seconds and TTFT SLO attainment, Shoal against HPA, KEDA, static.

Two workloads with 120 s cold starts (scenarios 08 and 09): (a) the Azure code trace, bursty; (b) one day of a
ServeGen diurnal rate curve compressed into 30 minutes (scenario 09's `servegen` trace; the `--servegen-*` flags
override its model, day, compression and peak rate). For each, the static peak fleet is found first: the fewest
static replicas whose run meets `--attainment` (99%) TTFT SLO attainment, by bisection over 1..max_replicas. Then
shoal, hpa and keda run with the scenario's shared bounds and per-replica target. The issue's goal per workload:
shoal at >= 99% attainment with <= 70% of static peak's replica-seconds, and fewer replica-seconds than hpa at
equal attainment.

    .venv/bin/python -m benchmarks.bench_autoscale                      # both workloads, ~3 min of one core
    .venv/bin/python -m benchmarks.bench_autoscale --workload azure --static-replicas 11   # skip the search
    .venv/bin/python -m benchmarks.bench_autoscale --workload azure --static-replicas 11 --policies '' \
        --shoal-variant '{"min_replicas": 6, "shoal": {"scale_down": {"stabilization_window_s": 900}}}'

Attainment is TTFT-only: requests with TTFT <= the scenario's `slo.ttft_s`, over all requests (rejected ones
count as missed). Replica-seconds count each replica from creation (start-up included) to removal or the run's end.

A `--shoal-variant` with `"rate_oracle_lead_s": L` is a bound, not a policy: Shoal's policy fed, instead of the
requests in flight it measures, those the trace's rate curve implies L seconds ahead (Little's law: the rate at
now + L times the static peak run's mean request time), free of Poisson noise and of queueing. servegen traces
only: no live autoscaler knows the rate, let alone ahead.

`--clairvoyant FACTOR[:HOLD_S]` adds a row for a fleet that knows every future arrival of the trace
(`ArrivalOracleFleet`, any workload): at each tick it wants the replicas that the requests in flight at each moment
up to a cold start ahead (and over the last HOLD_S seconds) would need, FACTOR times Little's law on those arrivals
over the per-replica target. A sweep of FACTOR and HOLD_S shows how much of static peak a fleet that sizes itself
on the load needs for a given attainment when it knows the load in advance:

    .venv/bin/python -m benchmarks.bench_autoscale --workload azure --static-replicas 11 --policies '' \
        --clairvoyant 2:300 --clairvoyant 3:0 --clairvoyant 3:60 --clairvoyant 4:0

`--clairvoyant-lead 0` makes those rows the reactive bound: a fleet that knows the load of each moment exactly (no
noise, no lag, the queue a burst leaves included through HOLD_S) but nothing of what comes within a cold start, the
most any policy that measures the load can know:

    .venv/bin/python -m benchmarks.bench_autoscale --workload sinusoid --static-replicas 5 --policies '' \
        --clairvoyant-lead 0 --clairvoyant 1:600 --clairvoyant 2:600 --clairvoyant 4:600

With `--clairvoyant` the table is followed by the trace's idle gaps longer than a cold start (after 10 s for the
requests in flight to finish), and what a fleet at static peak would save by dropping to one replica in each.
`--initial-replicas N` starts the autoscaled rows (not static peak) with N ready replicas instead of the
scenario's fleet.

`--router-limit N` runs every row, static peak included, with the router holding requests while every replica
has N in flight (`router/policy/admission.py`): one queue at the router instead of one per engine.

`--workload frontier` is the yardstick of issue 20: on four workloads (the Azure code hour, the Azure conversation
hour, the ServeGen day of scenario 09, and a sinusoid between 1 and 24 requests/s with a 10-minute period) it runs
static peak, Shoal's policy, HPA's and KEDA's defaults, and the clairvoyant fleet over a grid of factors and holds
(`--frontier-factors` 0.5-3x, `--frontier-holds` 0 and 120 s; the sweep's time is printed), and prints per workload
the cost-attainment frontier (the points of the clairvoyant fleets and static peak that no other beats on both
replica-seconds and attainment: a fleet that knows the load may also hold one size) beside the policies, with the
goal: Shoal at >= 99% attainment with <= 1.1x the frontier's replica-seconds at 99%, below HPA's and KEDA's at the
same attainment; on the sinusoid, goodput (TTFT and TPOT both within the SLO) >= 90%. HPA and KEDA run at their
default per-replica target and at `--baseline-targets` times it (0.5, 0.75, 1.5, 2), so that each has a curve
too: "below HPA" means fewer replica-seconds than HPA's cheapest run at Shoal's attainment or above (met, too,
where none of HPA's runs reaches it). `--frontier-only code,conv,sinusoid,servegen` runs a
subset. `--plot-dir DIR` writes one PNG per workload (replica-seconds
as % of static peak against attainment). `--startup` sets every row's cold starts: seconds, or a distribution as
JSON (`{"kind": "lognormal", "p50_s": 90, "p90_s": 180}`, `simulations/startup.py`); the titles name it.

    .venv/bin/python -m benchmarks.bench_autoscale --workload frontier --plot-dir benchmarks/results

`--where-missed` adds, per row, where in time the missed requests arrived: while a replica was starting (a
scale-up on its way), within 300 s after a replica was removed, or otherwise (a fleet at rest, whose misses are
queueing noise), with the scale-ups and removals counted; `--where-missed-per SECONDS` adds the misses per window
of that many seconds of arrivals.
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import json
import math
import os
import platform
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from autoscaler.policy import Demand, Observation, ScalerState, ScalingPolicyConfig, decide
from simulations.scaling import AutoscaleConfig, FleetObservation, PolicyFleet
from simulations.scenario import Scenario, build_workload, load_scenario
from simulations.servegen import ServeGenTraceConfig, ServeGenWorkload
from simulations.simulation import Simulation
from simulations.startup import StartupTime, describe_startup, startup_quantile_s
from simulations.workload import Workload

SCENARIOS = Path(__file__).resolve().parent.parent / "simulations" / "scenarios"


@dataclass(slots=True)
class Row:
    policy: str
    replica_seconds: float
    attainment: float
    ttft_p50_s: float
    ttft_p99_s: float
    max_replicas: int
    mean_replicas: float
    cpu_s: float
    reasons: dict[str, int]
    request_mean_s: float
    """Mean end-to-end time of a request."""
    goodput: float = math.nan
    """Share of requests within both the TTFT and the TPOT SLO (rejected ones count as missed)."""
    where_missed: str = ""
    arrivals: list[tuple[float, bool]] = field(default_factory=list)
    """(arrival, missed the TTFT SLO) of each served request, for `misses_per_window`."""


def merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` laid over it, mappings merged key by key."""
    out = dict(base)
    for key, value in overrides.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


class RateOracleFleet:
    """Shoal's policy on the requests a ServeGen rate curve implies `lead_s` ahead, not on those measured."""

    def __init__(
        self,
        config: ScalingPolicyConfig,
        workload: ServeGenWorkload,
        *,
        request_s: float,
        lead_s: float,
        interval_s: float,
    ) -> None:
        self.config = config
        self.workload = workload
        self.request_s = request_s
        self.lead_s = lead_s
        self.interval_s = interval_s
        self.reasons: Counter[str] = Counter()
        self._state = ScalerState()

    def desired_replicas(self, observation: FleetObservation) -> int | None:
        now = observation.now_s
        demand = Demand(requests=self.workload.rate_at(now + self.lead_s) * self.request_s)
        seen = Observation(demand=demand, num_ready=observation.num_ready, starting_since=observation.starting_since)
        decision, self._state = decide(seen, self._state, self.config, now=now)
        self.reasons[decision.reason.value] += 1
        return decision.target_replicas


class ArrivalOracleFleet:
    """A clairvoyant fleet: sized on the trace's own future arrivals, a cold start ahead.

    At each tick it wants, for every moment s from now until a replica created now would be ready (`lead_s`),
    the replicas that the requests in flight at s would need: those arriving in (s - request_s, s] (Little's
    law on the trace's real arrivals, so bursts included, with no noise to measure), times `factor`, over the
    per-replica target, and for every moment of the last `hold_s` (hysteresis: Little's law on arrivals misses
    the queue a burst builds, which keeps requests in flight after it). It asks for the largest of them. No policy
    that measures the load can know these arrivals; the rows show what sizing on them reaches."""

    def __init__(
        self,
        arrivals_s: list[float],
        *,
        request_s: float,
        lead_s: float,
        target: float,
        factor: float,
        hold_s: float = 0.0,
        min_replicas: int,
        max_replicas: int,
        interval_s: float,
    ) -> None:
        self.arrivals_s = arrivals_s
        self.request_s = request_s
        self.lead_s = lead_s
        self.target = target
        self.factor = factor
        self.hold_s = hold_s
        self.min_replicas = min_replicas
        self.max_replicas = max_replicas
        self.interval_s = interval_s
        self.reasons: Counter[str] = Counter()

    def needed(self, at_s: float) -> int:
        """Replicas the requests in flight at `at_s` need."""
        a = self.arrivals_s
        in_flight = bisect.bisect_right(a, at_s) - bisect.bisect_right(a, at_s - self.request_s)
        return math.ceil(in_flight * self.factor / self.target - 1e-9)

    def desired_replicas(self, observation: FleetObservation) -> int | None:
        now = observation.now_s
        ahead = int(self.lead_s // self.interval_s) + 1
        behind = int(self.hold_s // self.interval_s)
        want = max(self.needed(now + k * self.interval_s) for k in range(-behind, ahead + 1))
        self.reasons["clairvoyant"] += 1
        return min(self.max_replicas, max(self.min_replicas, want))


def run(
    scenario: Scenario,
    workload: Workload,
    policy: str,
    *,
    rate_oracle: tuple[float, float] | None = None,
    arrival_oracle: tuple[float, float, float] | None = None,
    oracle_lead_s: float | None = None,
    **overrides: Any,
) -> Row:
    """One simulation of `policy`; `rate_oracle` (lead seconds, mean request seconds) runs `RateOracleFleet`,
    `arrival_oracle` (factor, hold seconds, mean request seconds) `ArrivalOracleFleet`, looking `oracle_lead_s`
    ahead (default: a cold start)."""
    assert scenario.autoscale is not None
    autoscale = AutoscaleConfig.model_validate(merged(scenario.autoscale.model_dump(), {"policy": policy, **overrides}))
    scn = scenario.model_copy(update={"autoscale": autoscale})
    started = time.process_time()
    simulation = Simulation(scn, scn.policies[0], workload)
    if rate_oracle is not None:
        config = autoscale.policy_config()
        assert isinstance(workload, ServeGenWorkload) and isinstance(config, ScalingPolicyConfig)
        lead_s, request_s = rate_oracle
        simulation.scaling = RateOracleFleet(
            config, workload, request_s=request_s, lead_s=lead_s, interval_s=autoscale.interval_s
        )
    if arrival_oracle is not None:
        factor, hold_s, request_s = arrival_oracle
        arrivals = sorted(r.arrival_s for r in workload.requests())
        simulation.scaling = ArrivalOracleFleet(
            arrivals,
            request_s=request_s,
            lead_s=startup_quantile_s(autoscale.startup_s) if oracle_lead_s is None else oracle_lead_s,
            target=autoscale.target_requests_per_replica,
            factor=factor,
            hold_s=hold_s,
            min_replicas=autoscale.min_replicas,
            max_replicas=autoscale.max_replicas,
            interval_s=autoscale.interval_s,
        )
    result = simulation.run()
    summary = result.summary
    ttft = result.recorder.ttft_s
    total = len(ttft) + summary["rejected"]
    attained = sum(1 for t in ttft if t <= scn.slo.ttft_s)
    scaling = simulation.scaling
    reasons = dict(scaling.reasons) if isinstance(scaling, PolicyFleet | RateOracleFleet | ArrivalOracleFleet) else {}
    return Row(
        policy=policy,
        replica_seconds=summary["replica_seconds"],
        attainment=attained / total if total else math.nan,
        ttft_p50_s=summary["ttft_p50_s"],
        ttft_p99_s=summary["ttft_p99_s"],
        max_replicas=max(s.num_replicas for s in result.recorder.samples),
        mean_replicas=summary["replica_seconds"] / summary["duration_s"] if summary["duration_s"] else 0.0,
        cpu_s=time.process_time() - started,
        reasons=reasons,
        request_mean_s=sum(result.recorder.e2e_s) / len(result.recorder.e2e_s) if result.recorder.e2e_s else 0.0,
        goodput=summary["slo_attainment"],
        where_missed=where_missed(simulation, scn.slo.ttft_s),
        arrivals=[(a, t > scn.slo.ttft_s) for a, t in zip(result.recorder.arrival_s, ttft, strict=True)],
    )


AFTER_REMOVAL_S = 300.0
"""How long after a removal a miss counts as following it: the policies' default stabilization window."""


def where_missed(simulation: Simulation, slo_s: float) -> str:
    """Requests and misses by when they arrived: while a replica was starting, within `AFTER_REMOVAL_S` after a
    removal, or neither. Requests refused unserved are left out (none are in these scenarios' runs)."""
    members = simulation.members
    starts = [(m.created_s, min(m.ready_s, m.removed_s or m.ready_s)) for m in members if m.ready_s > m.created_s]
    removals = sorted(m.removed_s for m in members if m.removed_s is not None)
    # Times at which the number of starting replicas changes, and that number from each on.
    steps = sorted([(c, 1) for c, _ in starts] + [(r, -1) for _, r in starts])
    times, starting, count = [], [], 0
    for t, change in steps:
        count += change
        times.append(t)
        starting.append(count)
    counts = {"starting": [0, 0], "after removal": [0, 0], "at rest": [0, 0]}
    recorder = simulation.recorder
    for arrival, ttft in zip(recorder.arrival_s, recorder.ttft_s, strict=True):
        i = bisect.bisect_right(times, arrival) - 1
        j = bisect.bisect_right(removals, arrival) - 1
        if i >= 0 and starting[i] > 0:
            key = "starting"
        elif j >= 0 and arrival - removals[j] < AFTER_REMOVAL_S:
            key = "after removal"
        else:
            key = "at rest"
        counts[key][0] += 1
        counts[key][1] += ttft > slo_s
    parts = [f"{k} {m}/{n} ({100 * m / n if n else 0.0:.2f}%)" for k, (n, m) in counts.items()]
    num_started = sum(1 for c, _ in starts if c > 0)
    return f"missed/requests {'; '.join(parts)}; {num_started} replicas started, {len(removals)} removed"


def misses_per_window(row: Row, window_s: float) -> str:
    """Missed/served requests of `row` per window of `window_s` seconds of arrivals, in time order."""
    windows: dict[int, list[int]] = {}
    for arrival, is_missed in row.arrivals:
        window = windows.setdefault(int(arrival // window_s), [0, 0])
        window[0] += 1
        window[1] += is_missed
    return f"per {window_s:g} s of arrivals " + " ".join(f"{m}/{n}" for _, (n, m) in sorted(windows.items()))


IDLE_SETTLE_S = 10.0
"""Seconds after an arrival before a replica could go: the requests in flight finish (`idle_gaps`)."""


def idle_gaps(workload: Workload, cold_start_s: float, static: Row) -> str:
    """The gaps between arrivals that outlast the requests in flight (`IDLE_SETTLE_S`) by more than a cold start,
    and the share of static peak's replica-seconds that dropping to one replica in each would save (a replica let
    go must start again a cold start before the next arrival)."""
    arrivals = sorted(r.arrival_s for r in workload.requests())
    spare = [b - a - IDLE_SETTLE_S - cold_start_s for a, b in pairwise(arrivals)]
    spare = [s for s in spare if s > 0]
    saved = sum(spare) * (static.max_replicas - 1) / static.replica_seconds
    return (
        f"idle gaps longer than {IDLE_SETTLE_S:g} s + a {cold_start_s:g} s cold start: {len(spare)}; dropping to one "
        f"replica in each saves {100 * saved:.1f}% of static peak's replica-seconds"
    )


def clairvoyant_spec(text: str) -> tuple[float, float]:
    """`--clairvoyant FACTOR[:HOLD_S]` -> (factor, hold seconds)."""
    factor, _, hold = text.partition(":")
    try:
        values = (float(factor), float(hold or 0.0))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FACTOR[:HOLD_S], e.g. 3:60, not {text!r}") from None
    if not (values[0] > 0 and values[1] >= 0):
        raise argparse.ArgumentTypeError(f"FACTOR must be > 0 and HOLD_S >= 0, not {text!r}")
    return values


FRONTIER_FACTORS = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
"""Default clairvoyant factors swept for the frontier: from half of Little's law (a replica can carry more than
the per-replica target: static peak beats 1x on the sinusoid) to three times it."""
FRONTIER_HOLDS_S = (0.0, 120.0)
"""Default clairvoyant holds swept: none, and one cold start."""
BASELINE_TARGET_FACTORS = (0.5, 0.75, 1.5, 2.0)
"""Default multiples of the per-replica target that HPA and KEDA also run at in the frontier: their defaults are
one point of a curve, and the goal compares Shoal with that curve at Shoal's attainment."""
FRONTIER_SLACK = 1.1
"""The goal: Shoal's replica-seconds at the goal's attainment within this factor of the frontier's."""
FRONTIER_WORKLOADS = {"code": "(a)", "conv": "(a2)", "sinusoid": "(s)", "servegen": "(b)"}
"""`--frontier-only` names of the frontier's workloads, and the label each one's title starts with."""
SINUSOID_GOODPUT = 0.9
"""The goal's goodput on the sinusoid."""


def sinusoid_workload(
    like: ServeGenWorkload, *, low: float, high: float, period_s: float, duration_s: float, seed: int
) -> ServeGenWorkload:
    """Poisson arrivals at low + (high - low) (1 - cos(2 pi t / period)) / 2 requests/s, lengths drawn as `like`
    draws them; the rate is piecewise linear between 10 s windows' midpoints (60 per 10-minute period)."""
    window_s = 10.0
    n = round(duration_s / window_s)
    rates = [low + (high - low) * (1 - math.cos(2 * math.pi * (i + 0.5) * window_s / period_s)) / 2 for i in range(n)]
    workload = ServeGenWorkload(
        rates, window_s, like.lengths, peak_rate_per_s=max(rates), seed=seed, block_size=like.block_size
    )
    workload.name = f"sinusoid:{low:g}-{high:g}/{period_s:g}s"
    return workload


def pareto(rows: list[Row]) -> list[Row]:
    """The rows no other row beats on both replica-seconds (fewer) and attainment (more), cheapest first."""
    ordered = sorted(rows, key=lambda r: (r.replica_seconds, -r.attainment))
    front: list[Row] = []
    for row in ordered:
        if not front or row.attainment > front[-1].attainment:
            front.append(row)
    return front


def cheapest_at(rows: list[Row], goal: float) -> Row | None:
    """The row with the fewest replica-seconds among those at or above `goal` attainment."""
    met = [r for r in rows if r.attainment >= goal]
    return min(met, key=lambda r: r.replica_seconds) if met else None


def frontier_report(
    title: str,
    rows: list[Row],
    clairvoyant: list[Row],
    static: Row,
    goal: float,
    *,
    is_sinusoid: bool,
    baselines: dict[str, list[Row]] | None = None,
) -> None:
    """The policies and the frontier as one table, then the goal, line by line, with the margins. The frontier is
    that of the clairvoyant points and static peak together: a fleet of any shape that knows the load may also hold
    one size, so the cheapest point at the goal is a bound, whichever shape reaches it. `baselines`: per baseline
    policy, its runs at other per-replica targets, listed after the policies; the goal compares Shoal with each
    baseline's cheapest run (default or other) at Shoal's attainment or above."""
    baselines = baselines or {}
    shapes = [*clairvoyant, static]
    front = pareto(shapes)
    print(f"\n{title}")
    print("| row | replica-s | % of static peak | TTFT attainment | goodput | TTFT p99 s | max | mean |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    swept = [r for runs in baselines.values() for r in runs]
    for row in [*rows, *swept, static, *(r for r in front if r is not static)]:
        name = f"frontier: {row.policy}" if row in front else row.policy
        print(
            f"| {name} | {row.replica_seconds:.0f} | {100 * row.replica_seconds / static.replica_seconds:.1f}% "
            f"| {100 * row.attainment:.2f}% | {100 * row.goodput:.2f}% | {row.ttft_p99_s:.2f} | {row.max_replicas} "
            f"| {row.mean_replicas:.1f} |"
        )
    by_policy = {row.policy: row for row in rows}
    best = cheapest_at(shapes, goal)
    if best is not None:
        print(
            f"frontier at {100 * goal:g}%: {best.replica_seconds:.0f} replica-s ({best.policy}; "
            f"{len(clairvoyant)} clairvoyant points and static peak)"
        )
    checks: list[tuple[str, bool, str]] = []
    for shoal in (r for r in rows if r.policy not in ("hpa", "keda")):
        name = shoal.policy
        checks.append(
            (f"{name} >= {100 * goal:g}% attainment", shoal.attainment >= goal, f"{100 * shoal.attainment:.2f}%")
        )
        if best is None:
            checks.append((f"frontier at {100 * goal:g}%", False, "no point reaches it"))
        else:
            ratio = shoal.replica_seconds / best.replica_seconds
            at = "" if shoal.attainment >= goal else f", but at {100 * shoal.attainment:.2f}%"
            checks.append(
                (
                    f"{name} at {100 * goal:g}% with <= {FRONTIER_SLACK:g}x the frontier's replica-s there",
                    shoal.attainment >= goal and ratio <= FRONTIER_SLACK,
                    f"{ratio:.3f}x ({shoal.replica_seconds:.0f} against {best.replica_seconds:.0f}: {best.policy}){at}",
                )
            )
        for other in ("hpa", "keda"):
            default = by_policy.get(other)
            if default is None:
                continue
            # Below it at the same attainment: fewer replica-seconds than the baseline's cheapest run (at any of
            # its targets) that attains at least as much; met, too, where no run of it attains as much.
            curve = [default, *baselines.get(other, [])]
            rival = cheapest_at(curve, shoal.attainment)
            if rival is None:
                is_below = True
                most = max(r.attainment for r in curve)
                figures = f"no run of {other} reaches {100 * shoal.attainment:.2f}% (at most {100 * most:.2f}%)"
            else:
                is_below = shoal.replica_seconds < rival.replica_seconds
                figures = (
                    f"{shoal.replica_seconds:.0f} replica-s at {100 * shoal.attainment:.2f}% against "
                    f"{rival.replica_seconds:.0f} at {100 * rival.attainment:.2f}% ({rival.policy})"
                )
            checks.append((f"{name} below {other} at the same attainment", is_below, figures))
        if is_sinusoid:
            checks.append(
                (
                    f"{name} goodput >= {100 * SINUSOID_GOODPUT:g}%",
                    shoal.goodput >= SINUSOID_GOODPUT,
                    f"{100 * shoal.goodput:.2f}%",
                )
            )
    for what, is_met, figures in checks:
        print(f"goal {what}: {'met' if is_met else 'NOT met'} ({figures})")
    for row in rows:
        print(f"  {row.policy}: {row.cpu_s:.1f} s CPU; reasons {row.reasons}")


def plot_frontier(
    path: Path,
    title: str,
    rows: list[Row],
    clairvoyant: list[Row],
    static: Row,
    baselines: dict[str, list[Row]] | None = None,
) -> bool:
    """Replica-seconds (% of static peak) against attainment: the clairvoyant points and their frontier, the
    policies, the baselines' runs at other targets (a dotted line per baseline) and static peak. False when
    matplotlib is not installed (the `simulate` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False

    def xy(row: Row) -> tuple[float, float]:
        return 100 * row.attainment, 100 * row.replica_seconds / static.replica_seconds

    fig, ax = plt.subplots(figsize=(7, 4.5))
    points = [xy(r) for r in clairvoyant]
    front = [xy(r) for r in pareto([*clairvoyant, static])]
    ax.scatter([x for x, _ in points], [y for _, y in points], s=14, c="0.6", label="clairvoyant (factor, hold)")
    ax.plot([x for x, _ in front], [y for _, y in front], c="0.3", lw=1, label="frontier")
    defaults = {row.policy: row for row in rows}
    for name, runs in (baselines or {}).items():
        curve = sorted([xy(r) for r in runs] + ([xy(defaults[name])] if name in defaults else []))
        ax.plot([x for x, _ in curve], [y for _, y in curve], ls=":", marker=".", lw=1, label=f"{name}, targets swept")
    for row, marker in zip([*rows, static], "osD^v", strict=False):
        ax.scatter(*xy(row), marker=marker, s=50, label=row.policy, zorder=3)
    ax.set_xlabel("TTFT SLO attainment (%)")
    ax.set_ylabel("replica-seconds (% of static peak)")
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def startup_spec(text: str) -> StartupTime:
    """`--startup 120` or `--startup '{"kind": "lognormal", "p50_s": 90, "p90_s": 180}'`."""
    try:
        return TypeAdapter(StartupTime).validate_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--startup: {exc}") from None


def seeded(scenario: Scenario, seed: int | None, router_limit: int | None = None) -> Scenario:
    """The scenario with `--seed` and `--router-limit` applied, when given."""
    if seed is not None:
        scenario = scenario.model_copy(update={"seed": seed})
    if router_limit is not None:
        router = scenario.router.model_copy(update={"max_in_flight_per_replica": router_limit})
        scenario = scenario.model_copy(update={"router": router})
    return scenario


def static_peak(scenario: Scenario, workload: Workload, goal: float) -> Row:
    """The fewest static replicas meeting `goal` attainment (bisection; attainment grows with the fleet)."""
    assert scenario.autoscale is not None
    low, high = 1, scenario.autoscale.max_replicas
    best = run(scenario, workload, "static", static_replicas=high)
    while low < high:
        mid = (low + high) // 2
        row = run(scenario, workload, "static", static_replicas=mid)
        if row.attainment >= goal:
            high, best = mid, row
        else:
            low = mid + 1
    return best


def table(
    title: str,
    rows: list[Row],
    static: Row,
    goal: float,
    *,
    is_where_missed: bool = False,
    misses_window_s: float | None = None,
) -> None:
    print(f"\n{title}")
    print("| policy | replica-s | % of static peak | TTFT SLO attainment | TTFT p50 s | p99 s | max replicas | mean |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row.policy} | {row.replica_seconds:.0f} | {100 * row.replica_seconds / static.replica_seconds:.1f}% "
            f"| {100 * row.attainment:.2f}% | {row.ttft_p50_s:.2f} | {row.ttft_p99_s:.2f} | {row.max_replicas} "
            f"| {row.mean_replicas:.1f} |"
        )
    by_policy = {row.policy: row for row in rows}
    shoal, hpa = by_policy.get("shoal"), by_policy.get("hpa")
    if shoal is not None and hpa is not None:
        is_met = (
            shoal.attainment >= goal
            and shoal.replica_seconds <= 0.7 * static.replica_seconds
            and (shoal.replica_seconds < hpa.replica_seconds or shoal.attainment > hpa.attainment)
        )
        print(f"goal (>= {100 * goal:.0f}%, <= 70% of static peak, below hpa): {'met' if is_met else 'NOT met'}")
    for row in rows:
        print(f"  {row.policy}: {row.cpu_s:.1f} s CPU; reasons {row.reasons}")
        if is_where_missed:
            by_window = "" if misses_window_s is None else f"; {misses_per_window(row, misses_window_s)}"
            print(f"    {row.where_missed}{by_window}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--workload",
        choices=["azure", "azure-conv", "servegen", "sinusoid", "both", "frontier", "servegen-day", "servegen-day-x4"],
        default="both",
        help="both: azure and servegen; servegen-day: scenario 13, a whole day uncompressed (~8 min of one core); "
        "servegen-day-x4: scenario 14, the same day at 4x the load (~4x as long)",
    )
    parser.add_argument("--attainment", type=float, default=0.99, help="the goal's SLO attainment")
    parser.add_argument("--static-replicas", type=int, help="static peak fleet; default: searched")
    parser.add_argument(
        "--shoal-variant",
        type=json.loads,
        action="append",
        default=[],
        help="JSON merged into the scenario's `autoscale` section (mappings key by key): one more row, shoal unless "
        "it sets `policy`, named `name` if it sets one; `rate_oracle_lead_s` makes it the rate-oracle bound "
        "(above); repeatable",
    )
    parser.add_argument(
        "--policies",
        default="shoal,hpa,keda",
        help="comma-separated autoscalers to run beside static peak (default shoal,hpa,keda); '' for none",
    )
    parser.add_argument(
        "--clairvoyant",
        type=clairvoyant_spec,
        action="append",
        default=[],
        metavar="FACTOR[:HOLD_S]",
        help="add a row: a fleet sized on the trace's future arrivals a cold start ahead (ArrivalOracleFleet), "
        "FACTOR times the requests they put in flight over the per-replica target, kept HOLD_S seconds (default 0); "
        "repeatable",
    )
    parser.add_argument(
        "--clairvoyant-lead",
        type=float,
        metavar="SECONDS",
        help="how far ahead the --clairvoyant rows see the arrivals (default: a cold start); 0 is the reactive "
        "bound, a fleet that knows the present load exactly and nothing of what comes",
    )
    parser.add_argument(
        "--initial-replicas",
        type=int,
        help="ready replicas the autoscaled rows start with (default: the scenario's fleet); static peak keeps its own",
    )
    parser.add_argument("--where-missed", action="store_true", help="per row, when the missed requests arrived")
    parser.add_argument(
        "--where-missed-per",
        type=float,
        metavar="SECONDS",
        help="with --where-missed, also the misses per window of this many seconds of arrivals (the sinusoid's "
        "period: 600)",
    )
    parser.add_argument(
        "--frontier-factors",
        type=lambda t: [float(x) for x in t.split(",")],
        default=list(FRONTIER_FACTORS),
        help=f"clairvoyant factors of the frontier sweep (default {','.join(map(str, FRONTIER_FACTORS))})",
    )
    parser.add_argument(
        "--frontier-holds",
        type=lambda t: [float(x) for x in t.split(",")],
        default=list(FRONTIER_HOLDS_S),
        help=f"clairvoyant holds, seconds, of the frontier sweep (default {','.join(map(str, FRONTIER_HOLDS_S))})",
    )
    parser.add_argument(
        "--baseline-targets",
        type=lambda t: [float(x) for x in t.split(",") if x],
        default=list(BASELINE_TARGET_FACTORS),
        help="with --workload frontier, multiples of the per-replica target that HPA and KEDA also run at (default "
        f"{','.join(map(str, BASELINE_TARGET_FACTORS))}; '' for their defaults alone)",
    )
    parser.add_argument(
        "--frontier-only",
        type=lambda t: set(t.split(",")),
        help="with --workload frontier, only these workloads: a comma-separated subset of "
        f"{','.join(FRONTIER_WORKLOADS)}",
    )
    parser.add_argument("--plot-dir", type=Path, help="write one frontier PNG per workload here (needs matplotlib)")
    parser.add_argument(
        "--startup",
        type=startup_spec,
        help="cold starts of every row: seconds, or JSON of a distribution (default: the scenario's)",
    )
    parser.add_argument("--seed", type=int, help="the scenarios' seed (arrivals of servegen traces, policies' draws)")
    parser.add_argument(
        "--router-limit",
        type=int,
        help="the router's in-flight limit per replica (scenario `router.max_in_flight_per_replica`, the live "
        "router's `hold.max_in_flight_per_replica`) for every row, static peak included; default: the scenario's",
    )
    parser.add_argument(
        "--traces-dir",
        type=Path,
        default=os.environ.get("SHOAL_TRACES_DIR"),
        help="directory of the scenarios' trace files (default: $SHOAL_TRACES_DIR; `shoal simulate fetch-traces`)",
    )
    parser.add_argument("--servegen-model", help="the curve's model column (scenario 09: m-large)")
    parser.add_argument("--servegen-day", type=int, help="day of the curve (scenario 09: 0)")
    parser.add_argument("--servegen-compress", type=float, help="time compression (scenario 09: 48)")
    parser.add_argument("--servegen-peak-rate", type=float, help="req/s at the curve's peak (scenario 09: 40)")
    args = parser.parse_args()
    print(f"command: python -m benchmarks.bench_autoscale {' '.join(sys.argv[1:])}")
    print(f"date: {datetime.date.today()}; machine: {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs")
    policies = [p for p in args.policies.split(",") if p]
    if unknown := set(policies) - {"shoal", "hpa", "keda"}:
        parser.error(f"--policies: unknown {sorted(unknown)}")

    is_frontier = args.workload == "frontier"
    experiments: list[tuple[str, Scenario, Workload]] = []
    if args.workload in ("azure", "both", "frontier"):
        scenario = seeded(load_scenario(SCENARIOS / "08_autoscale_azure_code.yaml"), args.seed, args.router_limit)
        workload = build_workload(scenario, traces_dir=args.traces_dir)
        experiments.append(("(a) Azure code trace, bursty, 1 h", scenario, workload))
    if args.workload in ("azure-conv", "frontier"):
        # Scenario 08 on the conversation trace: outputs of ~211 tokens keep a request in flight ~10 s, so the
        # per-replica target is scenario 09's (32), not the code trace's (8).
        scenario = seeded(load_scenario(SCENARIOS / "08_autoscale_azure_code.yaml"), args.seed, args.router_limit)
        assert scenario.trace is not None and scenario.autoscale is not None
        trace = scenario.trace.model_copy(update={"path": Path("azure-llm-2023/AzureLLMInferenceTrace_conv.csv")})
        autoscale = scenario.autoscale.model_copy(update={"target_requests_per_replica": 32.0})
        scenario = scenario.model_copy(update={"trace": trace, "autoscale": autoscale, "name": "azure_conv"})
        workload = build_workload(scenario, traces_dir=args.traces_dir)
        experiments.append(("(a2) Azure conversation trace, 1 h", scenario, workload))
    if args.workload in ("servegen", "both", "frontier", "sinusoid"):
        scenario = seeded(load_scenario(SCENARIOS / "09_autoscale_servegen_diurnal.yaml"), args.seed, args.router_limit)
        assert isinstance(scenario.trace, ServeGenTraceConfig)
        flags = {
            "model": args.servegen_model,
            "day": args.servegen_day,
            "compress": args.servegen_compress,
            "peak_rate_per_s": args.servegen_peak_rate,
        }
        trace = ServeGenTraceConfig.model_validate(
            {**scenario.trace.model_dump(), **{k: v for k, v in flags.items() if v is not None}}
        )
        scenario = scenario.model_copy(update={"trace": trace})
        workload = build_workload(scenario, traces_dir=args.traces_dir)
        assert isinstance(workload, ServeGenWorkload)
        title = (
            f"(b) ServeGen {trace.model} day {trace.day}, {trace.compress:g}x compressed "
            f"({workload.duration_s / 60:.0f} min), peak {workload.peak_rate_per_s:g} req/s, "
            f"trough {min(workload.rates_per_s):.1f} req/s"
        )
        if args.workload == "sinusoid" or is_frontier:
            # Scenario 09's fleet, target and lengths; the rate a sinusoid (Dynamo's planner test shape).
            wave = sinusoid_workload(
                workload, low=1.0, high=24.0, period_s=600.0, duration_s=1800.0, seed=scenario.seed
            )
            experiments.append(("(s) sinusoid 1-24 req/s, 10 min period, 30 min", scenario, wave))
        if args.workload != "sinusoid":
            experiments.append((title, scenario, workload))

    if args.workload in ("servegen-day", "servegen-day-x4"):
        name, label = ("13_autoscale_servegen_day", "(c)")
        if args.workload == "servegen-day-x4":
            name, label = ("14_autoscale_servegen_day_x4", "(d)")
        scenario = seeded(load_scenario(SCENARIOS / f"{name}.yaml"), args.seed, args.router_limit)
        workload = build_workload(scenario, traces_dir=args.traces_dir)
        assert isinstance(workload, ServeGenWorkload)
        title = (
            f"{label} ServeGen day, uncompressed ({workload.duration_s / 3600:.0f} h), "
            f"peak {workload.peak_rate_per_s:g} req/s, trough {min(workload.rates_per_s):.2f} req/s, "
            f"replicas of {scenario.fleet.engine['max_num_seqs']} sequences"
        )
        experiments.append((title, scenario, workload))

    if args.frontier_only is not None:
        if unknown := args.frontier_only - set(FRONTIER_WORKLOADS):
            parser.error(f"--frontier-only: unknown {sorted(unknown)}")
        labels = {FRONTIER_WORKLOADS[name] for name in args.frontier_only}
        experiments = [e for e in experiments if e[0].split(" ")[0] in labels]
    for title, scenario, workload in experiments:
        assert scenario.autoscale is not None
        if args.startup is not None:
            scenario = scenario.model_copy(
                update={"autoscale": scenario.autoscale.model_copy(update={"startup_s": args.startup})}
            )
            assert scenario.autoscale is not None
        if args.static_replicas is not None:
            static = run(scenario, workload, "static", static_replicas=args.static_replicas)
        else:
            static = static_peak(scenario, workload, args.attainment)
        static.policy = f"static peak ({static.max_replicas})"
        if args.initial_replicas is not None:
            fleet = scenario.fleet.model_copy(update={"num_replicas": args.initial_replicas})
            scenario = scenario.model_copy(update={"fleet": fleet})
        assert scenario.autoscale is not None
        rows = [run(scenario, workload, policy) for policy in policies]
        for i, overrides in enumerate(args.shoal_variant):
            overrides = dict(overrides)
            label = overrides.pop("name", None)
            policy = overrides.pop("policy", "shoal")
            lead_s = overrides.pop("rate_oracle_lead_s", None)
            oracle = None if lead_s is None else (float(lead_s), static.request_mean_s)
            variant = run(scenario, workload, policy, rate_oracle=oracle, **overrides)
            name = policy if oracle is None else f"{policy} on the true rate {float(lead_s):g} s ahead"
            variant.policy = label or f"{name} {json.dumps(overrides)}"
            rows.insert(min(1 + i, len(rows)), variant)
        if is_frontier:
            started = time.monotonic()
            baselines: dict[str, list[Row]] = {}
            for other in (p for p in policies if p in ("hpa", "keda")):
                base_target = scenario.autoscale.target_requests_per_replica
                for factor in args.baseline_targets:
                    swept = run(scenario, workload, other, target_requests_per_replica=base_target * factor)
                    swept.policy = f"{other}, {base_target * factor:g} requests per replica"
                    baselines.setdefault(other, []).append(swept)
            clairvoyant = []
            for factor in args.frontier_factors:
                for hold_s in args.frontier_holds:
                    sizing = (factor, hold_s, static.request_mean_s)
                    bound = run(scenario, workload, "shoal", arrival_oracle=sizing)
                    bound.policy = f"clairvoyant {factor:g}x, hold {hold_s:g} s"
                    clairvoyant.append(bound)
            a = scenario.autoscale
            full = (
                f"{title}; {scenario.fleet.preset}, {describe_startup(a.startup_s)}, "
                f"TTFT <= {scenario.slo.ttft_s:g} s, {a.target_requests_per_replica:g} requests per replica, "
                f"{a.min_replicas}..{a.max_replicas} replicas"
            )
            frontier_report(
                full,
                [*rows],
                clairvoyant,
                static,
                args.attainment,
                is_sinusoid=title.startswith("(s)"),
                baselines=baselines,
            )
            swept_rows = [r for runs in baselines.values() for r in runs]
            cpu = sum(r.cpu_s for r in [*rows, *swept_rows, static, *clairvoyant])
            wall_s = time.monotonic() - started
            num_runs = len(rows) + len(swept_rows) + len(clairvoyant) + 1
            print(f"  {num_runs} runs, {cpu:.0f} s CPU; the baselines' and oracles' sweeps took {wall_s:.0f} s")
            if args.plot_dir is not None:
                args.plot_dir.mkdir(parents=True, exist_ok=True)
                name = "".join(c if c.isalnum() else "_" for c in title.split(",")[0]).strip("_").lower()
                path = args.plot_dir / f"autoscale_frontier_{name}.png"
                if plot_frontier(path, full, rows, clairvoyant, static, baselines):
                    print(f"  plot: {path}")
            continue
        for factor, hold_s in args.clairvoyant:
            sizing = (factor, hold_s, static.request_mean_s)
            bound = run(scenario, workload, "shoal", arrival_oracle=sizing, oracle_lead_s=args.clairvoyant_lead)
            ahead = "" if args.clairvoyant_lead is None else f" {args.clairvoyant_lead:g} s ahead"
            bound.policy = f"clairvoyant: {factor:g}x the arrivals' in-flight requests{ahead}, kept {hold_s:g} s"
            rows.append(bound)
        slo = f"TTFT <= {scenario.slo.ttft_s:g} s"
        a = scenario.autoscale
        table(
            f"{title}; {scenario.fleet.preset}, {describe_startup(a.startup_s)}, {slo}, "
            f"{a.target_requests_per_replica:g} requests per replica, {a.min_replicas}..{a.max_replicas} replicas",
            [*rows, static],
            static,
            args.attainment,
            is_where_missed=args.where_missed,
            misses_window_s=args.where_missed_per,
        )
        if args.clairvoyant:
            print(idle_gaps(workload, startup_quantile_s(scenario.autoscale.startup_s), static))


if __name__ == "__main__":
    main()
