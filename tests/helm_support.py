"""The Helm chart as the tests see it: rendered by the real Helm engine, and its settings checked against the code.

`render()` runs Helm's own template engine (helm-python-sdk bundles it) over `helm/shoal` with the values files
under `helm/shoal/ci/` and returns the manifests with the template each came from. The chart's values schema
embeds the JSON schema of the services' settings models for `router.config` and `replicas.shoal.config`;
`schema_defs()` regenerates that part and `python -m tests.helm_support` writes it into values.schema.json,
so the schema follows the code and a test fails when it has not been regenerated.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parent.parent
CHART_DIR = ROOT / "helm" / "shoal"
CI_DIR = CHART_DIR / "ci"
SCHEMA_PATH = CHART_DIR / "values.schema.json"
RELEASE = "demo"
NAMESPACE = "llm"

ROUTER_CHART_OWNED = frozenset({"host", "port", "admin_token", "config_file", "discovery"})
"""RouterSettings fields the chart sets itself (environment variables); router.config may not set them."""
REPLICA_CHART_OWNED = frozenset(
    {
        "model",
        "served_model_name",
        "host",
        "port",
        "device",
        "block_size",
        "replica_id",
        "config_file",
    }
)
"""ReplicaSettings fields the chart sets itself; replicas.shoal.config may not set them."""


@dataclass(frozen=True)
class Manifest:
    template: str
    """Template file name, e.g. `deployment-router.yaml`."""
    body: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.body["kind"])

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])


def ci_values(name: str) -> dict[str, Any]:
    """The values of `helm/shoal/ci/<name>-values.yaml`."""
    data = yaml.safe_load((CI_DIR / f"{name}-values.yaml").read_text()) or {}
    assert isinstance(data, dict)
    return data


def render(values: dict[str, Any] | None = None) -> list[Manifest]:
    """Render the chart as `helm template demo helm/shoal -n llm -f <values>` would; Helm checks the schema."""
    import helm_python

    with helm_python.Chart.load(CHART_DIR) as chart:
        rendered = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    manifests = []
    for path, text in sorted(rendered.items()):
        if not path.endswith((".yaml", ".yml")):
            continue  # NOTES.txt
        for body in yaml.safe_load_all(text):
            if body:
                manifests.append(Manifest(Path(path).name, body))
    return manifests


def render_notes(values: dict[str, Any] | None = None) -> str:
    import helm_python

    with helm_python.Chart.load(CHART_DIR) as chart:
        rendered = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return next(text for path, text in rendered.items() if path.endswith("NOTES.txt"))


def find(manifests: list[Manifest], kind: str, component: str) -> Manifest:
    name = f"{RELEASE}-shoal-{component}"
    matches = [m for m in manifests if m.kind == kind and m.name == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {[m.name for m in manifests if m.kind == kind]}"
    return matches[0]


def pod_specs(manifests: list[Manifest]) -> Iterator[tuple[Manifest, dict[str, Any]]]:
    for m in manifests:
        if m.kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield m, m.body["spec"]["template"]["spec"]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


# --- settings models <-> chart ----------------------------------------------------------------------------------


def _models_of(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation may hold (a model, a union of models, an Annotated union)."""
    from typing import get_args

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_of(arg)]


def settings_field_for_env(name: str, model: type[BaseModel], prefix: str) -> str | None:
    """The dotted settings path an environment variable sets (`SHOAL_ROUTER_LIMITS__REQUEST_TIMEOUT_S` ->
    `limits.request_timeout_s`), or None when it names no field. Nested models are entered with `__`, as
    pydantic-settings does; for a union (a policy) any member's field counts."""
    if not name.startswith(prefix):
        return None
    models, path = [model], []
    for part in name[len(prefix) :].lower().split("__"):
        fields = [m.model_fields[part] for m in models if part in m.model_fields]
        if not fields:
            return None
        path.append(part)
        models = [m for f in fields for m in _models_of(f.annotation)]
    return ".".join(path)


def _strip_titles(node: Any, *, in_properties: bool = False) -> Any:
    if isinstance(node, dict):
        return {
            key: _strip_titles(value, in_properties=key == "properties" and not in_properties)
            for key, value in node.items()
            if in_properties or key != "title"
        }
    if isinstance(node, list):
        return [_strip_titles(item) for item in node]
    return node


def _config_schema(model: type[BaseModel], owned: frozenset[str], description: str) -> tuple[dict[str, Any], dict]:
    schema = _strip_titles(model.model_json_schema(mode="validation"))
    properties = {k: v for k, v in schema["properties"].items() if k not in owned}
    config = {"type": "object", "description": description, "additionalProperties": False, "properties": properties}
    return config, schema.get("$defs", {})


def schema_defs() -> dict[str, Any]:
    """The `$defs` of values.schema.json, generated from RouterSettings and ReplicaSettings."""
    from replica.settings import ReplicaSettings
    from router.service.settings import RouterSettings

    router, router_defs = _config_schema(
        RouterSettings,
        ROUTER_CHART_OWNED,
        "Settings of `shoal router` (RouterSettings), generated from the model: see `shoal router --help`.",
    )
    replica, replica_defs = _config_schema(
        ReplicaSettings,
        REPLICA_CHART_OWNED,
        "Settings of `shoal replica` (ReplicaSettings), generated from the model: see `shoal replica --help`.",
    )
    clash = set(router_defs) & set(replica_defs)
    assert not clash, f"settings models share definition names: {clash}"
    defs = {**router_defs, **replica_defs, "RouterConfig": router, "ReplicaConfig": replica}
    # Keep the definitions the two configs reach; the chart-owned fields' (DiscoverySettings) are left out.
    reached, todo = set(), ["RouterConfig", "ReplicaConfig"]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += [ref.rsplit("/", 1)[1] for ref in _refs(defs[name])]
    return {name: defs[name] for name in sorted(reached)}


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


def write_schema() -> None:
    schema = json.loads(SCHEMA_PATH.read_text())
    schema["$defs"] = schema_defs()
    SCHEMA_PATH.write_text(json.dumps(schema, indent=2) + "\n")


if __name__ == "__main__":
    write_schema()
    print(f"wrote the generated $defs of {SCHEMA_PATH.relative_to(ROOT)}", file=sys.stderr)
