"""The engine on an event loop (`replica.server.async_engine`): the outputs are those of the engine driven alone,
what must run between steps (the KV-event snapshot) never meets a running step, and a failure in a step or in the
handling of its outputs ends every request with EngineDeadError instead of leaving them waiting.

The engine's `step` is wrapped to note whether a step runs (the engine itself runs unchanged).
"""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from replica.engine.engine import EngineConfig, LLMEngine, StepResult
from replica.model.model import MoEForCausalLM
from replica.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from tests.unit.replica_engine.conftest import drive, greedy

CONFIG = EngineConfig(num_blocks=200, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
PROMPTS = [[5, 9, 2, 7, 11], [3, 1, 4, 1, 5, 9, 2, 6], [40, 41, 42], [7, 7, 7, 7, 7, 7]]


class WatchedSteps:
    """Wraps `engine.step`: how many steps ran, and whether one runs now."""

    def __init__(self, engine: LLMEngine) -> None:
        self.count = 0
        self.running = threading.Event()
        step = engine.step

        def watched() -> StepResult:
            self.running.set()
            self.count += 1
            try:
                return step()
            finally:
                self.running.clear()

        engine.step = watched  # type: ignore[method-assign]


async def test_outputs_equal_the_engine_driven_alone(model: MoEForCausalLM) -> None:
    alone = LLMEngine(model, CONFIG)
    ids = [alone.add_request(p, greedy(24)) for p in PROMPTS]
    expected = drive(alone).tokens

    served = AsyncEngine(LLMEngine(model, CONFIG), max_waiting=16)
    served.start()
    try:
        streams = [served.submit(p, greedy(24)) for p in PROMPTS]

        async def read(stream: object) -> list[int]:
            tokens: list[int] = []
            async for out in stream:  # type: ignore[attr-defined]
                tokens.extend(out.new_token_ids)
            return tokens

        got = await asyncio.wait_for(asyncio.gather(*(read(s) for s in streams)), timeout=60)
    finally:
        await served.stop()
    assert got == [expected[i] for i in ids]


async def test_what_runs_between_steps_never_meets_a_running_step(model: MoEForCausalLM) -> None:
    engine = LLMEngine(model, CONFIG)
    steps = WatchedSteps(engine)
    served = AsyncEngine(engine, max_waiting=16)
    served.start()
    seen_running: list[bool] = []
    calls = 0
    try:
        streams = [served.submit(p, greedy(32)) for p in PROMPTS]

        async def read(stream: object) -> None:
            async for _ in stream:  # type: ignore[attr-defined]
                pass

        readers = asyncio.gather(*(read(s) for s in streams))
        while not readers.done():
            done = asyncio.get_running_loop().create_future()

            def check(done: asyncio.Future[None] = done) -> None:
                seen_running.append(steps.running.is_set())
                done.set_result(None)

            served.call_between_steps(check)
            await asyncio.wait_for(done, timeout=10)
            calls += 1
            await asyncio.sleep(0)
        await readers
    finally:
        await served.stop()
    assert calls >= 5 and not any(seen_running)
    assert steps.count > 10


class Injected(RuntimeError):
    """The failure these tests inject."""


async def outcome(stream: RequestStream) -> str:
    try:
        async for _ in stream:
            pass
    except EngineDeadError as exc:
        return str(exc)
    return "finished"


@pytest.mark.parametrize("where", ["step", "on_step"])
async def test_a_failure_ends_every_request_and_refuses_later_ones(
    model: MoEForCausalLM, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The third step fails: `step`, the engine's step raises (in its thread); `on_step`, the handling of its outputs
    raises (on the loop), which once ended the driver unseen and left every request waiting. While that step runs, a
    call is queued between steps: it still runs."""
    engine = LLMEngine(model, CONFIG)
    loop = asyncio.get_running_loop()
    ran: list[str] = []
    was_queued: list[bool] = []
    step = engine.step
    num_steps = 0

    async def queue_a_call() -> None:
        served.call_between_steps(lambda: ran.append("the queued call"))
        was_queued.append(not ran)

    def third_step_queues_a_call() -> StepResult:
        nonlocal num_steps
        num_steps += 1
        if num_steps == 3:
            asyncio.run_coroutine_threadsafe(queue_a_call(), loop).result(timeout=10)
            if where == "step":
                raise Injected("the third step")
        return step()

    def on_step(result: StepResult) -> None:
        if where == "on_step" and num_steps == 3:
            raise Injected("the third step")

    engine.step = third_step_queues_a_call  # type: ignore[method-assign]
    served = AsyncEngine(engine, max_waiting=16, on_step=on_step)
    served.start()
    try:
        with caplog.at_level(logging.ERROR, logger="replica.server.async_engine"):
            streams = [served.submit(p, greedy(32)) for p in PROMPTS]
            outcomes = await asyncio.wait_for(asyncio.gather(*(outcome(s) for s in streams)), timeout=30)
        assert outcomes == ["the engine failed: Injected('the third step')"] * len(PROMPTS)
        assert was_queued == [True] and ran == ["the queued call"]
        assert not served.is_alive
        with pytest.raises(EngineDeadError, match="Injected"):
            served.submit(PROMPTS[0], greedy(4))
        assert [r.getMessage() for r in caplog.records] == [
            f"the engine failed; failing {len(PROMPTS)} in-flight requests"
        ]
    finally:
        await asyncio.wait_for(served.stop(), timeout=30)
