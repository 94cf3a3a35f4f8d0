"""Free loopback ports for tests that start processes on fixed ports (`shoal up`, the local actuator)."""

from __future__ import annotations

import socket


def is_free(port: int) -> bool:
    """Whether `port` can be bound on 127.0.0.1 now (closed connections lingering in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> int:
    """A port p with p .. p + count - 1 free right now."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base: int = s.getsockname()[1]
        if base + count < 65536 and all(is_free(base + i) for i in range(1, count)):
            return base
    raise RuntimeError(f"no run of {count} free ports")
