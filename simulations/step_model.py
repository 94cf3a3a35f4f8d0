"""How long one engine step takes, and the engine presets that pair a step model with a KV cache size.

One step of a continuous-batching engine runs a chunk of prefill tokens and one token of every decoding sequence
in a single forward pass. Its duration is modelled as

    t = a + b * prefill_tokens + c * decode_seqs + d * kv_tokens_read + e * attention_pairs

- a (`step_s`): fixed cost of a step: reading the weights once (memory-bound decode), kernel launches, the
  scheduler, collectives under tensor parallelism.
- b (`prefill_s_per_token`): the linear FLOPs of one prompt token (~2 x active parameters), at prefill MFU.
- c (`decode_s_per_seq`): the extra cost of one more decoding sequence in the batch (its linear FLOPs, and for a
  MoE the experts it activates beyond those already read).
- d (`kv_read_s_per_token`): reading one token of KV cache: attention of a decoding sequence over its context,
  and of a prefill chunk over the prefix already cached (memory-bound view).
- e (`attention_s_per_token_pair`): causal attention FLOPs of prefill, per (query, key) pair: a chunk of t tokens
  after a prefix of p costs t * (p + (t + 1) / 2) pairs. The issue's four-term model leaves this out; it matters
  for long prompts (on the 70B preset it adds ~60% to a 64k-token prefill), so the presets state it and a fitted
  model may set it to 0.

Speculative decoding (`SpeculationConfig`): a drafter proposes k tokens per decoding sequence and the target
verifies the k + 1 positions in one pass. The k draft positions of a sequence are a prefill chunk of k after its
context, so a speculative step costs the plain step's terms plus, per decoding sequence, k verified positions
(`verify_s_per_token`, by default b) and their causal attention pairs (e), plus the drafter's own time
(`SpeculationConfig.step_time_s`, the one place of that formula). How many tokens a step emits is `speculation.py`'s.

Presets live in `simulations/presets/*.yaml`, each stating where its figures come from; `load_preset` reads one by
name or path. A `.json` path is a `shoal replica profile` file: real engine steps timed over a grid of batch
shapes, to which `fit_step_model` fits the coefficients (non-negative least squares on relative error, so 2 ms
decode steps weigh as much as 200 ms prefill steps), with the engine's own scheduler and cache settings. A
profile's optional `speculation` section (timed speculative decode steps) fits the speculation costs on top
(`fit_speculation`); acceptance cannot come from a profile of random prompts, so that preset's speculation stays
off until a scenario gives `mean_acceptance_length`.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, model_validator

from simulations.startup import StartupTime

PRESETS_DIR = Path(__file__).parent / "presets"


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class StepModel(_Model):
    """Coefficients of the step-time model (see the module docstring); all in seconds."""

    step_s: float = Field(ge=0.0)
    """a: seconds of every step, whatever it runs."""
    prefill_s_per_token: float = Field(ge=0.0)
    """b: seconds per prefill token (linear layers)."""
    decode_s_per_seq: float = Field(ge=0.0)
    """c: seconds per decoding sequence in the batch."""
    kv_read_s_per_token: float = Field(default=0.0, ge=0.0)
    """d: seconds per token of KV cache read by the step's attention."""
    attention_s_per_token_pair: float = Field(default=0.0, ge=0.0)
    """e: seconds per (query, key) pair of prefill attention."""

    def step_time_s(
        self, prefill_tokens: int, decode_seqs: int, kv_tokens_read: int = 0, attention_pairs: float = 0.0
    ) -> float:
        """Duration of one step running `prefill_tokens` prompt tokens and `decode_seqs` decoding sequences."""
        return (
            self.step_s
            + self.prefill_s_per_token * prefill_tokens
            + self.decode_s_per_seq * decode_seqs
            + self.kv_read_s_per_token * kv_tokens_read
            + self.attention_s_per_token_pair * attention_pairs
        )

    def scaled(self, factor: float) -> StepModel:
        """This model with every coefficient times `factor`: an engine `factor` times slower at every step."""
        return StepModel(**{name: value * factor for name, value in self.model_dump().items()})

    def prefill_tokens_per_s(self, chunk_tokens: int) -> float:
        """Throughput of back-to-back prefill chunks of `chunk_tokens` with no prefix and no decode, tokens/s: the
        figure a router's learned prefill rate converges to on an idle replica."""
        t = self.step_time_s(chunk_tokens, 0, 0, chunk_tokens * (chunk_tokens + 1) / 2)
        return chunk_tokens / t


