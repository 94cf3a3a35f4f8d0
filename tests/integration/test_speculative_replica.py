"""A speculating replica end to end: traffic captured as raw ids, `shoal replica train-drafter` on it (the real
command), the drafter loaded from the checkpoint's `drafter/` folder, the same greedy answers as without it through
the official openai client, and vLLM's speculative-decoding metrics."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import aiohttp
import openai
import pytest

from tests.integration.conftest import metric_value
from tests.integration.replica_support import StartReplica

pytestmark = pytest.mark.integration

SHOAL = str(Path(sys.executable).parent / "shoal")

QUESTIONS = [
    "Please check order ORD-48213 for Crestview Labs.",
    "来週の打ち合わせの時間をいただけますか。",
    "How many units of item A-17 are in stock?",
]


@pytest.fixture(scope="module")
def checkpoint_with_drafter(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from replica.capture import CaptureSource
    from replica.demo.traffic import generate_traffic
    from replica.model.loader import load_model
    from replica.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("with-drafter") / "ckpt"
    shutil.copytree(tiny_checkpoint, folder)
    traffic = folder.parent / "captures"
    torch.set_num_threads(1)
    source = CaptureSource(model="shoal-demo", model_hash="h", tokenizer_hash="t", keep_text=False)
    model, tokenizer = load_model(folder), Tokenizer.from_file(folder / "tokenizer.json")
    generate_traffic(model, tokenizer, traffic, num_requests=40, source=source, max_tokens=24, progress=lambda _: None)
    done = subprocess.run(
        [SHOAL, "replica", "train-drafter", "--traces", str(traffic),
         "--model", str(folder), "--out", str(folder / "drafter"), "--kind", "block", "--block-size", "3",
         "--max-steps", "8", "--eval-prompts", "4", "--threads", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "held-out acceptance length at k=3" in done.stdout + done.stderr
    assert (folder / "drafter" / "drafter.json").is_file()
    return folder


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


async def answers(url: str, *, stream: bool) -> list[str]:
    out = []
    async with client(url) as c:
        for q in QUESTIONS:
            messages = [{"role": "user", "content": q}]
            if stream:
                chunks = await c.chat.completions.create(
                    model="shoal-demo",
                    messages=messages,
                    max_tokens=24,
                    temperature=0,
                    stream=True,  # type: ignore[arg-type]
                )
                out.append("".join([ch.choices[0].delta.content or "" async for ch in chunks if ch.choices]))
            else:
                r = await c.chat.completions.create(
                    model="shoal-demo",
                    messages=messages,
                    max_tokens=24,
                    temperature=0,  # type: ignore[arg-type]
                )
                out.append(r.choices[0].message.content or "")
    return out


async def test_a_speculating_replica_answers_as_one_that_does_not(
    start_replica: StartReplica, checkpoint_with_drafter: Path
) -> None:
    plain = await start_replica(model=str(checkpoint_with_drafter), drafter="none")
    spec = await start_replica(model=str(checkpoint_with_drafter))  # drafter "auto": the checkpoint's drafter/
    off = await start_replica(model=str(checkpoint_with_drafter), num_speculative_tokens=0)
    assert plain.state.engine.engine.drafter is None and off.state.engine.engine.drafter is None
    assert spec.state.engine.engine.drafter is not None
    assert spec.state.engine.engine.config.num_speculative_tokens == 3  # the block drafter's own block size
    expected = await answers(plain.url, stream=False)
    assert await answers(spec.url, stream=False) == expected
    assert await answers(spec.url, stream=True) == expected
    async with aiohttp.ClientSession() as http, http.get(spec.url + "/metrics") as resp:
        text = await resp.text()
    labels = {"model_name": "shoal-demo"}
    drafts = metric_value(text, "vllm:spec_decode_num_drafts_total", labels)
    draft_tokens = metric_value(text, "vllm:spec_decode_num_draft_tokens_total", labels)
    accepted = metric_value(text, "vllm:spec_decode_num_accepted_tokens_total", labels)
    assert drafts and draft_tokens and draft_tokens >= drafts and accepted is not None
    first = metric_value(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", {**labels, "position": "0"})
    assert first is not None and first <= drafts
    per_position = [
        metric_value(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", {**labels, "position": str(j)}) or 0
        for j in range(3)
    ]
    assert sum(per_position) == accepted


async def test_a_drafter_that_does_not_fit_is_refused_with_a_reason(
    start_replica: StartReplica, checkpoint_with_drafter: Path, tmp_path: Path
) -> None:
    from replica.drafters.checkpoint import DrafterError

    with pytest.raises(DrafterError, match=r"no drafter\.json"):
        await start_replica(model=str(checkpoint_with_drafter), drafter=str(tmp_path))
    with pytest.raises(ValueError, match="more than this block drafter drafts"):
        await start_replica(model=str(checkpoint_with_drafter), num_speculative_tokens=5)


def test_train_drafter_without_captures_says_so(tmp_path: Path, tiny_checkpoint: Path) -> None:
    (tmp_path / "empty").mkdir()
    done = subprocess.run(
        [SHOAL, "replica", "train-drafter", "--traces", str(tmp_path / "empty"),
         "--model", str(tiny_checkpoint), "--out", str(tmp_path / "d")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert "no request with output" in done.stderr
    assert not (tmp_path / "d").exists()


async def test_greedy_constrained_answers_are_byte_identical_with_and_without_speculation(
    start_replica: StartReplica, checkpoint_with_drafter: Path
) -> None:
    from tests.integration.test_constrained_replica import ASK, TOOLS, json_schema_format

    plain = await start_replica(model=str(checkpoint_with_drafter), drafter="none")
    spec = await start_replica(model=str(checkpoint_with_drafter))
    requests: list[dict[str, object]] = [
        {"response_format": json_schema_format(True)},
        {"response_format": {"type": "json_object"}},
        {"tools": TOOLS, "tool_choice": "required"},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "book_room"}}},
    ]

    async def raw(url: str) -> list[bytes]:
        out = []
        async with aiohttp.ClientSession() as http:
            for extra in requests:
                body = {"model": "shoal-demo", "messages": ASK, "max_tokens": 120, "temperature": 0, **extra}
                async with http.post(url + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200
                    choice = (await resp.json())["choices"][0]
                message = choice["message"]
                calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
                out.append(json.dumps([message["content"], calls, choice["finish_reason"]]).encode())
        return out

    expected = await raw(plain.url)
    assert await raw(spec.url) == expected
    async with aiohttp.ClientSession() as http, http.get(spec.url + "/metrics") as resp:
        drafts = metric_value(await resp.text(), "vllm:spec_decode_num_drafts_total", {"model_name": "shoal-demo"})
    assert drafts
