"""A simulated serving engine: continuous batching with chunked prefill over a prefix-cached block KV cache.

The scheduler follows vLLM V1's. Each step has a budget of `max_num_batched_tokens`:
1. Running sequences, in admission order, each get their remaining tokens up to the budget: one for a decoding
   sequence, a prefill chunk otherwise. A sequence that needs KV blocks the cache cannot give preempts the most
   recently admitted running sequence (recompute: its blocks are released, cached ones stay cached, and it goes
   back to the head of the queue), repeatedly, until the blocks fit or it has preempted itself.
2. If nothing was preempted, waiting sequences are admitted first come, first served while the budget lasts and
   fewer than `max_num_seqs` run: the cache is matched for the prompt's leading blocks (never the whole prompt:
   at least one token is computed), and blocks are allocated for the cached prefix and the first chunk. The
   queue stops at the first sequence whose blocks do not fit (no overtaking).
The step lasts `StepModel.step_time_s(prefill tokens, decode sequences, KV tokens read, attention pairs)`, plus
`SimulatedEngineConfig.request_overhead_s` for each request admitted for the first time (not again after a
preemption), plus the serving loop's `step_overhead_s` and `output_overhead_s` for each sequence that samples in the
step, plus `wake_s` when the engine was idle before it, all times a factor drawn from `step_jitter` when it has any
and 1 + `busy_peer_slowdown` for each other replica mid-step as it starts.
When it ends, every scheduled sequence has its tokens computed; computed full blocks enter the prefix cache; a
sequence whose tokens are all computed samples one token (the first one ends its prefill: time to first token),
and one that has all its output finishes and releases its blocks. The next step starts at once while there is
work.

A sequence's tokens are its prompt and the output sampled so far (`num_tokens`); `num_computed` of them have KV.
Decode is the case `num_tokens - num_computed == 1`; recompute after preemption is a prefill of every known token.
KV blocks needed for `n` computed tokens: ceil(n / block_size); of a sequence's blocks, `num_cached` are the
cached prefix `cache_hashes[:num_cached]`, the rest private.

Decode runs: while no request waits and every running sequence decodes, up to `max_decode_steps_per_event` steps
(never past the next finish) run as one event, their KV blocks allocated up front; their total time is the sum of
the single steps' (the KV read grows by one token per sequence per step). A request arriving meanwhile cuts the run
at the boundary of the step in progress, where a single step would have admitted it. This removes most events of
a decode-heavy replica without changing any latency.

Speculative decoding (`speculation`, when its acceptance length is set): once a step is scheduled as above, it
speculates for all its decoding sequences or none. It does when the adaptive rule finds it faster (tau * t_plain >
t_spec, `SpeculationConfig.is_faster`; skipped when not adaptive), when the budget left has k tokens per decoding
sequence, and when the cache gives the blocks for each one's k + 1 verified positions without preempting; a step
that does not runs plain, and `spec_branches` counts why. Drafts thus take the budget after prefill chunks (vLLM
schedules them first), which matters only in steps whose prefill fills the budget. A speculating sequence emits
1 + A tokens, A the drafts accepted (`speculation.accepted_drafts`, from the sequence's own generator seeded by
the run's seed and the request id, so a seed names a run and the draws do not depend on the other requests),
capped by its remaining output; the KV of the rejected positions is never computed (it never reaches the prefix
cache) and its blocks stay with the sequence for its next steps. Decode runs are off on such a replica: a run's
length and durations would depend on draws not yet made.

A request whose prompt and output together exceed the whole cache is refused on arrival (`on_reject`), as an
engine refuses a prompt beyond its max_model_len; admitted, it would preempt itself forever.

Exact mode: with `on_kv_events`, each step's end reports the blocks evicted during the step, then those stored,
as `router.policy.kv_events` objects (engine hash = router hash: the simulator hashes as the router does).
"""

from __future__ import annotations

import random
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

from router.policy.kv_events import BlockRemoved, BlockStored, KVEvent
from simulations.events import Simulator
from simulations.kv_cache import KVCache
from simulations.speculation import acceptance_rate, accepted_drafts
from simulations.step_model import SimulatedEngineConfig, SpeculationConfig, StepModel
from simulations.workload import Request


