"""What importing the autoscaler pulls in at run time (import-linter checks only the static imports)."""

from __future__ import annotations

import json
import subprocess
import sys


def _modules_after(code: str) -> set[str]:
    probe = f"import sys, json\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_policy_is_pure_at_run_time() -> None:
    loaded = _modules_after("import autoscaler.policy")
    assert not loaded & {"asyncio", "aiohttp", "prometheus_client", "kubernetes", "torch", "yaml", "router"}


def test_the_local_autoscaler_needs_neither_torch_nor_kubernetes() -> None:
    loaded = _modules_after(
        "import autoscaler.cli, autoscaler.controller, autoscaler.actuators.local\n"
        "try:\n    autoscaler.cli.main(['--help'])\nexcept SystemExit:\n    pass"
    )
    assert not loaded & {"torch", "kubernetes", "replica"}
    # Of the router's service, only the supervision of background tasks (the layer contract's one exception).
    assert {m for m in loaded if m.startswith("router.service")} == {"router.service", "router.service.supervise"}
    assert "pydantic_settings" in loaded
