"""Routers share one view through a Sentinel-managed Redis and through a Redis Cluster, real servers all
(tests/integration/redis_server.py): a prefix routed by one router is a hit at another, and with Sentinel the
routers follow a failover to the promoted replica."""

from __future__ import annotations

import pytest
import redis.asyncio as redis

from router.service.app import FLEET
from tests.integration.conftest import StartFakes, StartRouter, eventually
from tests.integration.redis_server import RedisClusterProcesses, RedisSentinel
from tests.integration.test_router_fleet import assert_shared_prefixes, fleet_router

pytestmark = pytest.mark.integration


async def test_routers_share_a_view_through_sentinel_and_follow_a_failover(
    start_fakes: StartFakes, start_router: StartRouter, redis_sentinel: RedisSentinel
) -> None:
    fakes = await start_fakes(3)
    a = await fleet_router(start_router, fakes, redis_sentinel.url)
    b = await fleet_router(start_router, fakes, redis_sentinel.url)
    await assert_shared_prefixes(a, b, "before", 3, timeout_s=5.0)
    redis_sentinel.primary.pause()
    try:
        await eventually(
            lambda: redis_sentinel.primary_port() == redis_sentinel.replica.port,
            timeout_s=20.0,
            what="the sentinel promoted the replica",
        )
        await assert_shared_prefixes(a, b, "after", 3, timeout_s=5.0)
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
    await assert_shared_prefixes(a, b, "cluster", 3, timeout_s=5.0)
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
