"""Import hygiene that import-linter cannot see: what importing a package pulls in at run time."""

from __future__ import annotations

import json
import subprocess
import sys


def _modules_after(code: str) -> set[str]:
    probe = f"import sys, json\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_importing_router_and_its_policies_pulls_no_service_dependency() -> None:
    loaded = _modules_after(
        "import router, router.policy.config, router.policy.prefix_index, router.policy.hashing, "
        "router.policy.routing_text, router.policy.kv_events"
    )
    assert not loaded & {"aiohttp", "torch", "redis", "kubernetes", "prometheus_client", "asyncio"}


def test_importing_replica_does_not_import_torch() -> None:
    assert "torch" not in _modules_after("import replica")


def test_shoal_router_help_does_not_import_torch() -> None:
    loaded = _modules_after(
        "from router.cli import main\ntry:\n    main(['router', '--help'])\nexcept SystemExit:\n    pass"
    )
    assert "torch" not in loaded
    assert "aiohttp" in loaded or "pydantic_settings" in loaded  # the router's own settings were loaded


def test_a_router_without_tokenizers_loads_neither_tokenizers_nor_jinja2() -> None:
    loaded = _modules_after(
        "from router.service.app import create_app\nfrom router.service.settings import RouterSettings\n"
        "create_app(RouterSettings())"
    )
    assert "router.service.app" in loaded
    assert not loaded & {"tokenizers", "jinja2", "torch"}


def test_what_every_part_shares_pulls_in_no_part() -> None:
    """`router.common` is imported by the router, the autoscaler and the replica (DESIGN.md's layers)."""
    loaded = _modules_after("import router.common.child_processes, router.common.command_settings")
    assert not loaded & {"aiohttp", "torch", "router.policy", "router.service", "autoscaler", "replica"}
