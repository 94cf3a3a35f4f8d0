"""Engine gauges from a replica's Prometheus `/metrics` (DESIGN.md contract 3).

One parser serves vLLM and Shoal's replica (which exports vLLM's names, and as `shoal_replica_max_num_seqs` the
batch limit that vLLM does not export) and SGLang. Samples of one gauge with several label sets (one per model
served) are summed, except KV usage, where the fullest cache counts. The KV
cache's size in tokens comes from vLLM's `vllm:cache_config_info` (its labels `num_gpu_blocks` x `block_size`) or
SGLang's `sglang:max_total_num_tokens`; with several label sets the smallest counts. vLLM's KV block size (128 on
CPUs, 16 on GPUs) comes from the same labels: only whole blocks enter its prefix cache.
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
    "shoal_replica_max_num_seqs": ("max_num_seqs", "sum"),
}


def parse_engine_metrics(text: str) -> dict[str, float]:
    """Return {num_running, num_waiting, kv_usage, max_num_seqs, kv_capacity_tokens, kv_block_size} for the gauges
    present in `text` (others are absent)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info" and sample.labels.get("block_size", "").isdigit():
                out["kv_block_size"] = max(out.get("kv_block_size", 0.0), float(sample.labels["block_size"]))
            capacity = _kv_capacity_tokens(sample.name, sample.labels, sample.value)
            if capacity is not None:
                out["kv_capacity_tokens"] = min(out.get("kv_capacity_tokens", capacity), capacity)
                continue
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


def _kv_capacity_tokens(name: str, labels: dict[str, str], value: float) -> float | None:
    if name == "vllm:cache_config_info":
        try:
            capacity = float(labels["num_gpu_blocks"]) * float(labels["block_size"])
        except (KeyError, ValueError):  # vLLM before the profile run reports num_gpu_blocks="None"
            return None
        return capacity if capacity > 0 else None
    if name == "sglang:max_total_num_tokens":
        return value if value > 0 else None
    return None
