"""The import rules of docs/architecture.md, checked on the source of the whole package: no
import cycle (imports inside functions count; ``if TYPE_CHECKING:`` imports do not), and only
the front ends that show or build for a device import a back end."""

from __future__ import annotations

import ast
from pathlib import Path

import kdb

PACKAGE = Path(kdb.__file__).resolve().parent

#: Back ends: they import core, never the other way round.
BACKENDS = ("kdb.backends", "kdb.opencl", "kdb.cuda")
#: The front ends docs/architecture.md allows to import a back end.
DEVICE_FRONT_ENDS = {"kdb.explain", "kdb.info", "kdb.auto", "kdb.pack_compile",
                     "kdb.demo_programs"}


def _name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    return skip


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the kdb modules it imports at run time, anywhere in its text."""
    files = {_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_nodes(tree)
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t not in (name, "kdb"):
                    deps.add(t)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _is_backend(name: str) -> bool:
    return any(name == b or name.startswith(b + ".") for b in BACKENDS)


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_only_the_device_front_ends_import_a_back_end():
    graph = import_graph()
    offenders = {m: sorted(d for d in deps if _is_backend(d)) for m, deps in graph.items()
                 if not _is_backend(m) and m not in DEVICE_FRONT_ENDS}
    assert {m: d for m, d in offenders.items() if d} == {}


def test_the_checks_see_a_cycle_and_a_lazy_import(tmp_path):
    pkg = tmp_path / "kdb"
    (pkg / "backends").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "backends" / "__init__.py").write_text("")
    (pkg / "backends" / "gpu.py").write_text("from .. import store\n")
    (pkg / "store.py").write_text("def f():\n    from . import db\n")
    (pkg / "db.py").write_text("from . import store\nfrom .backends import gpu\n")
    (pkg / "keys.py").write_text("TYPE_CHECKING = False\nif TYPE_CHECKING:\n"
                                 "    from . import db\n")
    graph = import_graph(pkg)
    assert graph["kdb.keys"] == set()  # type-only imports are not run-time edges
    assert graph["kdb.db"] == {"kdb.store", "kdb.backends", "kdb.backends.gpu"}
    assert cycles(graph) == [["kdb.backends.gpu", "kdb.db", "kdb.store"]]
