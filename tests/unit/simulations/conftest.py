"""Builders shared by the simulator's tests: small hand-made requests and scenarios."""

from __future__ import annotations

from typing import Any

from router.policy.hashing import namespace_seed
from simulations.scenario import Scenario
from simulations.workload import ChainState, ListWorkload, Request, SegmentTokens, tokens_of

SEED = namespace_seed("test")
BLOCK = 16


def request(
    request_id: int,
    arrival_s: float,
    segments: tuple[tuple[int, int], ...],
    output_tokens: int,
    *,
    session: str | None = None,
) -> Request:
    """A request whose prompt is `segments` of made-up tokens (equal segments: equal tokens)."""
    chain = ChainState(SEED, BLOCK)
    num_tokens = sum(length for _, length in segments)
    chain.extend(tokens_of(segments, 0, num_tokens))
    return Request(
        id=request_id,
        arrival_s=arrival_s,
        prompt_tokens=num_tokens,
        output_tokens=output_tokens,
        hashes=chain.hashes,
        tokens=SegmentTokens(segments, BLOCK),
        session=session,
    )


def workload(*requests: Request) -> ListWorkload:
    return ListWorkload(list(requests), block_size=BLOCK, seed_bytes=SEED)


def scenario(**overrides: Any) -> Scenario:
    """A scenario on a simple engine: 10 ms per step, 1 ms per prefill token, 2 ms per decoding sequence, no
    KV-read or attention term, so latencies can be worked out by hand."""
    data: dict[str, Any] = {
        "fleet": {
            "num_replicas": 1,
            "engine": {"num_kv_blocks": 1000, "max_num_batched_tokens": 8192},
            "step_model": {
                "step_s": 0.01,
                "prefill_s_per_token": 0.001,
                "decode_s_per_seq": 0.002,
                "kv_read_s_per_token": 0.0,
                "attention_s_per_token_pair": 0.0,
            },
        },
        "policies": ["round_robin"],
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = _merge(data[key], value)
        else:
            data[key] = value
    return Scenario.model_validate(data)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
