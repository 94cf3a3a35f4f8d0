"""`LocalActuator`: `shoal replica` processes on loopback ports of this machine (what `shoal up --autoscale` uses).

Each replica takes the first free port slot (`base_port + i`, i < `num_slots`), is `starting` until its
`GET /health` answers 200 (the server listens only once its model is loaded), and `failed` once its process has
exited. The controller registers ready replicas with the routers and drains a victim before `scale_down`; this
actuator then stops the process gracefully (SIGTERM, which lets aiohttp finish open connections) and kills it
only after `stop_timeout_s`. Replicas are children of this process: `close()` stops them all, so an autoscaler
that exits leaves nothing behind; on Linux each replica also gets SIGTERM from the kernel when the autoscaler dies
without a chance to stop them (SIGKILL, a crash), through `PR_SET_PDEATHSIG` (`router.common.child_processes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

import aiohttp

from autoscaler.actuators.base import ActuatorError, ReplicaInfo, ReplicaPhase
from autoscaler.settings import LocalSettings
from router.common.child_processes import parent_death_signal, shoal_command

log = logging.getLogger(__name__)


@dataclass
class _Replica:
    name: str
    slot: int
    url: str
    process: asyncio.subprocess.Process
    created_s: float
    is_ready: bool = False
    is_terminating: bool = False
    log_file: IO[bytes] | None = None

    @property
    def phase(self) -> ReplicaPhase:
        if self.is_terminating:
            return "terminating"
        if self.process.returncode is not None:
            return "failed"
        return "ready" if self.is_ready else "starting"


class LocalActuator:
    def __init__(
        self,
        settings: LocalSettings,
        session: aiohttp.ClientSession,
        *,
        num_slots: int | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """`num_slots` applies when `settings.max_replicas` is unset (`shoal autoscaler` passes the policy's)."""
        slots = settings.max_replicas or num_slots
        if slots is None:
            raise ValueError("LocalActuator needs settings.max_replicas or num_slots")
        self.settings = settings
        self.num_slots = slots
        self._session = session
        self._wall_clock = wall_clock
        self._replicas: dict[str, _Replica] = {}
        self._preexec = parent_death_signal()
        """The kernel signals on the death of the thread that started the child: the event loop's thread,
        which lives as long as the autoscaler (`asyncio.run` in the main thread)."""

    # The Actuator protocol ------------------------------------------------------------------------------------

    async def observe(self) -> list[ReplicaInfo]:
        starting = [r for r in self._replicas.values() if r.phase == "starting"]
        if starting:
            healthy = await asyncio.gather(*(self._is_healthy(r) for r in starting))
            for replica, ok in zip(starting, healthy, strict=True):
                if ok and replica.process.returncode is None:
                    replica.is_ready = True
                    log.info("%s is ready at %s", replica.name, replica.url)
        return [ReplicaInfo(r.name, r.url, r.phase, r.created_s) for r in self._replicas.values()]

    async def desired_replicas(self) -> int:
        return sum(1 for r in self._replicas.values() if not r.is_terminating)

    async def scale_up(self, target: int) -> None:
        missing = target - await self.desired_replicas()
        for _ in range(missing):
            await self._start()

    async def scale_down(self, victim: ReplicaInfo, target: int) -> None:
        replica = self._replicas.get(victim.name)
        if replica is None:
            raise ActuatorError(f"no local replica {victim.name!r}")
        await self._stop(replica)
        if await self.desired_replicas() != target:
            log.info("holding %d local replicas (asked for %d)", await self.desired_replicas(), target)

    # Lifecycle ------------------------------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop every replica (all at once: each gets `stop_timeout_s`)."""
        await asyncio.gather(*(self._stop(r) for r in list(self._replicas.values())))

    async def _start(self) -> None:
        slot = self._free_slot()
        port = self.settings.base_port + slot
        name = f"local-{port}"
        s = self.settings
        threads = s.threads or max(1, (os.cpu_count() or 1) // self.num_slots)
        cmd = [*(s.command or shoal_command()), "replica", "--model", s.model]
        cmd += ["--host", s.host, "--port", str(port), "--threads", str(threads)]
        if s.served_model_name:
            cmd += ["--served-model-name", s.served_model_name]
        cmd += s.replica_args
        log_file = None
        if s.log_dir is not None:
            s.log_dir.mkdir(parents=True, exist_ok=True)
            log_file = (s.log_dir / f"{name}.log").open("ab")
        try:
            process = await asyncio.create_subprocess_exec(
                *cmd,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                preexec_fn=self._preexec,
            )
        except OSError as exc:
            if log_file is not None:
                log_file.close()
            raise ActuatorError(f"cannot start {' '.join(cmd)}: {exc}") from exc
        self._replicas[name] = _Replica(
            name, slot, f"http://{s.host}:{port}", process, self._wall_clock(), log_file=log_file
        )
        log.info("started %s (pid %d): %s", name, process.pid, " ".join(cmd))

    def _free_slot(self) -> int:
        """The first slot no replica of ours holds and whose port nothing else is bound to."""
        taken = {r.slot for r in self._replicas.values()}
        for slot in range(self.num_slots):
            if slot not in taken and _is_port_free(self.settings.host, self.settings.base_port + slot):
                return slot
        raise ActuatorError(
            f"no free port slot among {self.num_slots} from {self.settings.base_port} ({len(taken)} replicas running)"
        )

    async def _stop(self, replica: _Replica) -> None:
        replica.is_terminating = True
        process = replica.process
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), self.settings.stop_timeout_s)
            except TimeoutError:
                log.warning(
                    "%s did not exit %.0f s after SIGTERM; killing it", replica.name, self.settings.stop_timeout_s
                )
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        if replica.log_file is not None:
            replica.log_file.close()
        self._replicas.pop(replica.name, None)
        log.info("stopped %s (exit status %s)", replica.name, process.returncode)

    async def _is_healthy(self, replica: _Replica) -> bool:
        try:
            async with self._session.get(replica.url + "/health", timeout=aiohttp.ClientTimeout(total=1.0)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False


def _is_port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
