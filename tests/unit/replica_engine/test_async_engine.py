"""The engine on an event loop (`replica.server.async_engine`): the outputs are those of the engine driven alone, and
what must run between steps (the KV-event snapshot) never meets a running step.

The engine's `step` is wrapped to note whether a step runs (the engine itself runs unchanged).
"""

from __future__ import annotations

import asyncio
import threading

from replica.engine.engine import EngineConfig, LLMEngine, StepResult
from replica.model.model import MoEForCausalLM
from replica.server.async_engine import AsyncEngine
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
