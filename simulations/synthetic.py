"""Synthetic workloads with known prefix structure, seeded.

- `shared_prefix`: independent requests, each a system prompt (one of `num_system_prompts`, chosen with Zipf
  popularity) followed by its own user text. Poisson arrivals.
- `sessions`: multi-turn conversations. A conversation opens with a Zipf-chosen system prompt and a user message;
  each later turn resends the whole conversation so far (previous prompt, the model's answer, a new user message),
  as chat APIs do, so it extends the previous turn's prompt block for block. Conversations start as a Poisson
  process; turns follow each other after exponential think times.
- `agentic`: tool loops. An episode opens with the system prompt of its kind of agent (tool schemas included; one of
  `num_agent_kinds`, Zipf-popular, shared by every episode of that kind) and its task. Each step the model answers
  with a short tool call; the tool's result is appended and the next step resends the whole history, so step k+1
  extends step k's prompt and answer block for block. The last step's answer ends the episode.

Both multi-request kinds replay open-loop, as a trace does: a request's arrival is fixed in advance, not set by
when the previous one completes (the simulator has no closed-loop clients). A turn arrives a think time after the
previous turn arrived; an agent step arrives the previous step's estimated response time (`estimated_ttft_s` +
output tokens x `estimated_tpot_s`) plus a tool latency after it. Choose think times, and the estimates, at or
above the latencies the fleet will show: when a response takes longer, the next request arrives before it would
have, and finds the answer's blocks not yet cached. The engine caches an answer's blocks as it computes them, so
the next request can hit them (`Request.cache_hashes`). Every request carries its conversation or episode as
`Request.session`, the key a client would send in the router's session header.

Every length (and tool latency) is drawn uniformly from an inclusive [min, max] range. Random draws come from one
`random.Random(seed)` per workload, consumed in a fixed order, so a workload is the same on every call of
`requests()`.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from router.policy.hashing import namespace_seed
from simulations.workload import ChainState, Request, SegmentTokens, segment_tokens


class _Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class SharedPrefixConfig(_Config):
    """Independent requests sharing Zipf-popular system prompts."""

    kind: Literal["shared_prefix"] = "shared_prefix"
    num_requests: int = Field(default=2000, ge=1)
    rate_per_s: float = Field(default=10.0, gt=0.0)
    """Mean arrival rate (Poisson), requests per second."""
    num_system_prompts: int = Field(default=20, ge=1)
    zipf_s: float = Field(default=1.0, ge=0.0)
    """Zipf exponent of system-prompt popularity: P(k) ~ 1 / k**s. 1.0 is the classic web-popularity figure; 0 is
    uniform."""
    system_prompt_tokens: tuple[int, int] = (1000, 4000)
    user_tokens: tuple[int, int] = (50, 1000)
    output_tokens: tuple[int, int] = (20, 400)
    seed: int = 0


class SessionsConfig(_Config):
    """Multi-turn conversations over Zipf-popular system prompts."""

    kind: Literal["sessions"] = "sessions"
    num_sessions: int = Field(default=300, ge=1)
    session_rate_per_s: float = Field(default=1.0, gt=0.0)
    """Mean rate at which conversations start (Poisson), per second."""
    mean_turns: float = Field(default=5.0, ge=1.0)
    """Mean turns per conversation (geometric, at least 1)."""
    think_time_s: float = Field(default=30.0, gt=0.0)
    """Mean seconds between a turn's arrival and the next (exponential)."""
    num_system_prompts: int = Field(default=10, ge=1)
    zipf_s: float = Field(default=1.0, ge=0.0)
    system_prompt_tokens: tuple[int, int] = (500, 3000)
    user_tokens: tuple[int, int] = (20, 500)
    output_tokens: tuple[int, int] = (50, 500)
    seed: int = 0


class Zipf:
    """Ranks 0..n-1 with P(k) ~ 1 / (k + 1)**s."""

    def __init__(self, n: int, s: float) -> None:
        weights = [1.0 / (k + 1) ** s for k in range(n)]
        self.cumulative = list(itertools.accumulate(weights))

    def draw(self, rng: random.Random) -> int:
        return bisect.bisect_left(self.cumulative, rng.random() * self.cumulative[-1])


class _SystemPrompts:
    """System prompt k is segment k; its chain is hashed once and copied for each user."""

    def __init__(self, lengths: list[int], seed: bytes, block_size: int) -> None:
        self.lengths = lengths
        self._chains: dict[int, ChainState] = {}
        self._seed = seed
        self._block_size = block_size

    def chain(self, k: int) -> ChainState:
        chain = self._chains.get(k)
        if chain is None:
            chain = self._chains[k] = ChainState(self._seed, self._block_size)
            chain.extend(segment_tokens(k, 0, self.lengths[k]))
        return chain.copy()


