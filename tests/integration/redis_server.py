"""Real redis-server processes on free loopback ports, for tests (DESIGN.md: real components in tests).

`redis_url` is one server for the whole session. `RedisProcess` is one a test controls: `stop()` (SIGTERM, its data
gone), `start()` again on the same port (an empty Redis, as a flushed or restarted one is), `pause()` (SIGSTOP: it
accepts connections and answers nothing, as a stalled one does) and `resume()` (SIGCONT). `RedisSentinel` is a
primary, its replica and a sentinel (`redis_sentinel`); `RedisClusterProcesses` a three-node cluster
(`redis_cluster`).

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
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def command(port: int, *args: str) -> bytes:
    """One command's raw reply from 127.0.0.1:`port` (RESP), or b"" when it does not answer within a second."""
    request = f"*{len(args)}\r\n" + "".join(f"${len(a.encode())}\r\n{a}\r\n" for a in args)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
            conn.sendall(request.encode())
            return conn.recv(65536)
    except OSError:
        return b""


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    """Poll `predicate` until it holds; fail the test naming `what` past the deadline."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s} s")
        time.sleep(0.05)  # polling servers that are starting or electing, with a deadline


def _binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed; .ci/run installs it")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    return binary


class RedisProcess:
    """One redis-server on 127.0.0.1:`port`, without persistence; `args` are more of its options."""

    def __init__(self, workdir: Path, port: int | None = None, args: Sequence[str] = ()) -> None:
        self.binary = _binary()
        self.workdir = workdir
        self.port = port or _free_port()
        self.args = list(args)
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
                *self.args,
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
        return command(self.port, "PING").startswith(b"+PONG")

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


class RedisSentinel:
    """A primary, a replica of it and one `redis-server --sentinel` monitoring the primary as `service` (quorum 1,
    down after `down_after_ms`), so that stopping the primary (SIGSTOP) makes the sentinel promote the replica."""

    def __init__(self, workdir: Path, service: str = "shoal-primary", down_after_ms: int = 500) -> None:
        self.service = service
        self.primary = RedisProcess(workdir / "primary")
        self.replica = RedisProcess(workdir / "replica", args=["--replicaof", "127.0.0.1", str(self.primary.port)])
        self.sentinel_port = _free_port()
        self.sentinel_dir = workdir / "sentinel"
        self._down_after_ms = down_after_ms
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{self.service}/0"

    def start(self) -> None:
        for folder in (self.primary.workdir, self.replica.workdir, self.sentinel_dir):
            folder.mkdir(parents=True, exist_ok=True)
        self.primary.start()
        self.replica.start()
        config = self.sentinel_dir / "sentinel.conf"  # the sentinel rewrites it, so a file of its own
        config.write_text(
            f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {self.sentinel_dir}\n"
            f"sentinel monitor {self.service} 127.0.0.1 {self.primary.port} 1\n"
            f"sentinel down-after-milliseconds {self.service} {self._down_after_ms}\n"
            f"sentinel failover-timeout {self.service} 2000\n"
        )
        self.proc = subprocess.Popen(
            [self.primary.binary, str(config), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_for(
            lambda: self._is_running() and self.primary_port() == self.primary.port, "the sentinel names the primary"
        )
        wait_for(lambda: b"master_link_status:up" in command(self.replica.port, "INFO", "replication"), "replication")
        wait_for(lambda: b"num-slaves\r\n$1\r\n1" in self._master_info(), "the sentinel sees the replica")

    def _is_running(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            pytest.fail(f"redis-server --sentinel exited (port {self.sentinel_port})")
        return True

    def _master_info(self) -> bytes:
        return command(self.sentinel_port, "SENTINEL", "MASTER", self.service)

    def primary_port(self) -> int | None:
        """The primary's port as the sentinel says it, None while it cannot say."""
        reply = command(self.sentinel_port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service).split(b"\r\n")
        return int(reply[4]) if len(reply) > 4 and reply[4].isdigit() else None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None
        self.replica.stop()
        self.primary.stop()


class RedisClusterProcesses:
    """`num_nodes` `redis-server --cluster-enabled yes` primaries on free ports, joined by `redis-cli --cluster
    create` (every slot covered, no replicas); `start` returns once every node reports `cluster_state:ok`."""

    def __init__(self, workdir: Path, num_nodes: int = 3) -> None:
        self.nodes = [
            RedisProcess(
                workdir / f"node{i}",
                # a bus port of its own: the default, port + 10000, is past 65535 for half the free ports
                args=[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    f"nodes-{i}.conf",
                    "--cluster-port",
                    str(_free_port()),
                ],
            )
            for i in range(num_nodes)
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)

    def start(self) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            if os.environ.get("CI"):
                pytest.fail("redis-cli is not installed; .ci/run installs redis-server, which brings it")
            pytest.skip("redis-cli is not installed (apt-get install redis-tools)")
        for node in self.nodes:
            node.workdir.mkdir(parents=True, exist_ok=True)
            node.start()
        subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{node.port}" for node in self.nodes), "--cluster-yes"],
            check=True,
            timeout=30,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for node in self.nodes:
            wait_for(lambda n=node: b"cluster_state:ok" in command(n.port, "CLUSTER", "INFO"), "cluster_state:ok")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@pytest.fixture
def redis_sentinel(tmp_path: Path) -> Iterator[RedisSentinel]:
    """A Sentinel-managed primary and replica of the test's own."""
    servers = RedisSentinel(tmp_path)
    try:
        servers.start()
        yield servers
    finally:
        servers.stop()


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisClusterProcesses]:
    """A three-node Redis Cluster of the test's own."""
    cluster = RedisClusterProcesses(tmp_path)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


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
