"""The code's layering (shared/STYLE.md 13-14): imports only go downward, so no module of
``cp_lightning/`` or ``recipes/`` imports, directly or through others, a module that imports it.

The import graph is read with ``ast`` (nothing is imported), deferred imports inside functions
included: a deferred import hides a circle from Python, not from a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def import_graph(root: Path, packages: list[str]) -> dict[str, set[str]]:
    """Module name -> the package modules it imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    files = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            files[name] = path

    def resolve(target: str) -> str | None:
        while target and target not in files:
            target = target.rpartition(".")[0]
        return target or None

    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([module] if module else []))
                targets = [
                    f"{module}.{alias.name}" if f"{module}.{alias.name}" in files else module for alias in node.names
                ]
            else:
                continue
            edges.update(t for t in map(resolve, targets) if t is not None and t != name)
        graph[name] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each circle once, as the path that closes it (depth-first search, three colours)."""
    state, stack, found = {}, [], []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for child in sorted(graph[node]):
            if state.get(child) == "open":
                found.append(stack[stack.index(child) :] + [child])
            elif child not in state:
                visit(child)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


@pytest.mark.parametrize("packages", [["cp_lightning"], ["recipes"], ["cp_lightning", "recipes"]], ids=str)
def test_no_import_circle(packages):
    graph = import_graph(ROOT, packages)
    assert len(graph) > 10 * len(packages), graph  # the walk found the packages' modules
    found = circles(graph)
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_library_never_imports_the_recipes():
    """cp_lightning/ is the library; recipes/ assemble it. The planner finds the recipes' bucket scan through an
    entry point (pyproject.toml), not an import."""
    graph = import_graph(ROOT, ["cp_lightning", "recipes"])
    upward = sorted(f"{a} -> {b}" for a, edges in graph.items() if a.startswith("cp_lightning") for b in edges
                    if b.startswith("recipes"))  # fmt: skip
    assert not upward, upward
    by_name = [str(p.relative_to(ROOT)) for p in (ROOT / "cp_lightning").rglob("*.py") if "import_module(\"recipes" in
               p.read_text() or "__import__(\"recipes" in p.read_text()]  # fmt: skip
    assert not by_name, by_name


def test_the_walk_sees_a_circle_through_a_deferred_import(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg import b\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from .c import g\n")
    (tmp_path / "pkg" / "c.py").write_text("import pkg.a\n")
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"}
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    (tmp_path / "pkg" / "c.py").write_text("import os\n")
    assert circles(import_graph(tmp_path, ["pkg"])) == []


MAX_LINES = 450  # shared/STYLE.md: a reader holds one file in view


def test_no_file_in_the_library_is_over_the_length_a_reader_holds():
    long = {
        str(path.relative_to(ROOT)): n
        for path in sorted((ROOT / "cp_lightning").rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these by what they do: {long}"
