"""estimated_ttft's `select` against a plain reference of its formula, bit for bit, over random fleets.

`select` keeps each replica's request-independent terms between decisions and re-derives them only for a replica
that is another object or whose `ReplicaState.version` moved, so these tests run sequences of decisions on one
policy object while loads, rates and the set of eligible replicas change, as a router's do (through the state's
methods, or field writes followed by `touch()`). The reference below follows
the module docstring one replica at a time and takes every sum in the order the policy takes it; floats are
compared exactly (`float.hex`), so a cached term that went stale, a near-tie decided differently or a sum
reordered all fail.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from router.policy.config import EstimatedTTFTConfig
from router.policy.estimated_ttft import EstimatedTTFT
from router.policy.types import Branch, Decision, ReplicaState, RouteRequest


def reference_queue_s(cfg: EstimatedTTFTConfig, r: ReplicaState) -> float:
    """Seconds of wait for a batch slot: n - B + 1 completions at B / slot_s per second once n >= B, B the
    engine's limit, else the learned one, else the peers', either at least the most seen running, else the
    assumed one."""
    slots: float | None = r.max_num_seqs
    if slots is None:
        slots = r.learned_slots if r.learned_slots is not None else r.peer_max_num_seqs
        if slots is not None:
            slots = max(slots, r.most_running)
    if slots is None:
        slots = cfg.assumed_batch_slots
    # The router's own requests now and those the engine counted beyond its own at the last scrape.
    n = r.in_flight + max(0, (r.num_running or 0) + (r.num_waiting or 0) - r.in_flight_at_scrape)
    if slots is None or r.slot_s is None or n < slots:
        return 0.0
    return (n - slots + 1) * r.slot_s / slots


def reference_costs(
    cfg: EstimatedTTFTConfig, request: RouteRequest, replicas: Sequence[ReplicaState]
) -> list[tuple[float, float]]:
    """(ttft, cost) of each replica in seconds: the module docstring's formula, term by term."""
    rates = [max(r.prefill_tokens_per_s, 1.0) for r in replicas]
    n = len(rates)
    rate_sum = rate_sq_sum = 0.0
    for rate in rates:
        rate_sum += rate
        rate_sq_sum += rate * rate
    mean = rate_sum / n
    var = rate_sq_sum / n - mean * mean
    noise = (cfg.rate_noise_cv * mean) ** 2
    lam = 1.0 - noise / var if var > noise else 0.0
    pooled = [mean + lam * (rate - mean) for rate in rates]
    attn = cfg.attention_s_per_token_pair
    threshold = cfg.kv_pressure_threshold
    owns, ttfts = [], []
    for r, rate in zip(replicas, pooled, strict=True):
        cached = request.cached_tokens(r.id)
        uncached = request.prompt_tokens - cached
        own = uncached / rate + attn * uncached * (cached + uncached / 2)
        backlog = r.waiting_prompt_tokens
        decoding = max(r.streaming, r.num_running or 0)
        steps = 1.0 + (backlog + uncached) * (1.0 / cfg.prefill_tokens_per_step)
        ttft = backlog / rate + own + cfg.decode_s_per_seq_step * decoding * steps
        if r.waiting > 0:
            ttft += attn * backlog * backlog / (2 * r.waiting)
        if r.kv_usage is not None and r.kv_usage > threshold:
            excess = min(r.kv_usage, 1.0) - threshold
            ttft += cfg.kv_pressure_s / (1.0 - threshold) ** 2 * excess * excess
        ttft += reference_queue_s(cfg, r)
        ttft += r.fixed_s
        owns.append(own)
        ttfts.append(ttft)
    floor = min(owns)
    charged = [cfg.charges_idle_replicas or r.queue_depth > 0 for r in replicas]
    return [
        (t, t + cfg.fleet_cost_weight * (own - floor) if c else t)
        for t, own, c in zip(ttfts, owns, charged, strict=True)
    ]


