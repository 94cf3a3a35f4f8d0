"""`shoal up`: a router and N replicas of one model on loopback, for a laptop or a single GPU box.

The demo model is built once, in this process, before any replica starts (N replicas must not race to train it).
Each replica gets an equal share of the CPU threads. The router starts with every replica's URL and holds requests
until their health checks pass. Ctrl-C (or SIGTERM) stops every child; a child that dies stops the rest; a
`shoal up` killed outright takes its children with it (Linux: `router.common.child_processes`).

With `--autoscale`, the router starts empty and `shoal autoscaler` with its local actuator owns the replicas: it
starts `--min-replicas`, grows to `--max-replicas` under load and drains and stops them when the load goes. With
`--min-replicas 0` it starts none: the router holds the first request, the autoscaler sees it held and wakes a
replica, and after an idle window (`SHOAL_AUTOSCALER_POLICY__SCALE_TO_ZERO__IDLE_S`) the fleet is at zero again. The two
processes share a random admin token (passed in their environment, never on a command line). The autoscaler is run
as `python -m autoscaler.cli`: the replica package never imports the autoscaler (DESIGN.md's layers).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from router.common.child_processes import shoal_command, start_child


def _wait_healthy(
    url: str,
    procs: list[subprocess.Popen[bytes]],
    *,
    timeout_s: float,
    is_ready: Callable[[bytes], bool] = lambda _: True,
    what: str = "",
) -> None:
    """Poll `url` until it answers 200 with a body `is_ready` accepts; fail early if a child process has died."""
    deadline = time.monotonic() + timeout_s
    while True:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(map(str, proc.args))} exited with status {proc.returncode}")  # type: ignore[arg-type]
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200 and is_ready(resp.read()):
                    return
        except (urllib.error.URLError, OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what or url + ' did not answer'} within {timeout_s:.0f} s")
        time.sleep(0.2)


def run_up(
    *,
    num_replicas: int,
    model: str,
    port: int,
    replica_base_port: int,
    quantization: str = "none",
    demo_requests: bool = False,
    exit_after_demo: bool = False,
    autoscale: bool = False,
    min_replicas: int = 1,
    max_replicas: int = 4,
    engine: str = "shoal",
    vllm_python: str | None = None,
) -> int:
    if num_replicas < 1:
        print("shoal up: --replicas must be at least 1", file=sys.stderr)
        return 2
    if engine == "vllm" and (autoscale or quantization != "none"):
        print(
            "shoal up: --engine vllm starts a fixed fleet: --autoscale and --quantization are for Shoal's replica",
            file=sys.stderr,
        )
        return 2
    if autoscale and not (0 <= min_replicas <= max_replicas and max_replicas >= 1):
        print("shoal up: need 0 <= --min-replicas <= --max-replicas, and --max-replicas >= 1", file=sys.stderr)
        return 2
    step = _Steps()
    from replica.demo.build import ensure_demo_model

    if model == "demo":
        step(f"demo model: {ensure_demo_model(progress=step)}")
    served_name = "shoal-demo" if model == "demo" else Path(model).resolve().name
    shoal = shoal_command()
    threads = max(1, (os.cpu_count() or 1) // (max_replicas if autoscale else num_replicas))
    procs: list[subprocess.Popen[bytes]] = []
    replica_urls = []

    def stop_all(*_: Any) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                # The autoscaler first stops its replicas (each gets 15 s): give it longer than that.
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()

    def on_sigterm(*_: Any) -> None:
        stop_all()
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        if autoscale:
            step(f"starting the router on port {port} and the autoscaler ({min_replicas}-{max_replicas} replicas)")
            endpoint = _start_autoscaled(
                procs,
                shoal,
                model=model,
                served_name=served_name,
                port=port,
                replica_base_port=replica_base_port,
                quantization=quantization,
                threads=threads,
                min_replicas=min_replicas,
                max_replicas=max_replicas,
            )
            return _serve(procs, endpoint, served_name, demo_requests, exit_after_demo, [])
        if engine == "vllm":
            checkpoint = ensure_demo_model(progress=step) if model == "demo" else Path(model)
            return _up_vllm(
                procs,
                step,
                checkpoint,
                served_name,
                num_replicas,
                port,
                replica_base_port,
                vllm_python,
                demo_requests,
                exit_after_demo,
            )
        for i in range(num_replicas):
            replica_port = replica_base_port + i
            cmd = [*shoal, "replica", "--model", model, "--served-model-name", served_name]
            cmd += ["--port", str(replica_port), "--threads", str(threads)]
            if quantization != "none":
                cmd += ["--quantization", quantization]
            step(f"starting replica {i + 1} of {num_replicas} on port {replica_port} ({threads} thread(s))")
            procs.append(start_child(cmd))
            replica_urls.append(f"http://127.0.0.1:{replica_port}")
        step("waiting for the replicas to load the model and answer /health")
        for url in replica_urls:
            _wait_healthy(url + "/health", procs, timeout_s=300)
            step(f"replica {url} ready")
        step(f"starting the router on port {port}")
        router_cmd = [*shoal, "router", "--port", str(port), "--no-request-log"]
        for url in replica_urls:
            router_cmd += ["--replica", url]
        procs.append(start_child(router_cmd))
        endpoint = f"http://127.0.0.1:{port}"
        _wait_healthy(endpoint + "/ready", procs, timeout_s=60)
        step("router ready")
        print(f"\nShoal is up: {endpoint}/v1 (OpenAI API), {num_replicas} replica(s): {', '.join(replica_urls)}")
        print(f"  metrics: {endpoint}/metrics   replicas: {', '.join(u + '/metrics' for u in replica_urls)}")
        return _serve(procs, endpoint, served_name, demo_requests, exit_after_demo, replica_urls)
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"shoal up: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_all()


def _up_vllm(
    procs: list[subprocess.Popen[bytes]],
    step: Callable[[str], None],
    checkpoint: Path,
    served_name: str,
    num_replicas: int,
    port: int,
    replica_base_port: int,
    vllm_python: str | None,
    demo_requests: bool,
    exit_after_demo: bool,
) -> int:
    """N vLLM servers of `checkpoint` (each on cores of its own where there are enough), and the router in exact
    mode in front: KV events from each server's ZMQ publisher, chat routed on the model's token ids."""
    from replica.vllm_engine import VllmServer, find_vllm_python, start_all
    from router.common.ports import free_port_run

    python = find_vllm_python(vllm_python)
    if python is None:
        raise RuntimeError("no vLLM to start: `make vllm` builds its CPU build into .venv-vllm (or pass --vllm-python)")
    cores = sorted(os.sched_getaffinity(0))
    per_server = len(cores) // num_replicas
    servers = []
    for i in range(num_replicas):
        cpus = None
        if per_server:
            mine = cores[i * per_server : (i + 1) * per_server]
            cpus = ",".join(map(str, mine))
        servers.append(
            VllmServer(
                checkpoint,
                served_name,
                port=replica_base_port + i,
                events_port=free_port_run(2),
                cpus=cpus,
                # The demo's tool calls are Hermes-style (<tool_call>{...}</tool_call>); usage reports cached tokens.
                extra_args=(
                    "--enable-auto-tool-choice",
                    "--tool-call-parser",
                    "hermes",
                    "--enable-prompt-tokens-details",
                ),
            )
        )
    log_dir = Path(tempfile.mkdtemp(prefix="shoal-up-vllm-"))
    for server in servers:
        step(
            f"starting vLLM on port {server.port} (cores {server.cpus or 'all'}; log {log_dir}/vllm-{server.port}.log)"
        )
    step("waiting for vLLM to load the model (a minute or two on a CPU)")
    started = start_all(servers, python, log_dir, timeout_s=600, progress=step)
    procs.extend(proc for _, proc in started)
    servers = [server for server, _ in started]
    env = {
        **os.environ,
        "SHOAL_ROUTER_KV_EVENTS__SOURCE": "zmq",
        "SHOAL_ROUTER_TOKENIZER__MODELS": json.dumps({served_name: str(checkpoint.resolve())}),
    }
    router_cmd = [*shoal_command(), "router", "--port", str(port), "--no-request-log"]
    for server in servers:
        router_cmd += ["--replica", server.url]
    step(f"starting the router on port {port} (exact mode: vLLM's KV events)")
    procs.append(start_child(router_cmd, env=env))
    endpoint = f"http://127.0.0.1:{port}"
    _wait_healthy(endpoint + "/ready", procs, timeout_s=60)
    step("router ready")
    urls = ", ".join(s.url for s in servers)
    print(f"\nShoal is up: {endpoint}/v1 (OpenAI API), {num_replicas} vLLM replica(s): {urls}")
    return _serve(procs, endpoint, served_name, demo_requests, exit_after_demo, [])


def _serve(
    procs: list[subprocess.Popen[bytes]],
    endpoint: str,
    served_name: str,
    demo_requests: bool,
    exit_after_demo: bool,
    replica_urls: list[str],
) -> int:
    """Send the demo requests if asked, then wait until Ctrl-C or until a child dies."""
    if demo_requests:
        from replica.demo.requests import run_demo_requests

        print("sending the demo requests", flush=True)
        run_demo_requests(endpoint, model=served_name, replica_urls=replica_urls)
        if exit_after_demo:
            return 0
    print("Ctrl-C stops the router and the replicas.", flush=True)
    while all(proc.poll() is None for proc in procs):
        time.sleep(0.5)
    dead = next(proc for proc in procs if proc.poll() is not None)
    print(f"shoal up: {' '.join(map(str, dead.args))} exited with {dead.returncode}; stopping", file=sys.stderr)  # type: ignore[arg-type]
    return 1


# Policy defaults for the demo, unless the environment sets them: the demo model loads in seconds, and a fleet
# that shrinks a minute after the load stops shows the autoscaler at work.
_DEMO_POLICY_ENV = {
    "SHOAL_AUTOSCALER_POLICY__EXPECTED_START_S": "30",
    "SHOAL_AUTOSCALER_POLICY__STABLE_WINDOW_S": "20",
    "SHOAL_AUTOSCALER_POLICY__SCALE_DOWN__STABILIZATION_WINDOW_S": "60",
    "SHOAL_AUTOSCALER_POLICY__SCALE_DOWN__PERIOD_S": "15",
    "SHOAL_AUTOSCALER_POLICY__SCALE_TO_ZERO__IDLE_S": "120",
}
_WAKE_HOLD_S = "300"
"""With --min-replicas 0, seconds the router holds a request that wakes the fleet (unless the environment sets
`SHOAL_ROUTER_HOLD__MAX_WAIT_S`): a replica's whole start, the model's load included, not just a restart."""


class _Steps:
    """Prints what `shoal up` is doing while it starts, each line with the seconds since it began, so a slow
    start shows where it is."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, message: str) -> None:
        print(f"shoal up [{time.monotonic() - self.started:5.1f} s] {message}", flush=True)


