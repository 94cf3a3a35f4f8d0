"""Several simulated routers (`simulations.routers`): one router runs as the single router did; with sharing, a
prefix one router routed is a hit at another once the lag has passed, and loads add up after a heartbeat."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from router.policy.config import build_policy, parse_policy_config
from router.policy.prefill_rate import PrefillRateEstimator
from router.policy.prefix_index import PrefixIndex, PrefixIndexConfig
from router.policy.types import Branch
from simulations.events import Simulator
from simulations.routers import FleetTicket, RouterFleet, RoutersConfig
from simulations.routing import SimRouter
from simulations.scenario import Scenario, build_workload
from simulations.simulation import Simulation
from tests.data import TRACES_DIR
from tests.unit.simulations.conftest import BLOCK, SEED, request

REPLICAS = ("r0", "r1", "r2")
PREFIX = (1, 32 * BLOCK)
"""A 32-block shared prefix (segment 1)."""


def fleet(count: int, policy: dict[str, Any] | None = None, **config: Any) -> RouterFleet:
    routers = []
    for i in range(count):
        router = SimRouter(
            build_policy(parse_policy_config({"kind": "estimated_ttft", **(policy or {})}), seed=i),
            PrefixIndex(PrefixIndexConfig()),
            PrefillRateEstimator(),
            block_size=BLOCK,
            seed_bytes=SEED,
        )
        routers.append(router)
    out = RouterFleet(routers, RoutersConfig(count=count, spread="round_robin", **config), Simulator())
    for replica in REPLICAS:
        out.add_replica(replica, None)
        out.set_eligible(replica, True)
    return out


def route_at(routers: RouterFleet, time_s: float, request_id: int, tickets: dict[int, FleetTicket]) -> None:
    """Route request `request_id` (the shared prefix and a suffix of its own) at `time_s`; round robin sends it to
    router `request_id % count`."""
    req = request(request_id, time_s, (PREFIX, (100 + request_id, 4 * BLOCK)), 10)

    def go(_: Any) -> None:
        ticket = routers.route(req.id, req.hashes, req.prompt_tokens, routers.sim.now)
        assert ticket is not None
        tickets[request_id] = ticket

    routers.sim.at(time_s, go)


@pytest.mark.parametrize(("sharing", "branch"), [(True, Branch.CACHE_HIT), (False, Branch.CACHE_MISS)])
def test_a_prefix_routed_by_one_router_is_a_hit_at_another_only_with_sharing(sharing: bool, branch: Branch) -> None:
    routers = fleet(2, sharing=sharing, lag_s=0.0)
    tickets: dict[int, FleetTicket] = {}
    route_at(routers, 0.0, 0, tickets)  # router 0
    route_at(routers, 0.001, 1, tickets)  # router 1
    routers.sim.run()
    assert tickets[0].router == 0 and tickets[1].router == 1
    assert tickets[0].decision.branch is Branch.CACHE_MISS
    assert tickets[1].decision.branch is branch
    if sharing:
        assert tickets[1].replica_id == tickets[0].replica_id
        assert tickets[1].decision.predicted_cached_tokens == PREFIX[1]


def test_the_lag_delays_a_peers_decision() -> None:
    # Nothing finishes here, so request 0 is still queued at its replica when request 3 comes, and the idle third
    # replica would answer sooner; charging it the fleet cost keeps the hit, and the test about the lag.
    routers = fleet(2, {"charges_idle_replicas": True}, sharing=True, lag_s=1.0)
    tickets: dict[int, FleetTicket] = {}
    route_at(routers, 0.0, 0, tickets)  # router 0
    route_at(routers, 0.999, 1, tickets)  # router 1, before router 0's decision reached it
    route_at(routers, 1.001, 3, tickets)  # router 1, after
    routers.sim.run()
    assert tickets[1].decision.branch is Branch.CACHE_MISS
    assert tickets[3].decision.branch is Branch.CACHE_HIT
    assert tickets[3].replica_id == tickets[0].replica_id


@pytest.mark.parametrize("sharing", [True, False])
def test_after_a_heartbeat_each_routers_load_is_the_sum_over_routers(sharing: bool) -> None:
    routers = fleet(3, sharing=sharing)
    sim = routers.sim
    tickets: dict[int, FleetTicket] = {}
    for request_id in range(7):
        route_at(routers, 0.0, request_id, tickets)
    routers.start(lambda: sim.now >= 1.0)
    sim.run(until_s=0.0)
    # Right after routing, before any batch arrived, a router sees only its own requests.
    for router in routers.routers:
        assert all(router.state(r).in_flight == router.core.own_load(r)[0] for r in REPLICAS)
    sim.run()  # past a heartbeat (0.5 s) and its round trip
    on_replica = {r: sum(1 for t in tickets.values() if t.replica_id == r) for r in REPLICAS}
    assert sum(on_replica.values()) == 7
    for router in routers.routers:
        for replica in REPLICAS:
            own_in_flight, own_waiting, _ = router.core.own_load(replica)
            state = router.state(replica)
            assert routers.in_flight(replica) == on_replica[replica]
            if sharing:
                assert state.in_flight == on_replica[replica] and state.waiting == on_replica[replica]
            else:
                assert state.in_flight == own_in_flight and state.waiting == own_waiting
    assert (routers.num_batches_applied > 0) is sharing


AGENTIC = {"kind": "agentic", "num_episodes": 30, "episode_rate_per_s": 1.5, "num_agent_kinds": 4, "seed": 0}


def small_scenarios(routers: dict[str, Any] | None = None) -> list[Scenario]:
    """A Mooncake slice on 4 replicas, and short agent loops on 3 with session affinity and KV events; the batch
    limit is not inferred, as in the simulator that `BEFORE` was taken from."""
    extra = {"routers": routers} if routers else {}
    return [
        Scenario.model_validate(
            {
                "trace": {"kind": "mooncake", "path": "mooncake/synthetic_trace.jsonl", "speed": 2.0, "limit": 200},
                "fleet": {"preset": "llama70b_8xa100", "num_replicas": 4},
                "policies": ["estimated_ttft"],
                "router": {"infer_max_num_seqs": False},
                "slo": {"ttft_s": 10.0, "tpot_s": 0.1},
                **extra,
            }
        ),
        Scenario.model_validate(
            {
                "trace": AGENTIC,
                "fleet": {"preset": "qwen3_30b_a3b_h100", "num_replicas": 3},
                "router": {"session_affinity": True, "index_mode": "exact_predicted", "infer_max_num_seqs": False},
                "policies": ["estimated_ttft"],
                **extra,
            }
        ),
    ]


def run(scenario: Scenario) -> dict[str, Any]:
    workload = build_workload(scenario, traces_dir=TRACES_DIR)
    return Simulation(scenario, scenario.policies[0], workload).run().summary


BEFORE = [
    # The single router's figures for `small_scenarios()`, from the simulator before it had several routers.
    {
        "requests": 200,
        "hit_ratio": 0.055085827563938906,
        "ttft_p50_s": 33.18709827246762,
        "ttft_p99_s": 63.84628063300623,
        "events": 758,
    },
    {
        "requests": 318,
        "hit_ratio": 0.9020920239449445,
        "ttft_p50_s": 0.09132517120000117,
        "ttft_p99_s": 0.23664705763291286,
        "events": 2369,
    },
]


BRANCHES_BEFORE = [{"cache_hit": 7, "cache_miss": 190, "spill": 3}, {"cache_hit": 26, "cache_miss": 4, "session": 288}]


@pytest.mark.parametrize("routers", [None, {"count": 1, "sharing": True}])
def test_one_router_gives_the_figures_of_before(routers: dict[str, Any] | None) -> None:
    for scenario, before, branches in zip(small_scenarios(routers), BEFORE, BRANCHES_BEFORE, strict=True):
        summary = run(scenario)
        assert {key: summary[key] for key in before} == pytest.approx(before, rel=1e-12)
        assert summary["branches"] == branches


def test_several_sharing_routers_are_deterministic_and_finish_every_request() -> None:
    _, agentic = small_scenarios({"count": 4, "sharing": True})
    first, second = run(agentic), run(agentic)
    assert first == second
    assert first["requests"] == 318 and first["rejected"] == 0


def test_a_scenario_file_reads_routers_on_and_off() -> None:
    section = yaml.safe_load("routers: {count: 4, sharing: on, spread: session, lag_s: 0.2}")
    config = Scenario.model_validate(section).routers
    assert (config.count, config.sharing, config.spread, config.decision_lag_s) == (4, True, "session", 0.2)
    default = Scenario.model_validate({}).routers
    assert (default.count, default.sharing) == (1, False)
    assert default.decision_lag_s == pytest.approx(default.flush_interval_s + default.round_trip_s)
