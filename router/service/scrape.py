"""Engine gauges from a replica's Prometheus `/metrics` (DESIGN.md contract 3).

One parser serves vLLM and Shoal's replica (which exports vLLM's names) and SGLang. Samples of one gauge with
several label sets (one per model served) are summed, except KV usage, where the fullest cache counts.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

# Engine metric name -> (our name, how label sets combine).
_GAUGES: dict[str, tuple[str, str]] = {
    "vllm:num_requests_running": ("num_running", "sum"),
    "vllm:num_requests_waiting": ("num_waiting", "sum"),
    "vllm:kv_cache_usage_perc": ("kv_usage", "max"),
    "vllm:gpu_cache_usage_perc": ("kv_usage", "max"),  # vLLM before v0.10
    "sglang:num_running_reqs": ("num_running", "sum"),
    "sglang:num_queue_reqs": ("num_waiting", "sum"),
    "sglang:token_usage": ("kv_usage", "max"),
    "sglang:max_running_requests": ("max_num_seqs", "sum"),
}


def parse_engine_metrics(text: str) -> dict[str, float]:
    """Return {num_running, num_waiting, kv_usage, max_num_seqs} for the gauges present in `text` (others are
    absent)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            target = _GAUGES.get(sample.name)
            if target is None:
                continue
            name, how = target
            value = float(sample.value)
            if name not in out:
                out[name] = value
            elif how == "sum":
                out[name] += value
            else:
                out[name] = max(out[name], value)
    return out