class Seq:
    """One request on a replica."""

    __slots__ = (
        "cache_hashes",
        "first_token_s",
        "hit_tokens",
        "is_drafting",
        "num_cached",
        "num_computed",
        "num_output",
        "num_preemptions",
        "num_private",
        "num_scheduled",
        "num_tokens",
        "request",
        "rng",
        "ticket",
    )

    def __init__(self, request: Request, ticket: Any = None) -> None:
        self.request = request
        self.ticket = ticket
        """The router's bookkeeping for this request (opaque here)."""
        self.cache_hashes: Sequence[int] = request.cache_hashes if request.cache_hashes is not None else request.hashes
        self.num_tokens = request.prompt_tokens
        self.num_computed = 0
        self.num_output = 0
        self.num_cached = 0
        self.num_private = 0
        self.num_scheduled = 0
        self.num_preemptions = 0
        self.hit_tokens: int | None = None
        """Prompt tokens found in the prefix cache at first admission (None until admitted)."""
        self.first_token_s: float | None = None
        self.is_drafting = False
        """The step in flight verifies drafts of this sequence."""
        self.rng: random.Random | None = None
        """Draws of the drafts this sequence's speculative steps accept (made on its first such step)."""


class SimReplica:
    """One engine replica driven by the simulator's clock."""

    def __init__(
        self,
        replica_id: str,
        engine: SimulatedEngineConfig,
        step_model: StepModel,
        sim: Simulator,
        *,
        on_first_token: Callable[[Seq], None],
        on_finish: Callable[[Seq], None],
        on_reject: Callable[[Seq], None] | None = None,
        on_kv_events: Callable[[str, list[KVEvent]], None] | None = None,
        max_decode_steps_per_event: int = 64,
        speculation: SpeculationConfig | None = None,
        seed: int = 0,
        busy_peers: Callable[[], int] = lambda: 0,
    ) -> None:
        """`busy_peers()`: how many other replicas of the fleet are mid-step now
        (`SimulatedEngineConfig.busy_peer_slowdown`)."""
        self.id = replica_id
        self.engine = engine
        self.step_model = step_model
        self.sim = sim
        self.cache = KVCache(
            engine.num_kv_blocks, is_caching=engine.enable_prefix_caching, is_tracking_removed=on_kv_events is not None
        )
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.is_busy = False
        """A step is in flight."""
        self._on_first_token = on_first_token
        self._on_finish = on_finish
        self._on_reject = on_reject
        self._on_kv_events = on_kv_events
        self._scheduled: list[Seq] = []
        self._stored: list[tuple[Seq, int, int]] = []
        self.max_decode_steps_per_event = max_decode_steps_per_event
        self._version = 0
        """Incremented whenever a scheduled step end is superseded (a decode run cut short)."""
        self._run: tuple[float, int, int, int, float] | None = None
        """The decode run in flight: (start_s, steps, sequences, KV tokens at its start, the factor on its time:
        `step_jitter`'s mean and the busy peers' slowdown as it started); None for a single step."""
        self.speculation = speculation if speculation is not None and speculation.is_enabled else None
        """Speculative decoding, None when off (or its acceptance length unknown)."""
        self._alpha = 0.0
        """Per-draft acceptance probability solved from the acceptance length, once."""
        if self.speculation is not None:
            assert self.speculation.mean_acceptance_length is not None
            self._alpha = acceptance_rate(
                self.speculation.num_speculative_tokens, self.speculation.mean_acceptance_length
            )
        self._seed = seed
        self._jitter = engine.step_jitter
        self._jitter_rng = random.Random(f"jitter:{seed}:{replica_id}")
        self._jitter_mean = sum(self._jitter) / len(self._jitter) if self._jitter else 1.0
        self._busy_peers = busy_peers
        self.spec_branches: Counter[str] = Counter()
        """Steps with decoding sequences, by what they did: `speculated`, or why not (`slower`, `no_budget`,
        `no_blocks`); empty without speculation."""
        self.num_spec_seq_steps = 0
        """Decoding sequences summed over speculative steps."""
        self.num_spec_tokens = 0
        """Tokens those emitted (accepted drafts and bonus tokens, capped by the outputs' ends)."""
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_rejected = 0
        self._is_waking = False
        """The next step starts an idle engine (`SimulatedEngineConfig.wake_s`)."""
        self.busy_s = 0.0
        """Seconds spent running steps."""

    # Gauges, as an engine exports them ----------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def is_idle(self) -> bool:
        return not self.running and not self.waiting

    # Driving --------------------------------------------------------------------------------------------------

    def can_hold(self, request: Request) -> bool:
        """Whether the whole request (prompt and output) fits in the KV cache at all. A request that does not is
        refused on arrival, as an engine refuses one longer than its max_model_len: admitted, it would preempt
        itself forever."""
        return -(-(request.prompt_tokens + request.output_tokens) // self.engine.block_size) <= self.cache.num_blocks

    def submit(self, seq: Seq) -> None:
        """A request arrives at the engine now."""
        if not self.can_hold(seq.request):
            self.num_rejected += 1
            if self._on_reject is not None:
                self._on_reject(seq)
            return
        self.waiting.append(seq)
        if not self.is_busy:
            self._is_waking = True
            self._start_step()
        elif self._run is not None:
            self._cut_run()

    def _start_step(self) -> None:
        if (
            not self.waiting
            and self.running
            and self.max_decode_steps_per_event > 1
            and self.speculation is None
            and self._start_run()
        ):
            return
        engine = self.engine
        bs = engine.block_size
        budget = engine.max_num_batched_tokens
        cache = self.cache
        running = self.running
        scheduled = self._scheduled
        prefill_tokens = 0
        decoding: list[Seq] = []
        decode_kv = 0
        kv_read = 0
        pairs = 0.0
        is_preempted = False
        num_new = 0
        num_sampling = 0  # sequences whose tokens this step computes to the end: each samples one

        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            computed = seq.num_computed
            remaining = seq.num_tokens - computed
            t = remaining if remaining < budget else budget
            need = -(-(computed + t) // bs) - seq.num_cached - seq.num_private
            if need > 0:
                is_self_preempted = False
                while not cache.allocate(need):
                    victim = running.pop()  # the most recently admitted; never one scheduled before `seq`
                    self._preempt(victim)
                    is_preempted = True
                    if victim is seq:
                        is_self_preempted = True
                        break
                if is_self_preempted:
                    break
                seq.num_private += need
            seq.num_scheduled = t
            scheduled.append(seq)
            budget -= t
            kv_read += computed
            if remaining == 1 and seq.num_output:
                decoding.append(seq)
                decode_kv += computed
            else:
                prefill_tokens += t
                pairs += t * (computed + (t + 1) / 2)
            if t == remaining:
                num_sampling += 1
            i += 1

        if not is_preempted:
            waiting = self.waiting
            max_seqs = engine.max_num_seqs
            is_caching = cache.is_caching
            while waiting and budget > 0 and len(running) < max_seqs:
                seq = waiting[0]
                num_tokens = seq.num_tokens
                hit = cache.match(seq.cache_hashes, (num_tokens - 1) // bs) if is_caching else 0
                computed = hit * bs
                remaining = num_tokens - computed
                t = remaining if remaining < budget else budget
                need = -(-(computed + t) // bs) - hit
                # The matched blocks that sit evictable stop being available once acquired.
                if need > cache.num_free and need > cache.num_available - cache.num_evictable_in(seq.cache_hashes, hit):
                    break
                cache.acquire(seq.cache_hashes, hit)
                cache.allocate(need)
                waiting.popleft()
                running.append(seq)
                seq.num_cached = hit
                seq.num_private = need
                seq.num_computed = computed
                if seq.hit_tokens is None:
                    seq.hit_tokens = computed
                    num_new += 1
                seq.num_scheduled = t
                scheduled.append(seq)
                budget -= t
                kv_read += computed
                prefill_tokens += t
                pairs += t * (computed + (t + 1) / 2)
                if t == remaining:
                    num_sampling += 1

        if not scheduled:
            self.is_busy = False
            return
        self.is_busy = True
        decode_seqs = len(decoding)
        duration_s = self.step_model.step_time_s(prefill_tokens, decode_seqs, kv_read, pairs)
        spec = self.speculation
        if spec is not None and decoding:
            spec_s = spec.step_time_s(self.step_model, prefill_tokens, decode_seqs, decode_kv, kv_read, pairs)
            branch = self._speculation_branch(decoding, budget, duration_s, spec_s)
            self.spec_branches[branch] += 1
            if branch == "speculated":
                duration_s = spec_s
        duration_s += (
            engine.request_overhead_s * num_new + engine.step_overhead_s + engine.output_overhead_s * num_sampling
        )
        if self._is_waking:
            self._is_waking = False
            duration_s += engine.wake_s
        if self._jitter:
            duration_s *= self._jitter_rng.choice(self._jitter)
        if engine.busy_peer_slowdown:
            duration_s *= 1.0 + engine.busy_peer_slowdown * self._busy_peers()
        self.busy_s += duration_s
        self.num_steps += 1
        self._version += 1
        self.sim.at(self.sim.now + duration_s, self._step_ended, self._version)

    def _speculation_branch(self, decoding: list[Seq], budget: int, plain_s: float, spec_s: float) -> str:
        """Whether the step just scheduled speculates for its decoding sequences (`speculated`: their blocks for
        k + 1 positions allocated, each marked `is_drafting`), or why not."""
        spec = self.speculation
        assert spec is not None
        k = spec.num_speculative_tokens
        if spec.adaptive and not spec.is_faster(plain_s, spec_s):
            return "slower"
        if budget < k * len(decoding):
            return "no_budget"
        bs = self.engine.block_size
        needs = [-(-(seq.num_computed + 1 + k) // bs) - seq.num_cached - seq.num_private for seq in decoding]
        total = sum(need for need in needs if need > 0)
        if total and not self.cache.allocate(total):
            return "no_blocks"
        for seq, need in zip(decoding, needs, strict=True):
            if need > 0:
                seq.num_private += need
            seq.is_drafting = True
        return "speculated"

    def _speculated_tokens(self, seq: Seq) -> int:
        """Tokens a decoding sequence emits in a speculative step: 1 + the drafts accepted, capped by its output."""
        spec = self.speculation
        assert spec is not None
        if seq.rng is None:
            seq.rng = random.Random(f"speculation:{self._seed}:{seq.request.id}")
        emitted = 1 + accepted_drafts(seq.rng.random(), self._alpha, spec.num_speculative_tokens)
        left = seq.request.output_tokens - seq.num_output
        if emitted > left:
            emitted = left
        self.num_spec_seq_steps += 1
        self.num_spec_tokens += emitted
        return emitted

    # Decode runs: several decode-only steps as one event -----------------------------------------------------

    def _start_run(self) -> bool:
        """Start a run of decode-only steps up to the next finish; False when the next step is not one."""
        running = self.running
        num_steps = self.max_decode_steps_per_event
        kv_tokens = 0
        for seq in running:
            if seq.num_tokens - seq.num_computed != 1 or not seq.num_output:
                return False
            left = seq.request.output_tokens - seq.num_output
            if left < num_steps:
                num_steps = left
            kv_tokens += seq.num_computed
        n = len(running)
        if num_steps <= 1 or n > self.engine.max_num_batched_tokens:
            return False
        bs = self.engine.block_size
        needs = [-(-(seq.num_computed + num_steps) // bs) - seq.num_cached - seq.num_private for seq in running]
        total = sum(need for need in needs if need > 0)
        if total and not self.cache.allocate(total):
            return False
        for seq, need in zip(running, needs, strict=True):
            if need > 0:
                seq.num_private += need
        slowdown = self.engine.busy_peer_slowdown
        factor = self._jitter_mean * (1.0 + slowdown * self._busy_peers() if slowdown else 1.0)
        duration_s = self._run_s(num_steps, n, kv_tokens, factor)
        now = self.sim.now
        self._run = (now, num_steps, n, kv_tokens, factor)
        self.is_busy = True
        self.busy_s += duration_s
        self.num_steps += num_steps
        self._version += 1
        self.sim.at(now + duration_s, self._step_ended, self._version)
        return True

    def _run_s(self, num_steps: int, n: int, kv_tokens: int, factor: float) -> float:
        """Duration of the first `num_steps` decode steps of a run of `n` sequences holding `kv_tokens` of KV, times
        `factor`."""
        m = self.step_model
        e = self.engine
        per_step_s = m.step_s + e.step_overhead_s + (m.decode_s_per_seq + e.output_overhead_s) * n
        # Step j (0-based) reads kv_tokens + j * n tokens of KV: the sum over the steps in closed form.
        return factor * (
            num_steps * (per_step_s + m.kv_read_s_per_token * kv_tokens)
            + m.kv_read_s_per_token * n * num_steps * (num_steps - 1) / 2
        )

    def _cut_run(self) -> None:
        """A request arrived during a decode run: end the run at the boundary of the step in progress."""
        assert self._run is not None
        start_s, num_steps, n, kv_tokens, factor = self._run
        # The first step that ends at or after now: the run's end grows with its steps, so a bisection finds it.
        elapsed_s = self.sim.now - start_s
        done = 1 + bisect_left(range(1, num_steps), elapsed_s, key=lambda m: self._run_s(m, n, kv_tokens, factor))
        if done == num_steps:
            return
        end_s = self._run_s(done, n, kv_tokens, factor)
        full_s = self._run_s(num_steps, n, kv_tokens, factor)
        self.busy_s -= full_s - end_s
        self.num_steps -= num_steps - done
        self._run = (start_s, done, n, kv_tokens, factor)
        self._version += 1
        self.sim.at(max(self.sim.now, start_s + end_s), self._step_ended, self._version)

    def _step_ended(self, version: int) -> None:
        if version != self._version:
            return  # superseded by a cut
        if self._run is None:
            self._end_step()
            return
        num_steps = self._run[1]
        self._run = None
        for seq in self.running:
            seq.num_scheduled = num_steps
        self._scheduled = list(self.running)
        self._end_step(num_steps)

    def _end_step(self, decode_steps: int = 0) -> None:
        """Apply the step (or decode run of `decode_steps` steps) that just ended, and start the next."""
        bs = self.engine.block_size
        cache = self.cache
        is_caching = cache.is_caching
        emits = self._on_kv_events is not None
        stored: list[int] | None = [] if emits else None
        is_finished = False
        for seq in self._scheduled:
            # A drafting sequence computes its last token and the drafts it accepts, and emits as many tokens.
            emitted = 0
            if seq.is_drafting:
                seq.is_drafting = False
                emitted = self._speculated_tokens(seq)
            computed = seq.num_computed + (emitted or seq.num_scheduled)
            seq.num_computed = computed
            if is_caching:
                full = computed // bs
                hashes = seq.cache_hashes
                if full > len(hashes):
                    full = len(hashes)
                if full > seq.num_cached:
                    if stored is not None:
                        before = len(stored)
                        cache.commit(hashes, seq.num_cached, full, stored)
                        if len(stored) > before:
                            self._stored.append((seq, before, len(stored)))
                    else:
                        cache.commit(hashes, seq.num_cached, full)
                    seq.num_private -= full - seq.num_cached
                    seq.num_cached = full
            if decode_steps or emitted:
                seq.num_output += decode_steps or emitted
                seq.num_tokens += decode_steps or emitted
                if seq.num_output >= seq.request.output_tokens:
                    is_finished = True
            elif computed == seq.num_tokens:
                seq.num_output += 1
                seq.num_tokens += 1
                if seq.num_output == 1:
                    seq.first_token_s = self.sim.now
                    self._on_first_token(seq)
                if seq.num_output >= seq.request.output_tokens:
                    is_finished = True
        self._scheduled = []
        if emits:
            self._emit_events(stored or [])
        if is_finished:
            still: list[Seq] = []
            for seq in self.running:
                if seq.num_output >= seq.request.output_tokens:
                    cache.release(seq.cache_hashes, seq.num_cached, seq.num_private)
                    seq.num_cached = seq.num_private = 0
                    self._on_finish(seq)
                else:
                    still.append(seq)
            self.running = still
        self._start_step()

    def _preempt(self, seq: Seq) -> None:
        """Recompute preemption: release every block (cached ones stay cached) and requeue at the head."""
        self.cache.release(seq.cache_hashes, seq.num_cached, seq.num_private)
        seq.num_cached = seq.num_private = seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _emit_events(self, stored: list[int]) -> None:
        assert self._on_kv_events is not None
        events: list[KVEvent] = []
        removed = self.cache.take_removed()
        if removed:
            events.append(BlockRemoved(tuple(removed)))
        bs = self.engine.block_size
        for seq, first, last in self._stored:
            hashes = seq.cache_hashes
            indexes = stored[first:last]
            run_start = 0
            for k in range(1, len(indexes) + 1):  # one event per run of consecutive blocks
                if k == len(indexes) or indexes[k] != indexes[k - 1] + 1:
                    a, b = indexes[run_start], indexes[k - 1] + 1
                    tokens: list[int] = []
                    for block in range(a, b):
                        tokens.extend(seq.request.tokens.block_tokens(block))
                    parent = hashes[a - 1] if a > 0 else None
                    events.append(BlockStored(tuple(hashes[a:b]), parent, tuple(tokens), bs))
                    run_start = k
        self._stored = []
        if events:
            self._on_kv_events(self.id, events)
