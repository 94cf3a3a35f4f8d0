"""Traffic for the demo drafter: the demo model answering chat requests, captured as a replica captures them.

`shoal replica build-demo` trains the demo drafter on what the demo model itself says, as a drafter must be trained
in production (`shoal replica --capture-dir`, then `train-drafter`): requests drawn from the corpus generator with
a seed of their own (not training conversations), answered by the engine, half greedy and half sampled at
temperature 0.7, written as capture records of the raw prompt and output ids. Nothing here decodes and re-encodes.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

from replica.capture import CaptureSource, encode_record
from replica.capture.record import capture_file_name
from replica.demo.corpus import chat_requests
from replica.engine.engine import EngineConfig, LLMEngine
from replica.engine.sampling import SamplingParams
from replica.model.model import MoEForCausalLM
from replica.tokenizer import Tokenizer

TRAFFIC_SEED = 20_261_201
"""Distinct from the training and calibration seeds: the drafter's traffic is not the model's training text."""


def generate_traffic(
    model: MoEForCausalLM,
    tokenizer: Tokenizer,
    out_dir: Path,
    *,
    num_requests: int,
    source: CaptureSource,
    seed: int = TRAFFIC_SEED,
    max_tokens: int = 256,
    progress: Callable[[str], None] = print,
) -> int:
    """Answer `num_requests` demo chat requests with the engine and write them to `out_dir` as capture files;
    returns the output tokens generated."""
    bodies = chat_requests(num_requests, seed=seed, japanese_fraction=0.5, tool_fraction=0.4)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(b["messages"], tools=b.get("tools"))) for b in bodies]
    longest = max(len(p) for p in prompts) + max_tokens
    num_seqs = 32
    engine = LLMEngine(
        model,
        EngineConfig(num_blocks=num_seqs * (longest // 16 + 2), max_num_seqs=num_seqs, max_num_batched_tokens=2048),
        eos_token_ids=tokenizer.eos_token_ids,
    )
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=0.0 if i % 2 == 0 else 0.7, top_p=1.0, seed=seed + i)
        for i in range(len(prompts))
    ]
    ids = {engine.add_request(p, sp): i for i, (p, sp) in enumerate(zip(prompts, params, strict=True))}
    outputs: dict[int, list[int]] = {i: [] for i in ids.values()}
    reasons: dict[int, str] = {}
    started = time.monotonic()
    last_report = started
    while engine.has_work:
        for out in engine.step().outputs:
            i = ids[out.seq_id]
            outputs[i].extend(out.new_token_ids)
            if out.finished:
                assert out.finish_reason is not None
                reasons[i] = out.finish_reason.value
        if time.monotonic() - last_report >= 10:
            last_report = time.monotonic()
            progress(f"traffic: {len(reasons)}/{len(prompts)} requests answered")
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        encode_record(
            source.record(
                request_id=str(uuid.UUID(int=seed * 100_000 + i)),
                endpoint="chat",
                prompt_token_ids=prompts[i],
                output_token_ids=outputs[i],
                params=params[i],
                finish_reason=reasons[i],
                num_cached_tokens=0,
                arrival_unix_s=0.0,
                ttft_s=None,
                e2e_s=0.0,
                prompt_text=None,
                output_text=None,
            )
        )
        for i in range(len(prompts))
    ]
    (out_dir / capture_file_name(1)).write_bytes(b"".join(lines))
    num_tokens = sum(len(o) for o in outputs.values())
    progress(
        f"traffic: {len(prompts)} requests, {num_tokens:,} output tokens in {time.monotonic() - started:.0f} s "
        f"(half greedy, half at temperature 0.7)"
    )
    return num_tokens
