"""A real redis-server process on a free loopback port, for tests (DESIGN.md: real components in tests).

`redis_url` is one server for the whole session. `RedisProcess` is one a test controls: `stop()` (SIGTERM, its data
gone), `start()` again on the same port (an empty Redis, as a flushed or restarted one is), `pause()` (SIGSTOP: it
accepts connections and answers nothing, as a stalled one does) and `resume()` (SIGCONT).

`.ci/run` installs Debian's redis-server where it is missing. Elsewhere a missing binary skips the Redis tests,
except under CI (`CI` set), where it fails them: CI must never pass by skipping.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed; .ci/run installs it")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    return binary


class RedisProcess:
    """One redis-server on 127.0.0.1:`port`, without persistence."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.binary = _binary()
        self.workdir = workdir
        self.port = port or _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start it and return once it answers PING (polled with a deadline)."""
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)  # polling a process that is starting, with a deadline

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = RedisProcess(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server.url
    server.stop()


@pytest.fixture
def redis_process(tmp_path: Path) -> Iterator[RedisProcess]:
    """A redis-server of the test's own, which it may stop, pause and restart."""
    server = RedisProcess(tmp_path)
    server.start()
    yield server
    server.stop()
