"""The Helm chart, rendered by the real Helm engine and checked against the Kubernetes API schemas and the code.

Every values file under helm/shoal/ci/ is rendered and linted by Helm (helm-python-sdk bundles it), and every
manifest is validated with kubernetes-validate --strict. The rest asserts behaviour: RBAC grants exactly what
discovery and the autoscaler need, probes and grace periods follow the router's settings, the engines' flags turn
on prefix caching, metrics and KV events, the schema rejects bad values, and every setting the chart passes is
a real field of the settings models (the routers' tokenizer folders included, loaded from where the pod mounts
them), so the chart and the code cannot drift apart. The replicas' preStop drain script runs as a real process
against a real HTTP server serving the replica's own metrics.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import os
import re
import sys
import tarfile
from functools import cache
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml
from aiohttp import web

from autoscaler.settings import AutoscalerSettings
from replica.demo.build import PACKAGED_DIR as DEMO_WEIGHTS
from replica.server.metrics import ReplicaMetrics
from replica.settings import ReplicaSettings
from router.service.chat_tokenizer import load_tokenizers
from router.service.metrics import RouterMetrics
from router.service.pool import ReplicaPool
from router.service.settings import RouterSettings
from tests.helm_support import (
    CHART_DIR,
    CI_DIR,
    NAMESPACE,
    RELEASE,
    SCHEMA_PATH,
    Manifest,
    ci_values,
    env_of,
    find,
    pod_specs,
    render,
    render_notes,
    schema_defs,
    settings_field_for_env,
)

pytestmark = pytest.mark.integration

CI_NAMES = sorted(p.name.removesuffix("-values.yaml") for p in CI_DIR.glob("*-values.yaml"))
KUBE_VERSIONS = ("1.29.0", "1.37.0")
"""The chart's minimum (Chart.yaml kubeVersion) and the newest Kubernetes whose schemas kubernetes-validate has."""
CRD_KINDS = {"ServiceMonitor", "ScaledObject"}
"""Kinds from CRDs (Prometheus Operator, KEDA): no bundled schema, checked field by field below instead."""


@cache
def rendered(ci: str) -> list[Manifest]:
    return render(ci_values(ci))


def container(manifest: Manifest, index: int = 0) -> dict[str, Any]:
    return manifest.body["spec"]["template"]["spec"]["containers"][index]


def router_settings_of(manifests: list[Manifest]) -> RouterSettings:
    """RouterSettings as the router pod would build them: its rendered settings file, then its literal env."""
    config = yaml.safe_load(find(manifests, "ConfigMap", "router").body["data"]["router.yaml"])
    env = {
        name: e["value"]
        for name, e in env_of(container(find(manifests, "Deployment", "router"))).items()
        if "value" in e and name.startswith("SHOAL_ROUTER_") and name != "SHOAL_ROUTER_CONFIG_FILE"
    }
    return RouterSettings.model_validate({**config, **_nest(env, "SHOAL_ROUTER_")})