class SimulatedEngineConfig(_Model):
    """The scheduler and KV cache of one simulated replica (vLLM V1-like)."""

    num_kv_blocks: int = Field(ge=1)
    """KV cache size in blocks of `block_size` tokens."""
    block_size: int = Field(default=16, ge=1)
    """Tokens per KV block; also the router's token block size, so the simulated engine and the router hash the
    same blocks (exact mode needs them equal). vLLM's and SGLang's default: 16."""
    max_num_seqs: int = Field(default=256, ge=1)
    """Most sequences running at once (vLLM `--max-num-seqs`, default 256)."""
    exports_max_num_seqs: bool = False
    """The engine's gauges carry `max_num_seqs`, as SGLang's (`sglang:max_running_requests`) and Shoal's replica's
    (`shoal_replica_max_num_seqs`) do, so the router knows its batch slots. Off by default: vLLM's metrics carry no
    limit, and the presets model vLLM."""
    max_num_batched_tokens: int = Field(default=8192, ge=1)
    """Token budget of one step, prefill chunks and decode tokens together (vLLM V1 `--max-num-batched-tokens`,
    8192 for the online server on datacenter GPUs)."""
    enable_prefix_caching: bool = True
    """Block-level prefix caching (vLLM's default in V1). Off: no prompt ever hits the cache."""
    request_overhead_s: float = Field(default=0.0, ge=0.0)
    """Engine seconds each request costs once, added to the step that schedules its first prefill chunk: the
    engine loop's per-request work (input processing, block allocation, sampler and detokeniser state), serial
    with the steps, so a step admitting k new requests lasts k times this longer and a queue of short requests
    costs this much each. On an idle replica TTFT grows by exactly this. Tokenisation in a separate API-server
    process overlaps the engine and is not this. 0 (the default): not modelled, as in the presets."""
    step_overhead_s: float = Field(default=0.0, ge=0.0)
    """Engine seconds between two steps, whatever they run: the serving loop's own turn (handing the step to and
    from the engine's thread, routing its outputs), serial with the steps. `shoal replica profile` times
    `LLMEngine.step()` alone and leaves it out. 0 (the default): not modelled, as in the presets."""
    output_overhead_s: float = Field(default=0.0, ge=0.0)
    """Engine seconds per sequence that samples in a step (a decode, or the end of a prefill): writing its new
    token to the client (detokenising, encoding, streaming), serial with the steps on an engine whose server
    shares its process and core. 0 (the default): not modelled, as in the presets."""
    wake_s: float = Field(default=0.0, ge=0.0)
    """Seconds added to the first step after the engine was idle: its threads and the CPU waking (a sleeping worker
    thread, cold caches, a clock that slowed down), which a profile of back-to-back steps never sees. At a low load
    most first tokens come from such a step. 0 (the default): not modelled, as in the presets."""
    step_jitter: list[PositiveFloat] = Field(default_factory=list)
    """Factors by which a step's duration varies on the live stack, the same work timed again and again (scheduling,
    caches, the GIL between the engine's thread and its server): each step's time is multiplied by one of them,
    drawn at random from the replica's own seeded generator; a run of decode steps (`max_decode_steps_per_event`)
    by their mean. `benchmarks/sim_vs_live.py` measures them on the idle stack. Empty (the default): none."""
    busy_peer_slowdown: float = Field(default=0.0, ge=0.0)
    """How much longer a step lasts, as a fraction, for each other replica of the fleet that is mid-step when it
    starts: replicas that share one machine's CPUs with each other and with the router (`shoal up` on a small
    host), where the serving path of one replica's requests waits for cores the other replica's work holds.
    `benchmarks/sim_vs_live.py` measures it. 0 (the default): replicas on machines of their own."""
    startup_s: StartupTime = 0.0
    """Seconds from a replica's creation to its first request (image pull, weights load, CUDA graphs), or a
    distribution of them (`simulations.startup`); applies to replicas added while the simulation runs, not to
    the initial fleet."""


