"""`shoal replica profile`: time the engine's steps over a grid of batch shapes and write them as JSON.

The simulator models a step as `t = a + b * prefill_tokens + c * decode_seqs + d * kv_tokens_read + e *
attention_pairs` (`simulations/step_model.py`) and fits those coefficients to this file, so that a simulated fleet
can be checked against the real engine. Every sample is one real `LLMEngine.step()` (scheduling, the forward pass,
sampling and prefix-cache bookkeeping, as served), timed with `time.perf_counter`, and carries the same four
features the simulator computes for a step:
- prefill: a chunk of `n` new tokens after a cached prefix of `p` tokens (the prefix is made cached by running it
  first, as a previous request would): `kv_tokens_read = p`, `attention_pairs = n * (p + (n + 1) / 2)`;
- decode: `B` sequences of context `L` decoding one token each: `kv_tokens_read` = the sum of their computed tokens;
- mixed: `B` decoding sequences plus one prefill chunk in the same step, to check that the costs add.
Each point is repeated and the median kept (the spread is written too), after warm-up steps that are not kept.

With a drafter (the settings' `drafter`, as `shoal replica` would load it), the decode points are timed again as
speculative steps, at k = the configured `num_speculative_tokens` and half of it, drafts verified and the next
ones proposed in each timed step: the file's `speculation` section, to which the simulator fits the cost of
verifying and drafting (two values of k separate the per-token from the per-sequence cost). Random prompts say
nothing about acceptance, so the section has no acceptance length.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch

from replica.engine.engine import LLMEngine
from replica.engine.sampling import SamplingParams

PROFILE_KIND = "shoal-replica-profile"
PROFILE_VERSION = 1


@dataclass(frozen=True)
class ProfileGrid:
    prefill_tokens: tuple[int, ...] = (16, 64, 128, 256, 512)
    """Prefill chunk sizes; capped by the engine's max_num_batched_tokens (one chunk per step)."""
    is_budget_chunk_timed: bool = True
    """The engine's own chunk budget (max_num_batched_tokens) is timed too, after each prefix: every chunk of a long
    prompt but its last is that size, and a fit that never saw one would extrapolate to it."""
    prefix_tokens: tuple[int, ...] = (0, 256, 1024)
    """Cached prefixes before each chunk; multiples of the block size, so the whole prefix is cached."""
    decode_seqs: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    """Decode batch sizes; capped by max_num_seqs and by the KV blocks the contexts need."""
    decode_context_tokens: tuple[int, ...] = (64, 512, 1024)
    mixed: tuple[tuple[int, int], ...] = ((4, 64), (4, 256), (16, 64), (16, 256))
    """(decoding sequences, prefill chunk) steps at `mixed_context_tokens`."""
    mixed_context_tokens: int = 256
    repeats: int = 5
    """Timed steps per point; the median is the sample."""
    warmup_steps: int = 3


@dataclass
class StepSample:
    kind: Literal["prefill", "decode", "mixed"]
    prefill_tokens: int
    decode_seqs: int
    kv_tokens_read: int
    attention_pairs: float
    step_s: float
    """Median of `step_s_all`."""
    step_s_all: list[float] = field(default_factory=list)


