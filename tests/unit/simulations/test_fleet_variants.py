"""Fleet variants in a scenario, and speculation set or turned off by a scenario's fleet or by the CLI."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from simulations.cli import add_simulate_command, resolve_scenario
from simulations.scenario import Scenario

SPECULATION = {
    "num_speculative_tokens": 4,
    "mean_acceptance_length": 3.0,
    "verify_s_per_token": 1e-4,
    "draft_step_s": 0.0015,
    "draft_s_per_seq": 2e-5,
}


def with_variants(*variants: dict[str, Any], **fleet: Any) -> Scenario:
    return Scenario.model_validate(
        {
            "trace": {"kind": "shared_prefix", "num_requests": 60, "rate_per_s": 4.0, "output_tokens": [20, 80]},
            "fleet": {"preset": "qwen3_30b_a3b_h100", "num_replicas": 2, "speculation": SPECULATION, **fleet},
            "policies": ["round_robin", "least_load"],
            "variants": list(variants),
        }
    )


def test_each_policy_runs_on_each_variant_with_the_variants_overrides() -> None:
    scenario = with_variants(
        {"label": "plain", "fleet": {"speculation": None}},
        {"label": "spec"},
        {"label": "tau2, 3 replicas", "fleet": {"num_replicas": 3, "speculation": {"mean_acceptance_length": 2.0}}},
    )
    runs = scenario.runs()
    assert [entry.label for _, entry in runs] == [
        "plain: round_robin",
        "plain: least_load",
        "spec: round_robin",
        "spec: least_load",
        "tau2, 3 replicas: round_robin",
        "tau2, 3 replicas: least_load",
    ]
    assert runs[0][0].fleet.resolve().speculation is None
    spec = runs[2][0].fleet.resolve().speculation
    assert spec is not None and spec.mean_acceptance_length == 3.0
    tau2 = runs[4][0]
    assert tau2.fleet.num_replicas == 3 and not tau2.variants
    merged = tau2.fleet.resolve().speculation
    assert merged is not None and merged.mean_acceptance_length == 2.0 and merged.draft_step_s == 0.0015
    # Without variants, the policies alone.
    assert [entry.label for _, entry in with_variants().runs()] == ["round_robin", "least_load"]


@pytest.mark.parametrize(
    ("variants", "message"),
    [
        ([{"label": "a"}, {"label": "a"}], "labels must differ"),
        ([{"label": "p", "fleet": {"prefill_only": True}}], "prefill_only"),
        ([{"label": "x", "fleet": {"num_replica": 3}}], "num_replica"),
    ],
)
def test_bad_variants_are_refused_when_the_scenario_loads(variants: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        with_variants(*variants)


def test_tau_above_k_plus_one_is_refused_when_the_fleet_resolves() -> None:
    scenario = with_variants({"label": "bad", "fleet": {"speculation": {"mean_acceptance_length": 6.0}}})
    with pytest.raises(ValidationError, match="exceeds k \\+ 1"):
        scenario.runs()[0][0].fleet.resolve()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="shoal")
    add_simulate_command(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["simulate", *argv])


def test_the_cli_runs_the_variants_and_prints_a_speculation_line_per_speculating_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(
        with_variants({"label": "plain", "fleet": {"speculation": None}}, {"label": "spec"}).model_dump_json()
    )
    args = parse(["--scenario", str(path), "--policies", "round_robin", "--out", str(tmp_path / "o"), "--no-plots"])
    assert args.run(args) == 0
    out = capsys.readouterr().out
    assert "| plain: round_robin" in out and "| spec: round_robin" in out
    lines = [line for line in out.splitlines() if line.startswith("speculation, ")]
    assert len(lines) == 1 and lines[0].startswith("speculation, spec: round_robin: ")
    document = json.loads((tmp_path / "o" / "results.json").read_text())
    assert "speculation" not in document["policies"]["plain: round_robin"]["summary"]
    spec = document["policies"]["spec: round_robin"]["summary"]["speculation"]
    assert spec["spec_steps"] > 0 and 2.5 < spec["spec_tokens_per_step"] <= 3.2


def test_acceptance_length_flag_turns_on_a_fleets_speculation(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(with_variants(speculation={**SPECULATION, "mean_acceptance_length": None}).model_dump_json())
    off = resolve_scenario(parse(["--scenario", str(path), "--out", str(tmp_path)]))
    speculation = off.fleet.resolve().speculation
    assert speculation is not None and not speculation.is_enabled
    on = resolve_scenario(parse(["--scenario", str(path), "--acceptance-length", "2.5", "--out", str(tmp_path)]))
    speculation = on.fleet.resolve().speculation
    assert speculation is not None and speculation.mean_acceptance_length == 2.5 and speculation.is_enabled


def test_routers_and_sharing_flags_set_the_scenarios_routers(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(with_variants().model_dump_json())
    lone = resolve_scenario(parse(["--scenario", str(path), "--out", str(tmp_path)]))
    assert (lone.routers.count, lone.routers.sharing) == (1, False)
    fleet = resolve_scenario(parse(["--scenario", str(path), "--routers", "4", "--sharing", "on", "--out", "o"]))
    assert (fleet.routers.count, fleet.routers.sharing) == (4, True)
