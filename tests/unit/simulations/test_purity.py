"""The simulator's core reads no wall clock and draws only from seeded generators (DESIGN.md: pure core)."""

from __future__ import annotations

import re
from pathlib import Path

SOURCES = sorted((Path(__file__).parents[3] / "simulations").glob("*.py"))

WALL_CLOCK = re.compile(
    r"^\s*(import time|from time import)|time\.(time|perf_counter|monotonic)\(|datetime\.now\(", re.M
)
GLOBAL_RANDOM = re.compile(r"\brandom\.(random|randint|choice|choices|sample|shuffle|uniform|expovariate|seed)\(")


def test_no_module_reads_the_wall_clock() -> None:
    assert SOURCES
    offenders = [p.name for p in SOURCES if WALL_CLOCK.search(p.read_text())]
    assert offenders == []


def test_randomness_comes_from_seeded_generators_only() -> None:
    offenders = [p.name for p in SOURCES if GLOBAL_RANDOM.search(p.read_text())]
    assert offenders == []
