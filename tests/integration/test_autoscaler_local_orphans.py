"""Replica processes never outlive a local actuator that is killed outright (Linux: the kernel's parent-death
signal), where `close()` gets no chance to stop them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.integration.ports import free_ports

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's"),
]

# The autoscaler's side: one replica slot, a stand-in replica that only sleeps, and the child's pid on stdout.
ACTUATOR = textwrap.dedent(
    """
    import asyncio, sys
    import aiohttp
    from autoscaler.actuators.local import LocalActuator
    from autoscaler.settings import LocalSettings

    async def main() -> None:
        replica = [sys.executable, "-c", "import time; time.sleep(120)"]
        async with aiohttp.ClientSession() as session:
            settings = LocalSettings(command=replica, base_port=int(sys.argv[1]), max_replicas=1)
            actuator = LocalActuator(settings, session)
            await actuator.scale_up(1)
            (info,) = await actuator.observe()
            print(actuator._replicas[info.name].process.pid, flush=True)
            await asyncio.sleep(120)

    asyncio.run(main())
    """
)


def is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever reaps orphans here)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    return fields[0] != "Z"


def test_replicas_get_sigterm_when_the_autoscaler_is_killed() -> None:
    port = free_ports(1)
    parent = subprocess.Popen(
        [sys.executable, "-c", ACTUATOR, str(port)], stdout=subprocess.PIPE, cwd=Path(__file__).parents[2]
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert is_running(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while is_running(child):
            assert time.monotonic() < deadline, f"replica {child} outlived its killed autoscaler"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()
