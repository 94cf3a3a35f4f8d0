"""The replica pool's eligibility filter, which inlines `Replica.is_eligible` and `Replica.serves` for speed, and the
eligible load views it keeps between requests."""

from __future__ import annotations

import itertools

from router.service.pool import ReplicaPool


def test_eligible_is_the_replicas_own_predicates_over_every_combination() -> None:
    pool = ReplicaPool()
    states = itertools.product([False, True], [False, True], [None, 5.0], [{}, {"m": {}}, {"other": {}}])
    for i, (is_healthy, is_draining, circuit_open_until, cards) in enumerate(states):
        replica = pool.add(f"http://127.0.0.1:{9000 + i}")
        replica.is_healthy = is_healthy
        replica.is_draining = is_draining
        replica.circuit_open_until = circuit_open_until
        replica.model_cards = dict(cards)
    ids = [r.id for r in pool]
    for model, exclude in itertools.product([None, "m", "nope"], [(), ids[::3], {ids[1]}]):
        expected = [r for r in pool if r.is_eligible and r.serves(model) and r.id not in set(exclude)]
        assert pool.eligible(model, exclude) == expected
    assert any(pool.eligible("m")) and not pool.eligible("m", ids)


def test_eligible_states_follow_every_change_of_eligibility() -> None:
    pool = ReplicaPool()
    replicas = [pool.add(f"http://127.0.0.1:{9100 + i}") for i in range(4)]
    changes = itertools.cycle(
        [
            ("is_healthy", True),
            ("model_cards", {"m": {}}),
            ("is_draining", True),
            ("circuit_open_until", 7.0),
            ("is_draining", False),
            ("model_cards", {"other": {}}),
            ("circuit_open_until", None),
            ("is_healthy", False),
        ]
    )
    for step in range(40):
        for model in (None, "m", "other"):
            expected = [r.state for r in pool.eligible(model)]
            assert pool.eligible_states(model) == expected
            assert pool.eligible_states(model) is pool.eligible_states(model)  # kept while nothing changes
            assert pool.eligible_states(model, [replicas[0].id]) == [s for s in expected if s is not replicas[0].state]
        name, value = next(changes)
        setattr(replicas[step % len(replicas)], name, value)
        if step == 20:
            pool.remove(replicas[1].id)
            replicas[1] = pool.add("http://127.0.0.1:9200")
            replicas[1].is_healthy = True


def test_eligible_states_are_kept_across_writes_that_change_nothing_of_eligibility() -> None:
    pool = ReplicaPool()
    replica = pool.add("http://127.0.0.1:9300")
    replica.is_healthy = True
    kept = pool.eligible_states(None)
    replica.is_healthy = True  # every good probe writes it again
    replica.consecutive_request_failures = 0
    replica.state.in_flight += 1
    assert pool.eligible_states(None) is kept == [replica.state]
