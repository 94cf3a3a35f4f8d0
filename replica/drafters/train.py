"""`shoal replica train-drafter`: a drafter distilled from the target on the token ids a replica captured.

Data: capture files (`shoal replica --capture-dir`), each record a prompt's and an output's ids exactly as served.
Records split by a hash of their request id into training and held-out (`heldout_fraction`), so the split is
stable as captures grow. A training step takes `batch_size` records; the target runs over each (prompt + output,
no cache, no gradient) for its distribution at every position and, for a block drafter, its feature layers'
outputs (recomputed from the ids, never stored). The drafter is fitted to the target's distributions on the
output positions (forward KL, which is what acceptance rewards): distillation on the target's own outputs.
- dense: its next-token distribution at every output position;
- block: `anchors_per_sequence` anchors drawn from the output; each anchor's block of K positions is fitted with
  the path head fed the true previous token, position j weighted `position_decay^(j-1)` (a late position matters
  only if every earlier one is accepted).
At the end: the held-out loss and per-position agreement with the target's argmax, and the mean acceptance length
of speculative decoding on held-out prompts run through the engine itself (greedy, and sampled at 0.7).

T = tokens, K = drafts per block, V = vocabulary.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch

from replica.capture import CaptureRecord, iter_captures
from replica.drafters.block import BlockDrafterConfig, BlockDrafterModel
from replica.drafters.checkpoint import DrafterModel
from replica.drafters.dense import DenseDrafterConfig, DenseDrafterModel
from replica.model.model import MoEForCausalLM

DrafterKind = Literal["dense", "block"]


@dataclass(frozen=True)
class DrafterRecipe:
    kind: DrafterKind = "block"
    block_size: int = 8
    """Block drafter: drafts per pass (the most `--num-speculative-tokens` it serves)."""
    num_layers: int | None = None
    """Drafter layers; default 2 for a block drafter, 1 for a dense one."""
    max_steps: int = 1200
    max_seconds: float = 1800.0
    """Training stops at max_steps or after this long, whichever comes first."""
    batch_size: int = 8
    """Records per step."""
    anchors_per_sequence: int = 32
    learning_rate: float = 3e-3
    position_decay: float = 0.9
    heldout_fraction: float = 0.1
    seed: int = 0
    eval_prompts: int = 48
    """Held-out prompts run through the engine for the acceptance length."""
    eval_max_tokens: int = 160


@dataclass(frozen=True)
class Example:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    temperature: float

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@dataclass
class TrainReport:
    num_train: int
    num_heldout: int
    steps: int = 0
    seconds: float = 0.0
    train_loss: float = math.nan
    heldout_loss: float = math.nan
    heldout_top1_by_position: list[float] = field(default_factory=list)
    acceptance_length: dict[str, float] = field(default_factory=dict)
    """Mean tokens per speculative step (1 + accepted / drafts) on held-out prompts, by 'greedy' / 'sampled'."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def is_heldout(request_id: str, fraction: float) -> bool:
    bucket = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "little") / 2**64
    return bucket < fraction


def load_examples(
    records: Iterable[CaptureRecord], *, max_len: int, heldout_fraction: float
) -> tuple[list[Example], list[Example]]:
    """-> (training, held-out) examples of the records that have output, truncated to `max_len` ids."""
    train: list[Example] = []
    heldout: list[Example] = []
    for r in records:
        if not r.output_token_ids or len(r.prompt_token_ids) >= max_len - 1:
            continue
        room = max_len - len(r.prompt_token_ids)
        temperature = float(r.params.get("temperature", 1.0))
        example = Example(r.request_id, list(r.prompt_token_ids), list(r.output_token_ids[:room]), temperature)
        (heldout if is_heldout(r.request_id, heldout_fraction) else train).append(example)
    return train, heldout


def load_capture_examples(
    capture_dir: Path, *, max_len: int, heldout_fraction: float
) -> tuple[list[Example], list[Example]]:
    return load_examples(iter_captures(capture_dir), max_len=max_len, heldout_fraction=heldout_fraction)


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """Three target layers spread over the depth, the last one included (all of them below four)."""
    if num_layers <= 3:
        return tuple(range(num_layers))
    return tuple(sorted({round(num_layers * f) - 1 for f in (0.5, 0.75, 1.0)}))