def _start_autoscaled(
    procs: list[subprocess.Popen[bytes]],
    shoal: list[str],
    *,
    model: str,
    served_name: str,
    port: int,
    replica_base_port: int,
    quantization: str,
    threads: int,
    min_replicas: int,
    max_replicas: int,
) -> str:
    """An empty router and the autoscaler that fills it; returns the router's URL once a replica serves (at once with
    `min_replicas` 0: the first request wakes one)."""
    token = secrets.token_urlsafe(24)
    endpoint = f"http://127.0.0.1:{port}"
    router_env = {**os.environ, "SHOAL_ROUTER_ADMIN_TOKEN": token}
    if min_replicas == 0:
        router_env.setdefault("SHOAL_ROUTER_HOLD__MAX_WAIT_S", _WAKE_HOLD_S)
    procs.append(start_child([*shoal, "router", "--port", str(port), "--no-request-log"], env=router_env))
    _wait_healthy(endpoint + "/health", procs, timeout_s=60)
    metrics_port = port + 1
    env = {**_DEMO_POLICY_ENV, **os.environ, "SHOAL_AUTOSCALER_ADMIN_TOKEN": token}
    env["SHOAL_AUTOSCALER_LOCAL__MAX_REPLICAS"] = str(max_replicas)
    env["SHOAL_AUTOSCALER_LOCAL__THREADS"] = str(threads)
    if quantization != "none":
        env["SHOAL_AUTOSCALER_LOCAL__REPLICA_ARGS"] = json.dumps(["--quantization", quantization])
    cmd = [sys.executable, "-m", "autoscaler.cli", "--actuator", "local", "--router", endpoint]
    cmd += ["--model", model, "--served-model-name", served_name, "--replica-base-port", str(replica_base_port)]
    cmd += ["--min-replicas", str(min_replicas), "--max-replicas", str(max_replicas)]
    cmd += ["--metrics-port", str(metrics_port)]
    procs.append(start_child(cmd, env=env))
    # The router answers /ready 200 while it holds requests; wait for a replica in rotation, unless the fleet
    # starts at zero (then the autoscaler's own /metrics answering says it is up).
    if min_replicas == 0:
        _wait_healthy(f"http://127.0.0.1:{metrics_port}/metrics", procs, timeout_s=60)
    else:
        _wait_healthy(
            endpoint + "/ready",
            procs,
            timeout_s=300,
            is_ready=lambda body: json.loads(body).get("status") == "ready",
            what=f"no replica was serving behind {endpoint}",
        )
    woken = "; the first request wakes a replica" if min_replicas == 0 else ""
    print(
        f"\nShoal is up: {endpoint}/v1 (OpenAI API), autoscaling {min_replicas}-{max_replicas} replica(s) "
        f"on ports from {replica_base_port}{woken}"
    )
    print(f"  metrics: {endpoint}/metrics   autoscaler: http://127.0.0.1:{metrics_port}/metrics")
    return endpoint
