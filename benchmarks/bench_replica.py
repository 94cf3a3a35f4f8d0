"""The bundled replica on the demo model: decode throughput against batch size, TTFT of a cold prompt against a
90%-cached one, routed-expert memory BF16 vs NVFP4, top-1 agreement of NVFP4 with the unquantized model, and how
often the demo model's tool calls parse (`replica.demo.toolcheck`).

Everything runs on the engine in-process (no HTTP), on the CPU unless `--device` says otherwise. Times are
wall-clock medians over `--repeats` runs; on a shared 2-core machine compare figures from one run only.

    .venv/bin/python -m benchmarks.bench_replica                 # all tables
    .venv/bin/python -m benchmarks.bench_replica --only ttft     # one of: throughput, ttft, memory, agreement, tools
    .venv/bin/python -m benchmarks.bench_replica --only ttft --wider 512   # the architecture 4x wider, random weights
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `shoal replica` serves: replica.loading.sleeping_omp_threads

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from replica.demo.build import ensure_demo_model, held_out_texts
from replica.engine.engine import EngineConfig, LLMEngine, RequestOutput
from replica.engine.sampling import SamplingParams
from replica.model.config import ModelConfig
from replica.model.loader import init_weights, load_model
from replica.model.model import MoEForCausalLM
from replica.quant.calibrate import observe_experts, read_chat_prompts
from replica.quant.experts import quantize_model_experts, routed_expert_bytes
from replica.tokenizer import Tokenizer

ENGINE_VALUES = {"num_blocks": 4096, "block_size": 16, "max_num_seqs": 64, "max_num_batched_tokens": 2048}


def _engine(model: MoEForCausalLM, **config: int) -> LLMEngine:
    values = {**ENGINE_VALUES, **config}
    return LLMEngine(model, EngineConfig(**values))  # type: ignore[arg-type]


def _run(engine: LLMEngine) -> None:
    while engine.has_work:
        engine.step()


def _first_token(engine: LLMEngine, prompt: list[int]) -> RequestOutput:
    """Steps until the request's first token: a prompt longer than the step budget takes several chunks."""
    engine.add_request(prompt, SamplingParams(max_tokens=1))
    while True:
        outputs = engine.step().outputs
        if outputs:
            return outputs[0]


def throughput(model: MoEForCausalLM, tokenizer: Tokenizer, texts: list[str], repeats: int) -> None:
    print("\n## Decode throughput against batch size (prompt ~64 tokens, 64 generated tokens each)")
    print(f"{'batch':>6} {'tokens/s':>10} {'step ms':>9}")
    prompts = [tokenizer.encode(t)[:64] for t in texts]
    for batch in (1, 2, 4, 8, 16, 32, 64):
        rates, steps = [], []
        for _ in range(repeats):
            engine = _engine(model)
            params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
            for i in range(batch):
                engine.add_request(prompts[i % len(prompts)], params)
            engine.step()  # prefill of all prompts, not timed
            started = time.perf_counter()
            num_steps = 0
            num_tokens = 0
            while engine.has_work:
                result = engine.step()
                num_steps += 1
                num_tokens += len(result.outputs)
            elapsed = time.perf_counter() - started
            rates.append(num_tokens / elapsed)
            steps.append(elapsed / num_steps * 1000)
        print(f"{batch:>6} {statistics.median(rates):>10.0f} {statistics.median(steps):>9.2f}")


def ttft(model: MoEForCausalLM, tokenizer: Tokenizer, texts: list[str], repeats: int) -> None:
    print("\n## Time to first token: cold prompt against a 90%-cached one (one request, engine in-process)")
    print(f"(both engines: {ENGINE_VALUES['max_num_batched_tokens']}-token steps; a longer prompt takes several)")
    stream: list[int] = []
    for t in texts:
        stream.extend(tokenizer.encode(t))
    print(f"{'prompt':>7} {'cached':>7} {'cold ms':>9} {'warm ms':>9} {'speed-up':>9}")
    # Multiples of ten blocks, so that 90% of each prompt is whole blocks: the cache holds exactly 90% of it (a
    # partial block is never cached, and 90% of 1,900 tokens would cache 89.3%, of 256 tokens 87.5%).
    ten_blocks = 10 * ENGINE_VALUES["block_size"]
    for length in (2 * ten_blocks, 4 * ten_blocks, 8 * ten_blocks, 12 * ten_blocks, 24 * ten_blocks):
        if length >= model.config.max_position_embeddings:
            continue
        prompt = stream[:length]
        shared = int(length * 0.9)
        cold_s, warm_s, cached = [], [], 0
        for r in range(repeats):
            # Both engines first: zeroing a new engine's KV cache evicts the weights from the CPU caches, which
            # would otherwise slow whichever request follows it, as it does not on a serving replica.
            engine, cold = _engine(model), _engine(model)
            other = [*prompt[:shared], *stream[length + r * 200 : length + r * 200 + length - shared]]
            engine.add_request(other, SamplingParams(max_tokens=1))
            _run(engine)  # caches the shared 90%
            started = time.perf_counter()
            cached = _first_token(engine, prompt).num_cached_tokens
            warm_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            _first_token(cold, prompt)
            cold_s.append(time.perf_counter() - started)
        c, w = statistics.median(cold_s), statistics.median(warm_s)
        print(f"{length:>7} {cached:>7} {c * 1000:>9.1f} {w * 1000:>9.1f} {c / w:>8.1f}x")