class AgenticConfig(_Config):
    """Agent episodes: tool loops over Zipf-popular kinds of agent, every step resending the whole history."""

    kind: Literal["agentic"] = "agentic"
    num_episodes: int = Field(default=300, ge=1)
    episode_rate_per_s: float = Field(default=1.0, gt=0.0)
    """Mean rate at which episodes start (Poisson), per second."""
    num_agent_kinds: int = Field(default=8, ge=1)
    """Distinct system prompts: episodes of one kind of agent share theirs."""
    zipf_s: float = Field(default=1.0, ge=0.0)
    """Zipf exponent of the kinds' popularity: P(k) ~ 1 / k**s."""
    system_prompt_tokens: tuple[int, int] = (2000, 8000)
    """An agent's instructions and tool schemas: longer than a chat system prompt."""
    task_tokens: tuple[int, int] = (50, 1000)
    """The episode's task, after the system prompt."""
    num_steps: tuple[int, int] = (2, 20)
    """Model calls per episode: every one but the last is followed by a tool call's result."""
    output_tokens: tuple[int, int] = (20, 200)
    """Tokens the model generates per step: a tool call (the last step's is the final answer)."""
    tool_result_tokens: tuple[int, int] = (100, 3000)
    """Tokens of a tool's result, appended to the history before the next step."""
    tool_latency_s: tuple[float, float] = (0.2, 5.0)
    """Seconds a tool call takes, from the model's answer to the next step's request."""
    estimated_ttft_s: float = Field(default=0.5, ge=0.0)
    """Open-loop estimate of a step's time to first token, seconds: part of the gap before the next step."""
    estimated_tpot_s: float = Field(default=0.03, ge=0.0)
    """Open-loop estimate of seconds per generated token (30 ms: the presets' decode under load)."""
    seed: int = 0

    @model_validator(mode="after")
    def _ranges(self) -> AgenticConfig:
        ranges: list[tuple[float, float]] = [
            self.system_prompt_tokens,
            self.task_tokens,
            self.output_tokens,
            self.tool_result_tokens,
            self.tool_latency_s,
        ]
        for low, high in ranges:
            if not 0 <= low <= high:
                raise ValueError(f"a range must be 0 <= min <= max, got ({low}, {high})")
        if not 1 <= self.num_steps[0] <= self.num_steps[1]:
            raise ValueError(f"num_steps must be 1 <= min <= max, got {self.num_steps}")
        return self


