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

Presets live in `simulations/presets/*.yaml`, each stating where its figures come from; `load_preset` reads one by
name or path.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

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

    def prefill_tokens_per_s(self, chunk_tokens: int) -> float:
        """Throughput of back-to-back prefill chunks of `chunk_tokens` with no prefix and no decode, tokens/s: the
        figure a router's learned prefill rate converges to on an idle replica."""
        t = self.step_time_s(chunk_tokens, 0, 0, chunk_tokens * (chunk_tokens + 1) / 2)
        return chunk_tokens / t


class EngineConfig(_Model):
    """The scheduler and KV cache of one simulated replica (vLLM V1-like)."""

    num_kv_blocks: int = Field(ge=1)
    """KV cache size in blocks of `block_size` tokens."""
    block_size: int = Field(default=16, ge=1)
    """Tokens per KV block; also the router's token block size, so the simulated engine and the router hash the
    same blocks (exact mode needs them equal). vLLM's and SGLang's default: 16."""
    max_num_seqs: int = Field(default=256, ge=1)
    """Most sequences running at once (vLLM `--max-num-seqs`, default 256)."""
    max_num_batched_tokens: int = Field(default=8192, ge=1)
    """Token budget of one step, prefill chunks and decode tokens together (vLLM V1 `--max-num-batched-tokens`,
    8192 for the online server on datacenter GPUs)."""
    enable_prefix_caching: bool = True
    """Block-level prefix caching (vLLM's default in V1). Off: no prompt ever hits the cache."""
    startup_s: float = Field(default=0.0, ge=0.0)
    """Seconds from a replica's creation to its first request (weights load, CUDA graphs); applies to replicas
    added while the simulation runs, not to the initial fleet."""


class Preset(_Model):
    """A named engine: its step model, its KV cache and scheduler, and where the figures come from."""

    name: str
    description: str
    sources: list[str]
    """Where each figure comes from, and which ones are estimates."""
    step_model: StepModel
    engine: EngineConfig


def load_preset(name_or_path: str) -> Preset:
    """A preset by name (a file in `simulations/presets/`, without `.yaml`) or by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PRESETS_DIR / f"{name_or_path}.yaml"
    with path.open() as f:
        return Preset.model_validate(yaml.safe_load(f))


def preset_names() -> list[str]:
    """The presets bundled in `simulations/presets/`."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))
