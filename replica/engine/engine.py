"""The engine: requests in, tokens out, one `step()` at a time.

`add_request` and `abort` may be called from another thread than `step` (the server calls them on its event loop
while a step runs in the engine's worker thread): they only append to an inbox that `step` drains first. Everything
else is touched by `step` alone, so the engine has no locks.

A step: drain the inbox, schedule, run the model, compute the step's grammar masks, decide the tokens
(`replica.engine.decide`: sampling, or with a drafter the verification of last step's drafts and the proposal of
the next ones), append them, check stop conditions, register newly computed full blocks in the prefix cache, and
return each touched request's new tokens plus the KV events.

Speculation (`num_speculative_tokens` > 0 and a drafter): a decoding sequence runs its last token and its drafts in
one forward pass; `decide` keeps the accepted drafts and one more token, so a step emits 1 to k + 1 tokens per
sequence. Rejected drafts never become part of the sequence: their cache slots lie past `num_computed_tokens` and are
overwritten by the next step, and only full blocks of committed, computed tokens enter the prefix cache, so KV
events and prefix hits are exactly those of decoding without speculation. `SpeculationPolicy` picks each step's k.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from replica.engine.block_manager import BlockManager
from replica.engine.constrain import propose_constrained, target_allowed, verification_bitmasks
from replica.engine.decide import decide
from replica.engine.drafting import Drafter
from replica.engine.runner import ModelRunner, RunnerOutput
from replica.engine.sampler import TokenLogprob, gather_logprobs, raw_logprobs
from replica.engine.sampling import SamplingParams
from replica.engine.scheduler import ScheduledBatch, Scheduler
from replica.engine.sequence import FinishReason, Sequence, SequenceStatus
from replica.engine.speculation import SpeculationPolicy, SpeculationPolicyConfig
from replica.model.model import MoEForCausalLM
from router.policy.kv_events import KVEvent

if TYPE_CHECKING:
    from replica.grammar.matcher import GrammarCompiler
    from replica.tokenizer import Tokenizer


class RequestError(ValueError):
    """A request the engine cannot take (the server answers 400 with this message)."""


MAX_FORCED_DRAFTS = 8
"""`EngineConfig.max_forced_drafts` by default."""


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 1024
    """KV cache blocks; with block_size 16 the default holds 16384 tokens."""
    block_size: int = 16
    """Tokens per KV block; equals the router's token block size so KV events match its hashes."""
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    """Token budget of one step; longer prompts are prefilled in chunks of at most this."""
    max_model_len: int | None = None
    """Prompt plus output tokens; None: the model's max_position_embeddings, capped by the cache size."""
    enable_prefix_caching: bool = True
    hash_seed: bytes = b"shoal-demo"
    """Namespace of the block hashes (router.policy.hashing.namespace_seed of the served model name)."""
    seed: int = 0
    """Seed of the generator that gives requests without a seed of their own one (in order of admission)."""
    num_speculative_tokens: int = 0
    """k: tokens the drafter proposes per sequence per step, at most (needs a drafter); 0 turns speculation off."""
    adaptive_speculation: bool = True
    """Shrink k for sequences whose drafts are rarely accepted, and skip speculation for batch sizes where it is
    measured not to pay (`replica.engine.speculation`)."""
    max_forced_drafts: int = MAX_FORCED_DRAFTS
    """Tokens a grammar forces after a constrained sequence's drafts (a key and its quotes) that join them as
    drafts, at most (`replica.engine.constrain`); 0 turns that off. Each costs one verified position and no
    drafter work; 8, the demo drafter's k, takes nearly every forced run of the schema suite (16 adds little)."""


@dataclass
class RequestOutput:
    seq_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    error: str | None = None
    """With finish_reason ERROR: what went wrong (the grammar allowed no token)."""
    logprobs: list[TokenLogprob] | None = None
    """With `params.logprobs` set: one per new token."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """With `params.prompt_logprobs` set, on the request's first output: one per prompt token from the second on."""


