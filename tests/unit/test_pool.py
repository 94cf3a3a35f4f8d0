"""The replica pool's eligibility filter, which inlines `Replica.is_eligible` and `Replica.serves` for speed."""

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
