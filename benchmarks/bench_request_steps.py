"""The routing work of one proxied request, step by step, in-process: what `bench_proxy.py`'s router does per request
besides HTTP, for the same chat bodies (loadgen.py's, 1 KB by default) and two replicas.

Steps, as `Proxy` runs them: the JSON parse, the routing text, `PoolRouting.prepare` (hashing), `choose` (match and
policy), `begin`, `commit` (the rest of the hashing and the record), `first_byte`, `finish`, and the three metric
updates. Not a test: it prints p50 microseconds per step (one core: run it under `taskset -c 0`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from itertools import pairwise

import orjson

from benchmarks.loadgen import make_bodies
from router.policy.config import build_policy
from router.policy.prefix_index import PrefixIndex
from router.policy.routing_text import chat_routing_key
from router.service.metrics import RouterMetrics
from router.service.pool import ReplicaPool
from router.service.routing import PoolRouting
from router.service.settings import RouterSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--prompt-bytes", type=int, default=1024)
    parser.add_argument("--policy", default="estimated_ttft")
    args = parser.parse_args()

    settings = RouterSettings(replicas=["http://127.0.0.1:9001", "http://127.0.0.1:9002"], policy={"kind": args.policy})
    pool = ReplicaPool()
    routing = PoolRouting(
        settings, pool, PrefixIndex(settings.index), build_policy(settings.policy, seed=0), settings.prefill_rate
    )
    for url in settings.replicas:
        replica = pool.add(url)
        replica.is_healthy = True
        routing.add_replica(replica)
    metrics = RouterMetrics(pool)
    bodies = make_bodies(64, args.prompt_bytes, "m")
    clock = time.monotonic
    tick = time.perf_counter_ns
    steps = ("json parse", "routing text", "prepare", "choose", "begin", "commit", "first byte", "finish", "metrics")
    times: dict[str, list[int]] = {step: [] for step in steps}
    for i in range(args.requests):
        raw = bodies[i % len(bodies)]
        stamps = [tick()]
        body = orjson.loads(raw)
        stamps.append(tick())
        key = chat_routing_key(body)
        stamps.append(tick())
        prepared = routing.prepare(key, "m", None, None)
        stamps.append(tick())
        now = clock()
        decision = routing.choose(prepared, [], now)
        stamps.append(tick())
        assert decision is not None
        chosen = pool.get(decision.replica)
        assert chosen is not None
        stamps.append(tick())
        ticket = routing.begin(chosen, decision, prepared, now)
        stamps.append(tick())
        routing.commit(prepared, decision, now)
        stamps.append(tick())
        routing.first_byte(ticket, clock(), is_stream=False)
        stamps.append(tick())
        routing.finish(ticket)
        stamps.append(tick())
        metrics.decision_seconds.observe(1e-4)
        metrics.request_seconds.observe(1e-3)
        metrics.requests.inc(("200", decision.branch.value, chosen.id))
        stamps.append(tick())
        durations = [b - a for a, b in pairwise(stamps)]
        del durations[4]  # the pool look-up between choose and begin
        for step, duration in zip(steps, durations, strict=True):
            times[step].append(duration)
    warmup = args.requests // 10
    print(f"{args.requests} requests, {args.prompt_bytes}-byte chat prompts, policy {args.policy}, 2 replicas")
    print(f"{'step':14s}{'p50 us':>9s}")
    total = 0.0
    for step, samples in times.items():
        p50 = statistics.median(samples[warmup:]) / 1000
        total += p50
        print(f"{step:14s}{p50:9.1f}")
    print(f"{'sum':14s}{total:9.1f}")


if __name__ == "__main__":
    main()
