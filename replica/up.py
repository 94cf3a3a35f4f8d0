"""`shoal up`: a router and N replicas of one model on loopback, for a laptop or a single GPU box.

The demo model is built once, in this process, before any replica starts (N replicas must not race to train it).
Each replica gets an equal share of the CPU threads. The router starts with every replica's URL and holds requests
until their health checks pass. Ctrl-C (or SIGTERM) stops every child; a child that dies stops the rest.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def _shoal_command() -> list[str]:
    exe = Path(sys.executable).parent / "shoal"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("shoal")
    if found:
        return [found]
    return [sys.executable, "-c", "import sys; from router.cli import main; sys.exit(main())"]


def _wait_healthy(url: str, procs: list[subprocess.Popen[bytes]], *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(map(str, proc.args))} exited with status {proc.returncode}")  # type: ignore[arg-type]
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")
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
) -> int:
    if num_replicas < 1:
        print("shoal up: --replicas must be at least 1", file=sys.stderr)
        return 2
    if model == "demo":
        from replica.demo.build import ensure_demo_model

        ensure_demo_model()
    served_name = "shoal-demo" if model == "demo" else Path(model).resolve().name
    shoal = _shoal_command()
    threads = max(1, (os.cpu_count() or 1) // num_replicas)
    procs: list[subprocess.Popen[bytes]] = []
    replica_urls = []

    def stop_all(*_: Any) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()

    def on_sigterm(*_: Any) -> None:
        stop_all()
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        for i in range(num_replicas):
            replica_port = replica_base_port + i
            cmd = [*shoal, "replica", "--model", model, "--served-model-name", served_name]
            cmd += ["--port", str(replica_port), "--threads", str(threads)]
            if quantization != "none":
                cmd += ["--quantization", quantization]
            procs.append(subprocess.Popen(cmd))
            replica_urls.append(f"http://127.0.0.1:{replica_port}")
        for url in replica_urls:
            _wait_healthy(url + "/health", procs, timeout_s=300)
        router_cmd = [*shoal, "router", "--port", str(port), "--no-request-log"]
        for url in replica_urls:
            router_cmd += ["--replica", url]
        procs.append(subprocess.Popen(router_cmd))
        endpoint = f"http://127.0.0.1:{port}"
        _wait_healthy(endpoint + "/ready", procs, timeout_s=60)
        print(f"\nShoal is up: {endpoint}/v1 (OpenAI API), {num_replicas} replica(s): {', '.join(replica_urls)}")
        print(f"  metrics: {endpoint}/metrics   replicas: {', '.join(u + '/metrics' for u in replica_urls)}")
        if demo_requests:
            from replica.demo.requests import run_demo_requests

            run_demo_requests(endpoint, model=served_name)
            if exit_after_demo:
                return 0
        print("Ctrl-C stops the router and the replicas.", flush=True)
        while all(proc.poll() is None for proc in procs):
            time.sleep(0.5)
        dead = next(proc for proc in procs if proc.poll() is not None)
        print(f"shoal up: {' '.join(map(str, dead.args))} exited with {dead.returncode}; stopping", file=sys.stderr)  # type: ignore[arg-type]
        return 1
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"shoal up: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_all()
