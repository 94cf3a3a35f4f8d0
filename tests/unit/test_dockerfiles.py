"""The container images, checked statically: no Docker engine runs on these machines.

Each Dockerfile is parsed with dockerfile-parse and held to what the chart and the project rely on: multi-stage,
external base images pinned to an exact release or a digest, a numeric non-root USER that is the chart's
runAsUser, no secrets in ENV, ARG, LABEL or copied files, an allow-list .dockerignore that lets in exactly what
is copied, and a first-party package set closed under imports (the router image must not need torch; the replica
image must carry the router's hashing). docker/README.md says how to build them for real.
"""

from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parents[2]
DOCKER_DIR = ROOT / "docker"
IMAGES = ("router", "replica")
FIRST_PARTY = ("router", "autoscaler", "replica", "simulations")
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|API_?KEY|PRIVATE|CREDENTIAL|AUTH", re.IGNORECASE)
SECRET_FILE = re.compile(r"(^|/)(\.env|\.netrc|\.pypirc|\.npmrc|id_rsa|id_ed25519|credentials)$|\.(pem|key|p12)$")
EXACT_TAG = re.compile(r":[^:/@]*\d+\.\d+\.\d+[^:/@]*$")


@dataclass(frozen=True)
class Instruction:
    name: str
    value: str
    stage: int
    """Index of the FROM this instruction belongs to (-1: before the first FROM)."""


def instructions(image: str) -> list[Instruction]:
    parser = DockerfileParser(str(DOCKER_DIR / f"{image}.Dockerfile"))
    out, stage = [], -1
    for item in parser.structure:
        if item["instruction"] == "COMMENT":
            continue
        if item["instruction"] == "FROM":
            stage += 1
        out.append(Instruction(item["instruction"], item["value"], stage))
    return out


def final_stage(image: str) -> list[Instruction]:
    all_ = instructions(image)
    last = max(i.stage for i in all_)
    return [i for i in all_ if i.stage == last]


def stage_names(image: str) -> list[str]:
    return [
        m.group(1)
        for i in instructions(image)
        if i.name == "FROM"
        for m in [re.search(r"\bAS\s+(\S+)", i.value, re.I)]
        if m
    ]


def copied_sources(image: str) -> set[str]:
    """Paths COPY takes from the build context (not from another stage)."""
    sources = set()
    for i in instructions(image):
        if i.name == "COPY" and "--from=" not in i.value:
            parts = [p for p in i.value.split() if not p.startswith("--")]
            sources |= {p.rstrip("/") for p in parts[:-1]}
    return sources


@pytest.mark.parametrize("image", IMAGES)
def test_images_are_multi_stage_from_pinned_bases(image: str) -> None:
    parser = DockerfileParser(str(DOCKER_DIR / f"{image}.Dockerfile"))
    assert parser.is_multistage
    internal = set(stage_names(image))
    external = [ref for ref in parser.parent_images if ref not in internal]
    assert external, "no base image"
    for ref in external:
        assert "@sha256:" in ref or EXACT_TAG.search(ref), f"{ref} is not pinned to a release or a digest"
        assert not ref.endswith(":latest")
    for i in instructions(image):
        if i.name == "COPY" and "--from=" in i.value:
            source = re.search(r"--from=(\S+)", i.value)
            assert source and source.group(1) in internal


@pytest.mark.parametrize("image", IMAGES)
def test_images_run_as_the_charts_non_root_uid(image: str) -> None:
    users = [i.value for i in final_stage(image) if i.name == "USER"]
    assert users, "the final stage sets no USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) > 0, "USER must be numeric so runAsNonRoot can check it"
    values = yaml.safe_load((ROOT / "helm" / "shoal" / "values.yaml").read_text())
    assert int(uid) == values["podSecurityContext"]["runAsUser"]
    assert not gid or int(gid) == values["podSecurityContext"]["runAsGroup"]


