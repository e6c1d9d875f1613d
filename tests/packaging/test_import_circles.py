"""No import circles among the project's modules (every package: the client and its kernel, the CLI,
the demo rig, the replicator, the CSI driver, the operator).

Every import counts, wherever it is written: at the top, inside a function (a lazy import) or under
``if TYPE_CHECKING``. A lazy or type-only import still says that one module needs the other; two
modules that need each other are one concept split in two, or a third module is missing. The graph is
read from the source (nothing is imported), so the test is fast and names the circle it finds.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = {
    "tierckpt": REPO / "client",
    "tierckpt_cli": REPO / "cli",
    "tierckpt_demo": REPO / "demo",
    "tierckpt_replicator": REPO / "replicator",
    "tierckpt_csi": REPO / "csi",
    "tierckpt_operator": REPO / "operator",
}

KNOWN: set[frozenset[str]] = set()
"""Circles allowed to stay: none. Nothing may be added here."""


def modules() -> dict[str, Path]:
    found = {}
    for package, where in SOURCES.items():
        for path in (where / package).rglob("*.py"):
            parts = path.relative_to(where).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imports(path: Path, name: str, known: set[str]) -> Iterator[str]:
    """The project's modules that ``name`` (at ``path``) imports, anywhere in it."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    yield sub  # ``from package import module``
                elif base in known:
                    yield base


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
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
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_one_that_imports_it_back():
    found = modules()
    graph = {name: set(imports(path, name, set(found))) - {name} for name, path in found.items()}
    unexpected = [c for c in circles(graph) if frozenset(c) not in KNOWN]
    assert not unexpected, "import circles: " + "; ".join(" <-> ".join(c) for c in unexpected)


def test_the_detector_finds_a_circle():
    """The check itself: a circle through three modules is found, a chain is not."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
