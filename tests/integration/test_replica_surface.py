"""The rest of the OpenAI surface through the official openai client: logprobs, n choices, stop strings, penalties,
max_completion_tokens, echo (with the prompt's logprobs against a plain forward pass of the served model), and a
400 naming every parameter the server does not serve. Streamed and not, and with
speculation on and off where it matters (greedy answers and their logprobs are the same)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tests.integration.replica_support import StartReplica
from tests.integration.test_speculative_replica import checkpoint_with_drafter  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "Please confirm order SO-1234 and the invoice."}]


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


async def chat(url: str, *, stream: bool, **kwargs: Any) -> tuple[dict[int, str], dict[int, list[Any]], Any]:
    """(text by choice index, chat logprob entries by index, usage)."""
    async with client(url) as c:
        if not stream:
            r = await c.chat.completions.create(model="shoal-demo", messages=MESSAGES, **kwargs)  # type: ignore[call-overload]
            texts = {ch.index: ch.message.content or "" for ch in r.choices}
            lps = {ch.index: list(ch.logprobs.content) if ch.logprobs else [] for ch in r.choices}
            return texts, lps, r.usage
        texts, lps, usage = {}, {}, None
        chunks = await c.chat.completions.create(  # type: ignore[call-overload]
            model="shoal-demo", messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **kwargs
        )
        async for chunk in chunks:
            usage = chunk.usage or usage
            for ch in chunk.choices:
                texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
                lps.setdefault(ch.index, []).extend(ch.logprobs.content if ch.logprobs and ch.logprobs.content else [])
        return texts, lps, usage


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_logprobs_and_top_logprobs(start_replica: StartReplica, stream: bool) -> None:
    replica = await start_replica()
    texts, lps, usage = await chat(
        replica.url, stream=stream, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    entries = lps[0]
    assert len(entries) == usage.completion_tokens > 0
    assert "".join(e.token for e in entries).startswith(texts[0][:4])
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
        assert e.top_logprobs[0].token == e.token  # greedy: the chosen token is the most likely
        assert e.bytes == list(e.token.encode())


@pytest.mark.parametrize("stream", [False, True])
async def test_completion_logprobs_format(start_replica: StartReplica, stream: bool) -> None:
    replica = await start_replica()
    async with client(replica.url) as c:
        if stream:
            tokens, values, tops, offsets, text = [], [], [], [], ""
            async for chunk in await c.completions.create(
                model="shoal-demo", prompt="Hello", max_tokens=10, temperature=0, logprobs=2, stream=True
            ):
                ch = chunk.choices[0]
                text += ch.text
                if ch.logprobs:
                    tokens += ch.logprobs.tokens
                    values += ch.logprobs.token_logprobs
                    tops += ch.logprobs.top_logprobs
                    offsets += ch.logprobs.text_offset
        else:
            r = await c.completions.create(model="shoal-demo", prompt="Hello", max_tokens=10, temperature=0, logprobs=2)
            lp = r.choices[0].logprobs
            assert lp is not None
            tokens, values, tops, offsets, text = (
                lp.tokens,
                lp.token_logprobs,
                lp.top_logprobs,
                lp.text_offset,
                r.choices[0].text,
            )
    assert len(tokens) == len(values) == len(tops) == len(offsets) == 10
    assert all(len(t) <= 2 for t in tops) and all(v <= 0 for v in values)
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert text.startswith(tokens[0].strip("\ufffd")[:1])


async def test_greedy_logprobs_and_penalised_answers_are_the_same_with_speculation(
    start_replica: StartReplica,
    checkpoint_with_drafter: Path,  # noqa: F811
) -> None:
    plain = await start_replica(model=str(checkpoint_with_drafter), drafter="none")
    spec = await start_replica(model=str(checkpoint_with_drafter))
    assert spec.state.engine.engine.drafter is not None
    for kwargs in (
        {"logprobs": True, "top_logprobs": 2},
        {"frequency_penalty": 1.0, "presence_penalty": 0.5},
        {"extra_body": {"repetition_penalty": 1.4}},
    ):
        for stream in (False, True):
            a = await chat(plain.url, stream=stream, max_tokens=24, temperature=0, **kwargs)
            b = await chat(spec.url, stream=stream, max_tokens=24, temperature=0, **kwargs)
            assert a[0] == b[0], kwargs
            assert [e.token for e in a[1][0]] == [e.token for e in b[1][0]]
            assert [e.logprob for e in a[1][0]] == pytest.approx([e.logprob for e in b[1][0]], abs=1e-3)
    unpenalised = await chat(plain.url, stream=False, max_tokens=24, temperature=0)
    penalised = await chat(plain.url, stream=False, max_tokens=24, temperature=0, frequency_penalty=2.0)
    assert unpenalised[0] != penalised[0]


@pytest.mark.parametrize("stream", [False, True])
async def test_n_choices_share_one_prefill(start_replica: StartReplica, stream: bool) -> None:
    replica = await start_replica()
    bm = replica.state.engine.engine.block_manager
    before_hits = bm.prefix_hit_tokens
    texts, _, usage = await chat(replica.url, stream=stream, n=3, max_tokens=8, temperature=1.0, seed=5)
    assert sorted(texts) == [0, 1, 2]
    prompt = usage.prompt_tokens
    # Choices 1 and 2 found the prompt's full blocks in the cache: all but the last, partial, block.
    block = replica.state.settings.block_size
    assert bm.prefix_hit_tokens - before_hits == 2 * ((prompt - 1) // block) * block
    assert usage.completion_tokens <= 3 * 8
    again, _, _ = await chat(replica.url, stream=not stream, n=3, max_tokens=8, temperature=1.0, seed=5)
    assert again == texts  # seeded choices are reproducible, streamed or not


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_strings_across_tokens_and_stop_token_ids(start_replica: StartReplica, stream: bool) -> None:
    replica = await start_replica()
    free, lps, _ = await chat(replica.url, stream=False, max_tokens=30, temperature=0, logprobs=True)
    text = free[0]
    stop = text[5:9]
    assert len(stop) == 4
    cut, _, usage = await chat(replica.url, stream=stream, max_tokens=30, temperature=0, stop=[stop, "never-there"])
    assert cut[0] == text[: text.index(stop)]
    assert usage.completion_tokens < 30
    # A token the answer holds, by id: re-encoding the answer's text need not give the ids generated (a random
    # model writes partial characters), so take a later token whose text is one token of its own.
    tokenizer = replica.state.tokenizer
    stop_id = next(
        ids[0]
        for entry in lps[0][3:]
        if entry.token.isascii() and entry.token.strip() and len(ids := tokenizer.encode(entry.token)) == 1
    )
    by_id, _, _ = await chat(
        replica.url, stream=stream, max_tokens=30, temperature=0, extra_body={"stop_token_ids": [stop_id]}
    )
    assert len(by_id[0]) < len(text)


async def test_max_completion_tokens_and_echo(start_replica: StartReplica) -> None:
    replica = await start_replica()
    _, _, usage = await chat(
        replica.url, stream=False, max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert usage.completion_tokens == 3
    async with client(replica.url) as c:
        r = await c.completions.create(model="shoal-demo", prompt="Hello there", max_tokens=4, temperature=0, echo=True)
        plain = await c.completions.create(model="shoal-demo", prompt="Hello there", max_tokens=4, temperature=0)
        assert r.choices[0].text == "Hello there" + plain.choices[0].text
        text = ""
        async for chunk in await c.completions.create(
            model="shoal-demo", prompt="Hello there", max_tokens=4, temperature=0, echo=True, stream=True
        ):
            text += chunk.choices[0].text
        assert text == r.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
async def test_echo_with_logprobs_gives_the_prompts_from_a_plain_forward_pass(
    start_replica: StartReplica, tiny_checkpoint: Path, stream: bool
) -> None:
    """The prompt's tokens get the served model's log_softmax at the position before each (the first: null),
    the second time too, when the prompt's blocks are in the prefix cache; completion tokens follow them."""
    import torch

    from replica.loading import load_for_serving
    from replica.settings import ReplicaSettings

    replica = await start_replica()
    model, tokenizer = load_for_serving(ReplicaSettings(model=str(tiny_checkpoint), served_model_name="shoal-demo"))
    prompt = "Please confirm order SO-1234 and the invoice before Friday."
    ids = tokenizer.encode(prompt)  # type: ignore[attr-defined]
    with torch.inference_mode():
        logits, _ = model.forward_train(torch.tensor([ids]))  # type: ignore[attr-defined]
    reference = logits[0].float().log_softmax(-1)  # position p gives token p + 1
    async with client(replica.url) as c:
        for _ in range(2):
            kwargs: dict[str, Any] = {"model": "shoal-demo", "prompt": prompt, "max_tokens": 3, "temperature": 0}
            lp: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            text = ""
            if stream:
                async for chunk in await c.completions.create(**kwargs, echo=True, logprobs=2, stream=True):
                    text += chunk.choices[0].text
                    for key in lp:
                        lp[key] += getattr(chunk.choices[0].logprobs, key) if chunk.choices[0].logprobs else []
            else:
                r = await c.completions.create(**kwargs, echo=True, logprobs=2)
                text = r.choices[0].text
                lp = {key: getattr(r.choices[0].logprobs, key) for key in lp}
            assert text.startswith(prompt)
            assert len(lp["tokens"]) == len(ids) + 3
            assert lp["tokens"][: len(ids)] == [tokenizer.decode([t]) for t in ids]  # type: ignore[attr-defined]
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            for p in range(1, len(ids)):
                assert lp["token_logprobs"][p] == pytest.approx(float(reference[p - 1, ids[p]]), abs=2e-3)
                top = reference[p - 1].topk(2).values.tolist()
                alternatives = list(lp["top_logprobs"][p].values())  # keyed by text: two ids may print alike
                assert alternatives[0] == pytest.approx(top[0], abs=2e-3)
                assert all(min(abs(v - t) for t in top) < 2e-3 for v in alternatives)
            for token, offset in zip(lp["tokens"], lp["text_offset"], strict=True):
                assert text[offset : offset + len(token)] == token
        plain = await c.completions.create(**kwargs)
        assert plain.usage.prompt_tokens_details.cached_tokens > 0  # the prompt was cached all along


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("chat", {"logit_bias": {"5": 10}}, "logit_bias"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
        ("chat", {"n": 2, "best_of": 3}, "best_of"),
        ("chat", {"service_tier": "flex"}, "service_tier"),
        ("chat", {"functions": [{"name": "f"}]}, "functions"),
        ("chat", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("chat", {"presence_penalty": 3}, "presence_penalty"),
        ("chat", {"repetition_penalty": 0}, "repetition_penalty"),
        ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("chat", {"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
        ("completions", {"suffix": "x"}, "suffix"),
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"min_tokens": 3}, "min_tokens"),
    ],
)
async def test_unsupported_parameters_get_a_400_that_names_them(
    start_replica: StartReplica, path: str, body: dict[str, Any], param: str
) -> None:
    replica = await start_replica()
    base = {"messages": MESSAGES} if path == "chat" else {"prompt": "Hello"}
    url = replica.url + ("/v1/chat/completions" if path == "chat" else "/v1/completions")
    async with (
        aiohttp.ClientSession() as http,
        http.post(url, json={"model": "shoal-demo", "max_tokens": 4, **base, **body}) as resp,
    ):
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["param"] == param, error
    assert param in error["message"]
