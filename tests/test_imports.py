"""The package's imports follow the data flow: no module or package imports one that imports it back, and every module
imports only its own stage of the flow or earlier ones (:data:`STAGES`)."""

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


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package -> the other packages its modules import (``foxhunt.data.io`` is in ``foxhunt.data``; the top-level
    modules ``foxhunt.fit``, ``foxhunt.export``, .. are packages of their own)."""
    out: dict[str, set[str]] = {}
    for name, deps in graph.items():
        package = _package(name)
        out.setdefault(package, set()).update(_package(d) for d in deps if _package(d) != package)
    return out


# The stages of the data flow, earliest first: bars -> features -> windows -> members -> coordinator -> export -> the
# entry points, and the quality yardsticks after everything they measure. A module belongs to the stage of the
# longest prefix listed. The arithmetic of positions (``foxhunt.trading``: the exact P&L, the policy-table rollout,
# the oracle) and the scoring built on it (``foxhunt.evaluation``) sit before the members, which are trained on the
# one and score themselves with the other; neither reads a member.
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("plumbing", ("foxhunt.version", "foxhunt.files", "foxhunt.cli_errors", "foxhunt.kernels")),
    ("bars", ("foxhunt.data.bars", "foxhunt.data.dbn", "foxhunt.data.io", "foxhunt.data.synthetic")),
    ("features", ("foxhunt.features", "foxhunt.preprocessing")),
    ("windows", ("foxhunt.data",)),
    ("positions", ("foxhunt.trading",)),
    ("scoring", ("foxhunt.evaluation",)),
    ("networks", ("foxhunt.models", "foxhunt.training")),
    ("environment", ("foxhunt.rl",)),
    ("members", ("foxhunt.lit",)),
    ("coordinator", ("foxhunt.lit.ensemble",)),
    ("export", ("foxhunt.export",)),
    ("live", ("foxhunt.live",)),
    ("entry points", ("foxhunt", "foxhunt.fit", "foxhunt.backtest", "foxhunt.compare")),
    ("runs of fits", ("foxhunt.walkforward", "foxhunt.tune")),
    ("quality", ("foxhunt.quality",)),
)


def stage_of(module: str) -> int:
    """Index in :data:`STAGES` of the longest prefix of ``module`` listed there (the root package, ``foxhunt.load``,
    stands for itself alone); -1 when none is."""
    best, length = -1, -1
    for i, (_, prefixes) in enumerate(STAGES):
        for prefix in prefixes:
            inside = module.startswith(prefix + ".") and prefix != "foxhunt"
            if (module == prefix or inside) and len(prefix) > length:
                best, length = i, len(prefix)
    return best


def backward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a later stage of the flow (``importer -> imported``), and every module that belongs to none."""
    bad = [f"{name} belongs to no stage" for name in sorted(graph) if stage_of(name) < 0]
    for name in (n for n in sorted(graph) if stage_of(n) >= 0):
        later = [d for d in sorted(graph[name]) if stage_of(d) > stage_of(name)]
        bad += [f"{name} ({STAGES[stage_of(name)][0]}) -> {d} ({STAGES[stage_of(d)][0]})" for d in later]
    return bad


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "foxhunt.lit.ensemble" in graph and "foxhunt.evaluation.backtest" in graph["foxhunt.lit.ensemble"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_package_has_no_package_level_cycle() -> None:
    """Packages import one way too: ``rl`` and ``evaluation`` share ``trading`` instead of importing each other."""
    assert package_graph({"foxhunt.a.x": {"foxhunt.b.y"}, "foxhunt.b.y": set(), "foxhunt.b.z": {"foxhunt.a"},
                          "foxhunt.a": set()}) == {"foxhunt.a": {"foxhunt.b"}, "foxhunt.b": {"foxhunt.a"}}
    packages = package_graph(import_graph())
    assert {"foxhunt.rl", "foxhunt.evaluation"} <= packages["foxhunt.quality"]
    cycle = find_cycle(packages)
    assert cycle is None, "package import cycle: " + " -> ".join(cycle or [])


def test_stage_of_takes_the_longest_prefix() -> None:
    assert stage_of("foxhunt.lit.ensemble") > stage_of("foxhunt.lit.dqn") > stage_of("foxhunt.rl.env")
    assert stage_of("foxhunt.data.io") < stage_of("foxhunt.features.ops") < stage_of("foxhunt.data.windows")
    assert stage_of("foxhunt.dataset") == -1 and stage_of("foxhunt") == stage_of("foxhunt.fit")
    assert backward_imports({"foxhunt.rl.env": {"foxhunt.lit.dqn"}, "foxhunt.lit.dqn": {"foxhunt.rl.env"}}) == [
        "foxhunt.rl.env (environment) -> foxhunt.lit.dqn (members)"]
    assert backward_imports({"foxhunt.dataset": {"foxhunt.fit"}}) == ["foxhunt.dataset belongs to no stage"]


def test_every_import_follows_the_data_flow() -> None:
    """Nothing imports a later stage: scoring and the environment never import the members, the members never the
    coordinator, export or the entry points, and nothing but the quality yardsticks imports foxhunt.quality."""
    bad = backward_imports(import_graph())
    assert not bad, "imports against the data flow:\n" + "\n".join(bad)