def new_drafter(target: MoEForCausalLM, recipe: DrafterRecipe) -> DrafterModel:
    """A freshly initialised drafter for `target` (a dense one starts from the target's embeddings and LM head)."""
    c = target.config
    gen = torch.Generator().manual_seed(recipe.seed)
    model: DrafterModel
    if recipe.kind == "block":
        model = BlockDrafterModel(
            BlockDrafterConfig(
                vocab_size=c.vocab_size,
                hidden_size=c.hidden_size,
                feature_layers=default_feature_layers(c.num_hidden_layers),
                block_size=recipe.block_size,
                num_hidden_layers=recipe.num_layers or 2,
                num_attention_heads=c.num_attention_heads,
                num_key_value_heads=c.num_key_value_heads,
                head_dim=c.head_dim,
                intermediate_size=2 * c.hidden_size,
                rope_theta=c.rope_theta,
                max_position_embeddings=c.max_position_embeddings,
            ),
            target,
            dtype=target.dtype,
            device=target.device,
        )
    else:
        model = DenseDrafterModel(
            DenseDrafterConfig(
                vocab_size=c.vocab_size,
                hidden_size=c.hidden_size,
                num_hidden_layers=recipe.num_layers or 1,
                num_attention_heads=c.num_attention_heads,
                num_key_value_heads=c.num_key_value_heads,
                head_dim=c.head_dim,
                intermediate_size=2 * c.hidden_size,
                rope_theta=c.rope_theta,
                max_position_embeddings=c.max_position_embeddings,
            ),
            dtype=target.dtype,
            device=target.device,
        )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name == "mask_embedding":
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
            else:
                param.copy_((torch.randn(param.shape, generator=gen) * 0.02).to(param.dtype))
        if isinstance(model, DenseDrafterModel):
            model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
            model.lm_head.weight.copy_(target.lm_head.weight)
    return model


def _pad(examples: Sequence[Example], device: torch.device) -> tuple[torch.Tensor, list[int], list[int]]:
    longest = max(len(e.ids) for e in examples)
    ids = torch.zeros(len(examples), longest, dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, : len(e.ids)] = torch.tensor(e.ids)
    return ids.to(device), [len(e.ids) for e in examples], [len(e.prompt_ids) for e in examples]


def _kl(target_logits: torch.Tensor, draft_scores: torch.Tensor) -> torch.Tensor:
    """Forward KL(p || q) per row, from logits [..., V]."""
    log_p = target_logits.float().log_softmax(-1)
    return (log_p.exp() * (log_p - draft_scores.float().log_softmax(-1))).sum(-1)


@dataclass
class _Losses:
    loss: torch.Tensor
    """Weighted mean KL over the batch."""
    agree: torch.Tensor
    """[K] top-1 agreements with the target per position (summed), for evaluation."""
    count: torch.Tensor
    """[K] positions counted."""


def block_losses(
    drafter: BlockDrafterModel,
    ids: torch.Tensor,
    lengths: list[int],
    prompt_lens: list[int],
    teacher_logits: torch.Tensor,
    features: torch.Tensor,
    *,
    anchors_per_sequence: int,
    position_decay: float,
    gen: torch.Generator,
) -> _Losses:
    k = drafter.config.block_size
    device = ids.device
    weights = position_decay ** torch.arange(k, device=device, dtype=torch.float32)  # [K]
    total = torch.zeros((), device=device)
    norm = torch.zeros((), device=device)
    agree = torch.zeros(k, device=device)
    count = torch.zeros(k, device=device)
    for b, (n, p) in enumerate(zip(lengths, prompt_lens, strict=True)):
        if n - 1 <= p:
            continue
        candidates = torch.arange(p, n - 1)
        if len(candidates) > anchors_per_sequence:
            candidates = candidates[torch.randperm(len(candidates), generator=gen)[:anchors_per_sequence]]
        anchors = candidates.to(device)  # [M]
        m = anchors.shape[0]
        positions = torch.arange(n, device=device)
        cos, sin = drafter.rotary(positions)
        context = drafter.context(features[b, :n])  # [n, H]
        context_kv = []
        for layer in drafter.block_layers:
            kc, vc = layer.context_kv(context, cos, sin)  # [n, Hkv, D]
            context_kv.append((kc.expand(m, *kc.shape), vc.expand(m, *vc.shape)))
        visible = positions.unsqueeze(0) < anchors.unsqueeze(-1)  # [M, n]: the target computed what precedes it
        mask = torch.zeros(visible.shape, device=device).masked_fill_(~visible, -torch.inf)[:, None, None, :]
        hidden, unary = drafter.block_forward(ids[b, anchors], anchors, context_kv, mask)  # [M, K, H], [M, K, V]
        # Block position j (1-based) predicts the token at anchor + j from the true token before it.
        offsets = torch.arange(k, device=device)
        rows = anchors.unsqueeze(-1) + offsets  # [M, K] row whose target distribution is position j's
        valid = rows < n - 1
        rows = rows.clamp(max=n - 2)
        previous = ids[b, rows]
        scores = drafter.path.scores(unary, drafter.path.proj(hidden), previous)  # [M, K, V]
        teacher = teacher_logits[b, rows]  # [M, K, V]
        kl = _kl(teacher, scores)
        w = weights * valid
        total = total + (kl * w).sum()
        norm = norm + w.sum()
        agree = agree + ((scores.argmax(-1) == teacher.argmax(-1)) & valid).sum(0)
        count = count + valid.sum(0)
    return _Losses(total / norm.clamp_min(1e-9), agree, count)


