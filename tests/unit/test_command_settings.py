"""The settings every `shoal` command shares (`router.common.command_settings`): the router's, the autoscaler's and
the replica's each load a YAML file beneath their environment variables and list themselves for `--help`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from autoscaler.settings import AutoscalerSettings
from replica.settings import ReplicaSettings
from router.common.command_settings import settings_help
from router.service.settings import RouterSettings

COMMANDS: list[tuple[Any, str]] = [
    (RouterSettings, "SHOAL_ROUTER_"),
    (AutoscalerSettings, "SHOAL_AUTOSCALER_"),
    (ReplicaSettings, "SHOAL_REPLICA_"),
]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(tuple(prefix for _, prefix in COMMANDS)):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(("settings_cls", "prefix"), COMMANDS)
def test_file_then_environment_then_arguments(
    settings_cls: Any, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "settings.yaml"
    config.write_text("host: 10.0.0.1\n")
    monkeypatch.setenv(f"{prefix}CONFIG_FILE", str(config))
    loaded = settings_cls()
    assert (loaded.host, loaded.config_file) == ("10.0.0.1", config)
    monkeypatch.setenv(f"{prefix}HOST", "10.0.0.2")
    assert settings_cls().host == "10.0.0.2"
    assert settings_cls(host="10.0.0.3").host == "10.0.0.3"
    monkeypatch.delenv(f"{prefix}CONFIG_FILE")
    monkeypatch.delenv(f"{prefix}HOST")
    assert settings_cls(config_file=config).host == "10.0.0.1"  # the flag --config


@pytest.mark.parametrize(("settings_cls", "prefix"), COMMANDS)
def test_a_file_that_is_no_mapping_is_refused_by_name(settings_cls: Any, prefix: str, tmp_path: Path) -> None:
    config = tmp_path / "settings.yaml"
    config.write_text("- host: 10.0.0.1\n")
    with pytest.raises(ValueError, match=r"settings\.yaml must hold a mapping"):
        settings_cls(config_file=config)
    with pytest.raises(ValueError, match=r"nowhere\.yaml does not exist"):
        settings_cls(config_file=tmp_path / "nowhere.yaml")


@pytest.mark.parametrize(("settings_cls", "prefix"), COMMANDS)
def test_help_lists_every_setting_under_the_commands_prefix(settings_cls: Any, prefix: str) -> None:
    text = settings_help(settings_cls)
    assert f"  host  ({prefix}HOST, default '127.0.0.1')" in text
    assert f"  config_file  ({prefix}CONFIG_FILE, default None)" in text