def reference_select(cfg: EstimatedTTFTConfig, request: RouteRequest, replicas: Sequence[ReplicaState]) -> Decision:
    """The choice among two or more replicas: cap, near-tie band, then the longest match, fewer in flight, least
    recent, smallest id."""
    costs = reference_costs(cfg, request, replicas)
    under_cap = [i for i, r in enumerate(replicas) if r.queue_depth < cfg.max_queue_per_replica]
    candidates = under_cap if under_cap else list(range(len(replicas)))
    best_s = min(costs[i][1] for i in candidates)
    tied = [i for i in candidates if costs[i][1] <= best_s + cfg.tie_epsilon_s + cfg.tie_rel_epsilon * best_s]
    chosen = min(
        tied,
        key=lambda i: (
            -request.matched_blocks.get(replicas[i].id, 0),
            replicas[i].in_flight,
            replicas[i].last_selected,
            replicas[i].id,
        ),
    )
    rid = replicas[chosen].id
    longest = max(request.matched_blocks.get(r.id, 0) for r in replicas)
    blocks = request.matched_blocks.get(rid, 0)
    if not under_cap:
        branch = Branch.OVERLOADED
    elif longest <= 0:
        branch = Branch.CACHE_MISS
    else:
        branch = Branch.CACHE_HIT if blocks >= longest else Branch.SPILL
    if branch is Branch.SPILL:
        band = best_s + cfg.tie_epsilon_s + cfg.tie_rel_epsilon * best_s
        for i, r in enumerate(replicas):
            queue_s = reference_queue_s(cfg, r)
            if request.matched_blocks.get(r.id, 0) >= longest and queue_s > 0 and costs[i][1] - queue_s <= band:
                branch = Branch.SPILL_QUEUE
    return Decision(rid, branch, blocks, request.cached_tokens(rid), costs[chosen][0])


def exactly(d: Decision) -> tuple[object, ...]:
    ttft = d.predicted_ttft_s
    return (d.replica, d.branch, d.matched_blocks, d.predicted_cached_tokens, None if ttft is None else ttft.hex())


# Loads as the router sees them: counts with None for gauges not scraped yet, backlogs up to a few prefills, KV
# usage on both sides of the pressure threshold and at 1.0, rates from the floor to fast, the prior included.
replica_rows = st.fixed_dictionaries(
    {
        "in_flight": st.integers(0, 12),
        "waiting": st.integers(0, 6),
        "waiting_prompt_tokens": st.integers(0, 80_000),
        "streaming": st.integers(0, 300),
        "num_running": st.none() | st.integers(0, 300),
        "num_waiting": st.none() | st.integers(0, 12),
        "kv_usage": st.none() | st.floats(0.0, 1.0) | st.sampled_from([0.8, 1.0]),
        "prefill_tokens_per_s": st.sampled_from([10_000.0, 0.5]) | st.floats(100.0, 60_000.0),
        "last_selected": st.sampled_from([-math.inf, 0.0, 1.0]),
        "max_num_seqs": st.none() | st.integers(1, 8),
        "slot_s": st.none() | st.floats(0.0, 2.0),
        "learned_slots": st.none() | st.floats(1.0, 8.0),
        "most_running": st.integers(0, 10),
        "peer_max_num_seqs": st.none() | st.floats(1.0, 8.0),
        "fixed_s": st.sampled_from([0.0, 0.05]),
    }
)
configs = st.builds(
    EstimatedTTFTConfig,
    tie_epsilon_s=st.sampled_from([0.0, 0.005, 0.2]),
    tie_rel_epsilon=st.sampled_from([0.0, 0.02]),
    max_queue_per_replica=st.sampled_from([2, 8, 256]),
    assumed_batch_slots=st.sampled_from([None, 4, 256]),
    fleet_cost_weight=st.sampled_from([0.0, 1.5]),
    charges_idle_replicas=st.booleans(),
    rate_noise_cv=st.sampled_from([0.0, 0.25, 10.0]),
    kv_pressure_threshold=st.sampled_from([0.0, 0.8]),
)
# What happens to a fleet between two decisions.
changes = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "load",
                "begin",
                "first_byte",
                "finish",
                "scrape",
                "rate",
                "service",
                "peers",
                "uniform_rates",
                "subset",
                "swap",
                "replace",
                "copy",
                "none",
            ]
        ),
        st.integers(0, 2**16),
        replica_rows,
    ),
    min_size=1,
    max_size=12,
)


def fleet(rows: list[dict[str, object]], *, same_rate: bool) -> list[ReplicaState]:
    replicas = [ReplicaState(id=f"r{i:02d}", **row) for i, row in enumerate(rows)]  # type: ignore[arg-type]
    if same_rate:
        for r in replicas:
            r.prefill_tokens_per_s = 12_000.0
    return replicas


def route_request(prompt_tokens: int, matches: dict[int, int], num_replicas: int) -> RouteRequest:
    # Ids past the fleet stand for replicas the index holds that are not eligible (draining, unhealthy).
    matched = {f"r{i % (num_replicas + 3):02d}": blocks for i, blocks in matches.items()}
    return RouteRequest(hashes=[1], prompt_tokens=prompt_tokens, tokens_per_block=16.0, matched_blocks=matched)


