"""AutoscalerSettings: environment, YAML and flag precedence, validation, and `shoal autoscaler`'s error paths."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from autoscaler import cli
from autoscaler.settings import (
    AutoscalerSettings,
    KubernetesSettings,
    LocalSettings,
    MetricsSourceSettings,
    PrometheusQueries,
    PrometheusSettings,
)
from router.common.command_settings import settings_help


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("SHOAL_AUTOSCALER_"):
            monkeypatch.delenv(name)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_autoscaler_command(parser.add_subparsers(dest="command"))
    return parser.parse_args(["autoscaler", *argv])


def test_defaults() -> None:
    settings = AutoscalerSettings()
    assert settings.actuator == "local" and settings.routers == [] and settings.admin_token is None
    assert (settings.metrics_port, settings.dry_run, settings.host) == (9090, False, "127.0.0.1")
    assert settings.policy.min_replicas == 1 and not settings.policy.scale_to_zero.enabled
    assert settings.kubernetes.lease_name == "shoal-autoscaler" and settings.kubernetes.router_service is None


def test_yaml_then_environment_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "autoscaler.yaml"
    config.write_text(
        "routers: [http://r1:8000]\n"
        "admin_token: from-file\n"
        "policy:\n  max_replicas: 6\n  target_requests_per_replica: 4\n  scale_to_zero: {enabled: true, idle_s: 60}\n"
        "kubernetes: {namespace: prod, deployment: vllm}\n"
    )
    monkeypatch.setenv("SHOAL_AUTOSCALER_CONFIG_FILE", str(config))
    monkeypatch.setenv("SHOAL_AUTOSCALER_POLICY__MAX_REPLICAS", "5")
    monkeypatch.setenv("SHOAL_AUTOSCALER_ADMIN_TOKEN", "from-env")
    monkeypatch.setenv("SHOAL_AUTOSCALER_KUBERNETES__LEASE_DURATION_S", "30")
    settings = cli.settings_from_args(_args("--max-replicas", "4", "--router", "http://r2:8000/", "--dry-run"))
    assert settings.routers == ["http://r2:8000"]
    assert settings.admin_token is not None and settings.admin_token.get_secret_value() == "from-env"
    assert settings.policy.max_replicas == 4  # flag over environment over file
    assert settings.policy.target_requests_per_replica == 4  # the file's, merged field by field
    assert settings.policy.scale_to_zero.enabled and settings.policy.scale_to_zero.idle_s == 60
    assert (settings.kubernetes.namespace, settings.kubernetes.lease_duration_s) == ("prod", 30)
    assert settings.dry_run


def test_invalid_settings_are_rejected() -> None:
    with pytest.raises(ValidationError):
        AutoscalerSettings(routers=["r1:8000"])
    with pytest.raises(ValidationError):
        AutoscalerSettings(policy={"max_replicas": 9}, local={"max_replicas": 8})  # more than the port slots
    with pytest.raises(ValidationError):
        AutoscalerSettings(unknown=1)
    with pytest.raises(ValidationError):
        KubernetesSettings(lease_duration_s=10, renew_deadline_s=10)
    assert AutoscalerSettings(actuator="kubernetes", policy={"max_replicas": 50}).policy.max_replicas == 50


def test_cli_reports_bad_settings_and_missing_token(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--router", "nope"]) == 2
    assert "invalid settings" in capsys.readouterr().err
    assert cli.main(["--router", "http://127.0.0.1:9"]) == 2
    assert "admin_token" in capsys.readouterr().err


def test_kubernetes_pieces_that_are_missing_fail_clearly() -> None:
    with pytest.raises(cli.SetupError, match=r"autoscaler\.actuators\.nonexistent\.Thing"):
        cli._import("autoscaler.actuators.nonexistent", "Thing")
    with pytest.raises(cli.SetupError, match="has no Thing"):
        cli._import("autoscaler.actuators.base", "Thing")


def test_every_setting_documents_itself() -> None:
    for model in (
        AutoscalerSettings,
        KubernetesSettings,
        LocalSettings,
        MetricsSourceSettings,
        PrometheusSettings,
        PrometheusQueries,
    ):
        for name, info in model.model_fields.items():
            if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
                continue
            if name != "log_level":
                assert info.description, f"{model.__name__}.{name} has no docstring"
    text = settings_help(AutoscalerSettings)
    assert "SHOAL_AUTOSCALER_POLICY__SCALE_TO_ZERO__IDLE_S" in text
    assert "SHOAL_AUTOSCALER_KUBERNETES__ROUTER_SERVICE" in text
    assert "SHOAL_AUTOSCALER_METRICS__PROMETHEUS__QUERIES__TTFT_S" in text


def test_prediction_noise_and_headroom_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = AutoscalerSettings().policy
    assert not policy.forecast.enabled and policy.requests_headroom_sd == 0 and policy.panic.noise_margin_sd == 2.5
    monkeypatch.setenv("SHOAL_AUTOSCALER_POLICY__FORECAST__ENABLED", "true")
    monkeypatch.setenv("SHOAL_AUTOSCALER_POLICY__FORECAST__WINDOW_S", "600")
    monkeypatch.setenv("SHOAL_AUTOSCALER_POLICY__REQUESTS_HEADROOM_SD", "1.5")
    monkeypatch.setenv("SHOAL_AUTOSCALER_POLICY__PANIC__NOISE_MARGIN_SD", "0")
    policy = AutoscalerSettings().policy
    assert policy.forecast.enabled and policy.forecast.window_s == 600
    assert policy.forecast_horizon_s == policy.expected_start_s
    assert policy.requests_headroom_sd == 1.5 and policy.panic.noise_margin_sd == 0
    text = settings_help(AutoscalerSettings)
    for env in ("POLICY__FORECAST__MAX_RATIO", "POLICY__REQUESTS_HEADROOM_SD", "POLICY__PANIC__NOISE_MARGIN_SD"):
        assert f"SHOAL_AUTOSCALER_{env}" in text


def test_prometheus_source_from_the_environment_and_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    assert AutoscalerSettings().metrics.source == "routers"
    monkeypatch.setenv("SHOAL_AUTOSCALER_METRICS__SOURCE", "prometheus")
    monkeypatch.setenv("SHOAL_AUTOSCALER_METRICS__PROMETHEUS__URL", "http://prom:9090/")
    monkeypatch.setenv("SHOAL_AUTOSCALER_METRICS__PROMETHEUS__BEARER_TOKEN", "secret")
    monkeypatch.setenv("SHOAL_AUTOSCALER_METRICS__PROMETHEUS__HEADERS", '{"X-Scope-OrgID": "tenant-1"}')
    monkeypatch.setenv("SHOAL_AUTOSCALER_METRICS__PROMETHEUS__QUERIES__HELD", "sum(my_held)")
    prometheus = AutoscalerSettings().metrics.prometheus
    assert prometheus.url == "http://prom:9090" and prometheus.headers == {"X-Scope-OrgID": "tenant-1"}
    assert prometheus.bearer_token is not None and prometheus.bearer_token.get_secret_value() == "secret"
    assert prometheus.queries.held == "sum(my_held)"
    flagged = cli.settings_from_args(_args("--prometheus", "https://mimir.example/prometheus"))
    assert flagged.metrics.source == "prometheus"
    assert flagged.metrics.prometheus.url == "https://mimir.example/prometheus"
    assert flagged.metrics.prometheus.queries.held == "sum(my_held)"  # the environment's, merged


def test_prometheus_source_needs_a_url() -> None:
    with pytest.raises(ValidationError, match=r"metrics\.prometheus\.url"):
        AutoscalerSettings(metrics={"source": "prometheus"})
    with pytest.raises(ValidationError, match="Prometheus URL"):
        PrometheusSettings(url="prom:9090")


def test_default_queries_follow_the_selector_and_the_ttft_quantile() -> None:
    queries = PrometheusQueries().resolved('namespace="llm",service="r"', 0.95)
    assert queries["in_flight"] == 'sum(shoal_router_in_flight{namespace="llm",service="r"})'
    assert queries["held"] == 'sum(shoal_router_held_requests{namespace="llm",service="r"})'
    assert queries["ttft_s"] == (
        "histogram_quantile(0.95, sum by (le) "
        '(rate(shoal_router_ttft_seconds_bucket{namespace="llm",service="r"}[1m])))'
    )
    assert "kv_usage" not in queries, "KV usage comes from the routers' admin API unless a query is set"
    custom = "histogram_quantile({quantile}, sum by (le) (rate(my_ttft_bucket[5m])))"
    bare = PrometheusQueries(ttft_s=custom, kv_usage="sum(vllm:kv_cache_usage_perc)").resolved("", 0.9)
    assert bare["queue_depth"] == "sum(shoal_router_queue_depth)"
    assert bare["ttft_s"] == "histogram_quantile(0.9, sum by (le) (rate(my_ttft_bucket[5m])))"
    assert bare["kv_usage"] == "sum(vllm:kv_cache_usage_perc)"
    assert queries["routers_down"] == 'count(up{namespace="llm",service="r"} == 0)'
    assert bare["routers_down"] == "count(up == 0)"
    assert "routers_down" not in PrometheusQueries(routers_down="none").resolved("", 0.9)
