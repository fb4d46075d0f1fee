"""No import circle among the modules of ``services/``, ``shared/``, ``devstack/`` and ``bench/``.

Every import counts: at the top of a module, inside a function (imported only when used), and under
``TYPE_CHECKING``. A circle through any of them means two modules that cannot be understood, tested or
changed one without the other, whether or not Python happens to load them without an error.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "shared", "devstack", "bench")

KNOWN: set[frozenset[str]] = set()
"""Circles not yet taken apart, each named so that no new one hides behind it. None is left: any circle fails."""


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports anywhere in its file (``from a import b`` counts ``a.b`` when that
    is a module, else ``a``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def test_the_checker_finds_a_circle_through_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}) == [frozenset({"a", "b", "c"})]
    known = {"shared.x": tmp_path / "x.py", "shared.y": tmp_path / "y.py", "shared.z": tmp_path / "z.py"}
    known["shared.x"].write_text("def f():\n    from shared import y\n")
    known["shared.y"].write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .z import Z\n")
    known["shared.z"].write_text("import shared.x\n")
    g = {name: imported(name, path, known) for name, path in known.items()}
    assert g == {"shared.x": {"shared.y"}, "shared.y": {"shared.z"}, "shared.z": {"shared.x"}}
    assert circles(g) == [frozenset(known)]


def test_no_import_circle_in_the_project() -> None:
    found = set(circles(graph()))
    new = [sorted(c) for c in found - KNOWN]
    assert not new, f"import circles: {new}"
    gone = [sorted(c) for c in KNOWN - found]
    assert not gone, f"these circles are gone: remove them from KNOWN: {gone}"
