"""Routers share one view through a Sentinel-managed Redis and through a Redis Cluster, real servers all
(tests/integration/redis_server.py): a prefix routed by one router is a hit at another, and with Sentinel the
routers follow a failover to the promoted replica."""

from __future__ import annotations

import pytest
import redis.asyncio as redis

from router.service.app import FLEET
from tests.integration.conftest import LONG_PREFIX_BYTES, RouterHandle, StartFakes, StartRouter, eventually, unique_text
from tests.integration.redis_server import RedisClusterProcesses, RedisSentinel
from tests.integration.test_router_fleet import fleet_router, holder

pytestmark = pytest.mark.integration


async def assert_shared_prefixes(a: RouterHandle, b: RouterHandle, label: str, num_prompts: int = 3) -> None:
    """Each prompt routed by `a` is, once `b` has applied `a`'s batch, a cache hit on the same replica at `b`."""
    for i in range(num_prompts):
        text = unique_text(LONG_PREFIX_BYTES, f"{label}{i}")
        first = await a.complete(text + " first question", max_tokens=1)
        assert first.status == 200, first.body
        chosen, prefix = first.replica, text
        await eventually(lambda: chosen in holder(b, prefix), timeout_s=5.0, what="B indexed A's decision")  # noqa: B023
        second = await b.complete(text + " a follow-up", max_tokens=1)
        assert second.status == 200, second.body
        assert (second.replica, second.branch) == (first.replica, "cache_hit")


async def test_routers_share_a_view_through_sentinel_and_follow_a_failover(
    start_fakes: StartFakes, start_router: StartRouter, redis_sentinel: RedisSentinel
) -> None:
    fakes = await start_fakes(3)
    a = await fleet_router(start_router, fakes, redis_sentinel.url)
    b = await fleet_router(start_router, fakes, redis_sentinel.url)
    await assert_shared_prefixes(a, b, "before")
    redis_sentinel.primary.pause()
    try:
        await eventually(
            lambda: redis_sentinel.primary_port() == redis_sentinel.replica.port,
            timeout_s=20.0,
            what="the sentinel promoted the replica",
        )
        await assert_shared_prefixes(a, b, "after")
        assert all(router.app[FLEET].counts["outages"] >= 1 for router in (a, b))  # they did lose the old primary
    finally:
        redis_sentinel.primary.resume()
    promoted = redis.Redis(port=redis_sentinel.replica.port)
    try:
        assert await promoted.xlen(a.app[FLEET].stream_key) > 0
    finally:
        await promoted.aclose()


async def test_routers_share_a_view_through_a_redis_cluster(
    start_fakes: StartFakes, start_router: StartRouter, redis_cluster: RedisClusterProcesses
) -> None:
    fakes = await start_fakes(3)
    a = await fleet_router(start_router, fakes, redis_cluster.url)
    b = await fleet_router(start_router, fakes, redis_cluster.url)
    await assert_shared_prefixes(a, b, "cluster")
    fleet = a.app[FLEET]
    assert fleet.is_loaded and fleet.is_up
    assert b.app[FLEET].counts["batches_applied"] > 0
    client = redis.RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    try:
        slots = {await client.cluster_keyslot(key) for key in (fleet.stream_key, fleet.drains_key)}
        assert len(slots) == 1
        assert await client.xlen(fleet.stream_key) > 0
    finally:
        await client.aclose()