@pytest.mark.parametrize("image", IMAGES)
def test_images_hold_no_secrets(image: str) -> None:
    for i in instructions(image):
        assert i.name != "ADD", "COPY only: ADD fetches URLs and unpacks archives implicitly"
        if i.name in ("ENV", "ARG", "LABEL"):
            for key in re.findall(r"(?:^|\s)([A-Za-z_][\w.]*)=", i.value):
                assert not SECRET_NAME.search(key), f"{i.name} {key}: secrets belong in a build secret or a Secret"
        if i.name == "RUN":  # no secret assigned inline (a build secret is mounted, never written in)
            assert not re.search(r"\b\w*(TOKEN|SECRET|PASSW\w*|API_?KEY)\w*=\S", i.value, re.IGNORECASE)
    for source in copied_sources(image):
        assert not SECRET_FILE.search(source)


@pytest.mark.parametrize("image", IMAGES)
def test_the_dockerignore_lets_in_exactly_what_is_copied(image: str) -> None:
    lines = [
        line.strip()
        for line in (DOCKER_DIR / f"{image}.Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*", "an allow-list: everything is out unless named"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert allowed == copied_sources(image)
    assert not allowed & {".venv", ".git", ".env", "tests", "benchmarks"}


def _imports_of(package: str) -> set[str]:
    """First-party top-level packages a package's modules import."""
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            found |= {n.split(".")[0] for n in names if n.split(".")[0] in FIRST_PARTY}
    return found - {package}


@pytest.mark.parametrize("image", IMAGES)
def test_images_copy_every_first_party_package_they_import(image: str) -> None:
    packages = copied_sources(image) & set(FIRST_PARTY)
    missing = {imported for package in packages for imported in _imports_of(package)} - packages
    assert missing == set()
    assert {"pyproject.toml", "README.md"} <= copied_sources(image)  # what `pip install .` needs


def test_the_router_image_has_no_torch_and_runs_the_autoscaler() -> None:
    assert copied_sources("router") >= {"router", "autoscaler"} and "replica" not in copied_sources("router")
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in core if re.match(r"(torch|triton)\b", d)]
    runs = " ".join(i.value for i in instructions("router") if i.name == "RUN")
    assert "pip install '.[tokenize]'" in runs and "[replica]" not in runs and "torch ==" not in runs
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not [d for d in extras["tokenize"] if re.match(r"(torch|triton)\b", d)]  # the chat tokenizer only


def test_the_replica_image_is_cuda_torch_and_triton() -> None:
    parser = DockerfileParser(str(DOCKER_DIR / "replica.Dockerfile"))
    assert all(ref.startswith("nvidia/cuda:") for ref in parser.parent_images)
    runs = " ".join(i.value for i in instructions("replica") if i.name == "RUN")
    args = {
        i.value.split("=", 1)[0]: i.value.split("=", 1)[1]
        for i in instructions("replica")
        if i.name == "ARG" and "=" in i.value
    }
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d+", args["TORCH_INDEX_URL"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"])
    assert '".[replica]"' in runs and "import torch, triton" in runs and "torch.version.cuda" in runs
    # Triton compiles its launcher at run time: the final stage keeps a C compiler and Python's headers.
    final_runs = " ".join(i.value for i in final_stage("replica") if i.name == "RUN")
    assert "gcc" in final_runs and "python3-dev" in final_runs


@pytest.mark.parametrize("image", IMAGES)
def test_the_chart_runs_the_images_commands(image: str) -> None:
    """The chart starts `shoal <command>` in these images: the venv's bin is on PATH and the entry point exists."""
    env = " ".join(i.value for i in final_stage(image) if i.name == "ENV")
    assert "PATH=/opt/shoal/bin:$PATH" in env
    assert [i.value for i in final_stage(image) if i.name == "ENTRYPOINT"] == ['["shoal"]']
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "shoal" in scripts
    commands = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["shoal.commands"]
    needed = {"router": {"router", "autoscaler"}, "replica": {"replica"}}[image]
    assert needed <= set(commands)
    for command in needed:
        package = commands[command].split(".")[0]
        assert package in copied_sources(image)
