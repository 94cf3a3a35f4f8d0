"""Why drafters train on raw token ids: one drafter trained on the captured ids, one on the same traffic decoded to
text and tokenized again, both measured on held-out traffic served as the model serves it.

The traffic is the demo model answering demo chat requests (40% with tools, so JSON tool calls are in it), half
greedy and half at temperature 0.7, captured as `shoal replica --capture-dir` captures (`replica.demo.traffic`), or
any capture directory (`--traces`). The re-tokenized copy is what a pipeline that logs text would train on: the
prompt decoded with its special tokens and the answer decoded as returned to the client, encoded again with the
same tokenizer, the end-of-turn token put back. Both drafters share the recipe and the seed; the held-out prompts
are the same raw prompts for both. The report: how many answers tokenize differently, where (examples with their
tokens side by side), and each drafter's mean acceptance length on all held-out prompts and on the tool-call ones.

    .venv/bin/python -m benchmarks.experiment_retokenized                    # ~15 minutes on 2 cores
    .venv/bin/python -m benchmarks.experiment_retokenized --traces DIR --steps 300
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import tempfile
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from benchmarks.bench_speculative import shown
from replica.capture import CaptureSource
from replica.demo.build import ensure_demo_model
from replica.demo.traffic import generate_traffic
from replica.drafters.build import build_drafter
from replica.drafters.train import DrafterRecipe, Example, load_capture_examples, measure_acceptance
from replica.model.loader import load_model
from replica.tokenizer import Tokenizer

TOOL_CALL_TOKEN = "<tool_call>"


def retokenize(example: Example, tokenizer: Tokenizer) -> Example:
    prompt_text = tokenizer.decode(example.prompt_ids, skip_special_tokens=False)
    answer_text = tokenizer.decode(example.output_ids, skip_special_tokens=True)
    ids = tokenizer.encode(prompt_text + answer_text)
    ends = [t for t in example.output_ids[-1:] if t in tokenizer.eos_token_ids]
    prompt = tokenizer.encode(prompt_text)
    if ids[: len(prompt)] != prompt:  # the boundary merged: keep the whole text, split where the prompt ends
        prompt = ids[: len(prompt)]
    return replace(example, prompt_ids=prompt, output_ids=ids[len(prompt) :] + ends)


def describe(tokenizer: Tokenizer, ids: list[int]) -> str:
    return " ".join(json.dumps(tokenizer.decode([t], skip_special_tokens=False), ensure_ascii=False) for t in ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=Path, help="capture directory (default: demo traffic made here)")
    parser.add_argument("--requests", type=int, default=4000, help="demo requests to capture without --traces")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--eval-prompts", type=int, default=96)
    parser.add_argument("--examples", type=int, default=4, help="differing answers to print")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = ensure_demo_model()
    tokenizer = Tokenizer.from_file(path / "tokenizer.json")
    model = load_model(path)
    print(f"demo model {shown(path)}, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        traces = args.traces
        if traces is None:
            traces = Path(tmp) / "captures"
            source = CaptureSource(model="shoal-demo", model_hash="-", tokenizer_hash="-", keep_text=False)
            generate_traffic(model, tokenizer, traces, num_requests=args.requests, source=source, seed=4242)
        max_len = model.config.max_position_embeddings
        train, heldout = load_capture_examples(traces, max_len=max_len, heldout_fraction=0.1)
    retok = [retokenize(e, tokenizer) for e in train]
    differ = [(a, b) for a, b in zip(train, retok, strict=True) if a.output_ids != b.output_ids]
    tool_differ = sum(TOOL_CALL_TOKEN in tokenizer.decode(a.output_ids, skip_special_tokens=False) for a, _ in differ)
    num_tools = sum(TOOL_CALL_TOKEN in tokenizer.decode(a.output_ids, skip_special_tokens=False) for a in train)
    positions = sum(sum(x != y for x, y in zip(a.output_ids, b.output_ids, strict=False)) for a, b in differ)
    raw_tokens = sum(len(e.output_ids) for e in train)
    print(f"\n## The traffic: {len(train)} answers to train on ({raw_tokens:,} output ids), {len(heldout)} held out")
    print(f"answers whose re-tokenization differs from the ids the model emitted: {len(differ)} of {len(train)} "
          f"({len(differ) / len(train):.1%}); with a tool call: {tool_differ} of {num_tools}")  # fmt: skip
    print(f"output ids raw {raw_tokens:,}, re-tokenized {sum(len(e.output_ids) for e in retok):,}; "
          f"positions that differ (before the first length change) {positions:,}")  # fmt: skip
    for a, b in differ[: args.examples]:
        at = next(i for i, (x, y) in enumerate(zip(a.output_ids, b.output_ids, strict=False)) if x != y)
        lo = max(0, at - 3)
        print(f"\n  emitted:      {describe(tokenizer, a.output_ids[lo : at + 5])}")
        print(f"  re-tokenized: {describe(tokenizer, b.output_ids[lo : at + 5])}")

    recipe = DrafterRecipe(kind="block", max_steps=args.steps, block_size=max(args.k, 4), eval_prompts=0)
    drafters = {}
    for label, data in (("raw ids", train), ("re-tokenized text", retok)):
        print(f"\n## Training on {label}")
        drafters[label], _ = build_drafter(model, tokenizer, data, [], recipe, out=None, target_hash=None,
                                           show_bar=False)  # fmt: skip
    prompts = [e.prompt_ids for e in heldout[: args.eval_prompts]]
    tools = [
        e.prompt_ids for e in heldout if TOOL_CALL_TOKEN in tokenizer.decode(e.output_ids, skip_special_tokens=False)
    ]
    tools = tools[: args.eval_prompts]
    print(f"\n## Mean acceptance length on held-out traffic (engine, k = {args.k}; {len(prompts)} held-out prompts, "
          f"and {len(tools)} held-out prompts the model answered with a tool call)")  # fmt: skip
    print(f"{'trained on':<20} {'greedy':>8} {'temp 0.7':>9} {'tool calls, greedy':>19}")
    for label, drafter in drafters.items():
        measure = partial(
            measure_acceptance, model, drafter, num_speculative_tokens=args.k, max_tokens=160,
            eos_token_ids=tokenizer.eos_token_ids,
        )  # fmt: skip
        row = [measure(batch, temperature=t) for batch, t in ((prompts, 0.0), (prompts, 0.7), (tools, 0.0))]
        print(f"{label:<20} {row[0]:>8.2f} {row[1]:>9.2f} {row[2]:>19.2f}", flush=True)


if __name__ == "__main__":
    main()
