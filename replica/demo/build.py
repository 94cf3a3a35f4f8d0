"""`shoal replica build-demo`: train the demo model and its tokenizer from scratch, on the CPU.

The corpus is generated locally and deterministically (`replica.demo.corpus`: bilingual business dialogue and JSON
tool calls), so the same seed gives the same model on any machine and nothing is downloaded. Steps:
byte-level BPE on the rendered conversations (tokenizer.json, and tokenizer_config.json with the chat template as
Jinja, `replica.chat_template`); a small Qwen3-MoE (16 routed experts, top-2, no shared expert, so transformers and
vLLM build every weight it has; 5.5M parameters) trained on short windows of the token stream at random offsets
(and random token strings written twice, which teach it to copy), and long windows that start at tool
conversations, with AdamW, a cosine schedule and a load-balancing loss that keeps every expert in use, then answer
steps that weigh the loss toward the assistant's tokens (`DemoRecipe.answer_steps`); the last 5% of conversations
are held out and the loss on their answers reported; then the block drafter, trained on the model's own answers.
The result is written to a temporary folder and renamed into place, so an interrupted build never leaves a half
model. `replica.demo.answercheck` measures how well the model answers.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

DEMO_VERSION = "v8"
PACKAGED_DIR = Path(__file__).with_name("weights")
"""The demo model as the package ships it (BF16 weights, tokenizer, drafter): what `build_demo` wrote with the
default recipe, so `make demo` answers without training first."""


@dataclass(frozen=True)
class DemoRecipe:
    num_conversations: int = 60000
    """About 23M tokens, of which training sees some 14M: no conversation twice, so the model cannot remember a
    conversation's values and has to copy them from the ask (6,000 conversations, seen about twice, were
    remembered instead: training loss 0.05 against 0.14 held out)."""
    vocab_size: int = 2048
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    num_experts: int = 16
    experts_per_token: int = 2
    expert_size: int = 192
    shared_expert_size: int = 0
    """0: none, as Qwen3-MoE has none (a config with one is not a Hugging Face architecture); the parameters a
    shared expert would take widen the routed experts instead."""
    max_position_embeddings: int = 4096
    seq_len: int = 256
    batch_size: int = 16
    """Short steps: `batch_size` rows of `seq_len` tokens, `copy_rows` of them copy tasks and the others windows at
    random offsets of the stream (cheap; local structure: phrasing, JSON syntax, copying from the ask)."""
    copy_rows: int = 4
    """Rows of each short step that are a random token string written twice, with the loss on the second copy only:
    they teach the model to copy what it has read (an induction head), as an answer copies the ask's order numbers
    and dates. In 3,000 steps, the model copied the ask's values into 58% of held-out answers without them and
    80.5% with them (`tests/unit/replica/test_demo_answers.py`)."""
    long_seq_len: int = 768
    long_batch_size: int = 4
    long_fraction: float = 0.5
    """Long steps (this fraction of steps): windows of `long_seq_len` tokens that start where a tool conversation
    starts. One is 700-1,100 tokens, 590 of them its tools block, and its call ends by position ~700: only long
    steps show a call with the whole system prompt above it, at the distances it has when served; on short
    windows alone the model copies the tools' schema into its calls instead of arguments."""
    max_steps: int = 4500
    max_seconds: float = 7200.0
    """Training stops at max_steps, or at max_seconds (of training, not of corpus and tokenizer set-up) on a machine
    too slow or too busy for them: steps, not wall time, bound it, so a seed names one model whatever the
    machine's load."""
    learning_rate: float = 3e-3
    answer_steps: int = 3000
    """Steps after `max_steps` that weigh the loss toward the assistant's tokens (`prompt_token_weight` on the
    others): the demo's instruction tuning. The prompt teaches the model to read an ask; the answers are what it is
    judged on. The share of held-out answers that copy the ask's values (`benchmarks.demo_answers`: the test's 200
    prompts; 400 chats of another seed) was 82.5% (78.5%) without them (v6), 90.5% (86%) after 1,500 (v7) and 90%
    (90.2%) after 3,000 (v8)."""
    answer_learning_rate: float = 5e-4
    """Peak rate of the answer steps: warm-up over `ANSWER_WARMUP_STEPS`, then a cosine down to a tenth of it."""
    prompt_token_weight: float = 0.1
    """Loss weight of the tokens the assistant did not write, in the answer steps (theirs is 1)."""
    aux_loss_weight: float = 0.01
    seed: int = 0
    drafter_requests: int = 4000
    """Demo chat requests the trained model answers (half greedy, half sampled) to make the drafter's training
    traffic (`replica.demo.traffic`); 0 builds no drafter."""
    drafter_steps: int = 1200
    """Training steps of the demo's block drafter (`replica.drafters.train`)."""
    save_dtype: str = "bfloat16"
    """Dtype of the saved weights: BF16 halves the package (the model still serves in its configured dtype, and
    the drafter is trained against the model as loaded back from these weights)."""