def _nest(env: dict[str, str], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in env.items():
        *parents, leaf = name.removeprefix(prefix).lower().split("__")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def rbac_rules(role: Manifest) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role.body["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def router_metric_samples() -> set[str]:
    """Sample names a real router exports (counters as <name>_total, histograms as _bucket, _sum, _count)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    families = RouterMetrics(ReplicaPool()).registry.collect()
    return {family.name + suffix for family in families for suffix in suffixes[family.type]}


# --- Helm: render, lint, schema ----------------------------------------------------------------------------------


@pytest.mark.parametrize("ci", CI_NAMES)
def test_helm_lint_is_clean(ci: str) -> None:
    report = helm_python.lint(CHART_DIR, ci_values(ci), strict=True, namespace="llm", kube_version="v1.29.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == []


@pytest.mark.parametrize("ci", CI_NAMES)
def test_every_manifest_validates_against_the_kubernetes_schemas(ci: str) -> None:
    unchecked = set()
    for manifest in rendered(ci):
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(manifest.body, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                unchecked.add(manifest.kind)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{manifest.template} ({manifest.kind} {manifest.name}) against {version}: {exc.message}")
    assert unchecked <= CRD_KINDS


def test_the_validator_is_strict() -> None:
    body = find(rendered("defaults"), "Deployment", "router").body
    body = json.loads(json.dumps(body))
    body["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(body, KUBE_VERSIONS[-1], strict=True)


def test_the_ci_values_cover_the_issue_and_every_template() -> None:
    assert {"defaults", "vllm-exact", "autoscaler-scale-to-zero", "redis-external", "network-policy"} <= set(CI_NAMES)
    templates = {p.name for p in (CHART_DIR / "templates").glob("*.yaml")}
    used = {m.template for ci in CI_NAMES for m in rendered(ci)}
    assert templates - used == set()


def test_templates_are_named_kind_component() -> None:
    for ci in CI_NAMES:
        for m in rendered(ci):
            component = m.body["metadata"]["labels"]["app.kubernetes.io/component"]
            assert m.template == f"{m.kind.lower()}-{component}.yaml"
            assert m.name == f"{RELEASE}-shoal-{component}"


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"replicas": {"replicas": -1}}, "/replicas/replicas"),
        ({"replicas": {"engine": "tgi"}}, "/replicas/engine"),
        ({"router": {"replicas": 0}}, "/router/replicas"),
        ({"replica": {"engine": "vllm"}}, "'replica' not allowed"),
        ({"replicas": {"vllm": {"image": {"tag": "latest"}}}}, "/replicas/vllm/image/tag"),
        ({"router": {"config": {"limits": {"request_timeout": 60}}}}, "request_timeout"),
        ({"router": {"config": {"policy": {"kind": "fastest"}}}}, "/router/config/policy"),
        ({"router": {"config": {"port": 9000}}}, "'port' not allowed"),
        ({"replicas": {"shoal": {"config": {"block_size": 32}}}}, "'block_size' not allowed"),
        ({"replicas": {"shoal": {"config": {"dtype": "fp8"}}}}, "/replicas/shoal/config/dtype"),
        ({"autoscaling": {"mode": "hpa", "scaleToZero": {"enabled": True}}}, "/autoscaling/scaleToZero/enabled"),
        ({"autoscaling": {"mode": "keda"}}, "/autoscaling/keda/prometheusUrl"),
        ({"autoscaling": {"shoal": {"metricsSource": "prometheus"}}}, "/autoscaling/shoal/prometheus/url"),
        ({"autoscaling": {"shoal": {"metricsSource": "thanos"}}}, "/autoscaling/shoal/metricsSource"),
        ({"redis": {"mode": "external"}}, "/redis/external"),
        ({"redis": {"mode": "external", "external": {"url": "redis+replica://r:6379"}}}, "/redis/external/url"),
        ({"router": {"tokenizers": [{"model": "m", "path": "models/m"}]}}, "/router/tokenizers/0/path"),
        ({"router": {"tokenizers": [{"model": "m", "folder": "/models/m"}]}}, "/router/tokenizers/0"),
        ({"router": {"extraVolumeMounts": [{"name": "tokenizers"}]}}, "/router/extraVolumeMounts/0"),
    ],
)
def test_the_schema_rejects_bad_values(values: dict[str, Any], complaint: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as caught:
        render(values)
    assert complaint in str(caught.value)


def test_templates_reject_what_the_schema_cannot_compare() -> None:
    with pytest.raises(helm_python.HelmError, match="maxReplicas must be at least"):
        render({"autoscaling": {"mode": "shoal", "minReplicas": 4, "maxReplicas": 2}})
    with pytest.raises(helm_python.HelmError, match=r"token_block_size must equal replicas\.kvBlockSize"):
        render({"router": {"config": {"hashing": {"token_block_size": 32}}}})
    # An HPA on requests in flight per replica never scales up when the routers cap them at or below its target.
    at_limit = {"mode": "hpa", "targetRequestsPerReplica": 8}
    hold = {"max_in_flight_per_replica": 4}
    with pytest.raises(helm_python.HelmError, match=r"must be below router\.config\.hold\.max_in_flight_per_replica"):
        render({"autoscaling": at_limit, "router": {"replicas": 2, "config": {"hold": hold}}})
    render({"autoscaling": at_limit, "router": {"replicas": 3, "config": {"hold": hold}}})  # 3 routers: 12 > 8


def test_the_schema_embeds_the_settings_models_as_generated() -> None:
    schema = json.loads(SCHEMA_PATH.read_text())
    assert schema["$defs"] == schema_defs(), "run `python -m tests.helm_support` to regenerate values.schema.json"


def test_the_packaged_chart_keeps_its_values_schema(tmp_path: Path) -> None:
    archive = helm_python.package(CHART_DIR, destination=tmp_path)
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert {"shoal/values.schema.json", "shoal/files/drain.py", "shoal/files/dashboard.json"} <= names


def _schema_node(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = schema["$defs"][node["$ref"].rsplit("/", 1)[1]]
    return node


def test_values_are_documented_key_by_key_and_known_to_the_schema() -> None:
    """Each key of values.yaml has a comment above it (or beside it) and a described node in the schema; keys
    inside an opaque Kubernetes object (resources, probes, tolerations) are documented by their parent's."""
    text = (CHART_DIR / "values.yaml").read_text()
    lines = text.splitlines()
    schema = json.loads(SCHEMA_PATH.read_text())
    undocumented: list[str] = []

    def walk(node: yaml.Node, schema_node: dict[str, Any], path: str, generated: bool = False) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        for key, value in node.value:
            key_path = f"{path}.{key.value}".lstrip(".")
            line = key.start_mark.line
            above = lines[line - 1].strip() if line > 0 else ""
            if not (above.startswith("#") or "#" in lines[line]):
                undocumented.append(f"{key_path}: no comment")
            raw = schema_node.get("properties", {}).get(key.value, {})
            child = _schema_node(schema, raw)
            if not child:
                undocumented.append(f"{key_path}: not in values.schema.json")
                continue
            # Generated parts carry the settings models' own docstrings, where they have them.
            if not generated and not child.get("description"):
                undocumented.append(f"{key_path}: no description in values.schema.json")
            if "properties" in child:
                walk(value, child, key_path, generated or "$ref" in raw)

    walk(yaml.compose(text), schema, "")
    assert undocumented == []


def test_router_config_in_values_holds_the_routers_own_defaults() -> None:
    """The keys values.yaml spells out under router.config are the router's defaults, so the file never lies."""
    listed = yaml.safe_load((CHART_DIR / "values.yaml").read_text())["router"]["config"]
    defaults = RouterSettings.model_construct().model_dump()
    defaults["policy"] = RouterSettings.model_fields["policy"].get_default(call_default_factory=True).model_dump()

    def leaves(node: dict[str, Any], path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
        out = []
        for key, value in node.items():
            out += leaves(value, (*path, key)) if isinstance(value, dict) else [((*path, key), value)]
        return out

    for path, value in leaves(listed):
        default: Any = defaults
        for part in path:
            default = default[part]
        assert value == default, f"router.config.{'.'.join(path)}: {value!r} in values.yaml, {default!r} in code"


# --- chart <-> code: settings -----------------------------------------------------------------------------------


def test_every_shoal_env_var_names_a_real_settings_field() -> None:
    models = {"SHOAL_ROUTER_": RouterSettings, "SHOAL_REPLICA_": ReplicaSettings}
    unknown = set()
    for ci in CI_NAMES:
        for _, spec in pod_specs(rendered(ci)):
            for c in spec["containers"]:
                for name in env_of(c):
                    for prefix, model in models.items():
                        if name.startswith(prefix) and settings_field_for_env(name, model, prefix) is None:
                            unknown.add(name)
    assert unknown == set()


@pytest.mark.parametrize("ci", ["autoscaler-scale-to-zero", "autoscaler-prometheus"])
def test_every_autoscaler_env_var_names_a_real_settings_field(ci: str) -> None:
    names = set(env_of(container(find(rendered(ci), "Deployment", "autoscaler"))))
    unknown = {
        name
        for name in names
        if name.startswith("SHOAL_AUTOSCALER_")
        and settings_field_for_env(name, AutoscalerSettings, "SHOAL_AUTOSCALER_") is None
    }
    assert unknown == set()


@pytest.mark.parametrize("ci", CI_NAMES)
def test_the_router_and_replica_settings_load_from_what_the_chart_renders(ci: str) -> None:
    manifests = rendered(ci)
    router = router_settings_of(manifests)
    replica_deployment = find(manifests, "Deployment", "replica")
    replica = container(replica_deployment)
    assert router.host == "0.0.0.0"
    assert router.port == container(find(manifests, "Deployment", "router"))["ports"][0]["containerPort"]
    if replica["name"] != "shoal":
        return
    config = yaml.safe_load(find(manifests, "ConfigMap", "replica").body["data"]["replica.yaml"])
    env = {n: e["value"] for n, e in env_of(replica).items() if n.startswith("SHOAL_REPLICA_") and "value" in e}
    env.pop("SHOAL_REPLICA_CONFIG_FILE")
    settings = ReplicaSettings.model_validate({**config, **_nest(env, "SHOAL_REPLICA_")})
    assert settings.block_size == router.hashing.token_block_size
    assert (settings.host, settings.port) == ("0.0.0.0", replica["ports"][0]["containerPort"])
    # KV events name the replica as the routers' discovery does: by pod name.
    assert env_of(replica)["SHOAL_REPLICA_REPLICA_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}


def test_the_autoscaler_settings_load_from_what_the_chart_renders() -> None:
    manifests = rendered("autoscaler-scale-to-zero")
    env = {
        n: e["value"]
        for n, e in env_of(container(find(manifests, "Deployment", "autoscaler"))).items()
        if n.startswith("SHOAL_AUTOSCALER_") and "value" in e
    }
    settings = AutoscalerSettings.model_validate(_nest(env, "SHOAL_AUTOSCALER_"))
    assert settings.actuator == "kubernetes" and settings.host == "0.0.0.0"
    assert settings.kubernetes.deployment == find(manifests, "Deployment", "replica").name
    replica = container(find(manifests, "Deployment", "replica"))
    assert settings.kubernetes.replica_port == next(p["containerPort"] for p in replica["ports"] if p["name"] == "http")
    assert settings.policy.scale_to_zero.enabled and settings.policy.scale_to_zero.idle_s == 900
    assert settings.policy.expected_start_s == 300  # from autoscaling.shoal.extraEnv


# --- RBAC --------------------------------------------------------------------------------------------------------

_API_CALL = re.compile(r"\b(read|list|patch|replace|create|delete)_namespaced_(\w+)")
_WATCHED = re.compile(r"\.stream\((?:\s|#[^\n]*)*[\w.]+\.list_namespaced_(\w+)")
_VERBS = {"read": "get", "list": "list", "patch": "patch", "replace": "update", "create": "create", "delete": "delete"}
_RESOURCES = {
    "deployment_scale": ("apps", "deployments/scale"),
    "deployment": ("apps", "deployments"),
    "pod": ("", "pods"),
    "lease": ("coordination.k8s.io", "leases"),
    "endpoint_slice": ("discovery.k8s.io", "endpointslices"),
}


def api_calls_of(package: str) -> set[tuple[str, str, str]]:
    """(API group, resource, verb) of every Kubernetes client call in a package's source: what its Role must grant.
    `Watch().stream(api.list_namespaced_x, ...)` is a watch."""
    calls = set()
    for path in (Path(__file__).resolve().parents[2] / package).rglob("*.py"):
        source = path.read_text()
        for verb, resource in _API_CALL.findall(source):
            calls.add((*_RESOURCES[resource], _VERBS[verb]))
        for resource in _WATCHED.findall(source):
            calls.add((*_RESOURCES[resource], "watch"))
    return calls


def test_the_router_may_only_list_and_watch_endpointslices() -> None:
    manifests = rendered("defaults")
    granted = rbac_rules(find(manifests, "Role", "router"))
    assert (
        granted
        == api_calls_of("router")
        == {
            ("discovery.k8s.io", "endpointslices", "list"),
            ("discovery.k8s.io", "endpointslices", "watch"),
        }
    )
    binding = find(manifests, "RoleBinding", "router").body
    pod = find(manifests, "Deployment", "router").body["spec"]["template"]["spec"]
    assert binding["roleRef"]["name"] == f"{RELEASE}-shoal-router"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": "llm"}]
    assert pod["automountServiceAccountToken"] is True

    static = render({"router": {"discovery": {"kind": "static"}}})
    assert not [m for m in static if m.kind in ("Role", "RoleBinding")]
    assert (
        find(static, "Deployment", "router").body["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    )


def test_the_autoscaler_has_exactly_the_rights_its_code_uses() -> None:
    manifests = rendered("autoscaler-scale-to-zero")
    role = find(manifests, "Role", "autoscaler")
    assert rbac_rules(role) == api_calls_of("autoscaler")
    env = env_of(container(find(manifests, "Deployment", "autoscaler")))
    deployment = env["SHOAL_AUTOSCALER_KUBERNETES__DEPLOYMENT"]["value"]
    lease = env["SHOAL_AUTOSCALER_KUBERNETES__LEASE_NAME"]["value"]
    assert deployment == find(manifests, "Deployment", "replica").name
    by_rule = {(rule["resources"][0], tuple(rule["verbs"])): rule.get("resourceNames") for rule in role.body["rules"]}
    assert by_rule[("deployments/scale", ("get", "patch"))] == [deployment]
    assert by_rule[("leases", ("get", "update"))] == [lease]
    assert by_rule[("leases", ("create",))] is None  # Kubernetes cannot limit create by name
    binding = find(manifests, "RoleBinding", "autoscaler").body
    pod = find(manifests, "Deployment", "autoscaler").body["spec"]["template"]["spec"]
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"] == f"{RELEASE}-shoal-autoscaler"


def test_no_release_grants_cluster_wide_rights() -> None:
    for ci in CI_NAMES:
        assert not [m for m in rendered(ci) if m.kind in ("ClusterRole", "ClusterRoleBinding")]
        for m in rendered(ci):
            if m.kind == "Role":
                assert all("*" not in rule["verbs"] + rule["resources"] for rule in m.body["rules"])


# --- probes, grace periods, engines ------------------------------------------------------------------------------


@pytest.mark.parametrize("ci", CI_NAMES)
def test_router_probes_and_grace_period_follow_its_settings(ci: str) -> None:
    manifests = rendered(ci)
    settings = router_settings_of(manifests)
    deployment = find(manifests, "Deployment", "router")
    router = container(deployment)
    assert router["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert router["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert router["ports"] == [{"name": "http", "containerPort": settings.port, "protocol": "TCP"}]
    grace = deployment.body["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > settings.limits.unready_delay_s + settings.limits.shutdown_grace_s


@pytest.mark.parametrize("ci", CI_NAMES)
def test_replica_probes_drain_and_grace_period_follow_the_router(ci: str) -> None:
    manifests = rendered(ci)
    settings = router_settings_of(manifests)
    deployment = find(manifests, "Deployment", "replica")
    replica = container(deployment)
    http_port = next(p["containerPort"] for p in replica["ports"] if p["name"] == "http")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert replica[probe]["httpGet"] == {"path": settings.health.path, "port": "http"}
    startup = replica["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "weights need minutes to load"

    command = replica["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["python3", "/etc/shoal/drain.py"]
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in command[2:])
    assert int(flags["port"]) == http_port and flags["path"] == settings.scrape.path
    assert float(flags["timeout-s"]) >= settings.limits.request_timeout_s  # covers the longest request
    grace = deployment.body["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(flags["delay-s"]) + float(flags["timeout-s"])

    router_env = env_of(container(find(manifests, "Deployment", "router")))
    if "SHOAL_ROUTER_DISCOVERY__SERVICE" in router_env:
        service = find(manifests, "Service", "replica").body["spec"]
        assert router_env["SHOAL_ROUTER_DISCOVERY__SERVICE"]["value"] == find(manifests, "Service", "replica").name
        assert service["clusterIP"] == "None"
        assert labels_match(service["selector"], deployment.body["spec"]["template"]["metadata"]["labels"])
        ports = {p["name"]: p["targetPort"] for p in service["ports"]}
        assert ports[router_env["SHOAL_ROUTER_DISCOVERY__PORT_NAME"]["value"]] == "http"


def _flags(args: list[str]) -> dict[str, str]:
    """`--name=value` and bare `--name` flags, by name."""
    pairs = (arg.removeprefix("--").partition("=") for arg in args if arg.startswith("--"))
    return {name: value for name, _, value in pairs}


def test_vllm_runs_with_prefix_caching_and_publishes_kv_events() -> None:
    manifests = rendered("vllm-exact")
    settings = router_settings_of(manifests)
    vllm = container(find(manifests, "Deployment", "replica"))
    assert vllm["command"] == ["vllm", "serve"] and vllm["args"][0] == "/models/Qwen3-30B-A3B-Instruct-2507"
    flags = _flags(vllm["args"])
    assert "enable-prefix-caching" in flags and "no-enable-prefix-caching" not in flags
    assert int(flags["block-size"]) == settings.hashing.token_block_size
    assert int(flags["tensor-parallel-size"]) == vllm["resources"]["limits"]["nvidia.com/gpu"] == 2
    events = json.loads(flags["kv-events-config"])
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    port = int(events["endpoint"].rsplit(":", 1)[1])
    assert {"name": "kv-events", "containerPort": port, "protocol": "TCP"} in vllm["ports"]
    service_ports = {p["name"]: p["port"] for p in find(manifests, "Service", "replica").body["spec"]["ports"]}
    assert service_ports["kv-events"] == port
    replay_port = int(events["replay_endpoint"].rsplit(":", 1)[1])
    assert events["endpoint"].startswith("tcp://*:") and events["replay_endpoint"].startswith("tcp://*:")  # bound
    assert {"name": "kv-replay", "containerPort": replay_port, "protocol": "TCP"} in vllm["ports"]
    assert service_ports["kv-replay"] == replay_port
    # The routers follow those events: exact mode on the same ports and topic (vLLM's GET /kv_event_sources names
    # them too; these are the fallback).
    assert settings.kv_events.source == "zmq"
    assert settings.kv_events.zmq_port == port and settings.kv_events.zmq_topic == events["topic"]
    assert settings.kv_events.zmq_replay_port == replay_port

    quiet = render({"replicas": {"engine": "vllm", "kvEvents": {"enabled": False}}, "model": {"name": "m"}})
    quiet_vllm = container(find(quiet, "Deployment", "replica"))
    assert "kv-events-config" not in _flags(quiet_vllm["args"]) and len(quiet_vllm["ports"]) == 1
    assert router_settings_of(quiet).kv_events.source == "none"
    shoal = render({"replicas": {"engine": "shoal"}, "model": {"name": "m"}})
    assert router_settings_of(shoal).kv_events.source == "sse"


def test_sglang_runs_with_radix_cache_metrics_and_kv_events() -> None:
    manifests = rendered("sglang")
    sglang = container(find(manifests, "Deployment", "replica"))
    flags = _flags(sglang["args"])
    assert sglang["command"] == ["python3", "-m", "sglang.launch_server"]
    assert "enable-metrics" in flags and "disable-radix-cache" not in flags
    assert int(flags["page-size"]) == router_settings_of(manifests).hashing.token_block_size
    assert json.loads(flags["kv-events-config"])["enable_kv_cache_events"] is True
    assert flags["model-path"] == "/models/Qwen3-8B"


def test_replica_pods_get_gpus_shared_memory_and_model_storage() -> None:
    vllm = find(rendered("vllm-exact"), "Deployment", "replica").body["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in vllm["volumes"]}
    mounts = {m["name"]: m for m in vllm["containers"][0]["volumeMounts"]}
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory" and mounts["shm"]["mountPath"] == "/dev/shm"
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "model-weights", "readOnly": True}
    assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}
    assert vllm["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in vllm["tolerations"]
    assert vllm["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == 2

    sglang = find(rendered("sglang"), "Deployment", "replica").body["spec"]["template"]["spec"]
    assert {v["name"]: v for v in sglang["volumes"]}["model"]["hostPath"] == {
        "path": "/mnt/models",
        "type": "Directory",
    }

    created = render({"model": {"storage": {"kind": "pvc", "readOnly": False}}})
    claim = find(created, "PersistentVolumeClaim", "replica").body
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    env = env_of(container(find(created, "Deployment", "replica")))
    assert env["HF_HOME"]["value"] == "/models/.huggingface"

    cpu = container(find(render({"replicas": {"gpus": 0}}), "Deployment", "replica"))
    assert "nvidia.com/gpu" not in cpu["resources"]["limits"]
    assert env_of(cpu)["SHOAL_REPLICA_DEVICE"]["value"] == "cpu"


# --- router tokenizers ------------------------------------------------------------------------------------------


def _tokenizer_folder(folder: Path) -> Path:
    """A model's tokenizer folder, as a model volume holds it: the demo model's tokenizer.json and chat template."""
    folder.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((DEMO_WEIGHTS / name).read_bytes())
    return folder


def _validate(manifests: list[Manifest]) -> None:
    for manifest in manifests:
        if manifest.kind not in CRD_KINDS:
            for version in KUBE_VERSIONS:
                kubernetes_validate.validate(manifest.body, version, strict=True)


def test_router_tokenizers_load_from_the_model_claim_mounted_read_only(tmp_path: Path) -> None:
    # The test's folder stands for the pod's mount point, so the rendered settings load as the router loads them.
    mount = tmp_path / "models"
    folder = _tokenizer_folder(mount / "Qwen3-8B")
    storage = {"kind": "pvc", "mountPath": str(mount), "pvc": {"existingClaim": "model-weights"}}
    router = {"mountModelVolume": True, "tokenizers": [{"model": "Qwen/Qwen3-8B", "path": str(folder)}]}
    values = {
        "replicas": {"engine": "vllm"},
        "model": {"name": "Qwen/Qwen3-8B", "path": "Qwen3-8B", "storage": storage},
        "router": router,
    }
    manifests = render(values)
    _validate(manifests)
    report = helm_python.lint(CHART_DIR, values, strict=True, namespace="llm", kube_version="v1.29.0")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []

    settings = router_settings_of(manifests)
    assert settings.tokenizer.models == {"Qwen/Qwen3-8B": folder}
    tokenizers = load_tokenizers(settings.tokenizer)
    assert tokenizers["Qwen/Qwen3-8B"].template is not None  # chats route on token ids
    # The router mounts the replicas' claim, read-only, where the replicas mount it.
    pod = find(manifests, "Deployment", "router").body["spec"]["template"]["spec"]
    replica_pod = find(manifests, "Deployment", "replica").body["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    replica_claim = next(v for v in replica_pod["volumes"] if v["name"] == "model")["persistentVolumeClaim"]
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": replica_claim["claimName"], "readOnly": True}
    assert replica_claim["claimName"] == "model-weights"
    assert mounts["model"] == {"name": "model", "mountPath": str(mount), "readOnly": True}
    assert folder.is_relative_to(mounts["model"]["mountPath"])

    # The claim the chart creates, when routers and replicas on several nodes can mount it.
    created = render({"model": {"storage": {"kind": "pvc", "pvc": {"accessMode": "ReadWriteMany"}}}, "router": router})
    pod = find(created, "Deployment", "router").body["spec"]["template"]["spec"]
    claim = {v["name"]: v for v in pod["volumes"]}["model"]["persistentVolumeClaim"]
    assert claim == {"claimName": find(created, "PersistentVolumeClaim", "replica").name, "readOnly": True}
    _validate(created)


def test_router_tokenizers_load_from_a_volume_the_user_names(tmp_path: Path) -> None:
    folder = _tokenizer_folder(tmp_path / "tokenizers" / "llama")
    volume = {"name": "tokenizers", "persistentVolumeClaim": {"claimName": "tokenizers", "readOnly": True}}
    mount = {"name": "tokenizers", "mountPath": str(tmp_path / "tokenizers"), "readOnly": True}
    values = {
        "router": {
            "tokenizers": [{"model": "llama", "path": str(folder)}],
            "extraVolumes": [volume],
            "extraVolumeMounts": [mount],
        }
    }
    manifests = render(values)
    _validate(manifests)
    assert router_settings_of(manifests).tokenizer.models == {"llama": folder}
    pod = find(manifests, "Deployment", "router").body["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"]] == ["config", "tmp", "tokenizers"]
    assert pod["volumes"][-1] == volume and pod["containers"][0]["volumeMounts"][-1] == mount

    # By default the routers mount only their settings and /tmp, and route every model on text.
    defaults = rendered("defaults")
    pod = find(defaults, "Deployment", "router").body["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"]] == ["config", "tmp"]
    assert [m["name"] for m in pod["containers"][0]["volumeMounts"]] == ["config", "tmp"]
    assert router_settings_of(defaults).tokenizer.models == {}


def test_router_tokenizers_refuse_a_second_source_and_a_claim_the_routers_cannot_mount() -> None:
    tokenizers = [{"model": "m", "path": "/models/m"}]
    direct = {"tokenizer": {"models": {"other": "/models/other"}}}
    with pytest.raises(helm_python.HelmError, match=r"router\.tokenizers and router\.config\.tokenizer\.models"):
        render({"router": {"tokenizers": tokenizers, "config": direct}})
    # router.config.tokenizer.models alone is written as it is.
    only_direct = find(render({"router": {"config": direct}}), "ConfigMap", "router").body["data"]["router.yaml"]
    assert yaml.safe_load(only_direct)["tokenizer"]["models"] == {"other": "/models/other"}
    with pytest.raises(helm_python.HelmError, match=r'router\.tokenizers names model "m" twice'):
        render({"router": {"tokenizers": [*tokenizers, {"model": "m", "path": "/models/n"}]}})
    with pytest.raises(helm_python.HelmError, match=r"mountModelVolume needs model\.storage\.kind pvc, not hostPath"):
        render({"router": {"mountModelVolume": True}, "model": {"storage": {"kind": "hostPath"}}})
    with pytest.raises(helm_python.HelmError, match="ReadOnlyMany or ReadWriteMany, not ReadWriteOnce"):
        render({"router": {"mountModelVolume": True}, "model": {"storage": {"kind": "pvc"}}})


# --- autoscaling -------------------------------------------------------------------------------------------------


def test_an_autoscaler_owns_the_replica_count() -> None:
    assert find(rendered("defaults"), "Deployment", "replica").body["spec"]["replicas"] == 1
    for ci in ("autoscaler-scale-to-zero", "keda", "hpa"):
        assert "replicas" not in find(rendered(ci), "Deployment", "replica").body["spec"]


def test_shoal_autoscaler_is_wired_to_the_replicas_the_routers_and_the_admin_token() -> None:
    manifests = rendered("autoscaler-scale-to-zero")
    deployment = find(manifests, "Deployment", "autoscaler")
    autoscaler = container(deployment)
    env = env_of(autoscaler)
    assert autoscaler["command"] == ["shoal", "autoscaler"]
    assert autoscaler["image"] == container(find(manifests, "Deployment", "router"))["image"]
    assert deployment.body["spec"]["replicas"] == 2  # a standby behind the Lease
    assert env["SHOAL_AUTOSCALER_ACTUATOR"]["value"] == "kubernetes"
    assert env["SHOAL_AUTOSCALER_KUBERNETES__ROUTER_SERVICE"]["value"] == find(manifests, "Service", "router").name
    assert env["SHOAL_AUTOSCALER_POLICY__SCALE_TO_ZERO__ENABLED"]["value"] == "true"
    assert env["SHOAL_AUTOSCALER_POLICY__SCALE_TO_ZERO__IDLE_S"]["value"] == "900"
    assert (
        env["SHOAL_AUTOSCALER_POLICY__MIN_REPLICAS"]["value"],
        env["SHOAL_AUTOSCALER_POLICY__MAX_REPLICAS"]["value"],
    ) == ("1", "8")
    metrics_port = int(env["SHOAL_AUTOSCALER_METRICS_PORT"]["value"])
    assert autoscaler["ports"] == [{"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"}]
    router_token = env_of(container(find(manifests, "Deployment", "router")))["SHOAL_ROUTER_ADMIN_TOKEN"]
    assert env["SHOAL_AUTOSCALER_ADMIN_TOKEN"]["valueFrom"] == router_token["valueFrom"]
    assert router_settings_of(manifests).hold.max_wait_s == 600


def autoscaler_settings_from(env: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> AutoscalerSettings:
    """AutoscalerSettings as the autoscaler process loads them: from its environment, the pod's literal values set
    and Secrets standing in as placeholders."""
    for name in list(os.environ):
        if name.startswith("SHOAL_AUTOSCALER_"):
            monkeypatch.delenv(name)
    for name, entry in env.items():
        if name.startswith("SHOAL_AUTOSCALER_"):
            monkeypatch.setenv(name, entry.get("value", "from-a-secret"))
    return AutoscalerSettings()


def test_shoal_autoscaler_reads_prometheus_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    manifests = rendered("autoscaler-prometheus")
    env = env_of(container(find(manifests, "Deployment", "autoscaler")))
    assert env["SHOAL_AUTOSCALER_METRICS__PROMETHEUS__BEARER_TOKEN"]["valueFrom"] == {
        "secretKeyRef": {"name": "prometheus-reader", "key": "token"}
    }
    settings = autoscaler_settings_from(env, monkeypatch)
    prometheus = settings.metrics.prometheus
    assert settings.metrics.source == "prometheus" and prometheus.url == "http://prometheus-operated.monitoring:9090"
    assert prometheus.bearer_token is not None and prometheus.headers == {"X-Scope-OrgID": "llm"}
    # The default queries select this release's routers as KEDA's trigger would, and read what a router exports.
    router_service = find(manifests, "Service", "router").name
    assert prometheus.selector == f'namespace="{NAMESPACE}",service="{router_service}"'
    queries = prometheus.queries.resolved(prometheus.selector, settings.policy.ttft_quantile)
    assert all(prometheus.selector in q for q in queries.values())
    assert {m for q in queries.values() for m in re.findall(r"shoal_router_\w+", q)} <= router_metric_samples()
    # With the routers as the source (the default), nothing of Prometheus is set.
    routers_env = env_of(container(find(rendered("autoscaler-scale-to-zero"), "Deployment", "autoscaler")))
    assert not [n for n in routers_env if n.startswith("SHOAL_AUTOSCALER_METRICS__")]


def test_shoal_autoscaler_capacity_and_ttft_target_reach_its_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    shoal = {"targetTtftSeconds": 2.5, "capacity": {"fromArrivals": True, "learnTarget": True}}
    manifests = render({"autoscaling": {"mode": "shoal", "shoal": shoal}})
    env = env_of(container(find(manifests, "Deployment", "autoscaler")))
    policy = autoscaler_settings_from(env, monkeypatch).policy
    assert policy.target_ttft_s == 2.5 and policy.capacity.from_arrivals and policy.capacity.learn_target
    # Off by default: none of it is set.
    plain = env_of(container(find(rendered("autoscaler-scale-to-zero"), "Deployment", "autoscaler")))
    assert not [n for n in plain if "CAPACITY" in n or "TARGET_TTFT" in n]
    # Learning needs the TTFT target it learns from: the chart says so instead of a pod that fails to start.
    with pytest.raises(helm_python.HelmError, match=r"learnTarget needs autoscaling\.shoal\.targetTtftSeconds"):
        render({"autoscaling": {"mode": "shoal", "shoal": {"capacity": {"learnTarget": True}}}})


def test_keda_and_hpa_scale_on_metrics_the_router_exports() -> None:
    exported = router_metric_samples()
    keda = find(rendered("keda"), "ScaledObject", "replica").body["spec"]
    assert keda["scaleTargetRef"]["name"] == f"{RELEASE}-shoal-replica" and keda["minReplicaCount"] == 0
    trigger = keda["triggers"][0]
    assert trigger["type"] == "prometheus" and trigger["metadata"]["serverAddress"].startswith("http://")
    assert set(re.findall(r"shoal_router_\w+", trigger["metadata"]["query"])) <= exported
    hpa = find(rendered("hpa"), "HorizontalPodAutoscaler", "replica").body["spec"]
    assert hpa["metrics"][0]["external"]["metric"]["name"] in exported
    assert hpa["minReplicas"] == 2 and hpa["scaleTargetRef"]["name"] == f"{RELEASE}-shoal-replica"
    router_hpa = find(rendered("hpa"), "HorizontalPodAutoscaler", "router").body["spec"]
    assert router_hpa["metrics"][0]["resource"]["name"] == "cpu"
    assert "replicas" not in find(rendered("hpa"), "Deployment", "router").body["spec"]


# --- security ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ci", CI_NAMES)
def test_every_pod_runs_locked_down_with_resources(ci: str) -> None:
    for manifest, pod in pod_specs(rendered(ci)):
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        # Only Kubernetes discovery (every ci file uses it) and the autoscaler talk to the API server.
        assert pod["automountServiceAccountToken"] is manifest.name.endswith(("-router", "-autoscaler"))
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc.get("privileged")
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and "memory" in c["resources"]["limits"]
            assert ":" in c["image"] and not c["image"].endswith(":latest")


def test_the_admin_token_comes_from_a_secret() -> None:
    manifests = rendered("defaults")
    secret = find(manifests, "Secret", "admin").body
    token = secret["data"]["token"]
    assert len(base64.b64decode(token)) == 48
    ref = env_of(container(find(manifests, "Deployment", "router")))["SHOAL_ROUTER_ADMIN_TOKEN"]["valueFrom"]
    assert ref == {"secretKeyRef": {"name": f"{RELEASE}-shoal-admin", "key": "token"}}

    own = render({"adminToken": {"existingSecret": "my-token", "secretKey": "value"}})
    assert not [m for m in own if m.kind == "Secret"]
    ref = env_of(container(find(own, "Deployment", "router")))["SHOAL_ROUTER_ADMIN_TOKEN"]["valueFrom"]
    assert ref == {"secretKeyRef": {"name": "my-token", "key": "value"}}


def test_network_policy_lets_only_the_routers_reach_the_replicas() -> None:
    manifests = rendered("network-policy")
    pods = {
        m.name.removeprefix(f"{RELEASE}-shoal-"): m.body["spec"]["template"]["metadata"]["labels"]
        for m in manifests
        if m.kind in ("Deployment", "StatefulSet")
    }
    policy = find(manifests, "NetworkPolicy", "replica").body["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    assert [name for name, labels in pods.items() if labels_match(policy["podSelector"]["matchLabels"], labels)] == [
        "replica"
    ]
    from_router, from_metrics = policy["ingress"]
    (peer,) = from_router["from"]
    assert [name for name, labels in pods.items() if labels_match(peer["podSelector"]["matchLabels"], labels)] == [
        "router"
    ]
    assert {p["port"] for p in from_router["ports"]} == {"http", "kv-events", "kv-replay"}  # vLLM's replay too
    assert from_metrics["from"] == ci_values("network-policy")["networkPolicy"]["replicaMetricsFrom"]
    assert [p["port"] for p in from_metrics["ports"]] == ["http"]

    redis = find(manifests, "NetworkPolicy", "redis").body["spec"]
    allowed = {
        name
        for peer in redis["ingress"][0]["from"]
        for name, labels in pods.items()
        if labels_match(peer["podSelector"]["matchLabels"], labels)
    }
    assert allowed == {"router"}  # the replicas send their KV events to the routers, not through Redis
    assert not [m for m in rendered("defaults") if m.kind == "NetworkPolicy"]


# --- Redis, observability, notes ---------------------------------------------------------------------------------


def test_redis_is_auto_off_external_or_bundled() -> None:
    # auto (the default): two router pods share one view through a bundled Redis; the replicas publish nothing.
    defaults = rendered("defaults")
    service = find(defaults, "Service", "redis")
    url = f"redis://{service.name}:{service.body['spec']['ports'][0]['port']}/0"
    assert find(defaults, "StatefulSet", "redis")
    assert env_of(container(find(defaults, "Deployment", "router")))["SHOAL_ROUTER_REDIS_URL"]["value"] == url
    assert "SHOAL_REPLICA_KV_EVENTS_REDIS_URL" not in env_of(container(find(defaults, "Deployment", "replica")))
    assert "shared view of the fleet" in render_notes()
    # auto with one router pod, or none: no Redis at all.
    for values in ({"router": {"replicas": 1}}, {"redis": {"mode": "none"}}):
        manifests = render(values)
        assert not [m for m in manifests if m.kind == "StatefulSet"]
        assert "SHOAL_ROUTER_REDIS_URL" not in env_of(container(find(manifests, "Deployment", "router")))
    autoscaled = render({"router": {"replicas": 1, "autoscaling": {"enabled": True}}})
    assert find(autoscaled, "StatefulSet", "redis")
    assert "each router pod keeps its own view" in render_notes({"redis": {"mode": "none"}})
    external = env_of(container(find(rendered("redis-external"), "Deployment", "replica")))
    assert not [name for name in external if "REDIS" in name]  # replicas send KV events to routers directly
    router_env = env_of(container(find(rendered("redis-external"), "Deployment", "router")))
    assert router_env["SHOAL_ROUTER_REDIS_URL"]["valueFrom"] == {"secretKeyRef": {"name": "shoal-redis", "key": "url"}}
    bundled = render({"redis": {"mode": "bundled"}})
    service = find(bundled, "Service", "redis")
    url = f"redis://{service.name}:{service.body['spec']['ports'][0]['port']}/0"
    assert env_of(container(find(bundled, "Deployment", "router")))["SHOAL_ROUTER_REDIS_URL"]["value"] == url
    assert not [name for name in env_of(container(find(bundled, "Deployment", "replica"))) if "REDIS" in name]
    redis = container(find(bundled, "StatefulSet", "redis"))
    assert redis["args"][:4] == ["--save", "", "--appendonly", "no"]


def test_an_external_sentinel_or_cluster_url_goes_to_the_routers_only() -> None:
    for url in ("redis+sentinel://s1:26379,s2:26379/primary/0", "rediss+cluster://n1:6379,n2:6379"):
        manifests = render({"redis": {"mode": "external", "external": {"url": url}}})
        assert env_of(container(find(manifests, "Deployment", "router")))["SHOAL_ROUTER_REDIS_URL"]["value"] == url
        assert "SHOAL_REPLICA_KV_EVENTS_REDIS_URL" not in env_of(container(find(manifests, "Deployment", "replica")))
    standalone = render({"redis": {"mode": "external", "external": {"url": "redis://r:6379/0"}}})
    assert "SHOAL_REPLICA_KV_EVENTS_REDIS_URL" not in env_of(container(find(standalone, "Deployment", "replica")))


def test_dashboard_shows_what_the_issue_asks_with_real_metric_names() -> None:
    manifests = rendered("defaults")
    configmap = find(manifests, "ConfigMap", "dashboard").body
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(configmap["data"]["shoal.json"])
    titles = {p["title"] for p in dashboard["panels"]}
    assert {
        "Request rate",
        "Time to first token",
        "Route branches",
        "Prefix hit ratio",
        "Queue per replica",
        "Replicas: desired and ready",
    } <= titles
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert set(re.findall(r"shoal_router_\w+", " ".join(exprs))) <= router_metric_samples()
    replicas_panel = next(p for p in dashboard["panels"] if p["title"] == "Replicas: desired and ready")
    assert f'deployment="{RELEASE}-shoal-replica"' in replicas_panel["targets"][0]["expr"]


def test_service_monitors_select_the_services_they_scrape() -> None:
    manifests = rendered("autoscaler-scale-to-zero")
    for component in ("router", "replica", "autoscaler"):
        monitor = find(manifests, "ServiceMonitor", component).body["spec"]
        service = find(manifests, "Service", component).body
        assert labels_match(monitor["selector"]["matchLabels"], service["metadata"]["labels"])
        assert monitor["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
        assert monitor["endpoints"][0]["path"] == "/metrics"


def test_notes_say_how_to_reach_the_endpoint_and_send_a_first_request() -> None:
    notes = render_notes({"replicas": {"engine": "vllm"}, "model": {"name": "Qwen/Qwen3-8B"}})
    assert f"port-forward service/{RELEASE}-shoal-router 8000:8000" in notes
    assert '"model": "Qwen/Qwen3-8B"' in notes and "/v1/chat/completions" in notes


# --- the preStop drain script, as a real process against a real HTTP server --------------------------------------

DRAIN_SCRIPT = CHART_DIR / "files" / "drain.py"


def _drain_module() -> Any:
    spec = importlib.util.spec_from_file_location("shoal_chart_drain", DRAIN_SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_drain_counts_running_and_waiting_requests_of_every_engine() -> None:
    busy_requests = _drain_module().busy_requests
    metrics = ReplicaMetrics("m")  # Shoal's replica, under vLLM's names
    metrics.num_running.labels(model_name="m").set(3)
    metrics.num_waiting.labels(model_name="m").set(2)
    from prometheus_client import generate_latest

    assert busy_requests(generate_latest(metrics.registry).decode()) == 5
    sglang = 'sglang:num_running_reqs{model_name="m"} 1.0\nsglang:num_queue_reqs{model_name="m"} 4.0\n'
    assert busy_requests(sglang) == 5
    vllm_two_engines = (
        'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0\nvllm:num_requests_waiting_by_reason 9\n'
    )
    assert busy_requests(vllm_two_engines) == 3


async def _run_drain(port: int, *extra: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(DRAIN_SCRIPT),
        f"--port={port}",
        "--delay-s=0",
        "--interval-s=0.05",
        *extra,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=10)
    assert process.returncode is not None
    return process.returncode, stderr.decode()


async def _metrics_server(
    metrics: ReplicaMetrics, scrapes: list[float], *, delay_s: float = 0.0
) -> tuple[web.AppRunner, int]:
    from prometheus_client import generate_latest

    async def serve(_: web.Request) -> web.Response:
        scrapes.append(asyncio.get_running_loop().time())
        await asyncio.sleep(delay_s)
        return web.Response(body=generate_latest(metrics.registry), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", serve)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]


async def test_drain_waits_until_the_replica_is_idle() -> None:
    metrics, scrapes = ReplicaMetrics("m"), []
    running = metrics.num_running.labels(model_name="m")
    running.set(2)
    runner, port = await _metrics_server(metrics, scrapes)
    try:
        drain = asyncio.create_task(_run_drain(port, "--timeout-s=30"))
        while len(scrapes) < 5:  # it keeps polling while requests run
            assert not drain.done()
            await asyncio.sleep(0.02)
        running.set(0)
        code, stderr = await drain
    finally:
        await runner.cleanup()
    assert code == 0 and "drain: idle" in stderr


async def test_drain_gives_up_at_its_timeout_and_when_the_engine_is_gone() -> None:
    metrics, scrapes = ReplicaMetrics("m"), []
    metrics.num_waiting.labels(model_name="m").set(1)
    runner, port = await _metrics_server(metrics, scrapes)
    try:
        code, stderr = await _run_drain(port, "--timeout-s=0.3")
    finally:
        await runner.cleanup()
    assert code == 0 and "drain: timeout" in stderr and len(scrapes) >= 3
    code, stderr = await _run_drain(port, "--timeout-s=30")  # nothing listens there any more
    assert code == 0 and "drain: unreachable" in stderr


async def test_drain_counts_an_engine_too_slow_to_answer_as_busy() -> None:
    scrapes: list[float] = []
    runner, port = await _metrics_server(ReplicaMetrics("m"), scrapes, delay_s=1.0)  # idle, but slow to say so
    try:
        code, stderr = await _run_drain(port, "--timeout-s=0.3", "--scrape-timeout-s=0.1")
    finally:
        await runner.cleanup()
    assert code == 0 and "drain: timeout" in stderr and len(scrapes) >= 2
