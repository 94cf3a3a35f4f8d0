"""The admin API (auth, add, drain, remove, index), /metrics, scraped engine gauges, /health and /ready."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.integration.conftest import (
    LONG_PREFIX_BYTES,
    StartFakes,
    StartRouter,
    eventually,
    metric_value,
    replica_id,
    unique_text,
)

pytestmark = pytest.mark.integration


async def test_admin_requires_the_bearer_token(start_fakes: StartFakes, start_router: StartRouter) -> None:
    fakes = await start_fakes(1)
    router = await start_router(fakes)
    for method, path in (
        ("GET", "/admin/replicas"),
        ("POST", "/admin/replicas"),
        ("DELETE", f"/admin/replicas/{replica_id(fakes[0])}"),
        ("POST", f"/admin/replicas/{replica_id(fakes[0])}/drain"),
        ("GET", "/admin/index"),
    ):
        for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": "t"}, {"Authorization": "Basic t"}):
            reply = await router.request(method, path, headers=headers, json_body={"url": "http://127.0.0.1:9"})
            assert reply.status == 401, (method, path, headers)
            assert reply.json()["error"]["type"] == "authentication_error"
            assert reply.headers.get("WWW-Authenticate") == "Bearer"
    # Nothing changed behind the 401s.
    views = await router.replicas()
    assert list(views) == [replica_id(fakes[0])] and views[replica_id(fakes[0])]["status"] == "healthy"


async def test_list_shows_every_replica(start_fakes: StartFakes, start_router: StartRouter) -> None:
    fakes = await start_fakes(2)
    router = await start_router(fakes)
    views = await router.replicas()
    assert sorted(views) == sorted(replica_id(f) for f in fakes)
    for fake in fakes:
        view = views[replica_id(fake)]
        assert view["url"] == fake.url
        assert (view["status"], view["eligible"], view["models"]) == ("healthy", True, ["shoal-demo"])
        assert (view["in_flight"], view["waiting"], view["streaming"]) == (0, 0, 0)


async def test_added_replica_joins_rotation_after_a_probe(start_fakes: StartFakes, start_router: StartRouter) -> None:
    first, newcomer = await start_fakes(2)
    router = await start_router([first])
    reply = await router.admin("POST", "/replicas", {"url": newcomer.url})
    assert reply.status == 201, reply.body
    assert reply.json()["id"] == replica_id(newcomer)
    assert reply.json()["eligible"] is False  # not before it answered a probe
    await router.wait_eligible([replica_id(newcomer)], timeout_s=2.0)
    assert newcomer.requests_by_path["/health"] >= 1
    landed = {(await router.complete(unique_text(300, f"new {i}"))).replica for i in range(4)}
    assert replica_id(newcomer) in landed
    assert newcomer.requests_by_path["/v1/completions"] >= 1
    # Adding it again is idempotent; a name, a capacity and bad input are handled.
    again = await router.admin("POST", "/replicas", {"url": newcomer.url + "/"})
    assert again.status == 200
    assert (await router.admin("POST", "/replicas", {"url": "ftp://x"})).status == 400
    assert (await router.admin("POST", "/replicas", {"nope": 1})).status == 400
    assert (await router.admin("POST", "/replicas", {"url": newcomer.url, "name": "a/b"})).status == 400
    # A name goes into the x-shoal-replica header: no CR/LF smuggles another header in.
    injected = {"url": newcomer.url, "name": "ok\r\nSet-Cookie: x=1"}
    assert (await router.admin("POST", "/replicas", injected)).status == 400
    # Credentials the router would never send, and which would show in headers, metrics and logs, are refused.
    with_credentials = "http://user:secret@" + newcomer.url.removeprefix("http://")
    refused = await router.admin("POST", "/replicas", {"url": with_credentials})
    assert refused.status == 400 and "secret" not in refused.body.decode()
    assert (await router.admin("POST", "/replicas", {"url": newcomer.url, "kv_capacity_blocks": 0})).status == 400
    named = await router.admin("POST", "/replicas", {"url": "http://127.0.0.1:9", "name": replica_id(first)})
    assert named.status == 409
    assert len(await router.replicas()) == 2


async def test_drain_stops_new_requests_and_lets_in_flight_finish(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    fakes = await start_fakes(2, first_byte_delay_s=0.5)
    router = await start_router(fakes)
    slow = asyncio.create_task(router.complete("slow request"))
    await eventually(lambda: sum(f.in_flight for f in fakes) == 1, timeout_s=3, what="slow request in flight")
    busy = next(f for f in fakes if f.in_flight == 1)
    other = next(f for f in fakes if f is not busy)
    busy_id = replica_id(busy)
    reply = await router.admin("POST", f"/replicas/{busy_id}/drain")
    assert reply.status == 200
    assert (reply.json()["status"], reply.json()["eligible"], reply.json()["in_flight"]) == ("draining", False, 1)
    for fake in fakes:
        fake.config.first_byte_delay_s = 0.0
    for i in range(5):
        reply = await router.complete(unique_text(300, f"while draining {i}"))
        assert (reply.status, reply.replica) == (200, replica_id(other))
    done = await asyncio.wait_for(slow, timeout=5)
    assert (done.status, done.replica) == (200, busy_id)
    assert busy.requests_by_path["/v1/completions"] == 1
    assert (await router.replicas())[busy_id]["in_flight"] == 0
    # Undrain puts it back.
    assert (await router.admin("POST", f"/replicas/{busy_id}/undrain")).status == 200
    landed = {(await router.complete(unique_text(300, f"undrained {i}"))).replica for i in range(4)}
    assert busy_id in landed
    assert (await router.admin("POST", "/replicas/nope:1/drain")).status == 404


async def test_remove_drops_the_replica_and_its_index_entries(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    fakes = await start_fakes(2)
    router = await start_router(fakes)
    prefix = unique_text(LONG_PREFIX_BYTES, "indexed")
    first = await router.complete(prefix + " one")
    home = first.replica
    assert home is not None
    stats = (await router.admin("GET", "/index")).json()
    assert stats["blocks_per_replica"][home] >= LONG_PREFIX_BYTES // 64
    assert stats["num_blocks"] >= LONG_PREFIX_BYTES // 64
    reply = await router.admin("DELETE", f"/replicas/{home}")
    assert reply.status == 200 and reply.json()["id"] == home
    stats = (await router.admin("GET", "/index")).json()
    assert home not in stats["blocks_per_replica"]
    assert stats["num_entries"] == sum(stats["blocks_per_replica"].values())
    assert home not in await router.replicas()
    # The same prefix now goes elsewhere, as a miss: nothing remembers it.
    reply = await router.complete(prefix + " two")
    assert reply.status == 200 and reply.replica != home and reply.branch == "only_replica"
    assert (await router.admin("DELETE", f"/replicas/{home}")).status == 404


async def test_metrics_expose_requests_decisions_and_gauges(start_fakes: StartFakes, start_router: StartRouter) -> None:
    fakes = await start_fakes(2, first_byte_delay_s=0.0)
    router = await start_router(fakes)
    prefix = unique_text(LONG_PREFIX_BYTES, "metrics")
    first = await router.complete(prefix + " a")
    second = await router.complete(prefix + " b")
    assert (first.branch, second.branch) == ("cache_miss", "cache_hit")
    bad = await router.complete("x", model="nope")
    assert bad.status == 404
    text = await router.metrics()
    for reply, branch in ((first, "cache_miss"), (second, "cache_hit")):
        labels = {"status": "200", "branch": branch, "replica": reply.replica or ""}
        assert metric_value(text, "shoal_router_requests_total", labels) == 1.0
    assert metric_value(text, "shoal_router_decision_seconds_count") == 2.0
    assert metric_value(text, "shoal_router_request_seconds_count") == 2.0
    assert metric_value(text, "shoal_router_decision_seconds_bucket", {"le": "+Inf"}) == 2.0
    for fake in fakes:
        assert metric_value(text, "shoal_router_replica_in_flight", {"replica": replica_id(fake)}) == 0.0
        assert metric_value(text, "shoal_router_replica_up", {"replica": replica_id(fake), "status": "healthy"}) == 1.0
    assert metric_value(text, "shoal_router_in_flight") == 0.0
    assert metric_value(text, "shoal_router_queue_depth") == 0.0
    assert metric_value(text, "shoal_router_replicas", {"status": "healthy"}) == 2.0
    assert metric_value(text, "shoal_router_prompt_tokens_total") is not None

    # While requests wait for their first byte, the per-replica and fleet gauges show them.
    for fake in fakes:
        fake.config.first_byte_delay_s = 0.5
    pending = [asyncio.create_task(router.complete(unique_text(300, f"pending {i}"))) for i in range(4)]
    await eventually(lambda: sum(f.in_flight for f in fakes) == 4, timeout_s=3, what="four requests in flight")
    text = await router.metrics()
    assert metric_value(text, "shoal_router_in_flight") == 4.0
    assert metric_value(text, "shoal_router_queue_depth") == 4.0
    assert sum(metric_value(text, "shoal_router_replica_waiting", {"replica": replica_id(f)}) or 0 for f in fakes) == 4
    assert (metric_value(text, "shoal_router_prefill_backlog_tokens") or 0) > 0
    replies = await asyncio.wait_for(asyncio.gather(*pending), timeout=5)
    assert all(r.status == 200 for r in replies)
    text = await router.metrics()
    assert metric_value(text, "shoal_router_in_flight") == 0.0
    assert metric_value(text, "shoal_router_request_seconds_count") == 6.0
    assert (metric_value(text, "shoal_router_request_seconds_sum") or 0) >= 4 * 0.5


async def test_scraped_engine_gauges_vllm_and_sglang(start_fakes: StartFakes, start_router: StartRouter) -> None:
    (vllm,) = await start_fakes(1, metric_overrides={"running": 3, "waiting": 2, "kv_usage": 0.5})
    (sglang,) = await start_fakes(
        1, metrics_flavor="sglang", metric_overrides={"running": 7, "waiting": 1, "kv_usage": 0.25}
    )
    router = await start_router([vllm, sglang])

    async def scraped() -> bool:
        views = await router.replicas()
        return bool(views[replica_id(vllm)]["engine"]) and bool(views[replica_id(sglang)]["engine"])

    await eventually(scraped, timeout_s=3, what="both replicas scraped")
    views = await router.replicas()
    assert views[replica_id(vllm)]["engine"] == {"num_running": 3.0, "num_waiting": 2.0, "kv_usage": 0.5}
    assert views[replica_id(sglang)]["engine"] == {"num_running": 7.0, "num_waiting": 1.0, "kv_usage": 0.25}
    # The scrape follows the engine's changes.
    vllm.config.metric_overrides = {"running": 0, "waiting": 9, "kv_usage": 0.9}

    async def updated() -> bool:
        return bool((await router.replicas())[replica_id(vllm)]["engine"].get("num_waiting") == 9.0)

    await eventually(updated, timeout_s=3, what="the new vLLM gauges")


async def test_the_engines_kv_cache_size_bounds_the_index(start_fakes: StartFakes, start_router: StartRouter) -> None:
    # 8 blocks of 16 tokens: 128 tokens, 8 index blocks of 64 text bytes (16 tokens at 4 bytes a token).
    small = {"exports_cache_size": True, "prefix_cache_blocks": 8, "prefix_block_bytes": 64}
    (vllm,) = await start_fakes(1, **small)
    (sglang,) = await start_fakes(1, metrics_flavor="sglang", **small)
    (silent,) = await start_fakes(1)
    router = await start_router([vllm, sglang, silent])

    async def sized() -> bool:
        views = await router.replicas()
        return all(views[replica_id(f)]["kv_capacity_blocks"] == 8 for f in (vllm, sglang))

    await eventually(sized, timeout_s=3, what="both engines' cache sizes scraped")
    assert (await router.replicas())[replica_id(silent)]["kv_capacity_blocks"] is None
    for i in range(6):  # 62 blocks each; the policy spreads them, and each replica keeps at most what it can hold
        assert (await router.complete(unique_text(LONG_PREFIX_BYTES, f"doc{i}"), max_tokens=1)).status == 200
    held = (await router.admin("GET", "/index")).json()["blocks_per_replica"]
    assert held[replica_id(vllm)] <= 8 and held[replica_id(sglang)] <= 8
    assert sum(held.values()) > 16  # the replica that exports no size keeps what it was sent


async def test_a_kv_capacity_set_through_the_admin_api_outranks_the_scrape(
    start_fakes: StartFakes, start_router: StartRouter
) -> None:
    (fake,) = await start_fakes(1, exports_cache_size=True, prefix_cache_blocks=8)
    router = await start_router([])
    reply = await router.admin("POST", "/replicas", {"url": fake.url, "kv_capacity_blocks": 100})
    assert reply.status == 201, reply.body
    scrapes = fake.requests_by_path["/metrics"]

    async def scraped_twice() -> bool:
        return fake.requests_by_path["/metrics"] >= scrapes + 2

    await eventually(scraped_twice, timeout_s=3, what="two scrapes")
    assert (await router.replicas())[replica_id(fake)]["kv_capacity_blocks"] == 100


async def test_health_and_ready(start_fakes: StartFakes, start_router: StartRouter) -> None:
    empty = await start_router([], hold={"max_wait_s": 0.0})
    assert (await empty.request("GET", "/health")).status == 200
    ready = await empty.request("GET", "/ready")
    assert ready.status == 503
    reply = await empty.complete("nobody")
    assert reply.status == 503 and reply.json()["error"]["code"] == "no_replica_available"

    holding = await start_router([])
    assert (await holding.request("GET", "/ready")).status == 200  # it holds requests, so it must receive them

    (fake,) = await start_fakes(1)
    router = await start_router([fake], hold={"max_requests": 0})
    assert (await router.request("GET", "/ready")).status == 200
    fake.set_healthy(False)  # failure_threshold=2 failed probes at 0.2 s

    async def not_ready() -> bool:
        return (await router.request("GET", "/ready")).status == 503

    await eventually(not_ready, timeout_s=3, what="/ready 503 after the only replica went unhealthy")
    assert (await router.request("GET", "/health")).status == 200  # the router itself is alive
    fake.set_healthy(True)

    async def ready_again() -> bool:
        return (await router.request("GET", "/ready")).status == 200

    await eventually(ready_again, timeout_s=3, what="/ready 200 again")
    # An added replica that never answers is probed, found down, and leaves /ready as it was.
    reply = await router.admin("POST", "/replicas", {"url": "http://127.0.0.1:9", "name": "ghost"})
    assert reply.status == 201

    async def ghost_probed() -> bool:
        return (await router.replicas())["ghost"]["last_error"] is not None

    await eventually(ghost_probed, timeout_s=3, what="the ghost replica to be probed")
    assert (await router.replicas())["ghost"]["status"] == "unhealthy"
    ready = await router.request("GET", "/ready")
    assert (ready.status, ready.json()["replicas"]) == (200, 1)


async def test_one_structured_log_line_per_request(
    start_fakes: StartFakes, start_router: StartRouter, tmp_path: Path
) -> None:
    import json

    fakes = await start_fakes(2)
    path = tmp_path / "requests.jsonl"
    router = await start_router(fakes, log_requests=True, request_log={"path": path, "flush_interval_s": 0.05})
    messages = [{"role": "user", "content": unique_text(LONG_PREFIX_BYTES)}]
    first = await router.chat(messages)
    second = await router.chat(messages)
    await eventually(lambda: path.exists() and path.read_bytes().count(b"\n") >= 2, what="two request log lines")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 2
    for line, reply in zip(lines, (first, second), strict=True):
        assert line["status"] == 200
        assert line["replica"] == reply.headers["x-shoal-replica"]
        assert line["branch"] == reply.headers["x-shoal-route-branch"]
        assert line["ttfb_ms"] is not None and line["ttfb_ms"] <= line["ms"]
        assert line["decision_us"] > 0 and line["ts"] > 0
    assert lines[1]["branch"] == "cache_hit" and lines[1]["matched_blocks"] > 0
