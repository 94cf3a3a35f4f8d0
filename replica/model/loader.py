"""Checkpoints: Hugging Face Qwen3-MoE, Qwen2-MoE and Mixtral safetensors in, the same layouts out.

A Shoal checkpoint folder is `config.json` + `*.safetensors` + `tokenizer.json` with Hugging Face key names, so a
Qwen3-MoE, Qwen2-MoE or Mixtral folder from the hub or from transformers' `save_pretrained` loads the same way
(`ModelConfig.from_hf` says which configs, and refuses DeepSeek-V2/V3: multi-head latent attention is not
implemented). Loading builds the model on the `meta` device (no memory), materialises it empty on the target device,
then copies each tensor once. Routed experts load from either per-expert keys (`mlp.experts.{e}.gate_proj.weight`
..., Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2.weight`) or transformers' stacked ones
(`mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`) into the stacked expert tensors; the projections
that run as one matmul load into their rows of it (`self_attn.q_proj`, `k_proj`, `v_proj`, weights and biases, into
`self_attn.qkv_proj`; the shared expert's `gate_proj`, `up_proj` into `gate_up_proj`). Saving splits them back
into the per-expert layout of the architecture the model is (`ModelConfig.hf_model_type`), as `save_pretrained`
writes it. Every parameter must be covered and every key used, else the error names them: a silent partial load
serves garbage.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from replica.model.config import ModelConfig
from replica.model.model import MoEForCausalLM
from replica.model.moe import TopKRouter

_EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_RENAMES = (
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),  # Mixtral names
    (re.compile(r"(\.mlp\.experts\.\d+)\.w1\."), r"\1.gate_proj."),
    (re.compile(r"(\.mlp\.experts\.\d+)\.w3\."), r"\1.up_proj."),
    (re.compile(r"(\.mlp\.experts\.\d+)\.w2\."), r"\1.down_proj."),
    (re.compile(r"\.mlp\.experts\.gate_up_proj$"), ".mlp.experts.gate_up"),  # transformers' stacked experts
    (re.compile(r"\.mlp\.experts\.down_proj$"), ".mlp.experts.down"),
    (re.compile(r"\.mlp\.shared_experts\."), ".mlp.shared_expert."),  # DeepSeek names
    (re.compile(r"\.mlp\.gate\.e_score_correction_bias$"), ".mlp.gate.bias"),
)
_MIXTRAL_NAMES = (
    (re.compile(r"\.mlp\."), ".block_sparse_moe."),
    (re.compile(r"\.gate_proj\.weight$"), ".w1.weight"),
    (re.compile(r"\.up_proj\.weight$"), ".w3.weight"),
    (re.compile(r"\.down_proj\.weight$"), ".w2.weight"),
)
"""Qwen names -> Mixtral's on the hub (and in what vLLM and `save_pretrained` read and write)."""
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
_FUSED_KEY = re.compile(r"^(.*\.(?:self_attn|shared_expert))\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")