class SpeculationConfig(_Model):
    """Speculative decoding on a replica: what a speculative step costs (`step_time_s`), how many tokens it emits on
    average, and whether a step speculates only when that is faster."""

    num_speculative_tokens: int = Field(ge=1)
    """k: draft tokens proposed per decoding sequence in a speculative step; the target verifies k + 1 positions.
    No default: it is the deployment's choice (vLLM's `num_speculative_tokens`), and the acceptance length is
    only meaningful for a given k."""
    mean_acceptance_length: float | None = Field(default=None, ge=1.0)
    """tau: tokens a decoding sequence emits per speculative step on average, the bonus token included, so in
    [1, k + 1]; vLLM's metrics give it as 1 + accepted / drafts. None (the default): unknown, and no step
    speculates. It depends on the traffic and the drafter, so a profile of random prompts cannot measure it: a
    preset fitted from one leaves it None for a scenario (or `--acceptance-length`) to give."""
    verify_s_per_token: float | None = Field(default=None, ge=0.0)
    """Seconds per extra verified position (k per decoding sequence). None (the default): the step model's
    `prefill_s_per_token`, since the draft positions run through the target like a prefill chunk."""
    draft_step_s: float = Field(ge=0.0)
    """Seconds the drafter adds to a speculative step whatever its batch (its weights read once per draft position
    for an autoregressive drafter, once for a block drafter; launches). No default: it is the drafter's own."""
    draft_s_per_seq: float = Field(ge=0.0)
    """Seconds the drafter adds per decoding sequence of a speculative step (the FLOPs and KV of its k drafts). No
    default, as `draft_step_s`."""
    adaptive: bool = True
    """A step speculates only when it is expected to emit tokens faster: D * tau / t_spec > D / t_plain, t_plain
    being the same step without speculation. On by default: without it, speculation slows the steps where
    verifying and drafting cost more than acceptance saves, and it is the comparison the bundled replica's
    speculative decoding (to come) is to make. Off: every step with decoding sequences speculates when its token
    budget and KV blocks allow."""

    @model_validator(mode="after")
    def _tau_within_k(self) -> SpeculationConfig:
        tau, k = self.mean_acceptance_length, self.num_speculative_tokens
        if tau is not None and tau > k + 1:
            raise ValueError(f"mean_acceptance_length {tau} exceeds k + 1 = {k + 1}, the most a step can emit")
        return self

    @property
    def is_enabled(self) -> bool:
        """Whether steps may speculate: the acceptance length is known."""
        return self.mean_acceptance_length is not None

    def step_time_s(
        self,
        model: StepModel,
        prefill_tokens: int,
        decode_seqs: int,
        decode_context_tokens: int,
        kv_tokens_read: int = 0,
        attention_pairs: float = 0.0,
    ) -> float:
        """Duration of a step that speculates for its D = `decode_seqs` decoding sequences, whose computed tokens
        sum to C = `decode_context_tokens`:

            t = model.step_time_s(prefill_tokens, D, kv_tokens_read, attention_pairs + k (C + D) + D k (k + 1) / 2)
                + v k D + draft_step_s + draft_s_per_seq D

        A sequence's k drafts are a prefill chunk of k after its context and its last sampled token (c + 1
        tokens), hence k (c + 1) + k (k + 1) / 2 attention pairs each; their KV reads are the decode position's,
        already counted. v is `verify_s_per_token`, or the model's `prefill_s_per_token`."""
        k = self.num_speculative_tokens
        v = model.prefill_s_per_token if self.verify_s_per_token is None else self.verify_s_per_token
        draft_pairs = k * (decode_context_tokens + decode_seqs) + decode_seqs * k * (k + 1) / 2
        return (
            model.step_time_s(prefill_tokens, decode_seqs, kv_tokens_read, attention_pairs + draft_pairs)
            + v * k * decode_seqs
            + self.draft_step_s
            + self.draft_s_per_seq * decode_seqs
        )

    def is_faster(self, plain_step_s: float, speculative_step_s: float) -> bool:
        """The adaptive rule: D * tau / t_spec > D / t_plain, i.e. tau * t_plain > t_spec (D cancels)."""
        assert self.mean_acceptance_length is not None
        return self.mean_acceptance_length * plain_step_s > speculative_step_s


class Preset(_Model):
    """A named engine: its step model, its KV cache and scheduler, and where the figures come from."""

    name: str
    description: str
    sources: list[str]
    """Where each figure comes from, and which ones are estimates."""
    step_model: StepModel
    engine: SimulatedEngineConfig
    speculation: SpeculationConfig | None = None
    """Speculative decoding, when the engine runs it. None (the default): plain decoding, as the bundled presets
    describe engines without a drafter; a scenario's `fleet.speculation` sets or overrides it."""


