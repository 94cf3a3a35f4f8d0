"""A request's choices as the handlers see them: each choice's text deltas (detokenised, cut at stop strings), its
per-request metrics and capture record, the echoed prompt, and the choices merged for streaming."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from replica.engine.engine import RequestOutput
from replica.engine.sampler import TokenLogprob
from replica.server.async_engine import RequestStream
from replica.server.protocol import ParsedRequest, completion_logprobs, token_text, usage
from replica.server.state import ServerState
from replica.tokenizer import IncrementalDetokenizer, StopChecker


@dataclass
class Piece:
    """A text delta of one choice and the logprobs of the tokens that produced it (with `logprobs` asked)."""

    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


class Generation:
    """One choice: detokenises its outputs, applies stop strings, records per-request metrics and captures it."""

    def __init__(
        self,
        state: ServerState,
        parsed: ParsedRequest,
        stream: RequestStream,
        arrival_s: float,
        *,
        index: int = 0,
    ) -> None:
        self.index = index
        self.state = state
        self.parsed = parsed
        self.stream = stream
        self.arrival_s = arrival_s
        self.detok = IncrementalDetokenizer(state.tokenizer)
        self.stops = StopChecker(list(parsed.params.stop)) if parsed.params.stop else None
        self.finish_reason: str | None = None
        self.error: str | None = None
        """With finish_reason "error": why the engine ended the request."""
        self.num_prompt_tokens = len(parsed.prompt_token_ids)
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.output_token_ids: list[int] = []
        self.prompt_logprobs: list[TokenLogprob] | None = None
        """With echo and logprobs: the prompt tokens' from the second on (they come with the first output)."""
        source = state.capture_source
        self.output_texts: list[str] | None = [] if source is not None and source.keep_text else None
        self.e2e_s: float | None = None
        self._first_token_s: float | None = None
        self._last_token_s: float | None = None

    def _observe(self, out: RequestOutput) -> None:
        m, name = self.state.metrics, self.state.model_name
        now = time.monotonic()
        if self._last_token_s is None:
            self._first_token_s = now
            m.ttft.labels(name).observe(now - self.arrival_s)
            if self.index == 0:  # the choices share the prompt
                m.prompt_tokens.labels(name).inc(out.num_prompt_tokens)
        else:
            m.itl.labels(name).observe(now - self._last_token_s)
        self._last_token_s = now
        m.generation_tokens.labels(name).inc(len(out.new_token_ids))
        self.output_token_ids.extend(out.new_token_ids)
        self.num_cached_tokens = out.num_cached_tokens
        self.num_output_tokens = out.num_output_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.error is not None:
            self.error = out.error

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        m, name = self.state.metrics, self.state.model_name
        self.e2e_s = time.monotonic() - self.arrival_s
        m.e2e.labels(name).observe(self.e2e_s)
        m.request_success.labels(name, reason).inc()

    async def texts(self) -> AsyncIterator[str]:
        """Yields text deltas (possibly empty); `finish_reason` is set when it ends."""
        async for piece in self.pieces():
            yield piece.text

    async def pieces(self) -> AsyncIterator[Piece]:
        """Yields text deltas (possibly empty) with their tokens' logprobs; `finish_reason` is set when it ends."""
        try:
            async for out in self.stream:
                self._observe(out)
                text = "".join(self.detok.push(t) for t in out.new_token_ids)
                piece = Piece("", out.logprobs or [], out.new_token_ids)
                if out.finished:
                    text += self.detok.flush()
                if self.stops is not None:
                    text, stopped = self.stops.check(text)
                    if stopped:
                        self.stream.close()
                        self._finish("stop")
                        if self.output_texts is not None:
                            self.output_texts.append(text)
                        piece.text = text
                        yield piece
                        return
                    if out.finished:
                        text += self.stops.flush()
                if out.finished:
                    assert out.finish_reason is not None
                    self._finish(out.finish_reason.value)
                if self.output_texts is not None:
                    self.output_texts.append(text)
                piece.text = text
                yield piece
        finally:
            self.stream.close()

    def capture(self, request_id: str, *, chat: bool) -> None:
        """Hand the request to the capture writer, if there is one; a request that did not finish is an abort."""
        writer, source = self.state.capture, self.state.capture_source
        if writer is None or source is None:
            return
        now = time.monotonic()
        writer.record(
            source.record(
                request_id=request_id,
                endpoint="chat" if chat else "completions",
                prompt_token_ids=self.parsed.prompt_token_ids,
                output_token_ids=self.output_token_ids,
                params=self.parsed.params,
                finish_reason=self.finish_reason or "abort",
                num_cached_tokens=self.num_cached_tokens,
                arrival_unix_s=time.time() - (now - self.arrival_s),
                ttft_s=None if self._first_token_s is None else self._first_token_s - self.arrival_s,
                e2e_s=self.e2e_s if self.e2e_s is not None else now - self.arrival_s,
                prompt_text=self.parsed.prompt_text,
                output_text=None if self.output_texts is None else "".join(self.output_texts),
            )
        )

    def echo_logprobs(self) -> tuple[dict[str, Any] | None, int]:
        """The echoed prompt's part of the completions logprobs object (its first token's logprob and alternatives
        null, as OpenAI reports them) and the text offset after it; None without echo, logprobs or the prompt's."""
        ids, lps = self.parsed.prompt_token_ids, self.prompt_logprobs
        if not self.parsed.echo or lps is None:
            return None, 0
        tokenizer = self.state.tokenizer
        first = token_text(tokenizer, ids[0])
        rest, offset = completion_logprobs(tokenizer, lps, ids[1:], len(first))
        out: dict[str, Any] = {
            "tokens": [first, *rest["tokens"]],
            "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]],
            "text_offset": [0, *rest["text_offset"]],
        }
        return out, offset

    def echo_text(self) -> str:
        parsed = self.parsed
        if not parsed.echo:
            return ""
        if parsed.prompt_text is not None:
            return parsed.prompt_text
        return self.state.tokenizer.decode(parsed.prompt_token_ids)


def usage_of(gens: list[Generation]) -> dict[str, Any]:
    """The prompt counted once, the choices' outputs summed."""
    return usage(gens[0].num_prompt_tokens, sum(g.num_output_tokens for g in gens), gens[0].num_cached_tokens)


async def collect(gen: Generation) -> tuple[str, list[TokenLogprob], list[int]]:
    texts: list[str] = []
    logprobs: list[TokenLogprob] = []
    token_ids: list[int] = []
    async for piece in gen.pieces():
        texts.append(piece.text)
        logprobs.extend(piece.logprobs)
        token_ids.extend(piece.token_ids)
    return "".join(texts), logprobs, token_ids


async def merged(gens: list[Generation]) -> AsyncGenerator[tuple[int, Piece | None]]:
    """The choices' pieces as they come, tagged with the choice's index; (index, None) when a choice ends."""
    queue: asyncio.Queue[tuple[int, Piece | BaseException | None]] = asyncio.Queue()

    async def pump(gen: Generation) -> None:
        try:
            async for piece in gen.pieces():
                await queue.put((gen.index, piece))
            await queue.put((gen.index, None))
        except Exception as exc:  # the engine failed: handed to the writer, which reports it
            await queue.put((gen.index, exc))

    tasks = [asyncio.get_running_loop().create_task(pump(g)) for g in gens]
    try:
        remaining = len(gens)
        while remaining:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                remaining -= 1
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
