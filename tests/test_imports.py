"""The package's import graph has no cycles: data flows one way (bars -> features -> ... -> evaluation -> export)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "foxhunt"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node that can run: the bodies of ``if TYPE_CHECKING:`` (type-only imports) are left out."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the foxhunt modules it imports anywhere in its body (lazy imports inside functions included; the
    type-only imports under ``if TYPE_CHECKING:`` are not edges, since they never execute)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                # `from pkg import sub` imports the submodule pkg.sub when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target.startswith("foxhunt") and target != name:
                    deps.add(target)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path of module names, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "foxhunt.lit.ensemble" in graph and "foxhunt.evaluation.backtest" in graph["foxhunt.lit.ensemble"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_members_and_evaluation_do_not_reach_back() -> None:
    """Evaluation never imports the LightningModules, entry points or export; members never import the entry points;
    nothing but the quality yardsticks themselves imports foxhunt.quality."""
    graph = import_graph()
    late = ("foxhunt.lit", "foxhunt.fit", "foxhunt.export", "foxhunt.backtest", "foxhunt.tune", "foxhunt.quality")
    for name, deps in graph.items():
        if name.startswith(("foxhunt.evaluation", "foxhunt.data", "foxhunt.features", "foxhunt.rl", "foxhunt.models")):
            assert not [d for d in deps if d.startswith(late)], f"{name} imports {sorted(deps)}"
        if name.startswith("foxhunt.lit"):
            assert not [d for d in deps if d.startswith(late[1:])], f"{name} imports {sorted(deps)}"
        if not name.startswith("foxhunt.quality"):  # the yardsticks sit last: only tests and scripts import them
            assert not [d for d in deps if d.startswith("foxhunt.quality")], f"{name} imports {sorted(deps)}"
