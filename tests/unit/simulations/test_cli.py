"""`shoal simulate` through its argparse registration: table on stdout, results.json, plots, flag checking."""

from __future__ import annotations

import argparse
import json
from itertools import islice
from pathlib import Path

import pytest

from simulations.cli import add_simulate_command
from tests.data import MOONCAKE, TRACES_DIR

SCENARIOS = Path(__file__).parents[3] / "simulations" / "scenarios"


def simulate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shoal")
    add_simulate_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["simulate", *argv])
    result: int = args.run(args)
    return result


@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    path = tmp_path / "head.jsonl"
    with MOONCAKE.open() as f:
        path.write_text("".join(islice(f, 120)))
    return path


def test_compares_policies_and_writes_results_and_plots(
    small_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code = simulate(
        [
            "--trace",
            str(small_trace),
            "--policies",
            "estimated_ttft,round_robin",
            "--replicas",
            "4",
            "--speed",
            "0.5",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "| estimated_ttft" in table and "| round_robin" in table
    document = json.loads((out / "results.json").read_text())
    assert list(document["policies"]) == ["estimated_ttft", "round_robin"]
    summary = document["policies"]["estimated_ttft"]["summary"]
    assert summary["requests"] == 120
    assert {
        "ttft_p50_s",
        "ttft_p90_s",
        "ttft_p99_s",
        "e2e_p50_s",
        "e2e_p99_s",
        "hit_ratio",
        "replica_seconds",
        "slo_attainment",
        "branches",
    } <= set(summary)
    assert document["scenario"]["trace"]["speed"] == 0.5
    assert document["command"].startswith("shoal simulate --trace")
    assert (out / "ttft_cdf.png").stat().st_size > 1000
    assert (out / "timeseries.png").stat().st_size > 1000


def test_bundled_scenarios_parse_and_find_their_traces_in_the_traces_directory() -> None:
    from simulations.scenario import build_workload, load_scenario

    files = sorted(SCENARIOS.glob("*.yaml"))
    assert len(files) >= 15
    for path in files:
        scenario = load_scenario(path)
        assert scenario.description, path.name
        for run_scenario, _ in scenario.runs():
            run_scenario.fleet.resolve()
        # tests/data/traces is laid out as the full traces directory: every scenario's files are there.
        workload = build_workload(scenario, traces_dir=TRACES_DIR)
        assert next(iter(workload.requests())).prompt_tokens > 0, path.name


def test_a_bundled_scenario_without_its_trace_says_which_file_where_and_how_to_fetch_it(tmp_path: Path) -> None:
    from simulations.scenario import build_workload, load_scenario

    names = {
        "01_mooncake_moderate": "mooncake",
        "06_azure_code_bursty": "azure",
        "13_autoscale_servegen_day": "servegen",
    }
    for name, trace in names.items():
        with pytest.raises(ValueError, match="not found") as info:
            build_workload(load_scenario(SCENARIOS / f"{name}.yaml"), traces_dir=tmp_path)
        message = str(info.value)
        assert str(tmp_path) in message, message
        assert f"shoal simulate fetch-traces --traces-dir {tmp_path} --only {trace}" in message, message


def test_bad_flags_are_refused(small_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert simulate(["--trace", str(small_trace), "--policies", "nope", "--out", str(tmp_path)]) == 2
    assert "nope" in capsys.readouterr().err
    scenario = SCENARIOS / "05_synthetic_sessions.yaml"
    assert simulate(["--scenario", str(scenario), "--speed", "2", "--out", str(tmp_path)]) == 2


def test_the_speculative_decoding_scenario_compares_fleets_on_a_relative_trace() -> None:
    from simulations.scenario import AzureTraceConfig, load_scenario

    scenario = load_scenario(SCENARIOS / "15_speculative_decoding.yaml")
    assert isinstance(scenario.trace, AzureTraceConfig) and not scenario.trace.path.is_absolute()
    fleets = {entry.label.split(": ")[0]: run.fleet.resolve() for run, entry in scenario.runs()}
    assert fleets["plain"].speculation is None
    tau3 = fleets["k4 tau3"].speculation
    assert tau3 is not None and tau3.is_enabled and tau3.num_speculative_tokens == 4
    assert tau3.mean_acceptance_length == 3.0


def test_no_floor_leaves_out_the_floor_row_and_nothing_else(
    small_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    documents = []
    for extra in ([], ["--no-floor"]):
        out = tmp_path / f"out{len(extra)}"
        argv = ["--trace", str(small_trace), "--policies", "round_robin", "--replicas", "2", "--out", str(out)]
        assert simulate([*argv, "--no-plots", "--no-progress", *extra]) == 0
        documents.append(json.loads((out / "results.json").read_text()))
        table = capsys.readouterr().out
        assert ("floor: alone" in table) == (not extra)
    with_floor, without = documents
    assert with_floor["floor"]["hit_ratio"] > 0 and without["floor"] is None
    assert with_floor["policies"] == without["policies"]
    assert without["command"].endswith("--no-floor --no-progress")


def test_tile_to_replays_the_trace_to_a_request_count(
    small_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--trace", str(small_trace), "--policies", "round_robin", "--replicas", "2", "--no-plots", "--no-progress"]
    assert simulate([*argv, "--tile-to", "300", "--out", str(tmp_path / "a")]) == 0
    document = json.loads((tmp_path / "a" / "results.json").read_text())
    assert document["policies"]["round_robin"]["summary"]["requests"] == 300
    assert document["scenario"]["trace"]["tiles"] is None and document["scenario"]["trace"]["limit"] == 300
    assert "tiled to 300 requests" in capsys.readouterr().out
    assert simulate([*argv, "--tile", "2", "--out", str(tmp_path / "b")]) == 0
    document = json.loads((tmp_path / "b" / "results.json").read_text())
    assert document["policies"]["round_robin"]["summary"]["requests"] == 240
    assert simulate([*argv, "--tile-to", "300", "--limit", "5", "--out", str(tmp_path)]) == 2
    assert "--tile-to" in capsys.readouterr().err
    scenario = SCENARIOS / "05_synthetic_sessions.yaml"
    assert simulate(["--scenario", str(scenario), "--tile", "2", "--out", str(tmp_path)]) == 2