class Profiler:
    """Drives one engine through the grid. Prompts are random token ids, fresh for every request except cached
    prefixes, so nothing is cached by accident."""

    def __init__(self, engine: LLMEngine, *, seed: int = 0, progress: Callable[[str], None] | None = None) -> None:
        if not engine.config.enable_prefix_caching:
            raise ValueError("profiling needs prefix caching: a cached prefix is how prefill after a prefix is timed")
        self.engine = engine
        self.rng = random.Random(seed)
        self.progress = progress or (lambda _line: None)
        vocab = engine.model.config.vocab_size
        # Avoid the lowest ids (special tokens in Shoal's tokenizers); any id is a valid input to the model.
        self._low = min(16, vocab - 1)
        self._vocab = vocab

    # ---- helpers ----------------------------------------------------------------------------------------------

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self._low, self._vocab) for _ in range(n)]

    def _drain(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.engine.has_work:
                return
            self.engine.step()
        raise RuntimeError("the engine did not finish its requests")

    def _timed_step(self) -> float:
        start = time.perf_counter()
        self.engine.step()
        return time.perf_counter() - start

    def _cache_prefix(self, tokens: list[int]) -> None:
        self.engine.add_request(tokens + self._tokens(1), SamplingParams(max_tokens=1, temperature=0.0))
        self._drain()

    def _start_decoders(self, num_seqs: int, context_tokens: int, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for _ in range(num_seqs):
            self.engine.add_request(self._tokens(context_tokens), params)
        # Step until every sequence has its first token: from then on each step decodes all of them.
        for _ in range(100_000):
            running = self.engine.scheduler.running
            if (
                not self.engine.scheduler.waiting
                and len(running) == num_seqs
                and all(s.num_computed_tokens == s.num_tokens - 1 for s in running)
            ):
                return
            self.engine.step()
        raise RuntimeError("the decoding sequences never all started")

    def _decode_kv_read(self) -> int:
        return sum(s.num_computed_tokens for s in self.engine.scheduler.running)

    # ---- points -----------------------------------------------------------------------------------------------

    def prefill(self, chunk: int, prefix: int, repeats: int) -> StepSample:
        prefix_ids = self._tokens(prefix)
        if prefix:
            self._cache_prefix(prefix_ids)
        times = []
        for _ in range(repeats):
            self.engine.add_request(prefix_ids + self._tokens(chunk), SamplingParams(max_tokens=1, temperature=0.0))
            times.append(self._timed_step())
            self._drain()
        return _sample("prefill", chunk, 0, prefix, chunk * (prefix + (chunk + 1) / 2), times)

    def _startup_steps(self, num_seqs: int, context: int) -> int:
        """Steps until `num_seqs` prompts of `context` tokens are all decoding, at most: the first ones decode
        (and must not finish) while the last ones prefill."""
        return -(-num_seqs * context // self.engine.config.max_num_batched_tokens) + num_seqs + 1

    def decode(self, num_seqs: int, context: int, repeats: int, warmup: int) -> StepSample:
        startup = self._startup_steps(num_seqs, context)
        per_step = 1 + self.engine.config.num_speculative_tokens  # a speculative step emits up to k + 1 tokens
        self._start_decoders(num_seqs, context, max_tokens=(startup + warmup + repeats + 2) * per_step)
        for _ in range(warmup):
            self.engine.step()
        kv_reads, times = [], []
        for _ in range(repeats):
            kv_reads.append(self._decode_kv_read())
            times.append(self._timed_step())
        self._abort_all()
        return _sample("decode", 0, num_seqs, round(statistics.median(kv_reads)), 0.0, times)

    def mixed(self, num_seqs: int, chunk: int, context: int, repeats: int, warmup: int) -> StepSample:
        startup = self._startup_steps(num_seqs, context)
        self._start_decoders(num_seqs, context, max_tokens=startup + warmup + 2 * repeats + 2)
        for _ in range(warmup):
            self.engine.step()
        kv_reads, times = [], []
        for _ in range(repeats):
            kv_read = self._decode_kv_read()
            self.engine.add_request(self._tokens(chunk), SamplingParams(max_tokens=1, temperature=0.0))
            kv_reads.append(kv_read)
            times.append(self._timed_step())  # the prefill's one step, with every decoder's token
        self._abort_all()
        pairs = chunk * (chunk + 1) / 2
        return _sample("mixed", chunk, num_seqs, round(statistics.median(kv_reads)), pairs, times)

    def _abort_all(self) -> None:
        for seq in list(self.engine.scheduler.running) + list(self.engine.scheduler.waiting):
            self.engine.abort(seq.seq_id)
        self._drain()

    def speculative_decode(self, num_seqs: int, context: int, repeats: int, warmup: int) -> dict[str, Any]:
        """Steps of `num_seqs` decoding sequences that each verify k drafts and propose k more (the engine's k,
        adaptive speculation off so every step drafts k)."""
        sample = self.decode(num_seqs, context, repeats, warmup)
        return {
            "num_speculative_tokens": self.engine.config.num_speculative_tokens,
            "decode_seqs": num_seqs,
            "context_tokens": context,
            "kv_tokens_read": sample.kv_tokens_read,
            "step_s": sample.step_s,
            "step_s_all": sample.step_s_all,
        }

    def decode_points(self, grid: ProfileGrid) -> list[tuple[int, int]]:
        """(sequences, context) of the grid's decode points that fit this engine."""
        cfg = self.engine.config
        steps = grid.warmup_steps + 2 * grid.repeats + 4
        points = []
        for context in grid.decode_context_tokens:
            for seqs in grid.decode_seqs:
                tokens = context + (steps + self._startup_steps(seqs, context)) * (1 + cfg.num_speculative_tokens)
                blocks = seqs * (-(-tokens // cfg.block_size) + 1)
                if seqs <= cfg.max_num_seqs and tokens < self.engine.max_model_len and blocks <= cfg.num_blocks - 1:
                    points.append((seqs, context))
        return points

    def run(self, grid: ProfileGrid) -> list[StepSample]:
        cfg = self.engine.config
        max_len = self.engine.max_model_len
        points: list[tuple[str, Callable[[], StepSample]]] = []
        chunks = set(grid.prefill_tokens)
        if grid.is_budget_chunk_timed:
            chunks.add(cfg.max_num_batched_tokens)
        for prefix in grid.prefix_tokens:
            for chunk in sorted(chunks):
                if chunk <= cfg.max_num_batched_tokens and prefix + chunk < max_len:
                    points.append(
                        (f"prefill {chunk} after {prefix}", partial(self.prefill, chunk, prefix, grid.repeats))
                    )
        for seqs, context in self.decode_points(grid):
            points.append(
                (f"decode {seqs} x {context}", partial(self.decode, seqs, context, grid.repeats, grid.warmup_steps))
            )
        for seqs, chunk in grid.mixed:
            context = grid.mixed_context_tokens
            if seqs < cfg.max_num_seqs and chunk + seqs <= cfg.max_num_batched_tokens:
                points.append(
                    (
                        f"mixed {seqs} x {context} + {chunk}",
                        partial(self.mixed, seqs, chunk, context, grid.repeats, grid.warmup_steps),
                    )
                )
        self.engine.warm_up()  # the allocator and kernels, once, before anything is kept
        samples = []
        started = time.perf_counter()
        for i, (label, point) in enumerate(points, 1):
            sample = point()
            samples.append(sample)
            elapsed = time.perf_counter() - started
            self.progress(f"[{i}/{len(points)}] {label}: {sample.step_s * 1e3:.2f} ms ({elapsed:.0f} s)")
        return samples


def _sample(
    kind: Literal["prefill", "decode", "mixed"],
    prefill_tokens: int,
    decode_seqs: int,
    kv_tokens_read: int,
    attention_pairs: float,
    times: Iterable[float],
) -> StepSample:
    all_s = [round(t, 7) for t in times]
    median_s = statistics.median(all_s)
    return StepSample(kind, prefill_tokens, decode_seqs, kv_tokens_read, attention_pairs, median_s, all_s)


def profile_document(engine: LLMEngine, samples: list[StepSample], *, meta: dict[str, Any]) -> dict[str, Any]:
    """The JSON the simulator reads (`simulations.step_model.load_preset` with a `.json` path)."""
    cfg = engine.config
    return {
        "kind": PROFILE_KIND,
        "version": PROFILE_VERSION,
        **meta,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "engine": {
            "block_size": cfg.block_size,
            "num_blocks": cfg.num_blocks,
            "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "enable_prefix_caching": cfg.enable_prefix_caching,
        },
        "samples": [asdict(s) for s in samples],
    }


def run_profile(settings: Any, *, out: Path, grid: ProfileGrid, threads: int | None, seed: int = 0) -> dict[str, Any]:
    """Load the model `settings` (a ReplicaSettings) names, profile an engine configured as `shoal replica` would
    serve it, and write the JSON to `out`."""
    from replica.loading import load_for_serving

    if threads:
        torch.set_num_threads(threads)
    model, _tokenizer = load_for_serving(settings)
    from replica.drafters.checkpoint import default_num_speculative_tokens, drafter_runtime
    from replica.loading import checkpoint_dir, load_drafter_for_serving
    from replica.model.model import MoEForCausalLM

    assert isinstance(model, MoEForCausalLM)
    drafter = load_drafter_for_serving(settings, model, checkpoint_dir(settings))
    # Prefix caching on whatever the settings say: the grid times steps after cached prefixes.
    config = dataclasses.replace(settings.engine_config(), enable_prefix_caching=True)
    engine = LLMEngine(model, config)
    started = time.perf_counter()

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    samples = Profiler(engine, seed=seed, progress=progress).run(grid)
    speculation = None
    if drafter is not None:
        k_max = settings.speculative_tokens(default_num_speculative_tokens(drafter))
        spec_samples = []
        for k in sorted({max(1, k_max // 2), k_max}):
            spec_config = dataclasses.replace(config, num_speculative_tokens=k, adaptive_speculation=False)
            runtime = drafter_runtime(
                drafter,
                num_blocks=config.num_blocks,
                block_size=config.block_size,
                num_speculative_tokens=k,
            )
            profiler = Profiler(LLMEngine(model, spec_config, drafter=runtime), seed=seed, progress=progress)
            for seqs, context in profiler.decode_points(grid):
                spec_samples.append(profiler.speculative_decode(seqs, context, grid.repeats, grid.warmup_steps))
                progress(f"speculative decode k={k} {seqs} x {context}: {spec_samples[-1]['step_s'] * 1e3:.2f} ms")
        speculation = {
            "num_speculative_tokens": k_max,
            "drafter": "block" if drafter.__class__.__name__.startswith("Block") else "dense",
            "samples": spec_samples,
        }
    meta = {
        "model": settings.model_name,
        "device": settings.device,
        "dtype": settings.dtype,
        "quantization": settings.quantization,
        "profile_s": round(time.perf_counter() - started, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    document = profile_document(engine, samples, meta=meta)
    if speculation is not None:
        document["speculation"] = speculation
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(document, indent=1) + "\n")
    tmp.replace(out)
    return document