def dense_losses(
    drafter: DenseDrafterModel, ids: torch.Tensor, lengths: list[int], prompt_lens: list[int], teacher: torch.Tensor
) -> _Losses:
    logits = drafter.forward_train(ids)  # [B, T, V]
    positions = torch.arange(ids.shape[1], device=ids.device)
    # Rows p-1 .. n-2 predict the output tokens.
    starts = torch.tensor([p - 1 for p in prompt_lens], device=ids.device).unsqueeze(-1)
    ends = torch.tensor([n - 1 for n in lengths], device=ids.device).unsqueeze(-1)
    valid = (positions >= starts) & (positions < ends)  # [B, T]
    kl = _kl(teacher, logits)
    total = (kl * valid).sum() / valid.sum().clamp_min(1)
    agree = ((logits.argmax(-1) == teacher.argmax(-1)) & valid).sum().reshape(1).float()
    return _Losses(total, agree, valid.sum().reshape(1).float())


def _teacher(
    target: MoEForCausalLM, ids: torch.Tensor, feature_layers: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    with torch.no_grad():
        logits, _, features = target.forward_train_with_features(ids, feature_layers)
    return logits, features


def _losses(
    drafter: DrafterModel,
    target: MoEForCausalLM,
    examples: Sequence[Example],
    recipe: DrafterRecipe,
    gen: torch.Generator,
) -> _Losses:
    ids, lengths, prompt_lens = _pad(examples, target.device)
    if isinstance(drafter, BlockDrafterModel):
        teacher, features = _teacher(target, ids, drafter.config.feature_layers)
        assert features is not None
        return block_losses(
            drafter,
            ids,
            lengths,
            prompt_lens,
            teacher,
            features,
            anchors_per_sequence=recipe.anchors_per_sequence,
            position_decay=recipe.position_decay,
            gen=gen,
        )
    teacher, _ = _teacher(target, ids, ())
    return dense_losses(drafter, ids, lengths, prompt_lens, teacher)


def train_drafter(
    target: MoEForCausalLM,
    train: Sequence[Example],
    heldout: Sequence[Example],
    recipe: DrafterRecipe,
    *,
    progress: Callable[[str], None] = print,
    show_bar: bool = True,
) -> tuple[DrafterModel, TrainReport]:
    """Fit a new drafter to `target` on `train`; evaluate on `heldout` (the engine part: `measure_acceptance`)."""
    if not train:
        raise ValueError("no training examples: the captures hold no request with output")
    torch.manual_seed(recipe.seed)
    gen = torch.Generator().manual_seed(recipe.seed)
    drafter = new_drafter(target, recipe)
    target.eval()
    target.requires_grad_(False)  # it lends its embeddings and LM head; only the drafter learns
    drafter.train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=recipe.learning_rate, weight_decay=0.0, betas=(0.9, 0.95))
    report = TrainReport(num_train=len(train), num_heldout=len(heldout))
    by_length = sorted(train, key=lambda e: len(e.ids))
    bar = _bar(recipe.max_steps, show_bar)
    started = time.monotonic()
    smoothed = math.nan
    step = 0
    while step < recipe.max_steps and time.monotonic() - started < recipe.max_seconds:
        frac = step / recipe.max_steps
        lr = recipe.learning_rate * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        # Records of similar lengths in one batch: less padding in the target's pass.
        first = int(torch.randint(0, max(1, len(by_length) - recipe.batch_size + 1), (), generator=gen))
        losses = _losses(drafter, target, by_length[first : first + recipe.batch_size], recipe, gen)
        losses.loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        value = float(losses.loss.detach())
        smoothed = value if math.isnan(smoothed) else 0.95 * smoothed + 0.05 * value
        bar(step, f"loss {smoothed:.3f}")
    bar(None, "")
    drafter.eval()
    report.steps = step
    report.seconds = round(time.monotonic() - started, 1)
    report.train_loss = smoothed
    if heldout:
        report.heldout_loss, report.heldout_top1_by_position = evaluate(drafter, target, heldout, recipe)
    line = f"trained a {recipe.kind} drafter for {step} steps in {report.seconds:.0f} s: train loss {smoothed:.3f}"
    if heldout:
        line += f", held-out loss {report.heldout_loss:.3f}, held-out top-1 agreement by position " + " ".join(
            f"{a:.2f}" for a in report.heldout_top1_by_position
        )
    progress(line)
    return drafter, report


