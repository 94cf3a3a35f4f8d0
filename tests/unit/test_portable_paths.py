"""No file of the repository names a path of the machine it was written on, so a fresh clone runs anywhere.

Checked: every file git tracks or would track (untracked files not ignored), text files only. A machine path is
one under a workspace or a home directory (`work`, `root`, `home/NAME` or `Users/NAME` at the root of the file
system) or a pytest temporary directory; in committed data (benchmark results, test data) any path under `tmp` is
one too, since it names a run's scratch space. Paths inside the project's images (`/opt/shoal`, `/home/shoal`)
and the chart's mount points (`/mnt/models`) are theirs, not a machine's, and are allowed.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
_START = r"(?<![\w.~-])"
"""A path starts at a word boundary: a URL's path or one under `~` is no absolute path."""
_WORKSPACES = ("work", "root")
"""Top-level directories of the machines the project is written on (a workspace, root's home)."""
MACHINE_PATH = re.compile(
    rf"{_START}/(?:{'|'.join(_WORKSPACES)})/|{_START}/home/(?!shoal/)[\w.-]+/|{_START}/Users/[\w.-]+/"
    r"|/tmp/pytest[-]of[-]"
)
DATA_DIRS = ("benchmarks/results/", "tests/data/")
DATA_TMP = re.compile(rf"{_START}/tmp/")
_SKIP_DIRS = {".git", ".venv", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache", "build"}


def repository_files(root: Path) -> list[str]:
    """Files git tracks or would track under `root`; without git (an unpacked archive), every file but caches."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(root), "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return [
            path.relative_to(root).as_posix()
            for path in root.rglob("*")
            if path.is_file() and not _SKIP_DIRS & set(path.relative_to(root).parts)
        ]
    return [name for name in listed.decode().split("\0") if name]


def machine_paths(root: Path, files: list[str]) -> list[str]:
    """`file:line: match` for every machine path in the text files `files` of `root`."""
    found: list[str] = []
    for name in files:
        path = root / name
        if not path.is_file():
            continue  # deleted in the work tree, not yet in the index
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary: weights, images
        patterns = [MACHINE_PATH, DATA_TMP] if name.startswith(DATA_DIRS) else [MACHINE_PATH]
        for number, line in enumerate(data.decode(errors="replace").splitlines(), 1):
            found += [f"{name}:{number}: {m.group(0)}" for pattern in patterns for m in pattern.finditer(line)]
    return found


def test_no_file_names_a_path_of_this_machine() -> None:
    files = repository_files(ROOT)
    assert "README.md" in files and "tests/unit/test_portable_paths.py" in files
    found = machine_paths(ROOT, files)
    assert not found, "machine paths in the repository:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("name", "text", "is_found"),
    [
        ("tests/test_x.py", f'TRACE = Path("/{_WORKSPACES[0]}/data/x.jsonl")', True),
        ("README.md", f"cd /{_WORKSPACES[1]}/shoal && make", True),
        ("docs/a.md", "see /home/" + "alice/shoal", True),
        ("benchmarks/results/run.json", '{"out": "/' + 'tmp/sim/01"}', True),
        ("benchmarks/results/run.txt", "tmp_path /" + "tmp/pytest-of-root/pytest-3/x", True),
        ("tests/test_y.py", "out = tmp_path / 'x'  # not a literal path", False),
        ("README.md", "--out /" + "tmp/sim/01 (a user's choice, in prose)", False),
        ("docker/a.Dockerfile", "ENV HOME=/home/shoal PATH=/opt/shoal/bin", False),
        ("README.md", f"https://example.com/{_WORKSPACES[0]}/x and ~/{_WORKSPACES[0]}/x", False),
    ],
)
def test_the_check_finds_machine_paths_and_only_those(tmp_path: Path, name: str, text: str, is_found: bool) -> None:
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(text + "\n")
    assert bool(machine_paths(tmp_path, [name])) is is_found
