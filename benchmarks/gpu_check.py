"""The checks that need a GPU, in one run: speculative decoding's greedy equality and decode timings on CUDA, and
the Triton NVFP4 expert kernel against BF16 at decode shapes.

1. Greedy equality: the demo model in float32 (TF32 off) decodes held-out demo prompts with and without speculation
   (its block drafter, k = 4, adaptive off). Outputs must be identical; for any that differ, the first differing
   position and the target's top-2 logit gap there are printed (a gap near 0 is a rounding tie, not a bug).
2. Decode timing: batch 1, 8 and 32 of the same prompts, decode tokens/s with and without speculation (the engine's
   own step loop; `torch.cuda.synchronize` around each step).
3. The NVFP4 kernel (`replica.quant.triton_nvfp4.nvfp4_matmul`) against BF16 `torch.matmul` for one Qwen3-30B-A3B
   expert at decode rows M = 1..16 (`benchmarks/bench_nvfp4.py`'s CUDA table). Goal at M = 1 on an H200: at least
   2x; weight bytes bound it near 3.5x (0.5625 bytes per weight against 2).

    .venv/bin/python -m benchmarks.gpu_check                  # on a CUDA machine, ~3 minutes
    .venv/bin/python -m benchmarks.gpu_check --device cpu --prompts 8 --skip-kernel   # the same code, small, here
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import sys
import time
from collections.abc import Callable

import torch

from benchmarks.bench_speculative import prompts_for
from replica.demo.build import ensure_demo_model
from replica.drafters.checkpoint import DrafterModel, drafter_runtime, load_drafter
from replica.engine.engine import EngineConfig, LLMEngine
from replica.engine.sampling import SamplingParams
from replica.model.loader import load_model
from replica.model.model import MoEForCausalLM
from replica.tokenizer import Tokenizer


def generate(
    model: MoEForCausalLM,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    *,
    batch: int,
    drafter: DrafterModel | None,
    k: int,
    max_tokens: int,
    adaptive: bool = False,
) -> tuple[list[list[int]], float, float]:
    """-> (outputs in prompt order, decode tokens/s, mean acceptance length)."""
    num_blocks = batch * ((max(len(p) for p in prompts) + max_tokens) // 16 + 3) + 16
    config = EngineConfig(
        num_blocks=num_blocks,
        max_num_seqs=batch,
        max_num_batched_tokens=4096,
        num_speculative_tokens=k if drafter is not None else 0,
        adaptive_speculation=adaptive,
    )
    runtime = (
        drafter_runtime(drafter, num_blocks=num_blocks, block_size=16, num_speculative_tokens=k) if drafter else None
    )
    engine = LLMEngine(model, config, eos_token_ids=tokenizer.eos_token_ids, drafter=runtime)
    outputs: dict[int, list[int]] = {}
    decode_tokens, decode_s, drafts, accepted = 0, 0.0, 0, 0
    sync: Callable[[], None] = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    for start in range(0, len(prompts), batch):
        ids = [
            engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0.0))
            for p in prompts[start : start + batch]
        ]
        for i in ids:
            outputs[i] = []
        while engine.has_work:
            sync()
            began = time.perf_counter()
            result = engine.step()
            sync()
            elapsed = time.perf_counter() - began
            for o in result.outputs:
                outputs[o.seq_id].extend(o.new_token_ids)
            if result.outputs and all(o.num_output_tokens > len(o.new_token_ids) for o in result.outputs):
                decode_tokens += sum(len(o.new_token_ids) for o in result.outputs)
                decode_s += elapsed
            drafts += result.speculation.num_drafts
            accepted += result.speculation.num_accepted_tokens
    ordered = [outputs[i] for i in sorted(outputs)]
    return ordered, decode_tokens / max(decode_s, 1e-9), 1 + accepted / max(drafts, 1)


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def top2_gap(model: MoEForCausalLM, tokens: list[int]) -> float:
    with torch.inference_mode():
        logits, _ = model.forward_train(torch.tensor([tokens], device=model.device))
    top = logits[0, -1].topk(2).values
    return float(top[0] - top[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--skip-kernel", action="store_true", help="leave out the NVFP4 kernel table")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu for the small CPU version of the same checks")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    path = ensure_demo_model()
    tokenizer = Tokenizer.from_file(path / "tokenizer.json")
    model = load_model(path, device=args.device)
    drafter = load_drafter(path / "drafter", model)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"{name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, demo model float32, k = {args.k}")
    prompts = prompts_for(tokenizer, args.prompts)

    print(f"\n## 1. Greedy output with and without speculation ({len(prompts)} prompts, batch 8)")
    plain, _, _ = generate(model, tokenizer, prompts, batch=8, drafter=None, k=0, max_tokens=args.max_tokens)
    spec, _, accept = generate(
        model, tokenizer, prompts, batch=8, drafter=drafter, k=args.k, max_tokens=args.max_tokens
    )
    same = sum(a == b for a, b in zip(plain, spec, strict=True))
    print(f"identical: {same}/{len(prompts)}; mean acceptance length {accept:.2f}")
    for prompt, a, b in zip(prompts, plain, spec, strict=True):
        if a != b:
            at = first_difference(a, b)
            gap = top2_gap(model, prompt + a[:at])
            print(f"  differs at output token {at}: target top-2 logit gap {gap:.2e}")

    print("\n## 2. Decode tokens/s with and without speculation (greedy)")
    print(f"{'batch':>5} {'off tok/s':>10} {'on tok/s':>9} {'x':>6} {'accept len':>10}")
    for batch in (1, 8, 32):
        subset = prompts_for(tokenizer, max(batch * 2, 8))
        _, off, _ = generate(model, tokenizer, subset, batch=batch, drafter=None, k=0, max_tokens=args.max_tokens)
        _, on, accept = generate(
            model, tokenizer, subset, batch=batch, drafter=drafter, k=args.k, max_tokens=args.max_tokens
        )
        print(f"{batch:>5} {off:>10.0f} {on:>9.0f} {on / off:>5.2f}x {accept:>10.2f}", flush=True)

    if not args.skip_kernel and args.device.startswith("cuda"):
        print("\n## 3. NVFP4 expert kernel against BF16 (bench_nvfp4.py)")
        from benchmarks.bench_nvfp4 import bench_cuda

        bench_cuda(iters=100, sweep=True)


if __name__ == "__main__":
    main()