def _fused_rows(config: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """HF projection -> (our fused projection, first row, end row) in the fused weight, rows in HF order."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    shared = config.shared_expert_intermediate_size
    return {
        "q_proj": ("qkv_proj", 0, q),
        "k_proj": ("qkv_proj", q, q + kv),
        "v_proj": ("qkv_proj", q + kv, q + 2 * kv),
        "gate_proj": ("gate_up_proj", 0, shared),
        "up_proj": ("gate_up_proj", shared, 2 * shared),
    }


class CheckpointError(ValueError):
    """A checkpoint that does not match the model its config describes."""


def _target(key: str) -> tuple[str, int | None, str | None]:
    """HF key -> (our parameter name, expert index, projection) for routed experts, else (renamed key, None, None)."""
    for pattern, replacement in _RENAMES:
        key = pattern.sub(replacement, key)
    m = _EXPERT_KEY.match(key)
    if m:
        prefix, expert, proj = m.groups()
        name = f"{prefix}.experts.{'down' if proj == 'down_proj' else 'gate_up'}"
        return name, int(expert), proj
    return key, None, None


class _SkipInitDraws(TorchFunctionMode):
    """Leaves undone the `torch.nn.init` draws that module constructors make (`nn.Linear`, `nn.Embedding`): the
    checkpoint's tensors replace them. On the meta device a draw runs through torch's Python reference kernels, which
    import torch._dynamo: about 1.2 s of every replica's start, and triton, whose bindings print some 30 lines of
    "nanobind: leaked" when the process exits."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init" and func.__name__.endswith("_"):
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> MoEForCausalLM:
    """Build the model of `path/config.json` and load `path/*.safetensors` into it, for serving: on the CPU the
    routed experts in their serving layout (`MoEForCausalLM.use_serving_layout`)."""
    from safetensors import safe_open

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder} has no config.json")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no *.safetensors files")
    config = ModelConfig.from_file(folder / "config.json")
    with torch.device("meta"), _SkipInitDraws():
        model = MoEForCausalLM(config, dtype=dtype, device="meta")
    model.to_empty(device=device)
    model.init_rope(device)
    params = dict(model.state_dict(keep_vars=True))  # parameters and persistent buffers
    intermediate = config.moe_intermediate_size
    fused_rows = _fused_rows(config)
    filled: dict[str, int] = {}
    unexpected: list[str] = []
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if _IGNORED.search(key):
                        continue
                    name, expert, proj = _target(key)
                    if config.tie_word_embeddings and name == "lm_head.weight":
                        continue
                    rows = None
                    fused = _FUSED_KEY.match(name)
                    if fused:
                        fused_name, start, end = fused_rows[fused.group(2)]
                        name, rows = f"{fused.group(1)}.{fused_name}.{fused.group(3)}", slice(start, end)
                    target = params.get(name)
                    if target is None:
                        unexpected.append(key)
                        continue
                    tensor = f.get_tensor(key)
                    if rows is not None:
                        target = target[rows]
                    if expert is not None:
                        if proj == "gate_proj":
                            target = target[expert, :intermediate]
                        elif proj == "up_proj":
                            target = target[expert, intermediate:]
                        else:
                            target = target[expert]
                    if tuple(tensor.shape) != tuple(target.shape):
                        raise CheckpointError(
                            f"{key}: shape {tuple(tensor.shape)}, model expects {tuple(target.shape)}"
                        )
                    target.copy_(tensor.to(target.dtype))
                    filled[name] = filled.get(name, 0) + target.numel()
    if unexpected:
        raise CheckpointError(f"{len(unexpected)} checkpoint keys fit no parameter, e.g. {unexpected[:5]}")
    model.tie_weights()
    skip = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = [n for n, p in params.items() if n not in skip and filled.get(n, 0) != p.numel()]
    if missing:
        raise CheckpointError(f"checkpoint leaves {len(missing)} parameters unset, e.g. {missing[:5]}")
    if model.device.type == "cpu":  # measured on the CPU; GPUs multiply either layout through cuBLAS
        model.use_serving_layout()
    return model.eval()


def state_dict_hf(model: MoEForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face's Qwen-MoE key names: fused projections split, routed experts per
    expert (`save_checkpoint` renames them for a Mixtral)."""
    out: dict[str, torch.Tensor] = {}
    intermediate = model.config.moe_intermediate_size
    fused_rows = _fused_rows(model.config)
    for name, tensor in model.state_dict().items():
        if name.endswith((".qkv_proj.weight", ".qkv_proj.bias", ".gate_up_proj.weight")):
            prefix, fused_name, kind = name.rsplit(".", 2)
            for proj, (target, start, end) in fused_rows.items():
                if target == fused_name:
                    out[f"{prefix}.{proj}.{kind}"] = tensor[start:end].contiguous()
        elif name.endswith(".experts.gate_up"):
            prefix = name.removesuffix(".gate_up")
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = tensor[e, :intermediate].contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = tensor[e, intermediate:].contiguous()
        elif name.endswith(".experts.down"):
            prefix = name.removesuffix(".down")
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e].contiguous()
        elif name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        else:
            out[name] = tensor.contiguous()
    return out


def save_checkpoint(model: MoEForCausalLM, path: str | Path, *, dtype: torch.dtype | None = None) -> None:
    """Write `config.json` and `model.safetensors`, in `dtype` if given (the tokenizer is the caller's to add).
    ConfigError, before anything is written, for a model no Hugging Face architecture describes."""
    from safetensors.torch import save_file

    config = model.config.to_hf(dtype=str(dtype or model.dtype).removeprefix("torch."))
    state = {k: v if dtype is None else v.to(dtype) for k, v in state_dict_hf(model).items()}
    if config["model_type"] == "mixtral":
        for pattern, replacement in _MIXTRAL_NAMES:
            state = {pattern.sub(replacement, k): v for k, v in state.items()}
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def init_weights(model: MoEForCausalLM, *, seed: int, std: float = 0.02) -> None:
    """Random initialisation for training: normal(0, std) matrices, ones for norms, zero router bias."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * std
                param.copy_(values.to(param.dtype))
        for module in model.modules():
            if isinstance(module, TopKRouter) and module.bias is not None:
                module.bias.zero_()
    model.tie_weights()