def apply(change: tuple[str, int, dict[str, object]], replicas: list[ReplicaState]) -> list[ReplicaState]:
    """One change to the fleet; returns the eligible replicas of the next decision."""
    kind, k, row = change
    r = replicas[k % len(replicas)]
    match kind:
        case "load":  # begin, first byte, finish: the router's own counts
            r.in_flight = int(row["in_flight"])  # type: ignore[call-overload]
            r.waiting = int(row["waiting"])  # type: ignore[call-overload]
            r.waiting_prompt_tokens += 1 + k % 5_000
            r.streaming = int(row["streaming"])  # type: ignore[call-overload]
            r.last_selected = float(k)
            r.touch()
        case "begin":
            r.begin(k % 5_000, float(k))
        case "first_byte" if r.waiting > 0:
            r.first_byte(min(r.waiting_prompt_tokens, k % 5_000))
        case "finish" if r.in_flight > 0:
            r.finish(0, is_waiting=r.waiting > 0 and k % 2 == 0)
        case "scrape":
            r.set_gauges(row["num_running"], row["num_waiting"], row["kv_usage"])  # type: ignore[arg-type]
        case "rate":
            r.set_prefill_rate(float(row["prefill_tokens_per_s"]))  # type: ignore[arg-type]
        case "service":
            r.set_service(row["slot_s"], row["learned_slots"], row["fixed_s"])  # type: ignore[arg-type]
        case "peers":
            r.set_peer_max_num_seqs(row["peer_max_num_seqs"])  # type: ignore[arg-type]
        case "uniform_rates":
            for other in replicas:
                other.set_prefill_rate(9_000.0 + k % 3)
        case "subset":  # a replica drains, or a retry excludes one
            return [other for other in replicas if other is not r] if len(replicas) > 2 else replicas
        case "swap":  # the same replicas in another order (the pool lists them in the order they joined)
            j = (k // 7) % len(replicas)
            replicas[k % len(replicas)], replicas[j] = replicas[j], r
        case "replace":  # the replica left and came back: a new state object under the same id
            replicas[k % len(replicas)] = ReplicaState(id=r.id, **row)  # type: ignore[arg-type]
        case "copy":  # an equal state in a new object
            replicas[k % len(replicas)] = copy.copy(r)
    return replicas


@settings(max_examples=300, deadline=None)
@given(
    configs,
    st.lists(replica_rows, min_size=2, max_size=70),
    st.booleans(),
    st.lists(
        st.tuples(st.integers(0, 40_000), st.dictionaries(st.integers(0, 80), st.integers(0, 3_000), max_size=5)),
        min_size=1,
        max_size=6,
    ),
    changes,
)
def test_select_equals_the_reference_over_changing_fleets(
    cfg: EstimatedTTFTConfig,
    rows: list[dict[str, object]],
    same_rate: bool,
    prompts: list[tuple[int, dict[int, int]]],
    fleet_changes: list[tuple[str, int, dict[str, object]]],
) -> None:
    policy = EstimatedTTFT(cfg)
    replicas = fleet(rows, same_rate=same_rate)
    eligible = replicas
    for step, change in enumerate(fleet_changes):
        prompt_tokens, matches = prompts[step % len(prompts)]
        request = route_request(prompt_tokens, matches, len(replicas))
        if len(eligible) > 1:
            expected = reference_select(cfg, request, eligible)
            assert exactly(policy.select(request, eligible, now=float(step))) == exactly(expected)
            # The uncached path (no terms kept) sums the same floats.
            uncached = [(t.hex(), c.hex()) for t, c in policy.costs_s(request, eligible)]
            assert uncached == [(t.hex(), c.hex()) for t, c in reference_costs(cfg, request, eligible)]
        eligible = apply(change, replicas)


@settings(max_examples=300, deadline=None)
@given(
    configs,
    st.lists(replica_rows, min_size=2, max_size=12),
    st.booleans(),
    st.integers(0, 40_000),
    st.dictionaries(st.integers(0, 14), st.integers(0, 3_000), max_size=4),
    st.integers(0, 11),
    st.sampled_from([-1, 0, 1]),
)
def test_select_equals_the_reference_at_the_edge_of_the_tie_band(
    cfg: EstimatedTTFTConfig,
    rows: list[dict[str, object]],
    same_rate: bool,
    prompt_tokens: int,
    matches: dict[int, int],
    pick: int,
    ulps: int,
) -> None:
    # The tie margin set to one replica's distance from the best, and a float either side of it; that replica
    # wins the tie break when it is in the band, so a cost one float off changes the decision.
    replicas = fleet(rows, same_rate=same_rate)
    edge = replicas[pick % len(replicas)]
    for r in replicas:
        r.in_flight = 0 if r is edge else max(1, r.in_flight)
    request = route_request(prompt_tokens, matches, len(replicas))
    costs = [cost for _, cost in reference_costs(cfg, request, replicas)]
    gap = costs[pick % len(costs)] - min(costs)
    gap = max(0.0, math.nextafter(gap, ulps * math.inf) if ulps else gap)
    cfg = cfg.model_copy(update={"tie_epsilon_s": gap, "tie_rel_epsilon": 0.0})
    expected = reference_select(cfg, request, replicas)
    assert exactly(EstimatedTTFT(cfg).select(request, replicas, now=0.0)) == exactly(expected)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0.5, 2.0), min_size=2, max_size=70),
    st.sampled_from([0.5, 1.0 - 1e-9, 1.0, 1.0 + 1e-9, 2.0]),
    st.integers(1, 40_000),
)
def test_select_equals_the_reference_where_rates_stop_pooling_to_the_mean(
    spread: list[float], scale: float, prompt_tokens: int
) -> None:
    # `rate_noise_cv` set to the fleet's own spread (its float variance, as the reference computes it), and a
    # little either side: the rates pool to the mean on one side and keep a sliver of their deviation on the other.
    replicas = [ReplicaState(id=f"r{i:02d}", prefill_tokens_per_s=10_000.0 * x) for i, x in enumerate(spread)]
    rates = [r.prefill_tokens_per_s for r in replicas]
    mean = sum(rates) / len(rates)
    var = sum(x * x for x in rates) / len(rates) - mean * mean
    cv = math.sqrt(max(var, 0.0)) / mean * scale
    cfg = EstimatedTTFTConfig(rate_noise_cv=cv)
    request = route_request(prompt_tokens, {}, len(replicas))
    expected = reference_select(cfg, request, replicas)
    assert exactly(EstimatedTTFT(cfg).select(request, replicas, now=0.0)) == exactly(expected)


