"""How many tokens to draft for each sequence, step by step: an adaptive k.

Two rules, both on the host and both fed by measurements:
- Per sequence: the chance that its next draft is accepted, alpha, is estimated from its own recent verifications
  (accepted drafts over accepted drafts plus rejections, counts decayed by `recency` per round, with
  `prior_trials` trials' worth of the replica-wide estimate added, so one unlucky round does not halve its k).
  The j-th draft of a round survives with probability alpha^j, so a sequence drafts the largest
  k <= `num_speculative_tokens` with alpha^k >= `min_draft_acceptance`, and at least one, so that its estimate
  keeps learning.
- Per batch: speculation pays only while verifying and drafting cost less than the steps they save, and that depends
  on the batch size and the machine. The policy measures tokens emitted per second of step time with and without
  speculation, per batch-size bucket (powers of two), on pure decode steps (no prefill in them), and speculates in a
  bucket while the measured speculative rate is at least the plain one. Every `explore_interval` decisions a bucket
  runs the other mode for `explore_steps` steps, so that a change of load, drafter or machine is noticed; each try
  that leaves the choice as it was doubles the interval (up to `max_explore_interval`), so a mode that keeps losing
  costs less and less. A try measures its mode afresh: what that mode measured before is of the traffic of then
  (answers the drafter failed on, say), and kept, it would outweigh the try's few steps of the traffic of now.

A step's mode is decided when the previous step proposes (or does not propose) its drafts, so a switch costs one
step that neither mode's measurement counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from replica.engine.sequence import Sequence


@dataclass(frozen=True)
class SpeculationPolicyConfig:
    num_speculative_tokens: int = 0
    """Drafts per sequence per step, at most (k); 0 turns speculation off."""
    adaptive: bool = True
    """Shrink k per sequence with its acceptance and turn speculation off for batch sizes where it does not pay;
    off: every decoding sequence drafts `num_speculative_tokens` every step."""
    min_draft_acceptance: float = 0.1
    """A draft is proposed only while its estimated chance of acceptance is at least this. One more drafted and
    verified position of the demo's block drafter costs about a tenth of the time a speculative step spends per
    emitted token at batch 1 (k = 4 against k = 8 in benchmarks/bench_speculative.py --drafters), so a draft
    worth a tenth of a token is about even."""
    explore_interval: int = 64
    """Decisions per batch-size bucket between two tries of the mode it is not in."""
    explore_steps: int = 3
    """Length of such a try, in steps (the first one is a switch and is not measured)."""
    max_explore_interval: int = 1024
    """The interval a bucket backs off to while its tries keep confirming its mode."""
    prior_trials: float = 4.0
    """Weight, in draft trials, of the replica-wide estimate in a sequence's own (a round of k drafts is up to k)."""
    recency: float = 0.8
    """Per-round decay of a sequence's accepted and tried counts: its estimate follows the text it writes now."""
    rate_decay: float = 0.98
    """Per-step decay of a mode's measured token and second counts on that mode's steps, so that old load fades
    within a few hundred of them (a try of the other mode starts its measurement afresh)."""

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be 0 (off) or positive, got {self.num_speculative_tokens}")
        if not 0.0 < self.min_draft_acceptance < 1.0:
            raise ValueError(f"min_draft_acceptance must be in (0, 1), got {self.min_draft_acceptance}")


@dataclass
class _Rate:
    tokens: float = 0.0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float, decay: float) -> None:
        self.tokens = self.tokens * decay + tokens
        self.seconds = self.seconds * decay + seconds

    @property
    def per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


@dataclass
class _Bucket:
    speculative: _Rate = field(default_factory=_Rate)
    plain: _Rate = field(default_factory=_Rate)
    decisions: int = 0
    """Decisions since the last try of the other mode."""
    interval: int = 0
    """Decisions between tries (0: not set yet)."""
    exploring: int = 0
    """Steps left in the current try of the other mode."""
    mode_before_try: bool | None = None

    def preferred(self) -> bool:
        spec, plain = self.speculative.per_s, self.plain.per_s
        if spec is None:
            return True  # try speculation first: it is what a drafter is configured for
        if plain is None:
            return False
        return spec >= plain


