"""`ReplicaSettings`: every knob of `shoal replica`, from flags, `SHOAL_REPLICA_*` environment variables (nested with
`__`) and a YAML file (`--config` / `SHOAL_REPLICA_CONFIG_FILE`), in that order of precedence.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from router.common.command_settings import CommandSettings

Quantization = Literal["none", "nvfp4", "nvfp4-w4a4"]


if TYPE_CHECKING:
    from replica.engine.engine import EngineConfig


def parse_cpus(text: str) -> list[int]:
    """A CPU list as `taskset -c` and cgroups write it ("0-3", "0,2,5-7") -> its cores, in increasing order; `all`:
    every core this process may run on (its affinity)."""
    if text.strip() == "all":
        return sorted(os.sched_getaffinity(0))
    cores: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"cpus must be `all` or a list like 0-3 or 0,2,4-7, got {text!r}")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"cpus: the range {part.strip()} runs backwards")
        cores.update(range(low, high + 1))
    return sorted(cores)


class ReplicaSettings(CommandSettings):
    model_config = SettingsConfigDict(
        env_prefix="SHOAL_REPLICA_", env_nested_delimiter="__", extra="forbid", use_attribute_docstrings=True
    )

    model: str = "demo"
    """Checkpoint folder (config.json, *.safetensors, tokenizer.json), or `demo` for the bundled demo model, which
    is built into the cache directory on first use."""
    served_model_name: str | None = None
    """Model name in the API and in the block-hash namespace; default: `shoal-demo` or the folder's name."""
    host: str = "127.0.0.1"
    """Address to listen on. Loopback by default: exposing a replica is a decision, not an accident."""
    port: int = Field(8100, ge=0, le=65535)
    device: str = "cpu"
    """torch device: `cpu`, `cuda`, `cuda:1`."""
    cpus: str | None = None
    """CPU cores the replica has to itself, as `taskset -c` writes them (`0-3`, `0,2,4-7`), or `all`: every core the
    process may run on (a container given whole cores of its own, as Kubernetes' static CPU manager gives a
    Guaranteed pod: their numbers are not known in advance). It runs on them only,
    one torch thread per core (per rank under tensor parallelism: the cores split evenly), and idle threads spin
    briefly between operations instead of sleeping. For a pinned container or a host of its own; on 2 cores it
    made CPU decoding 1.3-2.3x faster (benchmarks/README.md). Unset: any core, threads that sleep when idle (safe where
    the cores are shared), and torch's thread count or `--threads`."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of attention, router and shared experts. float32 on CPUs (few have fast BF16); bfloat16 on GPUs."""
    quantization: Quantization = "none"
    """Routed experts: `none` (model dtype), `nvfp4` (weights NVFP4, activations in the model dtype: W4A16), or
    `nvfp4-w4a4` (activations also NVFP4, emulating Blackwell; needs `--activation-scales` from calibration)."""
    activation_scales: Path | None = None
    """JSON file written by `shoal replica calibrate`: per-expert activation global scales for W4A4."""
    block_size: int = Field(16, gt=0)
    """Tokens per KV block; equals the router's token block size (16), so KV events name blocks it can match."""
    num_blocks: int = Field(2048, gt=0)
    """KV cache blocks (x block_size tokens). The demo model needs 8 KiB per 16-token block at float32."""
    max_num_seqs: int = Field(32, gt=0)
    """Sequences decoded together in one step."""
    max_num_batched_tokens: int = Field(512, gt=0)
    """Tokens per step; longer prompts prefill in chunks of this, so decodes keep flowing."""
    max_model_len: int | None = Field(None, gt=1)
    """Prompt plus output tokens; default: the model's max_position_embeddings, capped by the cache."""
    max_waiting: int = Field(256, ge=0)
    """Requests queued beyond the running ones; more get 429 with Retry-After instead of waiting unboundedly."""
    max_tokens_default: int = Field(256, gt=0)
    """max_tokens of a request that sets none."""
    enable_prefix_caching: bool = True
    replica_id: str | None = None
    """Name in KV events; default host:port."""
    seed: int = 0
    """Seed for requests without a seed of their own."""
    drafter: str = "auto"
    """Speculative decoding's drafter: a folder written by `shoal replica train-drafter`, `none`, or `auto` (the
    default): the `drafter/` folder inside the model's checkpoint if it has one (the demo model does), else none."""
    num_speculative_tokens: int | None = Field(None, ge=0)
    """k: tokens the drafter proposes per sequence per step, at most; 0 turns speculation off. Default: the
    drafter's own: a block drafter's block size (one pass drafts that many anyway, and the adaptive k shrinks it
    where drafts are rejected), 4 for a dense drafter (each draft costs it a pass)."""
    adaptive_speculation: bool = True
    """Shrink k for sequences whose drafts are rarely accepted, and skip speculation for batch sizes where it is
    measured not to pay, so that speculation never makes a busy replica slower. Off: always k drafts."""
    capture_dir: Path | None = None
    """Record every request's prompt and output token ids here, as JSONL (`replica.capture`), for training a
    speculative drafter on the model's own ids. Off by default: capture is opt-in."""
    capture_text: Literal["none", "full"] = "none"
    """`full` also records prompt and output text and stop strings. `none` by default: token ids are what a drafter
    trains on; keeping text is for people inspecting traffic, and a privacy decision."""
    capture_file_max_bytes: int = Field(64 * 1024**2, gt=0)
    """Bytes after which a capture file is closed and the next one started (64 MiB: a few thousand long requests
    per file, small enough to copy or delete one at a time)."""
    capture_total_max_bytes: int = Field(1024**3, gt=0)
    """Bytes the capture files may take together, earlier runs' included; the oldest files are deleted to stay within
    it (1 GiB: a bounded share of a pod's disk)."""
    capture_queue_max_records: int = Field(4096, gt=0)
    """Records held in memory for the writer thread; more are dropped rather than slow a request or grow memory
    without bound (4096: a few seconds of a stalled disk at hundreds of requests per second; a waiting record holds
    its token ids, tens of bytes per token)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Ranks the model is sharded over (attention heads, expert and shared-expert hidden dimensions), one process
    each, on devices cuda:0..N-1 (or the CPU); rank 0 serves and decides every token. 1: no sharding."""
    tensor_parallel_timeout_s: float = Field(60.0, gt=0)
    """Seconds the ranks wait to form their group at start and for each all-reduce: a rank that hangs fails the
    step after this instead of stalling the replica (60: loading a large checkpoint on every rank takes a while)."""
    log_level: str = "INFO"
    config_file: Path | None = None
    """YAML file with any of these settings."""

    @model_validator(mode="after")
    def _check(self) -> ReplicaSettings:
        if self.quantization != "nvfp4-w4a4" and self.activation_scales is not None:
            raise ValueError("activation_scales only applies to quantization=nvfp4-w4a4")
        if self.quantization == "nvfp4-w4a4" and self.activation_scales is None:
            raise ValueError("quantization=nvfp4-w4a4 needs activation_scales (run `shoal replica calibrate`)")
        if self.capture_file_max_bytes > self.capture_total_max_bytes:
            raise ValueError("capture_file_max_bytes must not exceed capture_total_max_bytes")
        num_cores = len(parse_cpus(self.cpus)) if self.cpus is not None else 0
        if num_cores % self.tensor_parallel_size:
            raise ValueError(
                f"cpus: {num_cores} cores do not split evenly over {self.tensor_parallel_size} tensor-parallel ranks"
            )
        return self

    def with_cores_listed(self) -> ReplicaSettings:
        """These settings with `cpus: all` written out as this process's cores, for ranks that run elsewhere."""
        if self.cpus is None or self.cpus.strip() != "all":
            return self
        return self.model_copy(update={"cpus": ",".join(map(str, parse_cpus(self.cpus)))})

    def rank_cores(self, rank: int) -> list[int] | None:
        """The cores of tensor-parallel rank `rank` (consecutive, equal shares of `cpus`); None without `cpus`."""
        if self.cpus is None:
            return None
        cores = parse_cpus(self.cpus)
        share = len(cores) // self.tensor_parallel_size
        return cores[rank * share : (rank + 1) * share]

    def speculative_tokens(self, drafter_default: int) -> int:
        """k for a drafter whose own default is `drafter_default`."""
        return drafter_default if self.num_speculative_tokens is None else self.num_speculative_tokens

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return "shoal-demo" if self.model == "demo" else Path(self.model).resolve().name

    def engine_config(self, num_speculative_tokens: int = 0) -> EngineConfig:
        """The engine these settings describe, drafting `num_speculative_tokens` (`speculative_tokens`) (imported
        here: the settings load without torch)."""
        from replica.engine.engine import EngineConfig
        from router.policy.hashing import namespace_seed

        return EngineConfig(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            hash_seed=namespace_seed(self.model_name),
            seed=self.seed,
            num_speculative_tokens=num_speculative_tokens,
            adaptive_speculation=self.adaptive_speculation,
        )