@dataclass
class SpeculationStats:
    """One step's verifications, with vLLM's meanings: a draft is one sequence's drafts verified in a step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    """Accepted drafts by their position in the draft (0 = first)."""


@dataclass
class StepResult:
    outputs: list[RequestOutput] = field(default_factory=list)
    events: list[KVEvent] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_preempted: int = 0
    speculation: SpeculationStats = field(default_factory=SpeculationStats)


class LLMEngine:
    def __init__(
        self,
        model: MoEForCausalLM,
        config: EngineConfig,
        *,
        eos_token_ids: Iterable[int] = (),
        clock: Callable[[], float] = time.monotonic,
        drafter: Drafter | None = None,
        grammar: GrammarCompiler | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        """`grammar`: the replica's llguidance tokenizer, needed to serve requests with a grammar. `tokenizer`:
        needed to serve stop strings, which the engine detects on the decoded output."""
        if config.num_speculative_tokens and drafter is None:
            raise ValueError("num_speculative_tokens > 0 needs a drafter")
        if drafter is not None and drafter.vocab_size != model.config.vocab_size:
            raise ValueError(f"the drafter's vocabulary ({drafter.vocab_size}) is not the model's")
        self.model = model
        self.config = config
        self.drafter = drafter if config.num_speculative_tokens else None
        if grammar is not None and grammar.vocab_size != model.config.vocab_size:
            raise ValueError(f"the grammar's vocabulary ({grammar.vocab_size}) is not the model's")
        self.grammar = grammar
        self.tokenizer = tokenizer
        self.policy = SpeculationPolicy(
            SpeculationPolicyConfig(config.num_speculative_tokens, adaptive=config.adaptive_speculation)
        )
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        cache_len = config.num_blocks * config.block_size
        model_len = config.max_model_len or model.config.max_position_embeddings
        self.max_model_len = min(model_len, cache_len, model.config.max_position_embeddings)
        self.block_manager = BlockManager(
            config.num_blocks, config.block_size, config.hash_seed, enable_prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            lookahead_tokens=self.drafter.lookahead_tokens if self.drafter is not None else 0,
        )
        self.runner = ModelRunner(model, num_blocks=config.num_blocks, block_size=config.block_size)
        self._inbox: deque[tuple[str, Sequence | int]] = deque()
        self._seqs: dict[int, Sequence] = {}
        self._ids = itertools.count()
        self._seeds = random.Random(config.seed)
        self._parked: set[int] = set()
        """Followers of an `n` > 1 request waiting for their first sequence's prompt (`add_group`)."""
        self.num_preemptions = 0
        self.step_timer: Callable[[], float] = time.perf_counter
        """Times steps for the speculation policy (tests may replace it)."""

    # ---- thread-safe entry points -----------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise RequestError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:  # two C loops, not a Python one per token
            bad = next(t for t in prompt_token_ids if not 0 <= t < vocab)
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context is {self.max_model_len} tokens "
                "including at least one generated token"
            )
        if params.grammar is not None and self.grammar is None:
            raise RequestError("this engine has no grammar tokenizer: constrained outputs are not served")
        if params.stop and self.tokenizer is None:
            raise RequestError("this engine has no tokenizer: stop strings are not served")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Queue a request; returns its id. Raises RequestError for a prompt the engine cannot serve."""
        return self.add_group(prompt_token_ids, [params])[0]

    def add_group(self, prompt_token_ids: list[int], params: list[SamplingParams]) -> list[int]:
        """Queue one request with several choices (OpenAI's `n`), one sequence per entry of `params`; returns their
        ids. The first sequence is scheduled at once; the others wait until its prompt is computed and its full
        blocks are in the prefix cache, then take those blocks by reference (the prompt is prefilled once; each
        choice computes only the prompt's last block, at most `block_size` tokens). Without prefix caching each
        choice prefills the whole prompt."""
        if not params:
            raise RequestError("a request needs at least one choice")
        for p in params:
            self.validate(prompt_token_ids, p)
        now = self.clock()
        seqs = [Sequence(next(self._ids), list(prompt_token_ids), p, arrival_s=now) for p in params]
        seqs[0].followers = seqs[1:]
        self._inbox.append(("add", seqs[0]))
        return [s.seq_id for s in seqs]

    def warm_up(self) -> None:
        """Run one request of a full chunk budget of prompt tokens and one output token, then forget it: the first
        request served otherwise pays the allocator's and the kernels' first calls. Leaves no cached block and no KV
        event behind, and no decode step to teach the speculation policy. Call it before serving, with nothing
        queued."""
        if self.has_work:
            raise RuntimeError("warm_up needs an idle engine")
        vocab = self.model.config.vocab_size
        low = min(16, vocab - 1)  # clear of the special tokens in Shoal's tokenizers
        length = max(1, min(self.config.max_num_batched_tokens, self.max_model_len - 1))
        prompt = [low + (i * 7919) % (vocab - low) for i in range(length)]
        self.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        while self.has_work:
            self.step()
        self.block_manager.reset_prefix_cache()
        self.block_manager.drain_events()

    def abort(self, seq_id: int) -> None:
        """Stop a request; its blocks are freed at the start of the next step. Unknown or finished ids are ignored."""
        self._inbox.append(("abort", seq_id))

    # ---- engine thread ----------------------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def _drain_inbox(self, result: StepResult) -> None:
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "add":
                assert isinstance(item, Sequence)
                self._admit(item, result)
                for follower in item.followers:
                    self._seqs[follower.seq_id] = follower  # known (abortable), scheduled by `_release_followers`
                    self._parked.add(follower.seq_id)
            else:
                assert isinstance(item, int)
                seq = self._seqs.get(item)
                if seq is not None and not seq.is_finished:
                    self._finish(seq, FinishReason.ABORT, result, [])

    def _admit(self, seq: Sequence, result: StepResult, *, front: bool = False) -> None:
        self._seqs[seq.seq_id] = seq
        if seq.params.grammar is not None and not self._start_grammar(seq, result):
            return
        seq.sample_seed = seq.params.seed if seq.params.seed is not None else self._seeds.getrandbits(63)
        if seq.params.stop:
            from replica.tokenizer import IncrementalDetokenizer, StopChecker

            assert self.tokenizer is not None
            seq.stop_text = (IncrementalDetokenizer(self.tokenizer), StopChecker(list(seq.params.stop)))
        if front:
            self.scheduler.waiting.appendleft(seq)
        else:
            self.scheduler.add(seq)

    def _release_followers(self, seq: Sequence, result: StepResult) -> None:
        """Schedule the other choices of `seq`'s request, ahead of later arrivals (its prompt is now cached, or it
        ended before that: they prefill on their own). Aborted ones are dropped."""
        followers, seq.followers = seq.followers, []
        for follower in reversed(followers):
            if follower.seq_id in self._parked:
                self._parked.discard(follower.seq_id)
                self._admit(follower, result, front=True)

    def _start_grammar(self, seq: Sequence, result: StepResult) -> bool:
        """Give `seq` its matcher; a grammar that does not compile (the server validates, so rarely) ends it."""
        from replica.grammar.matcher import GrammarError

        assert self.grammar is not None and seq.params.grammar is not None
        try:
            seq.grammar = self.grammar.matcher(seq.params.grammar)
        except GrammarError as exc:
            seq.error = f"the grammar does not compile: {exc}"
            self._finish(seq, FinishReason.ERROR, result, [])
            return False
        return True

    def _finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        result: StepResult,
        new_tokens: list[int],
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        if seq.seq_id in self._parked:  # a follower never scheduled
            self._parked.discard(seq.seq_id)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        else:
            self.scheduler.finish(seq, reason)
        del self._seqs[seq.seq_id]
        result.outputs.append(self._output(seq, new_tokens, logprobs))
        if seq.followers:
            self._release_followers(seq, result)

    @staticmethod
    def _output(seq: Sequence, new_tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        is_first = new_tokens and len(new_tokens) == seq.num_output_tokens
        return RequestOutput(
            logprobs=logprobs,
            prompt_logprobs=seq.prompt_logprobs if is_first and seq.params.prompt_logprobs is not None else None,
            seq_id=seq.seq_id,
            new_token_ids=new_tokens,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=len(seq.output_token_ids),
            error=seq.error,
        )

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if seq.stop_text is not None:
            detok, stops = seq.stop_text
            if stops.check(detok.push(token))[1]:
                return FinishReason.STOP
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def step(self) -> StepResult:
        started = self.step_timer()
        result = StepResult()
        self._drain_inbox(result)
        batch = self.scheduler.schedule()
        result.num_preempted = len(batch.preempted)
        self.num_preemptions += len(batch.preempted)
        if not batch.seqs:
            result.events = self.block_manager.drain_events()
            return result
        result.num_batched_tokens = batch.num_tokens
        out = self.runner.run(batch, self.drafter.feature_layers if self.drafter is not None else ())
        if self.drafter is not None:
            self.drafter.ingest(out.inputs, out.features)
        # Once the pass is issued: where it runs asynchronously (CUDA), the host computes the masks meanwhile.
        bitmasks = self._verification_bitmasks(batch)
        if out.prompt_logits is not None:
            self._record_prompt_logprobs(batch, out)
        for seq, n, d in zip(batch.seqs, batch.num_new_tokens, batch.num_draft_tokens, strict=True):
            seq.num_computed_tokens += n - d  # the drafts count once verified
        num_emitted, proposed = self._decide(batch, out, result, bitmasks) if out.sampled else (0, False)
        for seq in batch.seqs:
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.register_computed(seq)
        result.events = self.block_manager.drain_events()
        if all(n - d == 1 for n, d in zip(batch.num_new_tokens, batch.num_draft_tokens, strict=True)):
            verified = result.speculation.num_drafts > 0
            if verified == proposed:  # a pure step of one mode, not a switch between them
                self.policy.observe_step(
                    len(batch.seqs), num_emitted, self.step_timer() - started, speculative=verified
                )
        return result

    @staticmethod
    def _record_prompt_logprobs(batch: ScheduledBatch, out: RunnerOutput) -> None:
        """Append the logprobs of the prompt tokens this step's logits give (`RunnerOutput.prompt_spans`): one more
        device-to-host transfer, in the steps that compute such prompts only."""
        assert out.prompt_logits is not None
        spans = [(batch.seqs[i], first, n) for i, first, n in out.prompt_spans]
        targets = [t for seq, first, n in spans for t in seq.token_ids[first + 1 : first + 1 + n]]
        num_top = max(seq.params.prompt_logprobs or 0 for seq, _, _ in spans)
        device = out.prompt_logits.device
        chosen, top_values, top_ids = gather_logprobs(
            raw_logprobs(out.prompt_logits), torch.tensor(targets, device=device), num_top
        )  # [N], [N, top], [N, top]
        host = torch.cat([chosen.double(), top_values.flatten().double(), top_ids.flatten().double()]).tolist()
        num_rows = len(targets)
        values, top_lp, top_tok = (
            host[:num_rows],
            host[num_rows : num_rows * (1 + num_top)],
            host[num_rows * (1 + num_top) :],
        )
        row = 0
        for seq, _, n in spans:
            asked = seq.params.prompt_logprobs or 0
            for r in range(row, row + n):
                top = [(int(top_tok[r * num_top + t]), top_lp[r * num_top + t]) for t in range(asked)]
                seq.prompt_logprobs.append(TokenLogprob(values[r], top))
            row += n

    def _verification_bitmasks(self, batch: ScheduledBatch) -> dict[int, torch.Tensor]:
        """Grammar masks of the constrained sequences that sample in this step, at their committed tokens and
        along their drafts: kept from the walk that drew the drafts, else computed now
        (`constrain.verification_bitmasks`)."""
        if self.grammar is None:
            return {}
        kept: dict[int, torch.Tensor] = {}
        fresh: list[tuple[Sequence, int]] = []
        for seq, n, d in zip(batch.seqs, batch.num_new_tokens, batch.num_draft_tokens, strict=True):
            if seq.grammar is None or seq.num_computed_tokens + n - d != seq.num_tokens:
                continue
            if seq.draft_bitmasks is not None:
                kept[seq.seq_id] = seq.draft_bitmasks[: 1 + d]  # the scheduler may have cut the drafts
            else:
                fresh.append((seq, d))
        if fresh:
            kept.update(verification_bitmasks(self.grammar, [s for s, _ in fresh], [d for _, d in fresh]))
        return kept

    def _decide(
        self, batch: ScheduledBatch, out: RunnerOutput, result: StepResult, bitmasks: dict[int, torch.Tensor]
    ) -> tuple[int, bool]:
        """Decide and append the sampled sequences' tokens; -> (tokens emitted, whether drafts were proposed)."""
        seqs = [batch.seqs[i] for i in out.sampled]
        num_drafts = [batch.num_draft_tokens[i] for i in out.sampled]
        speculate = self.drafter is not None and self.policy.should_speculate(len(self.scheduler.running))
        room = self.max_model_len - self.config.num_speculative_tokens - 1
        num_next_drafts = [
            self.policy.num_drafts(s) if speculate and s.has_draft_room and s.num_tokens + d < room else 0
            for s, d in zip(seqs, num_drafts, strict=True)
        ]
        allowed = None
        if bitmasks:
            assert out.logits is not None
            allowed = target_allowed(seqs, out.num_rows, bitmasks, out.logits.shape[-1], out.logits.device)
        decided = decide(seqs, num_drafts, num_next_drafts, out, self.drafter, allowed)
        constrained_next: list[tuple[Sequence, int, int]] = []
        stats = result.speculation
        now = self.clock()
        num_emitted = 0
        for seq, d, choice in zip(seqs, num_drafts, decided, strict=True):
            num_accepted = len(choice.tokens) - 1
            if d:
                stats.num_drafts += 1
                stats.num_draft_tokens += d
                stats.num_accepted_tokens += num_accepted
                if len(stats.accepted_per_position) < d:
                    stats.accepted_per_position.extend([0] * (d - len(stats.accepted_per_position)))
                for j in range(num_accepted):
                    stats.accepted_per_position[j] += 1
                self.policy.observe_verification(seq, d, num_accepted)
            seq.num_computed_tokens += num_accepted
            seq.clear_drafts()
            appended: list[int] = []
            reason = None
            for token in choice.tokens:  # tokens past a stop are dropped, as rejected drafts are
                if seq.grammar is not None and not seq.grammar.consume(token):
                    seq.error = seq.grammar.error or "the grammar allows no token here"
                    reason = FinishReason.ERROR
                    break
                seq.token_ids.append(token)
                appended.append(token)
                reason = self._stop_reason(seq, token)
                if reason is None and seq.grammar is not None and seq.grammar.is_stopped:
                    seq.error = seq.grammar.error
                    # Complete: only EOS could follow. Or failed (a limit of the parser was reached).
                    reason = FinishReason.STOP if seq.error is None else FinishReason.ERROR
                if reason is not None:
                    break
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
            num_emitted += len(appended)
            if seq.first_token_s is None:
                seq.first_token_s = now
            logprobs = None if choice.logprobs is None else choice.logprobs[: len(appended)]
            if reason is not None:
                self.block_manager.register_computed(seq)  # its blocks stay cached after it is freed
                self._finish(seq, reason, result, appended, logprobs)
                continue
            if seq.followers:
                self.block_manager.register_computed(seq)  # the prompt's full blocks, before the followers look
                self._release_followers(seq, result)
            remaining = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
            keep = max(0, min(len(choice.next_drafts), remaining - 1))
            if choice.num_constrained_next and remaining > 1:
                n = min(choice.num_constrained_next, remaining - 1)
                forced = min(self.config.max_forced_drafts, remaining - 1 - n)
                constrained_next.append((seq, n, forced))
            if keep:
                seq.draft_token_ids = choice.next_drafts[:keep]
            result.outputs.append(self._output(seq, appended, logprobs))
        if constrained_next:
            self._propose_constrained(constrained_next)
        return num_emitted, any(num_next_drafts)

    def _propose_constrained(self, pending: list[tuple[Sequence, int, int]]) -> None:
        """Drafts of constrained sequences, drawn under their grammars now that this step's tokens are consumed
        (`pending`: sequence, drafts, forced drafts allowed after them)."""
        assert self.drafter is not None and self.grammar is not None
        seqs = [seq for seq, _, _ in pending]
        num_next_drafts = [n for _, n, _ in pending]
        max_forced = [f for _, _, f in pending]
        proposals = propose_constrained(
            self.drafter, self.grammar, seqs, num_next_drafts, self.model.device, max_forced
        )
        for seq, (drafts, bitmasks) in zip(seqs, proposals, strict=True):
            if drafts:
                seq.draft_token_ids = drafts
                seq.draft_bitmasks = bitmasks

    def check_invariants(self) -> None:
        """Block accounting holds (tests call this after every step): every block is free xor referenced."""
        bm = self.block_manager
        refs = [0] * bm.num_blocks
        for seq in self.scheduler.running:
            assert seq.status is SequenceStatus.RUNNING
            for b in seq.block_table:
                refs[b] += 1
        assert refs == bm.ref_counts, "reference counts disagree with the running sequences' block tables"
        free = set(bm._free_uncached) | set(bm._free_cached)
        assert len(free) == bm.num_free_blocks, "a block is on a free list twice"
        for b in range(bm.num_blocks):
            assert (b in free) == (refs[b] == 0), f"block {b}: free={b in free} refs={refs[b]}"
