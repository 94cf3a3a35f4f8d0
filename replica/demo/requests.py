"""The requests `make demo` sends once the fleet is up: a Japanese chat (under one of the corpus's system prompts,
as every chat the demo model was trained on has one), a tool call (the tool named with `tool_choice`, so the call
is constrained to the function's schema), and the same long system prompt twice, to show the second request's
cached tokens and its lower time to first token; then what speculative decoding did on each replica (drafts
verified and the mean acceptance length, from its `/metrics`).

Stdlib HTTP only (the router's and the replica's dependencies suffice); TTFT is measured on the client from the
request's start to the first streamed content chunk.
"""

from __future__ import annotations

import copy
import json
import time
import urllib.error
import urllib.request
from typing import Any

from replica.demo.corpus import TOOLS
from replica.demo.phrasebook import JAPANESE

_POLICY_LINES = [
    "All quotes are valid for thirty days from the date of issue unless the customer agrees otherwise in writing.",
    "見積書の有効期限は発行日から三十日間です。延長をご希望の場合は担当者までご連絡ください。",
    "Invoices are issued at the end of each month and payment is due within forty-five days.",
    "請求書は毎月末に発行し、お支払い期限は発行日から四十五日以内とさせていただきます。",
    "Orders above five hundred units need approval from the regional sales manager before shipping.",
    "五百個を超えるご注文は、出荷前に地域営業部長の承認が必要となります。",
    "Meeting rooms on the third floor can be booked for at most two hours at a time.",
    "三階の会議室は一回につき最大二時間までご予約いただけます。",
    "Shipping delays of more than three business days must be reported to the customer on the same day.",
    "三営業日を超える納期遅延が発生した場合は、当日中にお客様へご連絡いたします。",
]


def long_system_prompt(num_repeats: int = 4) -> str:
    """About 1,650 tokens of the demo tokenizer at the default: long, and inside the demo model's 2,048."""
    lines = [
        "You are the assistant of Sakura Trading. Follow the company policies below. 以下の社内規定に従ってください。"
    ]
    for i in range(num_repeats):
        for j, line in enumerate(_POLICY_LINES):
            lines.append(f"{i * len(_POLICY_LINES) + j + 1}. {line}")
    return "\n".join(lines)


def _stream_chat(endpoint: str, body: dict[str, Any]) -> tuple[str, float, dict[str, Any], str]:
    """-> (text, seconds to first content, usage, replica that served it)."""
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(
        endpoint + "/v1/chat/completions",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    started = time.monotonic()
    first = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=300) as resp:
        replica = resp.headers.get("x-shoal-replica", "?") + " " + resp.headers.get("x-shoal-route-branch", "")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    if first is None:
                        first = time.monotonic() - started
                    parts.append(content)
    return "".join(parts), first if first is not None else float("nan"), usage, replica


def _post(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        endpoint + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        result: dict[str, Any] = json.load(resp)
        return result


def tool_call_request(model: str) -> dict[str, Any]:
    """The demo's tool-call request. Naming the tool makes the call grammar-constrained, and the request's copy of
    the tool pins its argument (an order number's pattern, no other keys), so every build of the demo model writes a
    valid call of it, whatever it would have written unconstrained. The order number is not the schema's example
    (ORD-48213): the corpus repeats that one in every tools block and never asks for it, so the demo tokenizer holds
    it as one token and the model has learned not to copy it."""
    tools = copy.deepcopy(TOOLS)
    for tool in tools:
        if tool["function"]["name"] == "get_order_status":
            parameters = tool["function"]["parameters"]
            parameters["properties"]["order_id"]["pattern"] = "^ORD-[0-9]{5}$"
            parameters["additionalProperties"] = False
    return {
        "model": model,
        "max_tokens": 80,
        "temperature": 0,
        "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "get_order_status"}},
        "messages": [{"role": "user", "content": "Could you check the status of order ORD-71520?"}],
    }


def run_demo_requests(endpoint: str, model: str = "shoal-demo", replica_urls: list[str] | None = None) -> None:
    try:
        _run_demo_requests(endpoint, model)
        if replica_urls:
            _speculation_summary(replica_urls)
    except urllib.error.HTTPError as exc:
        print(f"request failed: HTTP {exc.code}: {exc.read().decode(errors='replace')}")


def _speculation_summary(replica_urls: list[str]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    print("\n== 4. Speculative decoding on each replica ==")
    for url in replica_urls:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
            text = resp.read().decode()
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("vllm:spec_decode_num_") and "position" not in sample.labels:
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
        drafts = totals.get("vllm:spec_decode_num_drafts_total", 0.0)
        if not drafts:
            print(f"{url}: no drafts verified (speculation off, or no drafter)")
            continue
        accepted = totals.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
        drafted = totals.get("vllm:spec_decode_num_draft_tokens_total", 0.0)
        print(
            f"{url}: {drafts:.0f} verifications, {accepted:.0f} of {drafted:.0f} drafted tokens accepted; "
            f"mean acceptance length {1 + accepted / drafts:.2f} tokens per sequence per step"
        )


def japanese_chat_request(model: str) -> dict[str, Any]:
    """The demo's Japanese chat: an ask of the corpus's first scenario (order status) with values of its own, under
    one of the corpus's system prompts. The demo model knows only the corpus's scenarios: a free-form ask
    ("来週の火曜日に打ち合わせの時間をいただけますか。") gets the corpus's closing line."""
    ask = "株式会社山田製作所様のご注文（注文番号：ORD-30981）の状況を確認していただけますでしょうか。"
    return {
        "model": model,
        "max_tokens": 60,
        "temperature": 0,
        "messages": [
            {"role": "system", "content": JAPANESE.system_prompts[1]},
            {"role": "user", "content": ask},
        ],
    }


def _run_demo_requests(endpoint: str, model: str) -> None:
    print("\n== 1. A chat in Japanese ==")
    reply = _post(endpoint, japanese_chat_request(model))
    print("assistant:", reply["choices"][0]["message"]["content"])

    print("\n== 2. A tool call ==")
    reply = _post(endpoint, tool_call_request(model))
    message = reply["choices"][0]["message"]
    print("finish_reason:", reply["choices"][0]["finish_reason"])
    print("tool_calls:", json.dumps(message.get("tool_calls"), ensure_ascii=False))
    print("content:", message.get("content"))

    print("\n== 3. The same long system prompt twice (prefix cache) ==")
    system = long_system_prompt()
    rows = []
    for question in ("What is the payment term for invoices?", "見積書の有効期限を教えてください。"):
        body = {
            "model": model,
            "max_tokens": 24,
            "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        }
        text, ttft, usage, replica = _stream_chat(endpoint, body)
        cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        rows.append((question, replica, usage.get("prompt_tokens", 0), cached, ttft, text))
    print(f"{'request':<10} {'replica and routing branch':<28} {'prompt':>7} {'cached':>7} {'TTFT':>8}")
    for i, (_, replica, prompt, cached, ttft, _) in enumerate(rows):
        print(f"{'cold' if i == 0 else 'warm':<10} {replica:<28} {prompt:>7} {cached:>7} {ttft * 1000:>6.0f}ms")
    if rows[1][4] > 0:
        print(
            f"time to first token {rows[0][4] / rows[1][4]:.1f}x lower with {rows[1][3]} of {rows[1][2]} prompt "
            "tokens served from the prefix cache"
        )
