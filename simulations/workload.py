"""What the simulator replays: requests with arrival times, lengths and the chained block hashes of their prompts.

A `Workload` yields `Request`s in arrival order, afresh (and identically) on every call of `requests()`, so that
every policy of a run sees the same traffic; generators are seeded and keep no state between calls. They are
lazy: the simulator pulls the next request when the previous one arrives, so only requests in flight are held.

Prompts are token ids in principle, but no trace carries them: a `TokenSource` makes up deterministic ids for any
block on demand (only exact mode's `stored` events need them), and the hashes are `router.policy.hashing`'s over
those ids with the workload's namespace seed, exactly what the router and a real engine's KV events would
compute. Two prompts share a block hash exactly when the trace says they share that prefix.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

from router.policy.hashing import chain_hashes, pack_tokens

TOKEN_MASK = 0xFFFFFFFF


class TokenSource(Protocol):
    """Token ids of a prompt, by block."""

    def block_tokens(self, index: int) -> list[int]:
        """The `block_size` token ids of full block `index`."""
        ...


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a workload."""

    id: int
    arrival_s: float
    """Seconds from the start of the workload."""
    prompt_tokens: int
    output_tokens: int
    """Tokens the engine generates (at least 1)."""
    hashes: Sequence[int]
    """Chained hashes of the prompt's full blocks (`prompt_tokens // block_size` of them)."""
    tokens: TokenSource
    """Token ids of the blocks of `cache_hashes`, for exact mode's `stored` events."""
    cache_hashes: Sequence[int] | None = None
    """Hashes of the full blocks of prompt and output together, when the output's tokens are known (synthetic
    conversations, whose next turn resends them): the engine caches output blocks as it computes them. None: only
    the prompt's blocks are cacheable."""
    session: str | None = None
    """Conversation or agent episode the request belongs to, when the workload has them: the key a client would send
    in the router's session header (read with `router.session_affinity` on)."""
    is_stream: bool = True
    """The client streams the answer, so the router sees its first token (and learns the replica's prefill rate
    from it); False: the router's first byte is the whole answer, at its end."""


class Workload(Protocol):
    """A replayable, deterministic stream of requests."""

    name: str
    block_size: int
    """Tokens per block of the hashes; must equal the simulated engines' block size."""
    seed_bytes: bytes
    """Namespace seed of the hashes (`hashing.namespace_seed`), for re-hashing exact-mode events."""

    def requests(self) -> Iterator[Request]:
        """The requests in arrival order; a fresh, identical stream on every call."""
        ...


@runtime_checkable
class Copies(Protocol):
    """A workload made of copies that share no block (a tiled trace): what lets the floor forget a copy's blocks."""

    def copy_of(self, request: Request) -> int:
        """The copy the request belongs to."""
        ...

    def copy_end_s(self, copy: int) -> float:
        """A time no request of the copy arrives after."""
        ...


class ListWorkload:
    """Requests given as a list (tests, programmatic experiments); replayed in arrival order."""

    def __init__(self, requests: Sequence[Request], *, block_size: int, seed_bytes: bytes, name: str = "list") -> None:
        self.name = name
        self.block_size = block_size
        self.seed_bytes = seed_bytes
        self._requests = sorted(requests, key=lambda r: (r.arrival_s, r.id))

    def __len__(self) -> int:
        return len(self._requests)

    def requests(self) -> Iterator[Request]:
        return iter(self._requests)


class _RewrittenWorkload:
    """`workload` with every request rewritten by `rewrite`; its name says how."""

    def __init__(self, workload: Workload, how: str) -> None:
        self.inner = workload
        self.name = f"{workload.name} ({how})"
        self.block_size = workload.block_size
        self.seed_bytes = workload.seed_bytes

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]  # TypeError, as for any unsized workload

    def rewrite(self, request: Request) -> Request:
        raise NotImplementedError

    def copy_of(self, request: Request) -> int:
        return self.inner.copy_of(request) if isinstance(self.inner, Copies) else 0

    def copy_end_s(self, copy: int) -> float:
        return self.inner.copy_end_s(copy) if isinstance(self.inner, Copies) else float("inf")

    def requests(self) -> Iterator[Request]:
        for request in self.inner.requests():
            yield self.rewrite(request)


class PrefillOnlyWorkload(_RewrittenWorkload):
    """`workload` as a disaggregated prefill fleet sees it: one output token per request (the first; decode runs
    elsewhere), and only the prompt's blocks cacheable."""

    def __init__(self, workload: Workload) -> None:
        super().__init__(workload, "prefill only")

    def rewrite(self, request: Request) -> Request:
        return replace(request, output_tokens=1, cache_hashes=None)


class ScaledOutputWorkload(_RewrittenWorkload):
    """`workload` with every output `scale` times longer (rounded, at least 1 token): decode-heavy traffic."""

    def __init__(self, workload: Workload, scale: float) -> None:
        super().__init__(workload, f"outputs x{scale:g}")
        self.scale = scale

    def rewrite(self, request: Request) -> Request:
        return replace(request, output_tokens=max(1, round(request.output_tokens * self.scale)))


@dataclass(frozen=True, slots=True)
class SegmentTokens:
    """Token ids of a prompt made of segments (a system prompt, user turns, outputs), each a run of made-up ids.

    Token `offset` of segment `seg` is `(seg * 2654435761 + offset) mod 2**32`: distinct segments give distinct
    runs (the multiplier is odd, so the map is a bijection mod 2**32), and no segment needs its ids stored.
    """

    segments: tuple[tuple[int, int], ...]
    """(segment id, length in tokens), in prompt order."""
    block_size: int

    def block_tokens(self, index: int) -> list[int]:
        return tokens_of(self.segments, index * self.block_size, (index + 1) * self.block_size)


def segment_tokens(segment: int, start: int, stop: int) -> list[int]:
    """Tokens `start..stop-1` of one segment."""
    base = segment * 2654435761
    return [(base + offset) & TOKEN_MASK for offset in range(start, stop)]


def tokens_of(segments: Sequence[tuple[int, int]], start: int, stop: int) -> list[int]:
    """Tokens `start..stop-1` of the concatenation of `segments`."""
    out: list[int] = []
    position = 0
    for segment, length in segments:
        end = position + length
        if end > start and position < stop:
            out.extend(segment_tokens(segment, max(start, position) - position, min(stop, end) - position))
        position = end
        if position >= stop:
            break
    return out


class ChainState:
    """Incremental block hashes of a growing token sequence: full blocks hashed once, the partial tail kept."""

    __slots__ = ("block_size", "hashes", "num_tokens", "seed", "tail")

    def __init__(self, seed: bytes, block_size: int) -> None:
        self.seed = seed
        self.block_size = block_size
        self.hashes: list[int] = []
        self.tail: list[int] = []
        """Tokens after the last full block."""
        self.num_tokens = 0

    def copy(self) -> ChainState:
        other = ChainState(self.seed, self.block_size)
        other.hashes = list(self.hashes)
        other.tail = list(self.tail)
        other.num_tokens = self.num_tokens
        return other

    def extend(self, tokens: list[int]) -> None:
        """Append tokens; hash the blocks they complete."""
        self.num_tokens += len(tokens)
        pending = self.tail + tokens if self.tail else tokens
        bs = self.block_size
        num_full = len(pending) // bs
        if num_full:
            data = pack_tokens(pending[: num_full * bs])
            width = 4 * bs
            blocks = [data[i : i + width] for i in range(0, len(data), width)]
            parent = self.hashes[-1] if self.hashes else None
            self.hashes.extend(chain_hashes(blocks, self.seed, parent))
        self.tail = pending[num_full * bs :]
