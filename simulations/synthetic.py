"""Synthetic workloads with known prefix structure, seeded.

- `shared_prefix`: independent requests, each a system prompt (one of `num_system_prompts`, chosen with Zipf
  popularity) followed by its own user text. Poisson arrivals.
- `sessions`: multi-turn conversations. A conversation opens with a Zipf-chosen system prompt and a user message;
  each later turn resends the whole conversation so far (previous prompt, the model's answer, a new user message),
  as chat APIs do, so it extends the previous turn's prompt block for block. Conversations start as a Poisson
  process; turns follow each other after exponential think times. The replay is open-loop: a turn's arrival is the
  previous turn's arrival plus the think time, not its completion (a trace cannot know the response time); choose
  think times well above the expected latency. The engine caches the answer's blocks as it computes them, so the
  next turn can hit them (`Request.cache_hashes`).

Every length is drawn uniformly from an inclusive [min, max] range. Random draws come from one `random.Random(seed)`
per workload, consumed in a fixed order, so a workload is the same on every call of `requests()`.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

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


class _Zipf:
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
        zipf = _Zipf(cfg.num_system_prompts, cfg.zipf_s)
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
    index: int
    system_prompt: int
    turns: list[tuple[float, int, int]]
    """(arrival_s, user tokens, output tokens) per turn."""
    next_turn: int = 0
    chain: ChainState | None = None
    segments: tuple[tuple[int, int], ...] = ()


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
        zipf = _Zipf(cfg.num_system_prompts, cfg.zipf_s)
        continue_p = 1.0 - 1.0 / cfg.mean_turns
        # (arrival of the session's next turn, session index, session): the next turn of all sessions, earliest first.
        pending: list[tuple[float, int, _Session]] = []
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
            session = _Session(index, zipf.draw(rng), turns)
            pending.append((turns[0][0], index, session))
        heapq.heapify(pending)
        next_segment = cfg.num_system_prompts
        request_id = 0
        while pending:
            arrival, _, session = heapq.heappop(pending)
            _, user_len, output_len = session.turns[session.next_turn]
            if session.chain is None:
                session.chain = prompts.chain(session.system_prompt)
                session.segments = ((session.system_prompt, lengths[session.system_prompt]),)
            chain = session.chain
            chain.extend(segment_tokens(next_segment, 0, user_len))
            prompt_hashes = list(chain.hashes)
            prompt_tokens = chain.num_tokens
            output_segment = next_segment + 1
            chain.extend(segment_tokens(output_segment, 0, output_len))
            session.segments = (*session.segments, (next_segment, user_len), (output_segment, output_len))
            next_segment += 2
            yield Request(
                id=request_id,
                arrival_s=arrival,
                prompt_tokens=prompt_tokens,
                output_tokens=output_len,
                hashes=prompt_hashes,
                tokens=SegmentTokens(session.segments, self.block_size),
                cache_hashes=list(chain.hashes),
                session=f"s{session.index}",
            )
            request_id += 1
            session.next_turn += 1
            if session.next_turn < len(session.turns):
                heapq.heappush(pending, (session.turns[session.next_turn][0], session.index, session))
            else:
                session.chain = None  # the conversation is over: free its hashes
