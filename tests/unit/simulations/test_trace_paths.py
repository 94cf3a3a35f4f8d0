"""Relative trace paths in scenarios: taken from `--traces-dir` or $SHOAL_TRACES_DIR, and a clear error without."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from simulations.cli import add_simulate_command
from simulations.scenario import Scenario, build_workload

AZURE_ROWS = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
    f"2023-11-16 18:15:{i:02d}.5000000,{40 + i},{3 + i % 4}\n" for i in range(12)
)


@pytest.fixture
def traces(tmp_path: Path) -> Path:
    """A traces directory holding one small Azure file at `azure/conv.csv`."""
    root = tmp_path / "traces"
    (root / "azure").mkdir(parents=True)
    (root / "azure" / "conv.csv").write_text(AZURE_ROWS)
    return root


def azure_scenario(path: str | Path) -> Scenario:
    return Scenario.model_validate(
        {
            "trace": {"kind": "azure", "path": str(path)},
            "fleet": {"preset": "qwen3_30b_a3b_h100", "num_replicas": 1},
            "policies": ["round_robin"],
        }
    )


def test_a_relative_path_is_taken_from_the_traces_directory(traces: Path) -> None:
    workload = build_workload(azure_scenario("azure/conv.csv"), traces_dir=traces)
    assert len(list(workload.requests())) == 12
    # An absolute path is used as it is, with or without a directory.
    assert len(list(build_workload(azure_scenario(traces / "azure" / "conv.csv")).requests())) == 12


def test_a_relative_path_without_a_directory_says_how_to_set_one() -> None:
    with pytest.raises(ValueError, match="not set") as info:
        build_workload(azure_scenario("azure/conv.csv"))
    message = str(info.value)
    assert "azure/conv.csv" in message and "--traces-dir" in message and "SHOAL_TRACES_DIR" in message


def test_a_missing_file_is_named_with_the_directory_it_was_looked_for_in(traces: Path) -> None:
    with pytest.raises(ValueError, match="not found") as info:
        build_workload(azure_scenario("azure/code.csv"), traces_dir=traces)
    message = str(info.value)
    assert str(traces / "azure" / "code.csv") in message and "SHOAL_TRACES_DIR" in message
    with pytest.raises(ValueError, match="not found"):
        build_workload(azure_scenario(traces / "missing.csv"))


def simulate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shoal")
    add_simulate_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["simulate", *argv])
    result: int = args.run(args)
    return result


def test_the_cli_reads_the_directory_from_the_flag_or_the_environment(
    traces: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario_file = tmp_path / "s.yaml"
    scenario_file.write_text(azure_scenario("azure/conv.csv").model_dump_json())
    common = ["--scenario", str(scenario_file), "--no-plots", "--no-progress"]
    monkeypatch.delenv("SHOAL_TRACES_DIR", raising=False)
    assert simulate([*common, "--out", str(tmp_path / "none")]) == 2
    assert "SHOAL_TRACES_DIR" in capsys.readouterr().err
    assert simulate([*common, "--traces-dir", str(traces), "--out", str(tmp_path / "flag")]) == 0
    monkeypatch.setenv("SHOAL_TRACES_DIR", str(traces))
    assert simulate([*common, "--out", str(tmp_path / "env")]) == 0
    document = json.loads((tmp_path / "env" / "results.json").read_text())
    assert document["policies"]["round_robin"]["summary"]["requests"] == 12
    assert document["scenario"]["trace"]["path"] == "azure/conv.csv"  # as written, not this machine's path