def evaluate(
    drafter: DrafterModel, target: MoEForCausalLM, examples: Sequence[Example], recipe: DrafterRecipe
) -> tuple[float, list[float]]:
    """Held-out (loss, top-1 agreement with the target's argmax per draft position), teacher-forced."""
    gen = torch.Generator().manual_seed(recipe.seed + 1)
    total, agree, count = 0.0, None, None
    with torch.no_grad():
        for start in range(0, len(examples), recipe.batch_size):
            chunk = examples[start : start + recipe.batch_size]
            losses = _losses(drafter, target, chunk, recipe, gen)
            total += float(losses.loss) * len(chunk)
            agree = losses.agree if agree is None else agree + losses.agree
            count = losses.count if count is None else count + losses.count
    assert agree is not None and count is not None
    return total / len(examples), [round(float(a), 3) for a in agree / count.clamp_min(1)]


def measure_acceptance(
    target: MoEForCausalLM,
    drafter: DrafterModel,
    prompts: Sequence[list[int]],
    *,
    num_speculative_tokens: int,
    temperature: float,
    max_tokens: int,
    eos_token_ids: Iterable[int],
    seed: int = 0,
) -> float:
    """Mean acceptance length (tokens per verifying step, 1 + accepted / drafts) of the engine on `prompts`."""
    from replica.drafters.checkpoint import drafter_runtime
    from replica.engine.engine import EngineConfig, LLMEngine
    from replica.engine.sampling import SamplingParams

    longest = max(len(p) for p in prompts) + max_tokens + num_speculative_tokens + 2
    block_size = 16
    num_blocks = (longest // block_size + 2) * min(len(prompts), 16) + 8
    config = EngineConfig(
        num_blocks=num_blocks,
        max_num_seqs=16,
        max_num_batched_tokens=1024,
        num_speculative_tokens=num_speculative_tokens,
        adaptive_speculation=False,
        seed=seed,
    )
    runtime = drafter_runtime(
        drafter, num_blocks=num_blocks, block_size=block_size, num_speculative_tokens=num_speculative_tokens
    )
    engine = LLMEngine(target, config, eos_token_ids=eos_token_ids, drafter=runtime)
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature))
    drafts = accepted = 0
    while engine.has_work:
        stats = engine.step().speculation
        drafts += stats.num_drafts
        accepted += stats.num_accepted_tokens
    return 1.0 + accepted / max(drafts, 1)


def _bar(total: int, enabled: bool) -> Callable[[int | None, str], None]:
    """A tqdm bar when tqdm is installed and `enabled`, else a line every 10 %."""
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - tqdm is a dependency of the replica extra
        tqdm = None
    if enabled and tqdm is not None:
        bar = tqdm(total=total, unit="step", dynamic_ncols=True)

        def update(step: int | None, text: str) -> None:
            if step is None:
                bar.close()
                return
            bar.update(step - bar.n)
            bar.set_postfix_str(text)

        return update

    def log_line(step: int | None, text: str) -> None:
        if step is not None and enabled and (step == total or step % max(1, total // 10) == 0):
            print(f"step {step}/{total} {text}", flush=True)

    return log_line
