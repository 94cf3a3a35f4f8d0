"""Session affinity, as the live router does it with `session_header` set: a session goes back to its replica while
that one is eligible, consistent_hash keys on the session; off, sessions are invisible to the router. Then short
runs of the agentic and sessions workloads through the whole simulation."""

from __future__ import annotations

from collections import defaultdict

from router.policy.config import ConsistentHashConfig, build_policy, parse_policy_config
from router.policy.prefill_rate import PrefillRateEstimator
from router.policy.prefix_index import PrefixIndex, PrefixIndexConfig
from router.policy.types import Branch
from simulations.routing import SimRouter
from simulations.simulation import Simulation
from simulations.synthetic import AgenticConfig, AgenticWorkload
from tests.unit.simulations.conftest import BLOCK, SEED
from tests.unit.simulations.conftest import scenario as make_scenario

AGENTS = AgenticConfig(
    num_episodes=40,
    episode_rate_per_s=4.0,
    num_agent_kinds=2,
    system_prompt_tokens=(320, 320),
    task_tokens=(20, 60),
    num_steps=(3, 5),
    output_tokens=(10, 30),
    tool_result_tokens=(40, 120),
    tool_latency_s=(0.2, 0.5),
    seed=2,
)


def router(policy: str, *, is_session_affinity: bool) -> SimRouter:
    config = parse_policy_config({"kind": policy})
    sim_router = SimRouter(
        build_policy(config, seed=0),
        PrefixIndex(PrefixIndexConfig()),
        PrefillRateEstimator(),
        block_size=BLOCK,
        seed_bytes=SEED,
        is_session_affinity=is_session_affinity,
    )
    for replica in ("r0", "r1", "r2", "r3"):
        sim_router.add_replica(replica, None)
        sim_router.set_eligible(replica, True)
    return sim_router


def replicas_by(policy: str, *, is_session_affinity: bool) -> tuple[dict[str, set[str]], dict[int, set[str]]]:
    """Replicas each episode went to, and replicas each agent kind (first block) went to."""
    sim_router = router(policy, is_session_affinity=is_session_affinity)
    by_session: dict[str, set[str]] = defaultdict(set)
    by_kind: dict[int, set[str]] = defaultdict(set)
    for request in AgenticWorkload(AGENTS, block_size=BLOCK).requests():
        ticket = sim_router.route(request.hashes, request.prompt_tokens, request.arrival_s, request.session)
        assert ticket is not None and request.session is not None
        sim_router.finish(ticket, request.arrival_s)
        by_session[request.session].add(ticket.replica_id)
        by_kind[request.hashes[0]].add(ticket.replica_id)
    return by_session, by_kind


def test_consistent_hash_keys_on_the_session_when_the_router_reads_it() -> None:
    assert ConsistentHashConfig().kind == "consistent_hash"
    by_session, by_kind = replicas_by("consistent_hash", is_session_affinity=True)
    assert all(len(replicas) == 1 for replicas in by_session.values())
    assert all(len(replicas) > 1 for replicas in by_kind.values())  # episodes of one kind spread over the ring
    by_session, by_kind = replicas_by("consistent_hash", is_session_affinity=False)
    assert all(len(replicas) == 1 for replicas in by_kind.values())  # keyed on the system prompt's block: one replica
    assert len(by_kind) == 2


def test_a_session_returns_to_its_replica_while_it_is_eligible() -> None:
    sim_router = router("round_robin", is_session_affinity=True)
    first = sim_router.route([1, 2], 32, 0.0, "a0")
    again = sim_router.route([1, 2, 3], 48, 1.0, "a0")
    other = sim_router.route([9], 16, 1.5, "a1")
    assert first is not None and again is not None and other is not None
    assert again.replica_id == first.replica_id and again.decision.branch is Branch.SESSION
    assert other.replica_id != first.replica_id and other.decision.branch is Branch.ROUND_ROBIN
    sim_router.set_eligible(first.replica_id, False)
    moved = sim_router.route([1, 2, 3, 4], 64, 2.0, "a0")
    assert moved is not None and moved.replica_id != first.replica_id and moved.decision.branch is Branch.ROUND_ROBIN
    sim_router.set_eligible(first.replica_id, True)
    back = sim_router.route([1, 2, 3, 4, 5], 80, 3.0, "a0")
    assert back is not None and back.replica_id == moved.replica_id  # remembered where it went last
    blind = router("round_robin", is_session_affinity=False)
    tickets = [blind.route([1], 16, float(t), "a0") for t in range(4)]
    assert len({t.replica_id for t in tickets if t is not None}) == 4


def test_agentic_runs_through_the_simulation_with_and_without_affinity() -> None:
    workload = AgenticWorkload(AGENTS, block_size=BLOCK)
    num_requests = sum(1 for _ in workload.requests())
    summaries = {}
    for is_affine in (False, True):
        scenario = make_scenario(
            fleet={"num_replicas": 4},
            router={"session_affinity": is_affine},
            policies=["estimated_ttft", "round_robin"],
        )
        for entry in scenario.policies:
            result = Simulation(scenario, entry, workload).run()
            summaries[(is_affine, entry.label)] = result.summary
    for summary in summaries.values():
        assert summary["requests"] == num_requests and summary["rejected"] == 0
    pinned = summaries[(True, "round_robin")]["branches"]
    assert pinned == {"round_robin": 40, "session": num_requests - 40}
    # Pinned episodes find their whole history cached; round robin without affinity finds the system prompt and
    # only whatever of the history its replica happens to hold.
    assert summaries[(True, "round_robin")]["hit_ratio"] > summaries[(False, "round_robin")]["hit_ratio"] + 0.1
    assert summaries[(False, "estimated_ttft")]["hit_ratio"] > 0.6
    assert "session" not in summaries[(False, "estimated_ttft")]["branches"]
