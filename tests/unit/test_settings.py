"""RouterSettings: environment, YAML file and CLI precedence, validation, and the CLI's error path."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from router.cli import main
from router.common.command_settings import settings_help
from router.service.settings import RouterSettings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("SHOAL_ROUTER_"):
            monkeypatch.delenv(name)


def test_defaults_are_safe() -> None:
    settings = RouterSettings()
    assert settings.host == "127.0.0.1"
    assert settings.admin_token is None
    assert settings.policy.kind == "estimated_ttft"


def test_environment_nested_values_and_policy_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_ROUTER_HEALTH__INTERVAL_S", "0.5")
    monkeypatch.setenv("SHOAL_ROUTER_POLICY", '{"kind": "sglang_cache_aware", "cache_threshold": 0.5}')
    monkeypatch.setenv("SHOAL_ROUTER_REPLICAS", '["http://10.0.0.1:8000"]')
    settings = RouterSettings()
    assert settings.health.interval_s == 0.5
    assert settings.policy.kind == "sglang_cache_aware"
    assert settings.replicas == ["http://10.0.0.1:8000"]


def test_yaml_is_overridden_by_environment_which_is_overridden_by_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "router.yaml"
    config.write_text("port: 9000\nseed: 3\nhealth:\n  interval_s: 7\npolicy:\n  kind: round_robin\n")
    monkeypatch.setenv("SHOAL_ROUTER_SEED", "4")
    settings = RouterSettings(config_file=config, port=9100)
    assert (settings.port, settings.seed, settings.health.interval_s) == (9100, 4, 7)
    assert settings.policy.kind == "round_robin"


@pytest.mark.parametrize(
    "overrides",
    [
        {"replicas": ["https://tls-replica:443"]},
        {"replicas": ["10.0.0.1:8000"]},
        {"port": 70000},
        {"policy": {"kind": "nope"}},
        {"health": {"interval_s": 0}},
        {"unknown_setting": 1},
    ],
)
def test_bad_settings_are_rejected(overrides: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        RouterSettings(**overrides)


def test_the_file_named_by_the_environment_merges_with_the_environment_field_by_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "router.yaml"
    config.write_text("health:\n  interval_s: 7\n  timeout_s: 3\nreplicas: [http://10.0.0.1:8000/]\n")
    monkeypatch.setenv("SHOAL_ROUTER_CONFIG_FILE", str(config))
    monkeypatch.setenv("SHOAL_ROUTER_HEALTH__TIMEOUT_S", "1")
    settings = RouterSettings()
    assert (settings.health.interval_s, settings.health.timeout_s) == (7, 1)
    assert settings.replicas == ["http://10.0.0.1:8000"]  # validated as if it came from a flag
    assert settings.config_file == config


def test_an_empty_file_is_no_settings(tmp_path: Path) -> None:
    config = tmp_path / "empty.yaml"
    config.write_text("# nothing yet\n")
    assert RouterSettings(config_file=config).port == RouterSettings().port


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("- a list, not a mapping\n", "must hold a mapping"),
        ("- ab\n", "must hold a mapping"),  # a list of pairs, which a dict update would take
        ("7\n", "must hold a mapping"),
        ("port: [8000\n", "not valid YAML"),
    ],
)
def test_a_bad_file_is_refused_by_name(tmp_path: Path, text: str, complaint: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(ValueError, match=rf"bad\.yaml.*{complaint}|{complaint}.*bad\.yaml"):
        RouterSettings(config_file=config)


def test_a_missing_file_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"missing\.yaml does not exist"):
        RouterSettings(config_file=tmp_path / "missing.yaml")
    monkeypatch.setenv("SHOAL_ROUTER_CONFIG_FILE", str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match=r"missing\.yaml does not exist"):
        RouterSettings()


def test_cli_reports_a_bad_config_file_with_exit_code_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("port: [8000\n")
    assert main(["router", "--config", str(config), "--port", "0"]) == 2
    assert "bad.yaml is not valid YAML" in capsys.readouterr().err


def test_cli_reports_invalid_settings_with_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router", "--replica", "ftp://nowhere", "--port", "0"]) == 2
    assert "replica URL" in capsys.readouterr().err


def test_help_documents_every_setting_with_its_environment_variable() -> None:
    text = settings_help(RouterSettings)
    for env in ("SHOAL_ROUTER_PORT", "SHOAL_ROUTER_HEALTH__INTERVAL_S", "SHOAL_ROUTER_LIMITS__MAX_BODY_BYTES"):
        assert env in text
    assert "Seconds between probes of a healthy replica." in text


def test_tokenizer_folders_come_from_the_environment_and_must_hold_a_tokenizer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setenv("SHOAL_ROUTER_TOKENIZER__MODELS", f'{{"shoal-demo": "{tmp_path.as_posix()}"}}')
    assert RouterSettings().tokenizer.models == {"shoal-demo": tmp_path}
    monkeypatch.delenv("SHOAL_ROUTER_TOKENIZER__MODELS")
    with pytest.raises(ValidationError, match=r"has no tokenizer\.json"):
        RouterSettings(tokenizer={"models": {"m": tmp_path / "missing"}})
    assert main(["router", "--tokenizer", "shoal-demo", "--port", "0"]) == 2
    assert "MODEL=DIR" in capsys.readouterr().err
    assert main(["router", "--tokenizer", f"m={tmp_path / 'missing'}", "--port", "0"]) == 2
    assert "has no tokenizer.json" in capsys.readouterr().err
