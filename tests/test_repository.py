"""The README's test command runs on a fresh clone: no test reads a path outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

#: The sibling folder of a session's checkout that a fresh clone lacks, and what reaching above the repository root
#: looks like in a test. The patterns are assembled from parts so that this file, which names them, reads nothing.
SIBLING = "shared"
UP = ".."
OUTSIDE = re.compile("|".join((
    r"parents\[(?:[2-9]|\d\d)\]",  # Path(__file__).parents[k]: tests/ -> repo root is k = 1
    r"\.parent\.parent\.parent",
    re.escape(f"{UP}/{SIBLING}"),
    rf"/\s*[\"']{SIBLING}[\"']\s*/",
)))


def test_no_test_reads_outside_the_repository() -> None:
    offenders = [f"{p.name}:{i}: {line.strip()}" for p in sorted(TESTS.rglob("*.py")) if p.name != Path(__file__).name
                 for i, line in enumerate(p.read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert not offenders, "tests reaching outside the repository:\n" + "\n".join(offenders)


def test_the_pattern_catches_the_old_dbn_path() -> None:
    k = 2
    assert OUTSIDE.search(f'DBN_DIR = Path(__file__).resolve().parents[{k}] / "{SIBLING}" / "data" / "dbn"')
    assert OUTSIDE.search(f'open("{UP}/{SIBLING}/data/dbn/x.dbn")')
    assert not OUTSIDE.search('DBN_DIR = Path(__file__).resolve().parent / "data" / "dbn"')


def test_the_dbn_samples_ship_with_the_tests() -> None:
    assert len(sorted((TESTS / "data" / "dbn").glob("*.dbn*"))) == 16


def test_every_kernel_source_ships_as_package_data() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = TESTS.parent
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    sources = sorted((root / "foxhunt" / "kernels").glob("*.c"))
    assert sources, "foxhunt/kernels holds no C source"
    assert (root / "foxhunt" / "kernels" / "__init__.py").is_file()  # a regular package: packages.find ships it
    assert all(any(s.match(g) for g in data["foxhunt.kernels"]) for s in sources)