def wider_model(path: Path, hidden: int) -> MoEForCausalLM:
    """The checkpoint's architecture `hidden / its hidden size` times wider (hidden size, expert and shared-expert
    widths, heads of 64), random weights: timing only, for where the linear layers outweigh attention and the
    per-step costs, as in production models. Its outputs mean nothing."""
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    scale = hidden / config["hidden_size"]
    shared = config.get("shared_expert_intermediate_size") or 0
    config.update(
        hidden_size=hidden,
        head_dim=64,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        moe_intermediate_size=int(config["moe_intermediate_size"] * scale),
        shared_expert_intermediate_size=int(shared * scale),
    )
    model = MoEForCausalLM(ModelConfig.from_hf(config)).eval()
    init_weights(model, seed=0)
    model.use_serving_layout()  # as `load_model` serves on the CPU
    print(f"widened to hidden {hidden}, experts {config['moe_intermediate_size']} wide, random weights")
    return model


def memory(path: Path) -> None:
    print("\n## Routed-expert memory (bytes actually held by the expert tensors)")
    print(f"{'format':<10} {'expert bytes':>13} {'bytes/param':>12} {'model bytes':>12}")
    rows = []
    for label, dtype, quantize in (("BF16", torch.bfloat16, False), ("NVFP4", torch.bfloat16, True)):
        model = load_model(path, dtype=dtype)
        if quantize:
            quantize_model_experts(model, mode="w4a16")
        num_bytes, num_params = routed_expert_bytes(model)
        total = sum(t.nbytes for t in model.state_dict().values())
        rows.append(num_bytes)
        print(f"{label:<10} {num_bytes:>13,} {num_bytes / num_params:>12.4f} {total:>12,}")
    print(f"routed experts {rows[0] / rows[1]:.2f}x smaller in NVFP4")


def agreement(path: Path, tokenizer: Tokenizer, texts: list[str], dtype: torch.dtype) -> None:
    print(f"\n## Top-1 agreement with the unquantized model on held-out text ({len(texts)} conversations, {dtype})")
    reference = load_model(path, dtype=dtype)
    ids = [tokenizer.encode(t)[:1024] for t in texts]
    with torch.no_grad():
        want = [reference.forward_train(torch.tensor([x]))[0][0].argmax(-1) for x in ids]
    chats = read_chat_prompts(Path(__file__).parents[1] / "replica/demo/calibration_chats.jsonl", tokenizer)
    calibration = observe_experts(load_model(path, dtype=torch.float32), chats, min_tokens=16)
    naive = {p: torch.full_like(a, 6.0 * 448.0) for p, a in calibration.amax.items()}  # global scale 1.0
    print(f"{'variant':<44} {'agreement':>10}")
    variants: list[tuple[str, str, object]] = [
        ("NVFP4 W4A16 (weights only; no calibration)", "w4a16", None),
        ("NVFP4 W4A4, activation scales calibrated", "w4a4", calibration.amax),
        ("NVFP4 W4A4, uncalibrated (global scale 1)", "w4a4", naive),
    ]
    for label, mode, amax in variants:
        model = load_model(path, dtype=dtype)
        quantize_model_experts(model, mode=mode, activation_amax=amax)  # type: ignore[arg-type]
        same = total = 0
        with torch.no_grad():
            for x, w in zip(ids, want, strict=True):
                got = model.forward_train(torch.tensor([x]))[0][0].argmax(-1)
                same += int((got == w).sum())
                total += w.numel()
        print(f"{label:<44} {same / total:>9.2%}")
    print(
        f"(calibration: {calibration.num_requests} chats, {calibration.num_tokens} tokens, "
        f"fewest tokens of any expert {int(calibration.token_counts.min())})"
    )


def tool_calls(path: Path, tokenizer: Tokenizer, num_prompts: int) -> None:
    from replica.demo.toolcheck import LEVELS, check_tool_calls, rates, tool_prompts

    print(f"\n## Tool calls on {num_prompts} unseen tool conversations, cut after the ask (cumulative rates)")
    model = load_model(path)
    prompts = tool_prompts(num_prompts)
    print(f"{'sampling':<16}" + "".join(f"{level:>8}" for level in LEVELS))
    for label, temperature in (("greedy", 0.0), ("temperature 0.7", 0.7)):
        levels, _ = check_tool_calls(model, tokenizer, prompts, temperature=temperature)
        print(f"{label:<16}" + "".join(f"{rate:>8.0%}" for rate in rates(levels).values()))
    print(
        "call: a <tool_call> block; json: it parses, with a name and an arguments object; name: the expected "
        "function; schema: argument names and types fit it; exact: the expected arguments"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="checkpoint folder (default: the demo model, built if missing)")
    parser.add_argument("--only", choices=["throughput", "ttft", "memory", "agreement", "tools"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--agreement-texts", type=int, default=100, help="held-out conversations to score")
    parser.add_argument("--tool-prompts", type=int, default=50, help="tool-call prompts to score")
    parser.add_argument(
        "--wider",
        type=int,
        metavar="HIDDEN",
        help="throughput and ttft on the model's architecture widened to this hidden size, random weights "
        "(timing only; e.g. 512, 4x the demo model)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or ensure_demo_model()
    tokenizer = Tokenizer.from_file(path / "tokenizer.json")
    texts = held_out_texts(path)
    print(f"model {path}, torch {torch.__version__}, {torch.get_num_threads()} threads")

    def timed_model() -> MoEForCausalLM:
        return load_model(path) if args.wider is None else wider_model(path, args.wider)

    if args.only in (None, "throughput"):
        throughput(timed_model(), tokenizer, texts, args.repeats)
    if args.only in (None, "ttft"):
        ttft(timed_model(), tokenizer, texts, args.repeats)
    if args.only in (None, "memory"):
        memory(path)
    if args.only in (None, "agreement"):
        agreement(path, tokenizer, texts[: args.agreement_texts], torch.bfloat16)
    if args.only in (None, "tools"):
        tool_calls(path, tokenizer, args.tool_prompts)


if __name__ == "__main__":
    main()
