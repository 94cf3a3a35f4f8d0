"""The latency floor of a workload: each request alone on an idle replica, with every prefix it could share cached.

For every request, in arrival order, the cached prefix is what an unbounded cache shared by all earlier requests
holds (the trace's hit ceiling, at block granularity, at least one token computed), and its TTFT is the prefill of
the rest in chunks of `max_num_batched_tokens` on an idle engine, by the step model. No router can beat it: a
policy's TTFT above this floor is queueing, lost cache hits, or decode interference. Reported beside the policies.

The unbounded cache is a set of every distinct block hash of the workload: unlike a run, whose caches are the
fleet's, the floor's memory grows with the workload's distinct prefixes (`shoal simulate --no-floor` skips it).
A tiled trace (`Copies`) shares no block between its copies, so each copy gets a set of its own, dropped once no
request of that copy can arrive any more: the same hits, in the memory of a copy or two.
"""

from __future__ import annotations

from array import array

from simulations.step_model import SimulatedEngineConfig, StepModel
from simulations.workload import Copies, Workload


def isolated_prefill_s(
    prompt_tokens: int, cached_tokens: int, engine: SimulatedEngineConfig, model: StepModel
) -> float:
    """Seconds to prefill `prompt_tokens` after `cached_tokens` on an idle engine, chunk by chunk."""
    computed = cached_tokens
    total_s = 0.0
    while computed < prompt_tokens:
        chunk = min(engine.max_num_batched_tokens, prompt_tokens - computed)
        total_s += model.step_time_s(chunk, 0, computed, chunk * (computed + (chunk + 1) / 2))
        computed += chunk
    return total_s


def floor_ttfts(workload: Workload, engine: SimulatedEngineConfig, model: StepModel) -> tuple[array[float], float]:
    """(TTFT floor of each request in arrival order, token-weighted hit ratio of the shared unbounded cache)."""
    copies = workload if isinstance(workload, Copies) else None
    seen_by_copy: dict[int, set[int]] = {}
    bs = engine.block_size
    ttfts = array("d")
    hit_tokens = prompt_tokens = 0
    for request in workload.requests():
        copy = 0
        if copies is not None:
            copy = copies.copy_of(request)
            for done in [c for c in seen_by_copy if copies.copy_end_s(c) < request.arrival_s]:
                del seen_by_copy[done]
        seen = seen_by_copy.setdefault(copy, set())
        hashes = request.hashes
        limit = min(len(hashes), (request.prompt_tokens - 1) // bs)
        hit = 0
        while hit < limit and hashes[hit] in seen:
            hit += 1
        seen.update(request.cache_hashes if request.cache_hashes is not None else hashes)
        cached = hit * bs
        hit_tokens += cached
        prompt_tokens += request.prompt_tokens
        ttfts.append(isolated_prefill_s(request.prompt_tokens, cached, engine, model))
    return ttfts, (hit_tokens / prompt_tokens if prompt_tokens else 0.0)