def load_preset(name_or_path: str) -> Preset:
    """A preset by name (a file in `simulations/presets/` without its suffix: `.yaml`, else a profile's `.json`)
    or by path: YAML, or the JSON that `shoal replica profile` writes (fitted here)."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PRESETS_DIR / f"{name_or_path}.yaml"
        if not path.is_file() and (PRESETS_DIR / f"{name_or_path}.json").is_file():
            path = PRESETS_DIR / f"{name_or_path}.json"
    if path.suffix == ".json":
        return preset_from_profile(path)
    with path.open() as f:
        return Preset.model_validate(yaml.safe_load(f))


# ---- Fitting a step model to `shoal replica profile` output -------------------------------------------------------

PROFILE_KIND = "shoal-replica-profile"
"""The `kind` that `replica/profile.py` writes (the same constant there: the layer contracts keep the simulator from
importing the replica, so the file format is the contract)."""
_FEATURES = ("prefill_tokens", "decode_seqs", "kv_tokens_read", "attention_pairs")


class FitReport(_Model):
    """How well a fitted step model reproduces the profile it was fitted to."""

    num_samples: int
    median_abs_rel_error: float
    """Median over samples of |predicted - measured| / measured."""
    max_abs_rel_error: float
    by_kind: dict[str, float]
    """Median |relative error| per sample kind (prefill, decode, mixed)."""


def fit_step_model(samples: Sequence[dict[str, Any]]) -> tuple[StepModel, FitReport]:
    """Non-negative least squares of `step_s` on (1, prefill tokens, decode sequences, KV tokens read, attention
    pairs), each row divided by its measured time so that the fit minimises relative error."""
    if len(samples) < 5:
        raise ValueError(f"a step model has 5 coefficients; the profile has only {len(samples)} samples")
    rows: list[list[float]] = []
    targets: list[float] = []
    for i, sample in enumerate(samples):
        try:
            t = float(sample["step_s"])
            features = [1.0] + [float(sample[name]) for name in _FEATURES]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"profile sample {i} lacks a numeric {exc}") from exc
        if not (t > 0 and math.isfinite(t)):
            raise ValueError(f"profile sample {i} has step_s {t}; it must be a positive number of seconds")
        rows.append([x / t for x in features])
        targets.append(1.0)
    coefficients = _nnls(rows, targets)
    model = StepModel(
        step_s=coefficients[0],
        prefill_s_per_token=coefficients[1],
        decode_s_per_seq=coefficients[2],
        kv_read_s_per_token=coefficients[3],
        attention_s_per_token_pair=coefficients[4],
    )
    errors: dict[str, list[float]] = {}
    for sample in samples:
        predicted = model.step_time_s(*(sample[name] for name in _FEATURES))
        errors.setdefault(str(sample.get("kind", "step")), []).append(abs(predicted / sample["step_s"] - 1.0))
    every = [e for es in errors.values() for e in es]
    report = FitReport(
        num_samples=len(samples),
        median_abs_rel_error=statistics.median(every),
        max_abs_rel_error=max(every),
        by_kind={kind: statistics.median(es) for kind, es in sorted(errors.items())},
    )
    return model, report


def _nnls(rows: list[list[float]], targets: list[float]) -> list[float]:
    """min ||A x - y|| subject to x >= 0 (`scipy.optimize.nnls`). Columns are scaled to unit norm first, so
    coefficients of very different magnitudes (seconds per step, per token, per token pair) come out alike."""
    import numpy as np
    from scipy.optimize import nnls

    a = np.asarray(rows, dtype=float)  # [samples, coefficients]
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0.0] = 1.0
    x, _ = nnls(a / norms, np.asarray(targets, dtype=float))
    return [float(v) for v in x / norms]


def fit_speculation(section: dict[str, Any], model: StepModel) -> tuple[SpeculationConfig, FitReport]:
    """The speculation costs of a profile's `speculation` section: `num_speculative_tokens` k and samples of timed
    speculative decode steps (`decode_seqs` D sequences of `context_tokens` L each verifying k drafts, drafting
    included, `kv_tokens_read`, `step_s`). The residual t - t_plain, t_plain being the fitted `model`'s time for
    the same step with the drafts' attention pairs (`SpeculationConfig.step_time_s` with no other cost), is fitted
    by non-negative least squares on (k D, 1, D) for `verify_s_per_token`, `draft_step_s` and `draft_s_per_seq`,
    each row divided by t as in `fit_step_model`.

    k D and D are proportional when every sample has the same k, so the two per-sequence costs separate only if
    samples time two k or more (a sample's own `num_speculative_tokens`, default the section's). With one k the
    fit is of (1, D), and the per-sequence cost goes to verification at the prefill rate (`verify_s_per_token`'s
    default), the rest to the drafter: any split predicts the same steps at that k. The acceptance length stays
    None: random prompts say nothing of it."""
    try:
        k = int(section["num_speculative_tokens"])
        samples = section["samples"]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"the profile's speculation section lacks {exc}") from exc
    if len(samples) < 3:
        raise ValueError(f"speculation has 3 coefficients; the profile has only {len(samples)} speculative samples")
    shapes: list[tuple[SpeculationConfig, int, int, int, float]] = []
    for i, sample in enumerate(samples):
        try:
            k_i = int(sample.get("num_speculative_tokens", k))
            d, length, kv = (int(sample[name]) for name in ("decode_seqs", "context_tokens", "kv_tokens_read"))
            t = float(sample["step_s"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"speculative sample {i} lacks a numeric {exc}") from exc
        if not (t > 0 and math.isfinite(t)):
            raise ValueError(f"speculative sample {i} has step_s {t}; it must be a positive number of seconds")
        free = SpeculationConfig(
            num_speculative_tokens=k_i, verify_s_per_token=0.0, draft_step_s=0.0, draft_s_per_seq=0.0
        )
        shapes.append((free, d, length, kv, t))
    targets = [(t - free.step_time_s(model, 0, d, d * length, kv)) / t for free, d, length, kv, t in shapes]
    if len({free.num_speculative_tokens for free, *_ in shapes}) > 1:
        rows = [[free.num_speculative_tokens * d / t, 1.0 / t, d / t] for free, d, _, _, t in shapes]
        verify, fixed, per_seq = _nnls(rows, targets)
    else:
        fixed, both = _nnls([[1.0 / t, d / t] for _, d, _, _, t in shapes], targets)
        verify = min(model.prefill_s_per_token, both / k)
        per_seq = max(0.0, both - verify * k)
    costs = {"verify_s_per_token": verify, "draft_step_s": fixed, "draft_s_per_seq": per_seq}
    errors = [
        abs(free.model_copy(update=costs).step_time_s(model, 0, d, d * length, kv) / t - 1.0)
        for free, d, length, kv, t in shapes
    ]
    report = FitReport(
        num_samples=len(shapes),
        median_abs_rel_error=statistics.median(errors),
        max_abs_rel_error=max(errors),
        by_kind={"speculative": statistics.median(errors)},
    )
    return SpeculationConfig(num_speculative_tokens=k, **costs), report


def preset_from_profile(path: Path) -> Preset:
    """A preset whose step model is fitted to a `shoal replica profile` file and whose engine is the profiled
    one (its KV blocks, batch limits and block size), exporting its batch limit as Shoal's replica does."""
    try:
        document = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(document, dict) or document.get("kind") != PROFILE_KIND:
        raise ValueError(f"{path}: not a `shoal replica profile` file (no kind: {PROFILE_KIND})")
    model, report = fit_step_model(document["samples"])
    engine = document["engine"]
    description = (
        f"{document.get('model')} on {document.get('device')} ({document.get('dtype')}, "
        f"{document.get('threads')} threads), fitted to {report.num_samples} timed steps: median error "
        f"{report.median_abs_rel_error:.1%}, worst {report.max_abs_rel_error:.1%}"
    )
    speculation = None
    if document.get("speculation") is not None:
        section = document["speculation"]
        speculation, spec_report = fit_speculation(section, model)
        description += (
            f"; speculation (k {speculation.num_speculative_tokens}, {section.get('drafter')} drafter) fitted to "
            f"{spec_report.num_samples} timed steps: median error {spec_report.median_abs_rel_error:.1%}, off until "
            "a mean acceptance length is given"
        )
    return Preset(
        name=f"profile:{path.stem}",
        description=description,
        sources=[f"{path} (shoal replica profile, {document.get('created')})"],
        step_model=model,
        speculation=speculation,
        engine=SimulatedEngineConfig(
            num_kv_blocks=engine["num_blocks"],
            block_size=engine["block_size"],
            max_num_seqs=engine["max_num_seqs"],
            max_num_batched_tokens=engine["max_num_batched_tokens"],
            enable_prefix_caching=engine.get("enable_prefix_caching", True),
            exports_max_num_seqs=True,
        ),
    )
