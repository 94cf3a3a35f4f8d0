"""ServeGen rate curves: the file reads per model and day, arrivals follow the compressed curve within Poisson
noise, lengths come from their source, a seed fixes everything, and scenarios and `--trace` select the kind."""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

import pytest

from simulations.cli import add_simulate_command, trace_kind
from simulations.scenario import Scenario, build_workload, load_scenario
from simulations.servegen import ServeGenTraceConfig, ServeGenWorkload, UniformLengths, read_servegen
from simulations.traces import TraceRow
from tests.data import AZURE_CODE, SERVEGEN, TRACES_DIR

SCENARIOS = Path(__file__).parents[3] / "simulations" / "scenarios"
HEADER = ["category", "model", "window_start_s", "total_rate_req_per_s", "active_clients", "rate_weighted_mean_iat_cv"]


def write_curve(path: Path, rates: list[float], *, model: str = "m-test") -> Path:
    """A rate file in ServeGen's format: one day of 600 s windows repeating `rates`, and a second model as noise."""
    assert 144 % len(rates) == 0
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(HEADER)
        for i, rate in enumerate(rates * (144 // len(rates))):
            writer.writerow(["language", model, i * 600, rate, 10, 1.0])
            writer.writerow(["language", "other", i * 600, 1000.0, 10, 1.0])
    return path


def test_the_file_reads_per_model_and_day() -> None:
    rates, window_s = read_servegen(SERVEGEN, model="m-large", day=0)
    assert window_s == 600.0 and len(rates) == 144
    assert rates[0] == pytest.approx(212.78)
    two_days, _ = read_servegen(SERVEGEN, model="m-large", day=0, num_days=2)
    assert two_days[:144] == rates and len(two_days) == 288
    assert max(rates) / min(rates) > 2.5  # the README's diurnal swing
    with pytest.raises(ValueError, match="day"):
        read_servegen(SERVEGEN, model="deepseek-r1", day=1)
    with pytest.raises(ValueError, match="no rate curve"):
        read_servegen(SERVEGEN, model="nope")


def test_arrivals_follow_the_compressed_curve_within_poisson_noise(tmp_path: Path) -> None:
    rates = [10.0, 40.0, 5.0, 25.0, 25.0, 50.0, 2.0, 30.0]
    path = write_curve(tmp_path / "curve.csv", rates)
    short = UniformLengths(prompt_tokens=(16, 64), output_tokens=(1, 8))
    config = ServeGenTraceConfig(path=path, model="m-test", compress=300.0, peak_rate_per_s=200.0, lengths=short)
    workload = ServeGenWorkload.from_config(config, seed=3, block_size=16)
    assert workload.window_s == 2.0 and workload.duration_s == 288.0  # a day of 600 s windows in 288 s
    assert workload.rates_per_s[:8] == pytest.approx([r * 4 for r in rates])
    arrivals = [r.arrival_s for r in workload.requests()]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0 and arrivals[-1] < 288.0
    for window in range(144):
        start, stop = window * 2.0, (window + 1) * 2.0
        expected = workload.expected_requests(start, stop)
        count = sum(1 for a in arrivals if start <= a < stop)
        assert abs(count - expected) < 4.5 * math.sqrt(expected), (window, count, expected)
    # The 2 req/s window (x4) sits between 50 and 30: the interpolated rate rises towards both edges.
    assert workload.rate_at(13.0) == pytest.approx(8.0)
    assert workload.rate_at(12.0) == pytest.approx((200.0 + 8.0) / 2)
    total = workload.expected_requests()
    assert abs(len(arrivals) - total) < 4 * math.sqrt(total)
    low = [a for a in arrivals if 12.0 <= a % 16.0 < 14.0]  # every repeat of the 2 req/s window
    high = [a for a in arrivals if 10.0 <= a % 16.0 < 12.0]  # and of the 50 req/s one
    assert len(high) > 3 * len(low)  # 302 against 92 requests per repeat, by the interpolated rate


def test_recorded_rates_are_kept_without_a_peak(tmp_path: Path) -> None:
    path = write_curve(tmp_path / "curve.csv", [3.0, 6.0])
    workload = ServeGenWorkload.from_config(ServeGenTraceConfig(path=path, model="m-test"), seed=0, block_size=16)
    assert workload.rates_per_s[:2] == [3.0, 6.0] and workload.window_s == 600.0


def test_a_seed_fixes_arrivals_and_lengths(tmp_path: Path) -> None:
    path = write_curve(tmp_path / "curve.csv", [2.0, 6.0, 3.0])
    config = ServeGenTraceConfig(
        path=path, model="m-test", compress=600.0, lengths=UniformLengths(prompt_tokens=(16, 500))
    )

    def stream(seed: int) -> list[tuple[float, int, int, list[int]]]:
        workload = ServeGenWorkload.from_config(config, seed=seed, block_size=16)
        return [(r.arrival_s, r.prompt_tokens, r.output_tokens, list(r.hashes)) for r in workload.requests()]

    first = stream(0)
    assert first == stream(0)
    assert first != stream(1)
    hashes = [h for *_, request_hashes in first for h in request_hashes]
    assert len(hashes) == len(set(hashes))  # every prompt its own tokens


def test_lengths_come_from_their_source() -> None:
    ranges = UniformLengths(prompt_tokens=(100, 300), output_tokens=(0, 50))
    uniform = ServeGenWorkload([5.0, 10.0], 60.0, ranges, seed=1, block_size=16)
    requests = list(uniform.requests())
    assert len(requests) > 100
    assert all(100 <= r.prompt_tokens <= 300 and 1 <= r.output_tokens <= 50 for r in requests)
    assert all(len(r.hashes) == r.prompt_tokens // 16 for r in requests)
    rows = [TraceRow(0.0, 1000, 7), TraceRow(0.0, 40, 300), TraceRow(0.0, 5000, 1)]
    drawn = ServeGenWorkload([5.0, 10.0], 60.0, rows, seed=1, block_size=16, limit=60)
    pairs = [(r.prompt_tokens, r.output_tokens) for r in drawn.requests()]
    assert len(pairs) == 60  # `limit`
    assert set(pairs) == {(1000, 7), (40, 300), (5000, 1)}


def test_scenario_09_selects_the_servegen_kind() -> None:
    scenario = load_scenario(SCENARIOS / "09_autoscale_servegen_diurnal.yaml")
    assert isinstance(scenario.trace, ServeGenTraceConfig)
    trace = scenario.trace.model_copy(update={"limit": 5})
    workload = build_workload(scenario.model_copy(update={"trace": trace}), traces_dir=TRACES_DIR)
    assert isinstance(workload, ServeGenWorkload)
    assert workload.duration_s == 1800.0 and max(workload.rates_per_s) == pytest.approx(40.0)
    assert min(workload.rates_per_s) == pytest.approx(10.4, abs=0.05)  # the trough the README states
    assert len(list(workload.requests())) == 5


def test_a_bad_servegen_scenario_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="min <= max"):
        Scenario.model_validate(
            {
                "trace": {
                    "kind": "servegen",
                    "path": str(SERVEGEN),
                    "lengths": {"kind": "uniform", "prompt_tokens": [300, 100]},
                }
            }
        )


def test_simulate_replays_a_servegen_file_given_as_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_curve(tmp_path / "curve.csv", [1.0, 4.0, 2.0], model="m-large")  # 144 windows
    assert trace_kind(str(path)) == "servegen"
    assert trace_kind(str(AZURE_CODE)) == "azure"
    parser = argparse.ArgumentParser(prog="shoal")
    add_simulate_command(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "out"
    argv = ["simulate", "--trace", str(path), "--speed", "600", "--limit", "80", "--policies", "least_load"]
    args = parser.parse_args([*argv, "--out", str(out), "--no-plots", "--no-progress"])
    assert args.run(args) == 0
    assert "servegen:m-large:day0" in capsys.readouterr().out
    document = json.loads((out / "results.json").read_text())
    trace = document["scenario"]["trace"]
    assert trace["kind"] == "servegen" and trace["compress"] == 600.0  # --speed compresses the curve
    assert document["policies"]["least_load"]["summary"]["requests"] == 80  # --limit
