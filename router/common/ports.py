"""Free TCP ports for the processes Shoal starts on this host (tensor-parallel ranks, vLLM servers, benchmarks).

A port found free may be taken by another process before its owner binds it; callers that start servers retry on
"address already in use" (`replica.vllm_engine.start_all`).
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` right now."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def free_port_run(count: int, host: str = "") -> int:
    """A port p with p .. p + count - 1 free on `host` right now ("": every interface, as a `*` endpoint binds)."""
    for _ in range(100):
        base = free_port(host)
        if base + count < 65536 and all(_is_free(host, base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no run of {count} free ports")


def _is_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True
