"""One request's token state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from replica.engine.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

    from replica.engine.sampler import TokenLogprob
    from replica.grammar.matcher import GrammarMatcher
    from replica.tokenizer import IncrementalDetokenizer, StopChecker


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"
    """An end-of-sequence or stop token (or, decided by the server, a stop string)."""
    LENGTH = "length"
    """max_tokens, or the model's context length."""
    ABORT = "abort"
    ERROR = "error"
    """The request's grammar allowed no token (`Sequence.error` says why); the batch goes on without it."""


@dataclass
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float
    sample_seed: int = 0
    """Seed of the sequence's draws (`sampler.noise_keys`): the request's own, or one the engine drew for it."""
    token_ids: list[int] = field(default_factory=list)
    """Prompt followed by generated tokens."""
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens whose keys and values are in the cache (prefix hits included)."""
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache at the first admission (reported as usage cached_tokens)."""
    num_registered_blocks: int = 0
    """Leading full blocks already entered into the prefix cache (or found there)."""
    last_block_hash: int | None = None
    """Chain hash of the last of those blocks: the parent of the next block to register."""
    first_token_s: float | None = None
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    """Tokens a drafter proposed to follow `token_ids`, verified in the next step; not part of the sequence."""
    draft_bitmasks: torch.Tensor | None = None
    """Constrained drafts: the grammar's bitmasks [1 + len(draft_token_ids), W] on the host after the committed
    tokens and after each draft, kept from the walk that drew them so verification need not compute them again."""
    has_draft_room: bool = False
    """Set by the scheduler each step: the block table covers the drafter's look-ahead, so it may propose."""
    draft_accepted: float = 0.0
    """Accepted drafts, decayed per verification round (`SpeculationPolicy`)."""
    draft_trials: float = 0.0
    """Drafts tried (accepted ones plus rejections), decayed alike: their ratio estimates the acceptance rate."""
    grammar: GrammarMatcher | None = None
    """The request's grammar, at the state after its committed output tokens (between steps)."""
    error: str | None = None
    """Why the sequence finished with `FinishReason.ERROR`."""
    stop_text: tuple[IncrementalDetokenizer, StopChecker] | None = None
    """With stop strings (and an engine tokenizer): the output's text so far, checked after every appended token,
    so a stop string ends the sequence at the token that completes it and later tokens are never committed."""
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    """With `params.prompt_logprobs`: the logprobs of prompt tokens 1, 2, ... computed so far (token 0 has none)."""
    followers: list[Sequence] = field(default_factory=list)
    """The other choices of an `n` > 1 request, held until this sequence's prompt is computed and registered, so
    they find it in the prefix cache and compute only their last, partial block (`LLMEngine.add_group`)."""

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def clear_drafts(self) -> None:
        self.draft_token_ids = []
        self.draft_bitmasks = None

    @property
    def num_prompt_logprobs_missing(self) -> int:
        """Prompt logprobs still to compute (0 when none are asked): each needs its position's logits."""
        if self.params.prompt_logprobs is None:
            return 0
        return self.num_prompt_tokens - 1 - len(self.prompt_logprobs)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than one token still to run: the prompt (or, after preemption, prompt and output) is not cached."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
