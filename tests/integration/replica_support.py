"""Shoal replicas in-process on loopback, for the server tests and the router-in-front tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pytest
from aiohttp import web

from tests.replica_checkpoint import build_tiny_checkpoint


@dataclass
class ReplicaHandle:
    app: web.Application
    runner: web.AppRunner
    url: str

    @property
    def state(self) -> Any:
        from replica.server.state import STATE

        return self.app[STATE]


class StartReplica(Protocol):
    async def __call__(self, **settings: Any) -> ReplicaHandle: ...


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"))


@pytest.fixture
async def start_replica(tiny_checkpoint: Path) -> AsyncIterator[StartReplica]:
    """Replicas of the tiny checkpoint unless a test names another `model`."""
    async with _replicas(tiny_checkpoint) as start:
        yield start


@pytest.fixture
async def start_any_replica() -> AsyncIterator[StartReplica]:
    """Replicas of the checkpoint each test names (`model=...`), without building the tiny one."""
    async with _replicas(None) as start:
        yield start


@contextlib.asynccontextmanager
async def _replicas(default_model: Path | None) -> AsyncIterator[StartReplica]:
    from replica.loading import checkpoint_dir, load_drafter_for_serving, load_for_serving
    from replica.server.app import create_app
    from replica.settings import ReplicaSettings

    handles: list[ReplicaHandle] = []

    async def start(**overrides: Any) -> ReplicaHandle:
        values: dict[str, Any] = {"model": str(default_model), "served_model_name": "shoal-demo", "port": 0}
        values.update(overrides)
        settings = ReplicaSettings(**values)
        model, tokenizer = load_for_serving(settings)
        checkpoint = checkpoint_dir(settings)  # `demo` names the packaged folder, drafter included
        drafter = load_drafter_for_serving(settings, model, checkpoint)
        app = create_app(
            settings,
            model,  # type: ignore[arg-type]
            tokenizer,  # type: ignore[arg-type]
            checkpoint_dir=checkpoint,
            drafter=drafter,
        )
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=5.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        handle = ReplicaHandle(app, runner, f"http://{host}:{port}")
        handles.append(handle)
        return handle

    try:
        yield start
    finally:
        for handle in handles:
            await handle.runner.cleanup()
