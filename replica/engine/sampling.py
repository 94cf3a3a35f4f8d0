"""Per-request sampling parameters, validated once at the API edge with messages a client can act on."""

from __future__ import annotations

from dataclasses import dataclass, field


class SamplingError(ValueError):
    """Invalid sampling parameters (the server answers 400 with this message)."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 means no top-k cut."""
    seed: int | None = None
    """Same seed, same prompt, same parameters: same output."""
    stop: tuple[str, ...] = ()
    """Stop strings, matched on the detokenised text by the server; not included in the output."""
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False
    grammar: str | None = None
    """An llguidance grammar (`replica.grammar.formats`) the output must follow; None: unconstrained."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise SamplingError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be 0 (off) or positive, got {self.top_k}")
        if len(self.stop) > 8:
            raise SamplingError(f"at most 8 stop strings, got {len(self.stop)}")
        if any(not s for s in self.stop):
            raise SamplingError("stop strings must not be empty")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise SamplingError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
