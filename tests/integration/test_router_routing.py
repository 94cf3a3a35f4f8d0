"""Where requests land: prefix affinity, multi-turn affinity, spreading of cache misses, spill, session pins."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from tests.integration.conftest import LONG_PREFIX_BYTES, StartFakes, StartRouter, replica_id, unique_text

pytestmark = pytest.mark.integration


async def test_prefix_groups_stick_to_one_replica(start_fakes: StartFakes, start_router: StartRouter) -> None:
    fakes = await start_fakes(3)
    router = await start_router(fakes)
    by_id = {replica_id(f): f for f in fakes}
    homes: dict[int, str] = {}
    for group in range(6):
        system = unique_text(LONG_PREFIX_BYTES, f"group {group}")
        for turn in range(5):
            reply = await router.chat(
                [{"role": "system", "content": system}, {"role": "user", "content": f"question {turn} of {group}"}]
            )
            assert reply.status == 200, reply.body
            assert reply.replica in by_id
            if turn == 0:
                assert reply.branch == "cache_miss"
                homes[group] = reply.replica
            else:
                assert (reply.replica, reply.branch) == (homes[group], "cache_hit"), f"group {group} turn {turn}"
            assert reply.json()["system_fingerprint"] == f"fake-{by_id[reply.replica].name}"
    # Six new prefixes at concurrency 1 over three idle replicas: two homes each.
    assert sorted(Counter(homes.values()).values()) == [2, 2, 2]
    for rid, fake in by_id.items():
        assert fake.requests_by_path["/v1/chat/completions"] == 5 * list(homes.values()).count(rid)


async def test_growing_conversation_stays_on_its_replica(start_fakes: StartFakes, start_router: StartRouter) -> None:
    fakes = await start_fakes(3)
    router = await start_router(fakes)
    conversations = [[{"role": "system", "content": unique_text(LONG_PREFIX_BYTES, f"conv {c}")}] for c in range(3)]
    homes: dict[int, str] = {}
    for turn in range(6):
        for c, messages in enumerate(conversations):
            messages.append({"role": "user", "content": f"turn {turn}: tell me more about topic {c}"})
            reply = await router.chat(messages)
            assert reply.status == 200, reply.body
            if turn == 0:
                assert reply.branch == "cache_miss"
                homes[c] = reply.replica or ""
            else:
                assert (reply.replica, reply.branch) == (homes[c], "cache_hit"), f"conversation {c} turn {turn}"
            messages.append(reply.json()["choices"][0]["message"])
    assert len(set(homes.values())) == 3  # interleaved new conversations spread over the idle replicas


async def test_completion_prompt_groups_stick_too(start_fakes: StartFakes, start_router: StartRouter) -> None:
    fakes = await start_fakes(3)
    router = await start_router(fakes)
    prefix = unique_text(LONG_PREFIX_BYTES, "completions")
    first = await router.complete(prefix + " first question")
    assert (first.status, first.branch) == (200, "cache_miss")
    for i in range(4):
        reply = await router.complete(prefix + f" follow-up {i}")
        assert (reply.status, reply.replica, reply.branch) == (200, first.replica, "cache_hit")
    # Token-id prompts route on token blocks (16 tokens each) the same way.
    tokens = list(range(1000, 1600))
    first = await router.complete(tokens)
    assert (first.status, first.branch) == (200, "cache_miss")
    reply = await router.complete([*tokens, 7, 8, 9])
    assert (reply.status, reply.replica, reply.branch) == (200, first.replica, "cache_hit")


async def test_new_prefixes_spread_evenly_at_concurrency_one(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    fakes = await start_fakes(4)
    router = await start_router(fakes)
    num_requests = 40
    landed: Counter[str] = Counter()
    for i in range(num_requests):
        reply = await router.complete(unique_text(600, f"prompt {i}"), max_tokens=2)
        assert (reply.status, reply.branch) == (200, "cache_miss"), reply.body
        landed[reply.replica or ""] += 1
    assert set(landed) == {replica_id(f) for f in fakes}
    per_replica = num_requests // len(fakes)
    assert all(abs(n - per_replica) <= 1 for n in landed.values()), landed
    assert [f.requests_by_path["/v1/completions"] for f in fakes] == [landed[replica_id(f)] for f in fakes]


async def test_hot_prefix_spills_when_its_replica_backs_up(start_fakes: StartFakes, start_router: StartRouter) -> None:
    # Each request has a 1,000-byte distinct tail (~250 uncached tokens even on the replica holding the prefix),
    # and the replicas take 0.4 s to answer: the prefix holder's prefill backlog grows with every request sent
    # there, until another replica's full prefill is predicted to be sooner.
    fakes = await start_fakes(3, first_byte_delay_s=0.4, num_output_tokens=2)
    router = await start_router(fakes)
    prefix = unique_text(LONG_PREFIX_BYTES, "hot")
    warm = await router.complete(prefix + unique_text(1000, "warm"))
    assert warm.status == 200
    home = warm.replica

    async def one(i: int) -> tuple[str | None, str | None]:
        reply = await router.complete(prefix + unique_text(1000, f"burst {i}"))
        assert reply.status == 200, reply.body
        return reply.replica, reply.branch

    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(24))), timeout=10)
    replicas = Counter(r for r, _ in results)
    branches = Counter(b for _, b in results)
    assert len(replicas) >= 2, replicas
    assert branches["spill"] >= 1, branches
    assert replicas[home] >= 2, replicas  # affinity still held while the backlog was short
    assert branches["cache_miss"] == 0, branches
    assert sum(f.requests_by_path["/v1/completions"] for f in fakes) == 25


async def test_a_burst_sees_the_record_of_its_first_request(start_fakes: StartFakes, start_router: StartRouter) -> None:
    # The router records a routed prompt once the request is written (or before it connects), not within the
    # decision, but still before the next decision runs: a burst of one new prefix has a single cache miss.
    fakes = await start_fakes(3, first_byte_delay_s=0.2, num_output_tokens=2)
    router = await start_router(fakes)
    prefix = unique_text(LONG_PREFIX_BYTES, "new in a burst")

    async def one(i: int) -> str | None:
        reply = await router.complete(prefix + unique_text(300, f"tail {i}"))
        assert reply.status == 200, reply.body
        return reply.branch

    branches = Counter(await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(8))), timeout=10))
    assert branches["cache_miss"] == 1, branches
    assert branches["cache_hit"] + branches["spill"] == 7, branches


async def test_session_header_pins_distinct_prompts(start_fakes: StartFakes, start_router: StartRouter) -> None:
    fakes = await start_fakes(3)
    router = await start_router(fakes, session_header="x-session-id")
    homes: dict[str, str] = {}
    for round_ in range(4):
        for session in ("alice", "bob", "carol", "dave"):
            reply = await router.complete(
                unique_text(300, f"{session} {round_}"), headers={"x-session-id": session}, max_tokens=1
            )
            assert reply.status == 200
            if round_ == 0:
                homes[session] = reply.replica or ""
            else:
                assert (reply.replica, reply.branch) == (homes[session], "session"), session
    assert len(set(homes.values())) == 3  # first requests of new sessions still spread
    # Without the header the same distinct prompts spread over every replica.
    landed = {(await router.complete(unique_text(300, f"anon {i}"), max_tokens=1)).replica for i in range(6)}
    assert landed == {replica_id(f) for f in fakes}


async def test_session_moves_when_its_replica_leaves(start_fakes: StartFakes, start_router: StartRouter) -> None:
    fakes = await start_fakes(2)
    router = await start_router(fakes, session_header="x-session-id")
    first = await router.complete("hello", headers={"x-session-id": "s1"})
    assert first.status == 200
    home = first.replica
    drained = await router.admin("POST", f"/replicas/{home}/drain")
    assert drained.status == 200
    moved = await router.complete("hello again", headers={"x-session-id": "s1"})
    assert moved.status == 200 and moved.replica != home
    again = await router.complete("and again", headers={"x-session-id": "s1"})
    assert (again.replica, again.branch) == (moved.replica, "session")


async def test_streamed_groups_keep_affinity_while_the_prefill_rate_is_learned(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    # 2e-5 s per uncached token: a ~1,000-token miss takes ~20 ms to its first chunk, so each replica learns
    # ~50k tokens/s (the prior is 10k) from the first byte of its streams, and a hit stays clearly cheaper.
    fakes = await start_fakes(3, prefill_s_per_token=2e-5, num_output_tokens=2)
    router = await start_router(fakes)
    homes: dict[int, str] = {}
    systems = [unique_text(LONG_PREFIX_BYTES, f"streamed group {group}") for group in range(3)]
    for group, system in enumerate(systems):
        for turn in range(4):
            reply = await router.chat(
                [{"role": "system", "content": system}, {"role": "user", "content": f"q{turn}"}], stream=True
            )
            assert reply.status == 200 and reply.body.endswith(b"data: [DONE]\n\n")
            if turn == 0:
                assert reply.branch == "cache_miss"
                homes[group] = reply.replica or ""
            else:
                assert (reply.replica, reply.branch) == (homes[group], "cache_hit")
    assert len(set(homes.values())) == 3
    rates = [view["prefill_tokens_per_s"] for view in (await router.replicas()).values()]
    assert all(20_000 < rate <= 60_000 for rate in rates), rates
    assert sum(f.prefix_hit_bytes for f in fakes) >= 3 * 3 * (LONG_PREFIX_BYTES - 64)  # the fakes' caches hit too

    # A crash loses the replica's cache (its index entries go) but not its learned prefill rate.
    victim = next(f for f in fakes if replica_id(f) == homes[0])
    learned = (await router.replicas())[homes[0]]["prefill_tokens_per_s"]
    await victim.kill()
    reply = await router.chat([{"role": "system", "content": systems[0]}, {"role": "user", "content": "after crash"}])
    assert reply.status == 200 and reply.replica != homes[0]
    assert (await router.admin("GET", "/index")).json()["blocks_per_replica"][homes[0]] == 0
    await victim.restart()
    await router.wait_eligible([homes[0]], timeout_s=2.0)
    assert (await router.replicas())[homes[0]]["prefill_tokens_per_s"] == learned
