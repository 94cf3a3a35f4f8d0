"""Engine gauges and the KV cache's size from vLLM's, Shoal's and SGLang's /metrics (router/service/scrape.py)."""

from __future__ import annotations

from prometheus_client import generate_latest

from replica.server.metrics import ReplicaMetrics
from router.service.scrape import parse_engine_metrics

VLLM = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",model_name="m",num_gpu_blocks="2048"} 1.0
vllm:cache_config_info{block_size="16",engine="1",model_name="m",num_gpu_blocks="1024"} 1.0
"""


def test_the_kv_cache_size_is_blocks_times_block_size_the_smallest_engine_counting() -> None:
    gauges = parse_engine_metrics(VLLM)
    assert gauges == {"num_running": 3.0, "kv_capacity_tokens": 16 * 1024.0, "kv_block_size": 16.0}


def test_a_cache_not_yet_profiled_has_no_size() -> None:
    text = 'vllm:cache_config_info{block_size="128",num_gpu_blocks="None"} 1.0\n'
    assert parse_engine_metrics(text) == {"kv_block_size": 128.0}  # the block size is known before the profile


def test_sglang_reports_its_cache_in_tokens() -> None:
    text = 'sglang:max_total_num_tokens{model_name="m"} 500000.0\nsglang:num_queue_reqs{model_name="m"} 2.0\n'
    assert parse_engine_metrics(text) == {"kv_capacity_tokens": 500000.0, "num_waiting": 2.0}


def test_shoal_replicas_export_the_batch_limit_vllm_does_not() -> None:
    metrics = ReplicaMetrics("m")
    metrics.max_num_seqs.labels("m").set(48)
    metrics.num_running.labels("m").set(5)
    gauges = parse_engine_metrics(generate_latest(metrics.registry).decode())
    assert gauges["max_num_seqs"] == 48.0
    assert gauges["num_running"] == 5.0