def _draw(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(bounds[0], bounds[1])


class SharedPrefixWorkload:
    def __init__(self, config: SharedPrefixConfig, *, block_size: int = 16, model: str = "synthetic") -> None:
        self.config = config
        self.name = "shared_prefix"
        self.block_size = block_size
        self.seed_bytes = namespace_seed(model)

    def __len__(self) -> int:
        return self.config.num_requests

    def requests(self) -> Iterator[Request]:
        cfg = self.config
        rng = random.Random(cfg.seed)
        lengths = [_draw(rng, cfg.system_prompt_tokens) for _ in range(cfg.num_system_prompts)]
        prompts = _SystemPrompts(lengths, self.seed_bytes, self.block_size)
        zipf = Zipf(cfg.num_system_prompts, cfg.zipf_s)
        now = 0.0
        for i in range(cfg.num_requests):
            now += rng.expovariate(cfg.rate_per_s)
            k = zipf.draw(rng)
            user_len = _draw(rng, cfg.user_tokens)
            output_len = _draw(rng, cfg.output_tokens)
            user_segment = cfg.num_system_prompts + i
            chain = prompts.chain(k)
            chain.extend(segment_tokens(user_segment, 0, user_len))
            segments = ((k, lengths[k]), (user_segment, user_len))
            yield Request(
                id=i,
                arrival_s=now,
                prompt_tokens=chain.num_tokens,
                output_tokens=output_len,
                hashes=chain.hashes,
                tokens=SegmentTokens(segments, self.block_size),
            )


@dataclass(slots=True)
class _Session:
    """A conversation or an agent episode: requests that each resend the history before them."""

    index: int
    system_prompt: int
    turns: list[tuple[float, int, int]]
    """(arrival_s, tokens appended before the request (a user message, a task, a tool result), output tokens)."""
    next_turn: int = 0
    chain: ChainState | None = None
    segments: tuple[tuple[int, int], ...] = ()


def _replay(
    sessions: list[_Session], prompts: _SystemPrompts, *, first_segment: int, key_prefix: str, block_size: int
) -> Iterator[Request]:
    """The sessions' requests in arrival order (ties: lower session index first). Each request's prompt is the
    session's history: its system prompt, then every earlier turn's appended text and output, then its own
    appended text. Segment ids are handed out in the order requests are yielded, from `first_segment`."""
    # (arrival of the session's next turn, session index, session): the next turn of all sessions, earliest first.
    pending = [(session.turns[0][0], session.index, session) for session in sessions]
    heapq.heapify(pending)
    next_segment = first_segment
    request_id = 0
    while pending:
        arrival, _, session = heapq.heappop(pending)
        _, input_len, output_len = session.turns[session.next_turn]
        if session.chain is None:
            session.chain = prompts.chain(session.system_prompt)
            session.segments = ((session.system_prompt, prompts.lengths[session.system_prompt]),)
        chain = session.chain
        chain.extend(segment_tokens(next_segment, 0, input_len))
        prompt_hashes = list(chain.hashes)
        prompt_tokens = chain.num_tokens
        output_segment = next_segment + 1
        chain.extend(segment_tokens(output_segment, 0, output_len))
        session.segments = (*session.segments, (next_segment, input_len), (output_segment, output_len))
        next_segment += 2
        yield Request(
            id=request_id,
            arrival_s=arrival,
            prompt_tokens=prompt_tokens,
            output_tokens=output_len,
            hashes=prompt_hashes,
            tokens=SegmentTokens(session.segments, block_size),
            cache_hashes=list(chain.hashes),
            session=f"{key_prefix}{session.index}",
        )
        request_id += 1
        session.next_turn += 1
        if session.next_turn < len(session.turns):
            heapq.heappush(pending, (session.turns[session.next_turn][0], session.index, session))
        else:
            session.chain = None  # the session is over: free its hashes


class SessionsWorkload:
    def __init__(self, config: SessionsConfig, *, block_size: int = 16, model: str = "synthetic") -> None:
        self.config = config
        self.name = "sessions"
        self.block_size = block_size
        self.seed_bytes = namespace_seed(model)

    def requests(self) -> Iterator[Request]:
        cfg = self.config
        rng = random.Random(cfg.seed)
        lengths = [_draw(rng, cfg.system_prompt_tokens) for _ in range(cfg.num_system_prompts)]
        prompts = _SystemPrompts(lengths, self.seed_bytes, self.block_size)
        zipf = Zipf(cfg.num_system_prompts, cfg.zipf_s)
        continue_p = 1.0 - 1.0 / cfg.mean_turns
        sessions: list[_Session] = []
        start = 0.0
        for index in range(cfg.num_sessions):
            start += rng.expovariate(cfg.session_rate_per_s)
            turns: list[tuple[float, int, int]] = []
            arrival = start
            while True:
                turns.append((arrival, _draw(rng, cfg.user_tokens), _draw(rng, cfg.output_tokens)))
                if rng.random() >= continue_p:
                    break
                arrival += rng.expovariate(1.0 / cfg.think_time_s)
            sessions.append(_Session(index, zipf.draw(rng), turns))
        yield from _replay(
            sessions, prompts, first_segment=cfg.num_system_prompts, key_prefix="s", block_size=self.block_size
        )


class AgenticWorkload:
    def __init__(self, config: AgenticConfig, *, block_size: int = 16, model: str = "synthetic") -> None:
        self.config = config
        self.name = "agentic"
        self.block_size = block_size
        self.seed_bytes = namespace_seed(model)

    def requests(self) -> Iterator[Request]:
        cfg = self.config
        rng = random.Random(cfg.seed)
        lengths = [_draw(rng, cfg.system_prompt_tokens) for _ in range(cfg.num_agent_kinds)]
        prompts = _SystemPrompts(lengths, self.seed_bytes, self.block_size)
        zipf = Zipf(cfg.num_agent_kinds, cfg.zipf_s)
        episodes: list[_Session] = []
        start = 0.0
        for index in range(cfg.num_episodes):
            start += rng.expovariate(cfg.episode_rate_per_s)
            kind = zipf.draw(rng)
            num_steps = _draw(rng, cfg.num_steps)
            # Step 0 appends the task; step k > 0 the result of step k-1's tool call.
            steps: list[tuple[float, int, int]] = []
            arrival = start
            appended = _draw(rng, cfg.task_tokens)
            for step in range(num_steps):
                output_len = max(1, _draw(rng, cfg.output_tokens))
                steps.append((arrival, appended, output_len))
                if step + 1 < num_steps:
                    response_s = cfg.estimated_ttft_s + output_len * cfg.estimated_tpot_s
                    arrival += response_s + rng.uniform(*cfg.tool_latency_s)
                    appended = _draw(rng, cfg.tool_result_tokens)
            episodes.append(_Session(index, kind, steps))
        yield from _replay(
            episodes, prompts, first_segment=cfg.num_agent_kinds, key_prefix="a", block_size=self.block_size
        )