def test_identical_idle_replicas_tie_and_take_turns() -> None:
    policy = EstimatedTTFT(EstimatedTTFTConfig(tie_epsilon_s=0.0))
    replicas = [ReplicaState(id=f"r{i}") for i in range(64)]
    chosen = []
    for step in range(64):
        request = route_request(8_192, {}, len(replicas))
        d = policy.select(request, replicas, now=float(step))
        assert exactly(d) == exactly(reference_select(policy.config, request, replicas))
        replica = next(r for r in replicas if r.id == d.replica)
        replica.last_selected = float(step)
        replica.touch()
        chosen.append(d.replica)
    assert sorted(chosen) == sorted(r.id for r in replicas)


def test_every_changing_method_moves_the_version() -> None:
    state = ReplicaState(id="a")
    versions = [state.version]
    for change in (
        lambda: state.begin(100, 1.0),
        lambda: state.first_byte(100),
        lambda: state.finish(0, is_waiting=False),
        lambda: state.set_gauges(1, 0, 0.5),
        lambda: state.set_gauges(1, 0, 0.5),  # the same values: still a change to say
        lambda: state.set_prefill_rate(9_000.0),
        lambda: state.set_peer_max_num_seqs(4.0),
        state.touch,
    ):
        change()
        versions.append(state.version)
    assert len(set(versions)) == len(versions)
    assert (state.in_flight, state.waiting, state.streaming, state.waiting_prompt_tokens) == (0, 0, 0, 0)


def test_a_state_written_without_touch_is_not_seen_but_another_object_is() -> None:
    # What the version buys, and its contract: the policy re-reads a replica whose version moved or that is
    # another object; a bare field write (no `touch()`) is the caller's bug and goes unseen.
    policy = EstimatedTTFT(EstimatedTTFTConfig())
    replicas = [ReplicaState(id="a"), ReplicaState(id="b")]
    request = route_request(4_000, {}, 2)
    assert policy.select(request, replicas, now=0.0).replica == "a"
    replicas[0].waiting_prompt_tokens = 200_000  # no touch(): still the old terms
    replicas[0].waiting = 1
    assert policy.select(request, replicas, now=0.0).replica == "a"
    replicas[0].touch()
    assert policy.select(request, replicas, now=0.0).replica == "b"
    replicas[1] = copy.copy(replicas[1])
    replicas[1].waiting_prompt_tokens = 400_000
    replicas[1].waiting = 1
    assert policy.select(request, replicas, now=0.0).replica == "a"  # a new object is re-read whatever its version
