"""`shoal simulate --block-size`: KV blocks of another size for the engines and the router, the same KV tokens.

On a Mooncake trace, whose hash ids name 512-token blocks, 512-token blocks lose exactly the hits inside a prompt's
last, partial trace block; an open-loop policy's run then gives the same latencies as at 16 tokens."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from simulations.cli import add_simulate_command
from simulations.scenario import FleetConfig, Scenario, build_workload, policy_entry, with_block_size
from simulations.simulation import Simulation
from simulations.step_model import SimulatedEngineConfig
from simulations.workload import Workload
from tests.data import MOONCAKE


def mooncake(block_size: int, **fleet: object) -> Scenario:
    engine = with_block_size(FleetConfig().resolve().engine, block_size)
    return Scenario.model_validate(
        {"trace": {"kind": "mooncake", "path": str(MOONCAKE)}, "fleet": {"engine": engine, **fleet}}
    )


def test_the_kv_cache_keeps_its_tokens_in_whole_blocks() -> None:
    engine = SimulatedEngineConfig(num_kv_blocks=80_000, block_size=16)
    assert with_block_size(engine, 512) == {"block_size": 512, "num_kv_blocks": 2_500}
    assert with_block_size(SimulatedEngineConfig(num_kv_blocks=100, block_size=16), 48) == {
        "block_size": 48,
        "num_kv_blocks": 33,  # 1,600 tokens: 33 whole blocks of 48
    }
    with pytest.raises(ValueError, match="positive"):
        with_block_size(engine, 0)
    with pytest.raises(ValueError, match="more than the engine's KV cache"):
        with_block_size(SimulatedEngineConfig(num_kv_blocks=2, block_size=16), 64)


def test_512_token_blocks_lose_only_the_hits_inside_a_last_partial_trace_block() -> None:
    """Per request, against a cache shared by all requests before it: the 512-token hit is the 16-token hit cut to
    whole trace blocks, and some 16-token hits do end inside a trace block (so the comparison has teeth)."""
    fine, coarse = (shared_cache_hits(build_workload(mooncake(block_size)), block_size) for block_size in (16, 512))
    assert len(fine) == 400
    assert coarse == [hit // 512 * 512 for hit in fine]
    assert sum(1 for hit in fine if hit % 512) > 0


def shared_cache_hits(workload: Workload, block_size: int) -> list[int]:
    """Cached prompt tokens of each request against a cache shared by all requests before it (the floor's)."""
    seen: set[int] = set()
    hits = []
    for request in workload.requests():
        limit = min(len(request.hashes), (request.prompt_tokens - 1) // block_size)
        hit = 0
        while hit < limit and request.hashes[hit] in seen:
            hit += 1
        seen.update(request.hashes)
        hits.append(hit * block_size)
    return hits


@pytest.mark.parametrize("num_replicas", [8, 16])
def test_an_open_loop_policy_gives_the_same_latencies_with_512_token_blocks(num_replicas: int) -> None:
    """round_robin does not read the cache, so the runs differ only by the lost partial-block hits and by KV held
    in whole blocks: TTFT and E2E percentiles within 1%. (A policy that reads the cache feeds any difference back
    into its choices, as a different seed does: simulations/README.md.)"""
    summaries = []
    for block_size in (16, 512):
        scenario = mooncake(block_size, num_replicas=num_replicas)
        result = Simulation(scenario, policy_entry("round_robin"), build_workload(scenario)).run()
        summaries.append(result.summary)
    fine, coarse = summaries
    assert coarse["requests"] == fine["requests"] == 400
    for key in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_p50_s", "e2e_p90_s", "e2e_p99_s"):
        assert coarse[key] == pytest.approx(fine[key], rel=0.01), key
    assert coarse["slo_attainment"] == pytest.approx(fine["slo_attainment"], abs=0.01)


def test_the_flag_sets_the_engines_and_the_routers_block(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="shoal")
    add_simulate_command(parser.add_subparsers(dest="command", required=True))
    argv = ["simulate", "--trace", str(MOONCAKE), "--limit", "40", "--policies", "estimated_ttft", "--replicas", "2"]
    args = parser.parse_args([*argv, "--block-size", "512", "--no-plots", "--no-progress", "--out", str(tmp_path)])
    assert args.run(args) == 0
    document = json.loads((tmp_path / "results.json").read_text())
    assert document["scenario"]["fleet"]["engine"] == {"block_size": 512, "num_kv_blocks": 2_500}
    assert document["policies"]["estimated_ttft"]["summary"]["requests"] == 40
    args = parser.parse_args([*argv, "--block-size", "0", "--out", str(tmp_path)])
    assert args.run(args) == 2
