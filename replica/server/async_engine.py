"""The engine on an event loop: `step()` runs in one worker thread while the loop serves HTTP.

Requests enter through `submit`, which validates synchronously (bad input fails before anything is queued) and
returns a stream of the request's outputs. A driver task steps the engine while it has work and sleeps on an event
otherwise; each step's outputs are routed to their streams, and its KV events to the subscribers. A request whose
client goes away is aborted (`RequestStream.close`), which frees its blocks at the next step.

The worker is a one-thread executor that `stop()` shuts down after the step in progress: nothing outlives the app.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from replica.engine.engine import LLMEngine, RequestOutput, StepResult
from replica.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine failed (a step raised, or the driver's handling of one); in-flight and later requests fail with
    this."""


class QueueFullError(RuntimeError):
    """More requests are waiting than `max_waiting` allows."""


class RequestStream:
    def __init__(self, owner: AsyncEngine, seq_id: int) -> None:
        self.seq_id = seq_id
        self._owner = owner
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if item.finished:
                self.finished = True
            yield item

    def close(self) -> None:
        """Abort the request unless it finished (safe to call more than once)."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.seq_id)


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_waiting: int,
        on_step: Callable[[StepResult], None] | None = None,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        """`executor`: a one-thread executor to step in (the thread the model was loaded in); default: a new one."""
        self.engine = engine
        self.max_waiting = max_waiting
        self._on_step = on_step
        self._streams: dict[int, RequestStream] = {}
        self._wake = asyncio.Event()
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-engine")
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._in_step = False
        self._between_steps: deque[Callable[[], None]] = deque()
        self.error: BaseException | None = None

    @property
    def is_alive(self) -> bool:
        return self._task is not None and not self._task.done() and self.error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Submitted and not yet running (including requests the engine has not picked up yet)."""
        return max(0, len(self._streams) - self.engine.num_running)

    async def warm_up(self) -> None:
        """`LLMEngine.warm_up` in the worker thread the steps run in (some first-call costs are the thread's own);
        before `start`."""
        if self._task is not None:
            raise RuntimeError("warm up before start")
        await asyncio.get_running_loop().run_in_executor(self._executor, self.engine.warm_up)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._drive(), name="shoal-engine-driver")

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
        self._executor.shutdown(wait=True)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestStream:
        return self.submit_group(prompt_token_ids, [params])[0]

    def submit_group(self, prompt_token_ids: list[int], params: list[SamplingParams]) -> list[RequestStream]:
        """One request with a choice per entry of `params` (`LLMEngine.add_group`); a stream per choice."""
        if self.error is not None:
            raise EngineDeadError(f"the engine failed: {self.error!r}")
        room = self.max_waiting + self.engine.config.max_num_seqs - self.engine.num_running
        if self.num_waiting + len(params) - 1 >= room:
            raise QueueFullError(f"{self.num_waiting} requests are already waiting")
        streams = [RequestStream(self, seq_id) for seq_id in self.engine.add_group(prompt_token_ids, params)]
        for stream in streams:
            self._streams[stream.seq_id] = stream
        self._wake.set()
        return streams

    def call_between_steps(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the loop while no step runs: now if the engine is idle, else right after the current step."""
        if self._in_step:
            self._between_steps.append(fn)
        else:
            fn()

    def _run_between_steps(self) -> None:
        """The queued calls, in order; one that raises leaves those after it queued (`_fail` runs them)."""
        while self._between_steps:
            self._between_steps.popleft()()

    def abort(self, seq_id: int) -> None:
        if self._streams.pop(seq_id, None) is not None:
            self.engine.abort(seq_id)
            self._wake.set()

    async def _drive(self) -> None:
        """Step while there is work. Whatever raises in here, in a step or in the handling of its outputs, fails the
        engine (`_fail`): a driver that ended unseen would leave every request waiting forever."""
        try:
            await self._step_while_running()
        except Exception as exc:
            log.exception("the engine failed; failing %d in-flight requests", len(self._streams))
            self._fail(exc)

    async def _step_while_running(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            if not self.engine.has_work:
                self._wake.clear()
                if not self.engine.has_work:
                    await self._wake.wait()
                continue
            self._in_step = True
            try:
                result = await loop.run_in_executor(self._executor, self.engine.step)
            finally:
                self._in_step = False
            for out in result.outputs:
                target = self._streams.get(out.seq_id)
                if target is None:
                    continue  # aborted while the step ran
                target._put(out)
                if out.finished:
                    del self._streams[out.seq_id]
            if self._on_step is not None:
                self._on_step(result)
            self._run_between_steps()
            await asyncio.sleep(0)  # let handlers write what this step produced before the next step starts

    def _fail(self, exc: Exception) -> None:
        """Every request in flight ends with EngineDeadError, and `submit` refuses later ones (`is_alive` is false,
        so /health answers 503); what waits to run between steps runs now."""
        self.error = exc
        for stream in self._streams.values():
            stream._put(EngineDeadError(f"the engine failed: {exc!r}"))
        self._streams.clear()
        while True:
            try:
                self._run_between_steps()
                return
            except Exception:
                log.exception("a call queued between steps failed after the engine failed")
