"""The autoscaling hook: replicas start after their start-up delay, surplus ones drain, replica-seconds add up."""

from __future__ import annotations

import pytest

from simulations.scenario import policy_entry
from simulations.simulation import Simulation

from .conftest import request, scenario, workload


def test_scheduled_fleet_grows_after_startup_and_shrinks_by_draining() -> None:
    scn = scenario(
        fleet={"num_replicas": 1, "engine": {"startup_s": 5.0}},
        scaling={"kind": "schedule", "steps": [[0.0, 1], [10.0, 3], [40.0, 1]], "interval_s": 1.0},
        sample_interval_s=1.0,
    )
    requests = [request(i, 0.5 * i, ((i, 500),), output_tokens=20) for i in range(120)]
    simulation = Simulation(scn, policy_entry("least_load"), workload(*requests))
    result = simulation.run()
    assert result.summary["requests"] == 120
    members = simulation.members
    assert len(members) == 3
    added = [m for m in members if m.created_s > 0]
    assert all(m.created_s == pytest.approx(10.0) and m.ready_s == pytest.approx(15.0) for m in added)
    removed = [m.removed_s for m in added]
    assert all(t is not None and t >= 40.0 for t in removed)
    end = result.summary["duration_s"]
    expected = end + sum((t or 0.0) - m.created_s for t, m in zip(removed, added, strict=True))
    assert result.summary["replica_seconds"] == pytest.approx(expected)
    counts = {s.num_replicas for s in result.recorder.samples}
    assert counts == {1, 3}
    # No request went to a replica before it was ready.
    assert {r for r in result.summary["branches"]} == {"least_load", "only_replica"}


def test_requests_are_held_while_no_replica_is_ready() -> None:
    scn = scenario(
        fleet={"num_replicas": 1, "engine": {"startup_s": 3.0}},
        scaling={"kind": "schedule", "steps": [[0.0, 1], [1.0, 0], [2.0, 1]], "interval_s": 1.0},
    )
    late = request(0, 2.5, ((1, 100),), output_tokens=2)
    result = Simulation(scn, policy_entry("round_robin"), workload(late)).run()
    # Drained at 1 s, a new replica created at 2 s is ready at 5 s: the request waits for it.
    assert result.recorder.ttft_s[0] == pytest.approx(5.0 - 2.5 + 0.11)


def test_a_fleet_that_never_comes_back_fails_held_requests_after_the_hold_limit() -> None:
    scn = scenario(
        fleet={"num_replicas": 1},
        scaling={"kind": "schedule", "steps": [[0.0, 1], [1.0, 0]], "interval_s": 1.0},
        router={"hold_max_wait_s": 30.0},
    )
    served = request(0, 0.5, ((1, 100),), output_tokens=2)
    stranded = request(1, 2.0, ((2, 100),), output_tokens=2)
    result = Simulation(scn, policy_entry("round_robin"), workload(served, stranded)).run()
    assert result.summary["requests"] == 1
    assert result.summary["rejected"] == 1
    assert result.summary["duration_s"] == pytest.approx(32.0)


def test_a_busy_replica_drains_then_leaves_when_its_last_request_ends() -> None:
    scn = scenario(
        fleet={"num_replicas": 2},
        scaling={"kind": "schedule", "steps": [[0.0, 2], [1.0, 1]], "interval_s": 1.0},
    )
    # Both replicas busy when the fleet shrinks at 1 s: each has a long decode going.
    requests = [request(i, 0.0, ((i, 100),), output_tokens=200) for i in range(2)]
    simulation = Simulation(scn, policy_entry("round_robin"), workload(*requests))
    result = simulation.run()
    drained = [m for m in simulation.members if m.is_draining]
    assert len(drained) == 1
    assert drained[0].removed_s is not None and 1.0 < drained[0].removed_s < result.summary["duration_s"] + 1e-9
    assert result.recorder.samples[-1].num_replicas == 1


@pytest.mark.parametrize("limit", [0, 1])
def test_at_the_in_flight_limit_requests_wait_at_the_router_and_start_in_arrival_order(limit: int) -> None:
    scn = scenario(fleet={"num_replicas": 2}, router={"max_in_flight_per_replica": limit}, sample_interval_s=0.05)
    # Four long decodes and two short ones, all at once, on two replicas.
    lengths = [200, 200, 200, 200, 2, 2]
    requests = [request(i, 0.001 * i, ((i, 100),), output_tokens=n) for i, n in enumerate(lengths)]
    result = Simulation(scn, policy_entry("least_load"), workload(*requests)).run()
    assert result.summary["requests"] == 6
    first_token = sorted(zip(result.recorder.arrival_s, result.recorder.ttft_s, strict=True))
    starts = [arrival + ttft for arrival, ttft in first_token]
    most_running = max(s.engine_running for s in result.recorder.samples)
    if limit:
        assert most_running <= 2 and all(s.engine_waiting == 0 for s in result.recorder.samples)
        assert starts == sorted(starts)  # nobody overtakes a held request
        assert starts[2] > starts[1] + 0.2  # the third waited at the router for a long decode to end
    else:
        assert most_running >= 3  # the engines took everything at once
        assert max(starts) < 0.5
