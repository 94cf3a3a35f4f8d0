"""A seed gives one text through the server: alone or amid other requests, with speculation on or off, on either of
two replicas of the demo checkpoint (the official `openai` client, T=0.8, held-out demo chats)."""

from __future__ import annotations

import asyncio
import json
from importlib import resources

import aiohttp
import openai

from tests.integration.conftest import metric_value
from tests.integration.replica_support import ReplicaHandle, StartReplica

SEEDS = list(range(1000, 1020))
ASSISTANT = "<|im_start|>assistant\n"


def held_out_prompts(count: int) -> list[str]:
    chats = json.loads(resources.files("replica.demo").joinpath("weights/heldout.json").read_text(encoding="utf-8"))
    return [chat[: chat.rindex(ASSISTANT) + len(ASSISTANT)] for chat in chats[:count]]


async def seeded_texts(
    replica: ReplicaHandle, prompts: list[str], *, amid: list[str], temperature: float = 0.8
) -> dict[int, str]:
    """{seed: text} of one request per seed, seed i on prompt i: one after the other, or all at once with `amid`
    unseeded requests sent first and still running."""
    async with openai.AsyncOpenAI(base_url=f"{replica.url}/v1", api_key="-", max_retries=0) as client:

        async def complete(text: str, seed: int | None) -> str:
            done = await client.completions.create(
                model="shoal-demo", prompt=text, max_tokens=48, temperature=temperature, seed=seed
            )
            return done.choices[0].text

        if not amid:
            return {seed: await complete(prompt, seed) for seed, prompt in zip(SEEDS, prompts, strict=True)}
        others = [asyncio.create_task(complete(text, None)) for text in amid]
        texts = await asyncio.gather(*(complete(prompt, seed) for seed, prompt in zip(SEEDS, prompts, strict=True)))
        await asyncio.gather(*others)
        return dict(zip(SEEDS, texts, strict=True))


async def test_a_seed_gives_one_text_alone_or_amid_others_with_speculation_on_or_off(
    start_any_replica: StartReplica,
) -> None:
    speculating = await start_any_replica(model="demo")  # the demo's drafter, at the defaults
    plain = await start_any_replica(model="demo", num_speculative_tokens=0)
    chats = held_out_prompts(len(SEEDS) + 16)
    prompts, others = chats[: len(SEEDS)], chats[len(SEEDS) :]
    variants = {
        "speculation, alone": await seeded_texts(speculating, prompts, amid=[]),
        "speculation, amid 16": await seeded_texts(speculating, prompts, amid=others),
        "no speculation, alone": await seeded_texts(plain, prompts, amid=[]),
        "no speculation, amid 16": await seeded_texts(plain, prompts, amid=others),
    }
    reference = variants["no speculation, alone"]
    greedy = await seeded_texts(plain, prompts, amid=[], temperature=0.0)
    assert sum(reference[seed] != greedy[seed] for seed in SEEDS) >= 3  # T=0.8 really samples
    for name, texts in variants.items():
        differing = [seed for seed in SEEDS if texts[seed] != reference[seed]]
        assert not differing, f"{name}: seed {differing[0]}: {texts[differing[0]]!r} != {reference[differing[0]]!r}"
    async with aiohttp.ClientSession() as http, http.get(f"{speculating.url}/metrics") as response:
        metrics = await response.text()
    assert (metric_value(metrics, "vllm:spec_decode_num_drafts_total") or 0) > 0  # speculation ran
