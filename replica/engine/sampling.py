"""Per-request sampling parameters, validated once at the API edge with messages a client can act on."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_STOP_STRINGS = 4
"""OpenAI's limit on `stop`."""
MAX_TOP_LOGPROBS = 20
"""OpenAI's limit on `top_logprobs`."""


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
    presence_penalty: float = 0.0
    """OpenAI's: subtracted from the logit of every token already generated (prompt excluded)."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted once per earlier occurrence of the token in the generated tokens."""
    repetition_penalty: float = 1.0
    """vLLM's and HF's: a token seen in the prompt or the output has its logit divided by it when positive,
    multiplied by it when negative; 1 is off."""
    logprobs: int | None = None
    """None: no log-probabilities; n >= 0: each generated token's log-probability and the n most likely
    alternatives (at most `MAX_TOP_LOGPROBS`), from the model's raw distribution (`replica.engine.decide`)."""
    prompt_logprobs: int | None = None
    """None: none; n >= 0: each prompt token's log-probability given the tokens before it (from the second token
    on) and the n most likely alternatives, from the model's raw distribution. Such a prompt is computed in full,
    never taken from the prefix cache: cached blocks hold keys and values, not the logits of their positions."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise SamplingError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be 0 (off) or positive, got {self.top_k}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not s for s in self.stop):
            raise SamplingError("stop strings must not be empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise SamplingError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingError(f"prompt logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise SamplingError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
