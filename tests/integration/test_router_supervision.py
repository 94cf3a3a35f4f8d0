"""The router's background tasks under supervision (router/service/supervise.py), each failed once for real: a
replica whose answer breaks the code that reads it, served by a real HTTP peer on loopback. Each failure is
logged in one line (the traceback with a task's first), counted in `shoal_router_task_failures_total{task}`,
costs only the replica that caused it, and the task recovers once the answers do. State is polled with deadlines.
"""

from __future__ import annotations

import asyncio
import logging

import msgpack  # type: ignore[import-untyped]
import pytest
import zmq
import zmq.asyncio

from router.service.app import POOL
from router.service.settings import KVEventSettings
from tests.integration.conftest import RouterHandle, StartFakes, StartRouter, eventually, metric_value
from tests.integration.scripted_peer import REPLICA_ANSWERS, Answer, json_answer, scripted_peer
from tests.integration.test_router_kv_events import BLOCK, exact_depth, free_port

pytestmark = pytest.mark.integration


async def failures(router: RouterHandle, task: str) -> float | None:
    return metric_value(await router.metrics(), "shoal_router_task_failures_total", {"task": task})


async def has_failed(router: RouterHandle, task: str) -> bool:
    return (await failures(router, task) or 0) >= 1


async def num_down(router: RouterHandle, task: str) -> float | None:
    return metric_value(await router.metrics(), "shoal_router_tasks_down", {"task": task})


def failure_lines(caplog: pytest.LogCaptureFixture, task: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "shoal.router.tasks" and r.levelno == logging.ERROR and f"task {task} " in r.getMessage()
    ]


def assert_logged_once_each(caplog: pytest.LogCaptureFixture, task: str, num_failures: float) -> None:
    """One line per failure; the first carries the traceback, the others do not."""
    lines = failure_lines(caplog, task)
    assert len(lines) == num_failures >= 1, [r.getMessage() for r in lines]
    assert lines[0].exc_info is not None and all(r.exc_info is None for r in lines[1:])


def engine_metrics(running: float, waiting: float) -> Answer:
    text = f"vllm:num_requests_running {running}\nvllm:num_requests_waiting {waiting}\nvllm:kv_cache_usage_perc 0.5\n"
    return Answer(text.encode(), content_type="text/plain")


async def test_a_replica_whose_metrics_break_the_scraper_costs_only_itself(
    start_fakes: StartFakes, start_router: StartRouter, caplog: pytest.LogCaptureFixture
) -> None:
    (fake,) = await start_fakes(1)
    # +Inf running requests: a float the parser reads and no int can hold.
    answers = {**REPLICA_ANSWERS, "/metrics": [engine_metrics(3, 1), engine_metrics(float("inf"), 1)]}
    caplog.set_level(logging.ERROR, logger="shoal.router.tasks")
    async with scripted_peer(answers) as peer:
        router = await start_router(replicas=[peer.url, fake.url])
        assert await failures(router, "scrape") == 0  # the series exists before any failure

        async def engine(replica_id: str) -> dict[str, float]:
            return dict((await router.replicas())[replica_id]["engine"])

        async def is_read(replica_id: str, expected: dict[str, float]) -> bool:
            return await engine(replica_id) == expected

        await eventually(lambda: is_read(peer.host_port, {"num_running": 3, "num_waiting": 1, "kv_usage": 0.5}))
        await eventually(lambda: has_failed(router, "scrape"), what="the failed scrape counted")
        # While its answers cannot be read, its gauges are unknown (not the stale 3 and 1) and the task says it is
        # down for that replica; the other replica is still scraped.
        assert await engine(peer.host_port) == {}
        assert await num_down(router, "scrape") == 1
        fake.config.metric_overrides = {"running": 7, "waiting": 0, "kv_usage": 0.25}
        await eventually(
            lambda: is_read(f"{fake.host}:{fake.port}", {"num_running": 7, "num_waiting": 0, "kv_usage": 0.25})
        )

        peer.then("/metrics", engine_metrics(5, 2))
        await eventually(lambda: is_read(peer.host_port, {"num_running": 5, "num_waiting": 2, "kv_usage": 0.5}))
        assert await num_down(router, "scrape") == 0
        assert_logged_once_each(caplog, "scrape", await failures(router, "scrape") or 0)


async def test_a_replica_whose_model_list_breaks_the_probe_is_probed_again(
    start_fakes: StartFakes, start_router: StartRouter, caplog: pytest.LogCaptureFixture
) -> None:
    (fake,) = await start_fakes(1)
    answers = {**REPLICA_ANSWERS, "/v1/models": [json_answer({"data": 5}), *REPLICA_ANSWERS["/v1/models"]]}
    caplog.set_level(logging.ERROR, logger="shoal.router.tasks")
    async with scripted_peer(answers) as peer:
        router = await start_router(replicas=[peer.url, fake.url], num_ready=2)  # both in rotation: it recovered
        assert peer.num_requests["/v1/models"] >= 2
        assert await failures(router, "health") == 1
        assert await num_down(router, "health") == 0
        assert_logged_once_each(caplog, "health", 1)
        assert (await router.replicas())[peer.host_port]["models"] == ["shoal-demo"]


async def test_a_kv_event_reader_that_fails_is_restarted_and_its_stream_goes_live(
    start_router: StartRouter, caplog: pytest.LogCaptureFixture
) -> None:
    context = zmq.asyncio.Context()
    xpub = context.socket(zmq.XPUB)
    xpub.setsockopt(zmq.LINGER, 0)
    port = free_port()
    xpub.bind(f"tcp://127.0.0.1:{port}")
    # The first answer names a topic no socket can subscribe to (a lone surrogate, which JSON allows and UTF-8
    # does not); the second is what vLLM answers.
    broken = b'{"0": {"publisher": "zmq", "endpoint": "tcp://*:%d", "topic": "\\ud800"}}' % port
    sources = [Answer(broken), json_answer({"0": {"publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": "t"}})]
    caplog.set_level(logging.ERROR, logger="shoal.router.tasks")
    try:
        async with scripted_peer({**REPLICA_ANSWERS, "/kv_event_sources": sources}) as peer:
            settings = KVEventSettings(source="zmq", reconnect_min_s=0.05, reconnect_max_s=0.5)
            router = await start_router(replicas=[peer.url], kv_events=settings)
            assert await asyncio.wait_for(xpub.recv(), timeout=10) == b"\x01t"  # subscribed, after the restart
            assert await failures(router, "kv_events") == 1
            assert_logged_once_each(caplog, "kv_events", 1)
            tokens = list(range(1, 2 * BLOCK + 1))
            batch = msgpack.packb([0.0, [["BlockStored", [11, 12], None, tokens, BLOCK, None, "GPU"]], 0])
            await xpub.send_multipart([b"t", (0).to_bytes(8, "big"), batch])
            await eventually(lambda: exact_depth(router, peer.host_port, tokens) == 2, what="the batch applied")
            assert router.app[POOL].get(peer.host_port).has_live_kv_events  # type: ignore[union-attr]
            assert await num_down(router, "kv_events") == 0
    finally:
        xpub.close(linger=0)
        context.term()
