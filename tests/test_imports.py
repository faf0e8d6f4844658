"""The import graph of kdb: no cycles among the core modules (imports inside functions count),
core never imports a back end, and a hit in a fresh process imports only what it needs."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import kdb

PACKAGE = Path(kdb.__file__).resolve().parent

#: The rooms this graph pins: the lookup/compile/store core and its bookkeeping and lifecycle.
CORE = {"kdb.db", "kdb.tiers", "kdb.claims", "kdb.bookkeeping", "kdb.lifecycle",
        "kdb.background", "kdb.latency", "kdb.spool", "kdb.worker", "kdb.jobs", "kdb.keeper",
        "kdb.shared", "kdb.pgserver", "kdb.sharedreport", "kdb.sharedlocks", "kdb.tally", "kdb.logs",
        "kdb.faults"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the kdb modules it imports anywhere in its text (functions included)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name and t != "kdb":
                    deps.add(t)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]], among: set[str]) -> list[list[str]]:
    """Every strongly connected group of more than one module within ``among``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in among:
                continue
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

    for v in sorted(among):
        if v not in index:
            visit(v)
    return found


def test_the_core_modules_import_no_cycle():
    graph = import_graph()
    assert cycles(graph, CORE) == []


def test_the_core_never_imports_a_back_end():
    graph = import_graph()
    offenders = {m: sorted(d for d in deps if d.startswith("kdb.backends"))
                 for m, deps in graph.items() if m in CORE}
    assert {m: d for m, d in offenders.items() if d} == {}


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, {"a", "b", "c", "d"}) == [
        ["a", "b", "c"]]


def test_a_hit_in_a_fresh_process_imports_only_the_hit_path(cache_dir):
    """Serving a hit needs the tiers and the bookkeeping; claims, the background thread,
    the spool, the shared tier and the run reports load only for a miss or an exit."""
    db = kdb.KernelDB()
    attrs = kdb.HashAttributes(backend="opencl", source="__kernel void k() {}", arch="hitarch",
                               name="k")
    assert db.put(attrs, b"binary")
    db.close()
    code = f"""
        import json, sys
        import kdb
        db = kdb.KernelDB(use_system=False)
        a = kdb.HashAttributes(backend="opencl", source="__kernel void k() {{}}",
                               arch="hitarch", name="k")
        assert db.get(a) == b"binary"
        print(json.dumps(sorted(m for m in sys.modules if m.startswith("kdb"))))
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True,
                         capture_output=True, text=True).stdout
    loaded = set(json.loads(out))
    assert "kdb.tiers" in loaded and "kdb.bookkeeping" in loaded
    for name in ("kdb.tally", "kdb.background", "kdb.claims", "kdb.spool", "kdb.worker",
                 "kdb.shared", "kdb.jobs", "kdb.keeper"):
        assert name not in loaded, name
