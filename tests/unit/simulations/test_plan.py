"""`shoal simulate plan`'s parts: the --slo bounds, the bisection over replicas, and the plan as Helm values that the
autoscaler's and the router's own settings read back as the simulated policy."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml

from autoscaler.settings import AutoscalerSettings
from router.service.settings import RouterSettings
from simulations.objectives import parse_objective
from simulations.plan import Candidate, Planner, Scaling, Trial, bisection_runs, helm_values, search_replicas
from simulations.scaling import AutoscaleConfig
from simulations.scenario import Scenario, policy_entry


def summary(ttft_p99_s: float, attainment: float = 1.0) -> dict[str, float]:
    return {"ttft_p99_s": ttft_p99_s, "slo_attainment": attainment, "replica_seconds": 100.0}


def test_slo_bounds_read_units_and_percent_and_say_what_a_run_misses() -> None:
    objective = parse_objective(["ttft_p99=1.5s", "e2e_p99=800ms", "attainment=99%", "ttft=2s"])
    assert [(b.key, b.limit) for b in objective.bounds] == [("ttft_p99", 1.5), ("e2e_p99", 0.8), ("attainment", 0.99)]
    assert objective.request_slo == {"ttft_s": 2.0}
    met = {"ttft_p99_s": 1.5, "e2e_p99_s": 0.8, "slo_attainment": 0.99}
    assert objective.misses(met) == []
    missed = {"ttft_p99_s": 1.6, "e2e_p99_s": math.nan, "slo_attainment": 0.5}
    assert objective.misses(missed) == ["ttft_p99 1.6 s > 1.5 s", "e2e_p99 none > 800 ms", "attainment 0.500 < 0.99"]


@pytest.mark.parametrize(
    ("items", "complaint"),
    [
        (["ttft_p99=2"], "not a duration with its unit"),
        (["ttft_p99=2min"], "not a duration with its unit"),
        (["ttft_p99=0s"], "above 0"),
        (["p99=2s"], "unknown key 'p99'"),
        (["attainment=1.2"], "in (0, 1]"),
        (["attainment=99"], "in (0, 1]"),
        (["ttft_p99=2s", "ttft_p99=3s"], "given twice"),
        (["ttft_p99"], "expected KEY=VALUE"),
        (["ttft=2s"], "at least one bound"),
        ([], "at least one bound"),
    ],
)
def test_a_bad_slo_says_what_is_wrong(items: list[str], complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse_objective(items)


class TablePlanner(Planner):
    """A planner whose runs are looked up, not simulated: each policy's TTFT p99 falls with replicas as its
    table says, so the search's probes and answers can be followed. A policy in `broken` fails at those sizes."""

    def __init__(self, ttft_by_policy: dict[str, list[float]], broken: dict[str, int] | None = None) -> None:
        super().__init__(Scenario(), parse_objective(["ttft_p99=2s"]), None, 1, AutoscaleConfig())
        self.ttft_by_policy = ttft_by_policy
        self.broken = broken or {}
        self.rounds: list[list[Candidate]] = []

    def run(self, candidates: Sequence[Candidate], lo: int, hi: int) -> list[Trial]:
        self.rounds.append(list(candidates))
        trials = []
        for c in candidates:
            if self.broken.get(c.policy) == c.replicas:
                trials.append(Trial(c, None, error="RuntimeError: boom"))
                continue
            s = summary(self.ttft_by_policy[c.policy][c.replicas - 1])
            trials.append(Trial(c, s, tuple(self.objective.misses(s))))
        self.trials += trials
        return trials


def test_the_bisection_finds_the_fewest_replicas_and_has_run_the_count_below() -> None:
    ttft = [30.0, 12.0, 6.0, 3.0, 2.5, 1.9, 1.5, 1.2, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]  # meets from 6
    planner = TablePlanner({"fast": ttft, "slow": [9.0] * 16})
    answers = search_replicas(planner, ["fast", "slow"], 1, 16)
    assert answers["fast"] is not None and answers["fast"].candidate.replicas == 6
    assert answers["slow"] is None  # not even 16 meets it
    probed = {(t.candidate.policy, t.candidate.replicas): t for t in planner.trials}
    assert not probed[("fast", 5)].is_met
    assert probed[("slow", 16)].misses == ("ttft_p99 9 s > 2 s",)
    # Both searches share each round; neither takes more than the bound said up front.
    assert all({c.policy for c in r} <= {"fast", "slow"} and len(r) <= 2 for r in planner.rounds)
    for policy in ("fast", "slow"):
        assert sum(c.policy == policy for r in planner.rounds for c in r) <= bisection_runs(1, 16) == 5


def test_a_failed_run_ends_its_policy_search_and_the_others_go_on() -> None:
    ttft = [9.0, 9.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    planner = TablePlanner({"ok": ttft, "broken": ttft}, broken={"broken": 5})
    answers = search_replicas(planner, ["ok", "broken"], 1, 8)
    assert answers["ok"] is not None and answers["ok"].candidate.replicas == 3
    assert answers["broken"] is None
    failed = [t for t in planner.trials if t.error is not None]
    assert [t.candidate.label for t in failed] == ["broken, 5 replicas"]
    assert not any(c.policy == "broken" for r in planner.rounds[1:] for c in r)


def test_the_lower_bound_meeting_needs_no_count_below() -> None:
    planner = TablePlanner({"any": [1.0] * 4})
    answers = search_replicas(planner, ["any"], 2, 4)
    assert answers["any"] is not None and answers["any"].candidate.replicas == 2
    assert min(t.candidate.replicas for t in planner.trials) == 2


def test_static_plan_values_deploy_the_policy_on_the_fixed_fleet(tmp_path: Path) -> None:
    entry = policy_entry({"kind": "dynamo_kv", "overlap_score_weight": 2.0})
    values = helm_values(entry, 5, None)
    assert values["replicas"] == {"replicas": 5} and values["autoscaling"] == {"mode": "none"}
    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump(values["router"]["config"]))
    settings = RouterSettings(config_file=config)
    assert settings.policy == entry.config and settings.policy.overlap_score_weight == 2.0  # type: ignore[union-attr]


def test_autoscaled_plan_values_give_the_autoscaler_the_simulated_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    planner = Planner(Scenario(), parse_objective(["ttft_p99=2s"]), None, 1, AutoscaleConfig(startup_s=45.0))
    autoscale = planner.autoscale_config(3, Scaling(6.0, 2, 90.0), 2, 12)
    values = helm_values(policy_entry("least_load"), 3, autoscale)["autoscaling"]
    assert (values["mode"], values["minReplicas"], values["maxReplicas"]) == ("shoal", 2, 12)
    assert values["targetRequestsPerReplica"] == 6.0
    # What the chart passes on as environment variables, as `shoal autoscaler` reads them.
    env = {
        "SHOAL_AUTOSCALER_POLICY__MIN_REPLICAS": str(values["minReplicas"]),
        "SHOAL_AUTOSCALER_POLICY__MAX_REPLICAS": str(values["maxReplicas"]),
        "SHOAL_AUTOSCALER_POLICY__TARGET_REQUESTS_PER_REPLICA": str(values["targetRequestsPerReplica"]),
        **{e["name"]: e["value"] for e in values["shoal"]["extraEnv"]},
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = AutoscalerSettings()
    simulated = autoscale.policy_config("shoal")
    assert settings.policy == simulated
    assert settings.policy.scale_up.max_replicas == 2
    assert settings.policy.scale_down.stabilization_window_s == 90.0
    assert settings.policy.expected_start_s == 45.0
    assert settings.interval_s == autoscale.interval_s