def cache_dir() -> Path:
    """`$SHOAL_CACHE_DIR`, else `$XDG_CACHE_HOME/shoal`, else `~/.cache/shoal`."""
    if os.environ.get("SHOAL_CACHE_DIR"):
        return Path(os.environ["SHOAL_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shoal"


def demo_model_dir() -> Path:
    return cache_dir() / f"demo-model-{DEMO_VERSION}"


def is_built(path: Path) -> bool:
    return all((path / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def held_out_texts(path: Path) -> list[str]:
    """Conversations the demo model never trained on (for agreement and calibration checks)."""
    data = json.loads((path / "heldout.json").read_text(encoding="utf-8"))
    return list(data)


WARMUP_STEPS = 50
ANSWER_WARMUP_STEPS = 20
SAVED_HELDOUT = 300
"""Held-out conversations written beside the model (`heldout.json`, for benchmarks): the first of them, not all."""


def scheduled_learning_rate(recipe: DemoRecipe, step: int, elapsed_s: float) -> float:
    """Linear warm-up over `WARMUP_STEPS`, then a cosine from the recipe's rate down to a tenth of it.

    Progress through the cosine is by steps or by time, whichever is further along, so a run bound by
    `max_seconds` still ends at a low rate. Time counts in whole steps of the schedule: a run that keeps up with
    its step budget never reads the clock into a rate, so a seed names one model (a raw time fraction would make
    the first step's rate, and with it every later weight, differ from build to build)."""
    time_steps = math.floor(elapsed_s / recipe.max_seconds * recipe.max_steps)
    frac = min(1.0, max(step, time_steps) / recipe.max_steps)
    return _warm_cosine(recipe.learning_rate, step, WARMUP_STEPS, frac)


def answer_learning_rate(recipe: DemoRecipe, step: int) -> float:
    """The answer steps' rate: linear warm-up over `ANSWER_WARMUP_STEPS`, then a cosine down to a tenth."""
    return _warm_cosine(recipe.answer_learning_rate, step, ANSWER_WARMUP_STEPS, step / recipe.answer_steps)


def _warm_cosine(peak: float, step: int, warmup_steps: int, frac: float) -> float:
    """`peak` times a linear warm-up over `warmup_steps`, times a cosine from 1 down to 0.1 over `frac` 0..1."""
    warm = min(1.0, (step + 1) / warmup_steps)
    return peak * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


@dataclass(frozen=True)
class _Windows:
    """Training batches from the token stream: short windows at random offsets (with the recipe's copy rows), or long
    ones at tool conversations (`DemoRecipe.long_fraction`), each target weighted by `weights` (None: all 1)."""

    data: Any
    long_starts: Any
    weights: Any
    recipe: DemoRecipe
    vocab_size: int
    gen: Any

    def batch(self) -> tuple[Any, Any]:
        """(tokens [B, S+1], target weights [B, S])."""
        import torch

        recipe, gen = self.recipe, self.gen
        copy_rows = 0
        if float(torch.rand((), generator=gen)) < recipe.long_fraction:
            seq_len = recipe.long_seq_len
            starts = self.long_starts[torch.randint(0, len(self.long_starts), (recipe.long_batch_size,), generator=gen)]
        else:
            seq_len, copy_rows = recipe.seq_len, recipe.copy_rows
            starts = torch.randint(0, len(self.data) - seq_len - 1, (recipe.batch_size - copy_rows,), generator=gen)
        offsets = starts.tolist()
        batch = torch.stack([self.data[s : s + seq_len + 1] for s in offsets])
        if self.weights is None:
            weights = torch.ones(len(offsets), seq_len)
        else:
            weights = torch.stack([self.weights[s + 1 : s + seq_len + 1] for s in offsets])
        if copy_rows:
            copies, copy_weights = copy_task(copy_rows, seq_len, self.vocab_size, gen)
            batch, weights = torch.cat([batch, copies]), torch.cat([weights, copy_weights])
        return batch, weights


def _train(
    model: Any,
    windows: _Windows,
    steps: int,
    rate: Callable[[int], float],
    *,
    label: str,
    max_seconds: float,
    progress: Callable[[str], None],
) -> tuple[int, float]:
    """`steps` AdamW steps (fewer if `max_seconds` run out) at `rate(step)` -> (steps done, last loss)."""
    import torch

    recipe = windows.recipe
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=0.01, betas=(0.9, 0.95))
    started = last_report = time.monotonic()
    step, loss_value = 0, float("nan")
    while step < steps and time.monotonic() - started < max_seconds:
        lr = rate(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch, weights = windows.batch()
        logits, aux = model.forward_train(batch[:, :-1])
        losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="none")
        loss = (losses * weights.flatten()).sum() / weights.sum()
        (loss + recipe.aux_loss_weight * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        loss_value = loss.item()
        now = time.monotonic()
        if now - last_report >= 10 or step == 1:
            last_report = now
            progress(
                f"{label} {step:5d}  loss {loss_value:.3f}  balance {aux.item():.3f}  lr {lr:.1e}  "
                f"{now - started:5.0f} s (stops at {steps} steps or {max_seconds:.0f} s)"
            )
    if step < steps:
        progress(
            f"{label}s: stopped at {step} of {steps}, out of time ({max_seconds:.0f} s): "
            "not the model a faster machine builds"
        )
    return step, loss_value


def build_demo(
    out_dir: Path | None = None,
    *,
    recipe: DemoRecipe | None = None,
    progress: Callable[[str], None] = print,
) -> Path:
    import torch

    from replica.chat_template import write_tokenizer_config
    from replica.demo.corpus import TOOLS, generate_conversations, uses_tools
    from replica.model.config import ModelConfig
    from replica.model.loader import init_weights, save_checkpoint
    from replica.model.model import MoEForCausalLM
    from replica.tokenizer import train_bpe, training_text

    recipe = recipe or DemoRecipe()
    out = out_dir or demo_model_dir()
    started = time.monotonic()
    torch.manual_seed(recipe.seed)
    conversations = generate_conversations(recipe.num_conversations, seed=recipe.seed)
    texts = [training_text(c, TOOLS if uses_tools(c) else None) for c in conversations]
    num_heldout = max(1, len(texts) // 20)
    train_texts, heldout = texts[:-num_heldout], texts[-num_heldout:]
    progress(f"corpus: {len(train_texts)} conversations for training, {len(heldout)} held out")
    tokenizer = train_bpe(train_texts, vocab_size=recipe.vocab_size)
    eot = tokenizer.endoftext_token_id
    stream: list[int] = []
    tool_starts: list[int] = []
    for conversation, text in zip(conversations, train_texts, strict=False):
        if uses_tools(conversation):
            tool_starts.append(len(stream))
        stream.extend(tokenizer.encode(text))
        stream.append(eot)
    data = torch.tensor(stream, dtype=torch.long)
    long_starts = torch.tensor([s for s in tool_starts if s + recipe.long_seq_len + 1 <= len(stream)])
    progress(
        f"tokenizer: {tokenizer.vocab_size} tokens; corpus {len(stream):,} tokens "
        f"({sum(len(t.encode()) for t in train_texts) / len(stream):.2f} bytes/token)"
    )

    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=recipe.hidden_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        head_dim=recipe.head_dim,
        moe_intermediate_size=recipe.expert_size,
        num_experts=recipe.num_experts,
        num_experts_per_tok=recipe.experts_per_token,
        shared_expert_intermediate_size=recipe.shared_expert_size,
        max_position_embeddings=recipe.max_position_embeddings,
        rope_theta=10000.0,
        eos_token_id=sorted(tokenizer.eos_token_ids),
    )
    model = MoEForCausalLM(config)
    init_weights(model, seed=recipe.seed)
    num_params = sum(p.numel() for p in model.parameters())
    shared = config.shared_expert_intermediate_size
    progress(
        f"model: {num_params / 1e6:.2f}M parameters ({config.num_routed_expert_params / 1e6:.2f}M in routed "
        f"experts), {config.num_experts} experts top-{config.num_experts_per_tok}"
        + (f" + a shared expert of width {shared}" if shared else ", no shared expert")
    )
    model.train()
    train_started = time.monotonic()
    gen = torch.Generator().manual_seed(recipe.seed)
    windows = _Windows(data, long_starts, None, recipe, tokenizer.vocab_size, gen)

    def pretraining_rate(step: int) -> float:
        return scheduled_learning_rate(recipe, step, time.monotonic() - train_started)

    step, loss_value = _train(
        model, windows, recipe.max_steps, pretraining_rate, label="step", max_seconds=recipe.max_seconds,
        progress=progress,
    )  # fmt: skip
    if recipe.answer_steps:
        weight = recipe.prompt_token_weight
        answers = replace(windows, weights=weight + (1 - weight) * assistant_tokens(data, tokenizer).float())
        answer_steps, loss_value = _train(
            model, answers, recipe.answer_steps, lambda s: answer_learning_rate(recipe, s), label="answer step",
            max_seconds=recipe.max_seconds - (time.monotonic() - train_started), progress=progress,
        )  # fmt: skip
        step += answer_steps
    model.eval()
    heldout_loss = _heldout_loss(model, tokenizer, heldout)
    progress(
        f"trained {step} steps in {time.monotonic() - started:.0f} s: train loss {loss_value:.3f}, "
        f"held-out loss {heldout_loss:.3f}"
    )

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=out.parent))
    try:
        save_checkpoint(model, tmp, dtype=getattr(torch, recipe.save_dtype))
        tokenizer.save(tmp / "tokenizer.json")
        write_tokenizer_config(tmp, model_max_length=recipe.max_position_embeddings)
        if recipe.drafter_requests:
            _build_drafter(tokenizer, tmp, recipe, progress)
        saved = heldout[:SAVED_HELDOUT]
        (tmp / "heldout.json").write_text(json.dumps(saved, ensure_ascii=False), encoding="utf-8")
        meta = {
            "recipe": asdict(recipe),
            "steps": step,
            "train_loss": loss_value,
            "heldout_loss": heldout_loss,
            "seconds": time.monotonic() - started,
        }
        (tmp / "build.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    progress(f"demo model written to {out}")
    return out


def _build_drafter(tokenizer: Any, folder: Path, recipe: DemoRecipe, progress: Callable[[str], None]) -> None:
    """The demo's block drafter, trained on the demo model's own answers, into `folder/drafter`. The model is
    loaded back from `folder` as `shoal replica` loads it, so the drafter learns the model as it is served."""
    import torch

    from replica.capture import CaptureSource, fingerprint_model, fingerprint_tokenizer
    from replica.demo.traffic import generate_traffic
    from replica.drafters.build import build_drafter
    from replica.drafters.checkpoint import target_fingerprint
    from replica.drafters.train import DrafterRecipe, load_capture_examples
    from replica.model.loader import load_model

    traffic = folder / "traffic"
    source = CaptureSource(
        model="shoal-demo",
        model_hash=fingerprint_model(folder),
        tokenizer_hash=fingerprint_tokenizer(folder / "tokenizer.json"),
        keep_text=False,
    )
    model = load_model(folder)
    generate_traffic(model, tokenizer, traffic, num_requests=recipe.drafter_requests, source=source, progress=progress)
    drafter_recipe = DrafterRecipe(kind="block", max_steps=recipe.drafter_steps, seed=recipe.seed)
    train, heldout = load_capture_examples(
        traffic, max_len=model.config.max_position_embeddings, heldout_fraction=drafter_recipe.heldout_fraction
    )
    build_drafter(
        model,
        tokenizer,
        train,
        heldout,
        drafter_recipe,
        out=folder / "drafter",
        target_hash=target_fingerprint(folder),
        progress=progress,
        show_bar=False,
        save_dtype=getattr(torch, recipe.save_dtype),
    )
    shutil.rmtree(traffic)


def copy_task(rows: int, seq_len: int, vocab_size: int, gen: Any) -> tuple[Any, Any]:
    """`rows` rows of `seq_len` + 1 tokens: a random string of tokens after the special ones written twice,
    and the weight of each target (row[1:]): 1 where the second copy can be predicted (from its second token on),
    else 0. `train_bpe` numbers the special tokens first; the tool-call markers after them may be drawn."""
    import torch

    from replica.tokenizer import SPECIAL_TOKENS

    half = seq_len // 2
    string = torch.randint(len(SPECIAL_TOKENS), vocab_size, (rows, half), generator=gen)
    tokens = string.repeat(1, 3)[:, : seq_len + 1]  # [rows, S+1]: twice, and the last token of a third time
    weights = torch.zeros(rows, seq_len)
    weights[:, half:] = 1.0  # target j is tokens[j + 1]: the second copy's tokens after its first
    return tokens, weights


def assistant_tokens(ids: Any, tokenizer: Any) -> Any:
    """[N] bool over a token stream (a torch tensor of rendered conversations): True where the assistant wrote the
    token, from the line break after `<|im_start|>assistant` through its `<|im_end|>`."""
    import torch

    assistant = tokenizer.encode("assistant")
    assert len(assistant) == 1, "the role name must be one token for the turn to be found by id"
    positions = torch.arange(len(ids))
    opens = torch.zeros(len(ids), dtype=torch.bool)
    opens[2:] = (ids[:-2] == tokenizer.im_start_token_id) & (ids[1:-1] == assistant[0])  # the turn's line break
    closes = torch.zeros(len(ids), dtype=torch.bool)
    closes[1:] = ids[:-1] == tokenizer.eos_token_id  # the token after an <|im_end|>
    last_open = torch.where(opens, positions, -1).cummax(0).values
    last_close = torch.where(closes, positions, -1).cummax(0).values
    return last_open > last_close


def _heldout_loss(model: object, tokenizer: object, texts: list[str]) -> float:
    """Mean loss on the assistant's tokens (`assistant_tokens`) of the first 32 held-out conversations."""
    import torch

    from replica.model.model import MoEForCausalLM
    from replica.tokenizer import Tokenizer

    assert isinstance(model, MoEForCausalLM) and isinstance(tokenizer, Tokenizer)
    total, count = 0.0, 0
    with torch.no_grad():
        for text in texts[:32]:
            ids = torch.tensor(tokenizer.encode(text)[: model.config.max_position_embeddings])
            logits, _ = model.forward_train(ids[None, :-1])
            losses = torch.nn.functional.cross_entropy(logits[0], ids[1:], reduction="none")
            answer = assistant_tokens(ids, tokenizer)[1:]
            total += float(losses[answer].sum())
            count += int(answer.sum())
    return total / max(count, 1)


def ensure_demo_model(progress: Callable[[str], None] = print) -> Path:
    """The demo model's folder: one built into the cache (`shoal replica build-demo`) if there is one, else the
    packaged one, else one built now."""
    path = demo_model_dir()
    if not is_built(path) and is_built(PACKAGED_DIR):
        return PACKAGED_DIR
    if not is_built(path):
        progress(f"building the demo model into {path} (first use only; tens of minutes on 2 CPU cores)")
        build_demo(path, progress=progress)
    return path
