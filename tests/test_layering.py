"""The package imports one way, in the layer order docs/design.md writes (read here, its one home).

The import graph is read from the source with `ast` (every import statement, including
those inside functions and under ``if TYPE_CHECKING``), so a lazy import that points the
wrong way is caught as well as a top-level one. Two properties are checked:

- no cycle, anywhere in ``distconf`` (a cycle is named module by module, with the lines at fault);
- every import goes to the same layer or an earlier one.

Edges: ``import a.b.c`` is an edge to ``a.b.c``; ``from a.b import c`` is an edge to
``a.b.c`` when that is a module, else to ``a.b``; relative imports are resolved. The
implicit import of a package's ``__init__`` by a submodule import (``a.b`` when importing
``a.b.c``) is not an edge. A string constant that is a dotted path into the package
(``"distconf.blocks.make_block_class"``, resolved later by ``importlib``) is an edge "by name"
to the longest module prefix it names, unless that is one of the module's own packages: an
import by name points one way too.

`LATE_BINDINGS` lists the by-name edges allowed against the order, each with its reason; a
test checks that each one still exists, so the list cannot rot.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from itertools import pairwise
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "distconf"

DESIGN = REPO / "docs" / "design.md"


def read_layers(path: Path = DESIGN) -> tuple[dict[str, int], dict[int, str]]:
    """The layer order as docs/design.md writes it (its one home): each package's layer, and each layer's name.

    The table between ``<!-- layers -->`` and ``<!-- /layers -->``: one row per layer, earliest first, the
    packages in backquotes in the second column.
    """
    text = path.read_text(encoding="utf-8")
    table = text.split("<!-- layers -->", 1)[1].split("<!-- /layers -->", 1)[0]
    layers: dict[str, int] = {}
    names: dict[int, str] = {}
    for row in table.strip().splitlines()[2:]:  # after the header and the |---| line
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        index = len(names)
        names[index] = cells[0]
        for package in re.findall(r"`([^`]+)`", cells[1]):
            layers[package] = index
    return layers, names


# Layer of each top-level part of the package (a later layer may import an earlier one, never the reverse).
# ``distconf`` itself (the package __init__) re-exports the core only, so it is in the bottom layer.
LAYERS, LAYER_NAMES = read_layers()


LATE_BINDINGS: dict[tuple[str, str], str] = {
    ("distconf.loader.spec_block", "distconf.blocks"):
        "the default of a family file's `block.adapter`: data naming a factory, resolved at first use "
        "through the trusted class-path rule like every class path in a family file (a family may name its own)",
}
"""By-name edges against the layer order that are allowed: ``(module, target) -> why``."""

DOTTED_PATH = re.compile(r"distconf(\.[A-Za-z_][A-Za-z0-9_]*)+")


def module_files(root: Path = REPO / PACKAGE) -> dict[str, Path]:
    """Every module of the package, by dotted name (a package's ``__init__`` under the package name)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: set[str]) -> str | None:
    """The longest prefix of ``name`` that is a module of the package, or None (outside the package)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, source: str, modules: set[str], is_package: bool) -> dict[str, tuple[int, bool, bool]]:
    """Modules of the package that ``module`` imports anywhere in ``source``.

    Each maps to ``(line, type_only, by_name)``: the first line importing it, whether every
    import of it sits under ``if TYPE_CHECKING:``, and whether it is named only by a string.
    """
    tree = ast.parse(source)
    type_only = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node.test)
                 for statement in node.body for inner in ast.walk(statement)}
    found: dict[str, tuple[int, bool, bool]] = {}

    def add(target: str | None, node: ast.stmt | ast.expr, by_name: bool = False) -> None:
        if target is None or target == module:
            return
        line, only_types, only_names = found.get(target, (node.lineno, True, True))
        found[target] = (min(line, node.lineno), only_types and id(node) in type_only, only_names and by_name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_resolve(alias.name, modules), node)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                submodule = f"{origin}.{alias.name}"
                add(submodule if submodule in modules else _resolve(origin, modules), node)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and DOTTED_PATH.fullmatch(node.value):
            target = _resolve(node.value, modules)
            # A module's own packages are imported before it: naming one (a logger, a resource root) adds no edge.
            if target is not None and not module.startswith(target + ".") and target != module:
                add(target, node, by_name=True)
    return found


Graph = dict[str, dict[str, str]]
"""module -> {imported module: ``path:line`` of its first import}."""


def import_graph(root: Path = REPO / PACKAGE) -> Graph:
    """The package's import graph, read from its source.

    Imports under ``if TYPE_CHECKING:`` count: a one-way design has no back-reference, not
    even for annotations (their place is marked "under TYPE_CHECKING" in failure messages).
    """
    files = module_files(root)
    names = set(files)
    graph: Graph = {}
    for name, path in files.items():
        found = imports_of(name, path.read_text(encoding="utf-8"), names, path.name == "__init__.py")
        graph[name] = {
            target: f"{path.relative_to(root.parent)}:{line}" + (" under TYPE_CHECKING" if type_only else "")
            + (" by name" if by_name else "")
            for target, (line, type_only, by_name) in found.items()
        }
    return graph


def describe_cycle(cycle: list[str], graph: Graph) -> str:
    """``a -> b -> a`` followed by where each of those imports is written."""
    return " -> ".join(cycle) + "  (" + ", ".join(graph[a][b] for a, b in pairwise(cycle)) + ")"


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component that has one (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    components.append(sorted(component))
    return [_cycle_in(component, graph) for component in components]


def _cycle_in(component: list[str], graph: Mapping[str, Iterable[str]]) -> list[str]:
    """A shortest cycle through the first module of a strongly connected component (breadth-first)."""
    members = set(component)
    start = component[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph.get(node, ())):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child in members and child not in parent:
                    parent[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # pragma: no cover - a component always has one


def layer_of(module: str) -> int | None:
    """The layer of a module: that of its longest listed prefix (None when unlisted)."""
    found = _resolve(module, set(LAYERS))
    return None if found is None else LAYERS[found]


def layer_violations(graph: Graph) -> list[str]:
    """Every import from an earlier layer to a later one, with where it is written."""
    problems = []
    for module in sorted(graph):
        for target in sorted(graph[module]):
            low, high = layer_of(module), layer_of(target)
            if low is not None and high is not None and high > low:
                problems.append(f"{module} ({LAYER_NAMES[low]}) imports {target} ({LAYER_NAMES[high]}) "
                                f"at {graph[module][target]}")
    return problems


# --- self-tests: the machinery can fail ------------------------------------------------------------------


def test_cycle_finder_names_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"d"}}
    cycles = find_cycles(graph)
    assert sorted(cycles) == [["a", "b", "c", "a"], ["e", "e"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_edges_read_from_source(tmp_path) -> None:
    pkg = tmp_path / PACKAGE
    for name in ("loader", "blocks"):
        (pkg / name).mkdir(parents=True)
        (pkg / name / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from distconf.loader import core\n")
    (pkg / "loader" / "core.py").write_text(
        "def later():\n    from distconf.blocks import build\n    return build\n")
    (pkg / "loader" / "other.py").write_text("from . import core\nfrom .core import later\n")
    (pkg / "loader" / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from distconf.loader.other import later\n")
    (pkg / "blocks" / "build.py").write_text("import distconf.loader.core\nimport torch\n")
    graph = import_graph(pkg)
    assert set(graph["distconf"]) == {"distconf.loader.core"}
    assert set(graph["distconf.loader.core"]) == {"distconf.blocks.build"}  # inside a function; submodule by name
    assert set(graph["distconf.loader.other"]) == {"distconf.loader.core"}  # relative imports resolved
    assert set(graph["distconf.blocks.build"]) == {"distconf.loader.core"}  # outside packages ignored
    assert set(graph["distconf.loader.typed"]) == {"distconf.loader.other"}  # type-only imports count
    assert graph["distconf.loader.typed"]["distconf.loader.other"].endswith("typed.py:3 under TYPE_CHECKING")
    assert find_cycles(graph) == [["distconf.blocks.build", "distconf.loader.core", "distconf.blocks.build"]]
    assert layer_violations(graph) == [
        "distconf.loader.core (core) imports distconf.blocks.build (blocks) at distconf/loader/core.py:2"]
    cycle = describe_cycle(find_cycles(graph)[0], graph)
    assert cycle.endswith("(distconf/blocks/build.py:1, distconf/loader/core.py:2)")


def test_dotted_path_strings_are_edges(tmp_path) -> None:
    pkg = tmp_path / PACKAGE
    for name in ("loader", "blocks"):
        (pkg / name).mkdir(parents=True)
        (pkg / name / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "blocks" / "build.py").write_text("")
    (pkg / "loader" / "spec.py").write_text(
        'DEFAULT = "distconf.blocks.build.make"\nNOT_A_PATH = "distconf is nice"\nLOGGER = "distconf.nowhere"\n')
    graph = import_graph(pkg)
    assert graph["distconf.loader.spec"] == {"distconf.blocks.build": "distconf/loader/spec.py:1 by name"}
    assert layer_violations(graph) == [
        "distconf.loader.spec (core) imports distconf.blocks.build (blocks) at distconf/loader/spec.py:1 "
        "by name"]


# --- the package ------------------------------------------------------------------------------------------


def without_late_bindings(graph: Graph) -> Graph:
    """The graph less the allowed by-name edges of `LATE_BINDINGS`."""
    return {module: {t: where for t, where in targets.items() if (module, t) not in LATE_BINDINGS}
            for module, targets in graph.items()}


@pytest.fixture(scope="module")
def full_graph() -> Graph:
    return import_graph()


@pytest.fixture(scope="module")
def graph(full_graph) -> Graph:
    return without_late_bindings(full_graph)


def test_late_bindings_exist_and_are_by_name(full_graph) -> None:
    for module, target in LATE_BINDINGS:
        assert target in full_graph.get(module, {}), f"stale LATE_BINDINGS entry: {module} -> {target}"
        assert full_graph[module][target].endswith(" by name"), f"{module} imports {target} for real"


def test_graph_sees_the_package(graph) -> None:
    assert {"distconf.loader.registry", "distconf.blocks.build", "distconf.dht.discovery"} <= set(graph)
    assert "distconf.loader.spec" in graph["distconf.loader.source"]
    assert "distconf.loader.registry" in graph["distconf"]


def test_no_import_cycle(graph) -> None:
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(describe_cycle(cycle, graph) for cycle in cycles)


def test_every_module_has_a_layer(graph) -> None:
    unlisted = sorted(m for m in graph if layer_of(m) is None)
    assert not unlisted, f"modules outside every layer (add them to LAYERS in tests/test_layering.py): {unlisted}"


def test_imports_point_to_earlier_layers(graph) -> None:
    problems = layer_violations(graph)
    assert not problems, "imports against the layer order:\n" + "\n".join(problems)
