"""The scripts stand alone (none imports another or edits ``sys.path``; what they share lives in the package) and
scripts/README.md has one row per script."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _imported_modules(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def _edits_sys_path(tree: ast.AST) -> bool:
    return any(isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
               and node.value.id == "sys" for node in ast.walk(tree))


def test_no_script_imports_another_or_edits_sys_path() -> None:
    scripts = {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(SCRIPTS.glob("*.py"))}
    bad = [f"{name} imports {sorted(_imported_modules(tree) & set(scripts))}" for name, tree in scripts.items()
           if _imported_modules(tree) & set(scripts)]
    bad += [f"{name} edits sys.path" for name, tree in scripts.items() if _edits_sys_path(tree)]
    assert not bad, bad


def test_readme_has_one_row_per_script() -> None:
    rows = re.findall(r"^\| `(\w+\.py)` \|", (SCRIPTS / "README.md").read_text(), flags=re.MULTILINE)
    assert len(rows) == len(set(rows)), rows
    assert set(rows) == {p.name for p in SCRIPTS.glob("*.py")}
