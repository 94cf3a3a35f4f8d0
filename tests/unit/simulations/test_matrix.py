"""`shoal simulate --matrix`: a tiny matrix (2 engines x 1 trace slice x 2 policies, 2 seeds) end to end through the
CLI, its table's structure, and ratios worked out from the per-run summaries in results.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from simulations.matrix import load_matrix
from tests.data import TRACES_DIR

from .test_cli import simulate

MATRIX = {
    "name": "tiny",
    "fleet": {"preset": "llama70b_8xa100", "num_replicas": 2},
    "engines": [
        {"label": "preset"},
        {"label": "overhead", "fleet": {"engine": {"request_overhead_s": 0.05}}},
    ],
    "traces": [{"label": "mooncake", "trace": {"kind": "mooncake", "path": "mooncake/synthetic_trace.jsonl"}}],
    "limit": 40,
    "policies": ["estimated_ttft", "round_robin"],
    "seeds": [0, 1],
}


@pytest.fixture
def matrix_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(MATRIX))
    return path


def test_runs_every_cell_and_prints_one_table_of_means_p99s_and_ratios(
    matrix_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["--matrix", str(matrix_file), "--traces-dir", str(TRACES_DIR), "--out", str(out), "--no-progress"]
    code = simulate([*argv, "--set", "router.service_time.learn_fixed=true"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    table = [line for line in lines if line.startswith("|")]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header == ["engine", "trace", "estimated_ttft", "round_robin", "estimated_ttft <= 1.05 x best"]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    assert [row[:2] for row in rows] == [["preset", "mooncake"], ["overhead", "mooncake"], ["worst ratio", "to best"]]

    document = json.loads((out / "results.json").read_text())
    assert document["matrix"]["router"]["service_time"]["learn_fixed"] is True
    assert "--set router.service_time.learn_fixed=true" in document["command"]
    cell = document["cells"][1]
    runs = cell["runs"]
    assert [r["seed"] for r in runs["round_robin"]] == [0, 1]
    assert all(r["requests"] == 40 for r in runs["round_robin"] + runs["estimated_ttft"])
    # By hand: each policy's mean TTFT over the two seeds, and estimated_ttft's over the cell's best.
    mean = {p: (rs[0]["ttft_mean_s"] + rs[1]["ttft_mean_s"]) / 2 for p, rs in runs.items()}
    p99 = {p: (rs[0]["ttft_p99_s"] + rs[1]["ttft_p99_s"]) / 2 for p, rs in runs.items()}
    ratio_mean = mean["estimated_ttft"] / min(mean.values())
    ratio_p99 = p99["estimated_ttft"] / min(p99.values())
    assert cell["ratios"]["estimated_ttft"]["ttft_mean_s"] == pytest.approx(ratio_mean)
    assert cell["goal_met"] is (ratio_mean <= 1.05 and ratio_p99 <= 1.05)
    assert f"{ratio_mean:.2f} / {ratio_p99:.2f}" in rows[1][4]
    assert rows[1][4].startswith("yes" if cell["goal_met"] else "no")
    shown_mean, shown_p99 = (x.rstrip("*") for x in rows[1][3].split(" / "))
    assert (shown_mean, shown_p99) == (f"{mean['round_robin']:.2f}", f"{p99['round_robin']:.2f}")
    # The last row: each policy's worst ratio over both cells.
    worst = max(c["ratios"]["round_robin"]["ttft_mean_s"] for c in document["cells"])
    assert rows[2][3].startswith(f"{worst:.2f} / ")
    assert document["worst_ratios"]["round_robin"]["ttft_mean_s"] == pytest.approx(worst)


def test_flags_the_matrix_file_sets_are_refused(matrix_file: Path, tmp_path: Path) -> None:
    argv = ["--matrix", str(matrix_file), "--traces-dir", str(TRACES_DIR), "--out", str(tmp_path), "--no-progress"]
    assert simulate([*argv, "--replicas", "4"]) == 2
    assert simulate([*argv, "--set", "engines"]) == 2


def test_the_packaged_matrix_is_valid_and_its_engines_resolve() -> None:
    matrix = load_matrix(Path(__file__).parents[3] / "simulations" / "matrices" / "engines_x_traces.yaml")
    assert matrix.num_runs == 7 * 5 * 9
    fleets = {e.label: matrix.scenario(e, matrix.traces[0], 0).fleet for e in matrix.engines}
    assert fleets["one_slow"].step_time_factors == [2.0]
    assert not fleets["small_batch"].resolve().engine.exports_max_num_seqs
    assert fleets["small_batch_exported"].resolve().engine.exports_max_num_seqs
    assert fleets["profiled"].resolve().engine.exports_max_num_seqs  # as Shoal's replica does
    assert fleets["profiled"].resolve().engine.max_num_batched_tokens == 512  # the profile's, not the base preset's