class SpeculationPolicy:
    def __init__(self, config: SpeculationPolicyConfig) -> None:
        self.config = config
        self.acceptance_rate = 0.5
        """Replica-wide estimate: new sequences start from it. The mean of the first rounds, then a running
        average over about the last hundred, so a replica learns its drafter within a few requests."""
        self._num_rounds = 0
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket(num_decoding: int) -> int:
        """1, 2-3, 4-7, 8-15, ...: batch sizes whose costs are alike."""
        return max(1, num_decoding).bit_length()

    def _bucket(self, num_decoding: int) -> _Bucket:
        key = self.bucket(num_decoding)
        if key not in self._buckets:
            self._buckets[key] = _Bucket(interval=self.config.explore_interval)
        return self._buckets[key]

    def should_speculate(self, num_decoding: int) -> bool:
        """Whether the next step verifies drafts, for a batch of `num_decoding` decoding sequences."""
        if self.config.num_speculative_tokens == 0:
            return False
        if not self.config.adaptive:
            return True
        b = self._bucket(num_decoding)
        preferred = b.preferred()
        if b.exploring == 0 and b.mode_before_try is not None:  # a try just ended: did it change the choice?
            confirmed = preferred == b.mode_before_try
            b.interval = (
                min(2 * b.interval, self.config.max_explore_interval) if confirmed else self.config.explore_interval
            )
            b.mode_before_try = None
        b.decisions += 1
        if b.exploring == 0 and b.decisions >= b.interval:
            b.exploring, b.decisions, b.mode_before_try = self.config.explore_steps, 0, preferred
            if preferred:
                b.plain = _Rate()
            else:
                b.speculative = _Rate()
        if b.exploring:
            b.exploring -= 1
            return not preferred
        return preferred

    def num_drafts(self, seq: Sequence) -> int:
        """Drafts to propose for `seq` in a speculative step."""
        most = self.config.num_speculative_tokens
        if not self.config.adaptive:
            return most
        alpha = self.estimate(seq)
        if alpha >= 1.0:
            return most
        if alpha <= self.config.min_draft_acceptance:
            return 1
        return max(1, min(most, math.floor(math.log(self.config.min_draft_acceptance) / math.log(alpha))))

    def estimate(self, seq: Sequence) -> float:
        """alpha of `seq`: its decayed counts, plus `prior_trials` of the replica-wide estimate."""
        prior = self.config.prior_trials
        return (seq.draft_accepted + prior * self.acceptance_rate) / (seq.draft_trials + prior)

    def observe_verification(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """A round of `num_drafts` drafts of `seq` kept `num_accepted`."""
        if num_drafts == 0:
            return
        trials = num_accepted + (num_accepted < num_drafts)
        observed = num_accepted / trials
        seq.draft_accepted = seq.draft_accepted * self.config.recency + num_accepted
        seq.draft_trials = seq.draft_trials * self.config.recency + trials
        self._num_rounds += 1
        weight = max(1.0 / self._num_rounds, 0.01)
        self.acceptance_rate = (1 - weight) * self.acceptance_rate + weight * observed

    def observe_step(self, num_decoding: int, num_tokens: int, seconds: float, *, speculative: bool) -> None:
        """A pure decode step of `num_decoding` sequences emitted `num_tokens` in `seconds`; `speculative`: it
        verified drafts and proposed the next ones (a step that did one and not the other is a switch: skip it)."""
        b = self._bucket(num_decoding)
        (b.speculative if speculative else b.plain).add(num_tokens, seconds, self.config.rate_decay)

    def rates(self) -> dict[int, tuple[float | None, float | None]]:
        """Measured tokens/s per bucket: {bucket: (speculative, plain)} (for logs and benchmarks)."""
        return {k: (b.speculative.per_s, b.plain.per_s) for k, b in sorted(self._buckets.items())}
