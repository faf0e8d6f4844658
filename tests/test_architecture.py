"""The layer order of docs/architecture.md, checked on the source of the whole distribution
(the ``kdb`` package and the ``_kdb_auto`` start-up hook): every module sits in exactly one
layer of the map, no module imports from a layer above its own, there is no import cycle
(imports inside functions count; ``if TYPE_CHECKING:`` imports do not), and only the front
ends that show or build for a device import a back end.

The layers are read from the map itself, so the map and the code cannot drift apart."""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import _kdb_auto
import kdb

PACKAGE = Path(kdb.__file__).resolve().parent
REPO_MAP = PACKAGE.parent / "docs" / "architecture.md"
#: Modules of the distribution outside the package: name -> file.
TOP_MODULES = {"_kdb_auto": Path(_kdb_auto.__file__).resolve()}

#: Back ends: they import core, never the other way round.
BACKENDS = ("kdb.backends", "kdb.opencl", "kdb.cuda", "kdb.hip", "kdb.triton", "kdb.torch")
#: The front ends docs/architecture.md allows to import a back end.
DEVICE_FRONT_ENDS = {"kdb.admin.explain", "kdb.admin.info", "kdb.adopt.auto",
                     "kdb.pack.compiling", "kdb.demo.programs"}


def _name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    return skip


def import_graph(package: Path = PACKAGE, top: dict[str, Path] | None = None
                 ) -> dict[str, set[str]]:
    """Module -> the modules of the distribution it imports at run time, anywhere in its text."""
    files = {_name(p, package): p for p in package.rglob("*.py")}
    files.update(TOP_MODULES if top is None else top)
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
                subs = [f"{base}.{a.name}" for a in node.names]
                # ``from . import sibling`` needs the sibling only: its package is the one
                # being imported already (Python imports a package before its modules).
                bare = node.level and not node.module and all(t in files for t in subs)
                targets = subs if bare else [base] + subs
            else:
                continue
            for t in targets:
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != name:
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


def layers(text: str | None = None) -> list[tuple[str, list[str]]]:
    """The map's layers, lowest first: ``(name, module patterns)`` from the table under
    "## Layers" in docs/architecture.md (a pattern may end in ``.*``)."""
    if text is None:
        text = REPO_MAP.read_text(encoding="utf-8")
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    found = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not re.match(r"\*\*\d+\.", cells[0]):
            continue
        found.append((cells[0].strip("*"), re.findall(r"`([\w.*]+)`", cells[1])))
    return found


def layer_of(module: str, table: list[tuple[str, list[str]]]) -> list[int]:
    return [i for i, (_, pats) in enumerate(table)
            if any(fnmatch.fnmatchcase(module, p) for p in pats)]


def _is_backend(name: str) -> bool:
    return any(name == b or name.startswith(b + ".") for b in BACKENDS)


def test_every_module_is_in_exactly_one_layer_of_the_map():
    table = layers()
    assert len(table) >= 5, "docs/architecture.md lost its layer table"
    placed = {m: layer_of(m, table) for m in import_graph()}
    assert {m: ls for m, ls in placed.items() if len(ls) != 1} == {}


def test_no_module_imports_from_a_layer_above_its_own():
    table = layers()
    graph = import_graph()
    up = {}
    for m, deps in graph.items():
        (mine,) = layer_of(m, table)
        bad = sorted(d for d in deps if layer_of(d, table)[0] > mine)
        if bad:
            up[f"{m} ({table[mine][0]})"] = bad
    assert up == {}


def test_the_distribution_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_only_the_device_front_ends_import_a_back_end():
    graph = import_graph()
    offenders = {m: sorted(d for d in deps if _is_backend(d)) for m, deps in graph.items()
                 if not _is_backend(m) and m not in DEVICE_FRONT_ENDS}
    assert {m: d for m, d in offenders.items() if d} == {}


def test_each_wing_says_what_it_owns_and_may_import():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert doc and "import" in doc.lower(), f"{init.parent.name}/__init__.py says nothing of its imports"



def private_imports(package: Path = PACKAGE) -> list[str]:
    """``importer <- module.name`` for every private name (``_x``, not ``__x__``) imported
    from a module of another package of the distribution: a wing's private names are its own."""
    files = {_name(p, package): p for p in package.rglob("*.py")}

    def home(module: str) -> str:  # the package a module belongs to
        return module if files[module].name == "__init__.py" else module.rpartition(".")[0]

    found = []
    for name in files:
        for node in ast.walk(ast.parse(files[name].read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                up = home(name).split(".")[: len(home(name).split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and base in files and home(base) != home(name):
                    found.append(f"{name} <- {base}.{alias.name}")
    return sorted(found)


def test_no_private_name_crosses_a_package():
    assert private_imports() == []


def test_the_check_sees_a_private_name_taken_from_another_package(tmp_path):
    pkg = tmp_path / "kdb"
    (pkg / "wing").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "wing" / "__init__.py").write_text("from .room import _mine, shared  # its own\n")
    (pkg / "wing" / "room.py").write_text("_mine = shared = 1\n")
    (pkg / "core.py").write_text("from .wing import _mine\nfrom .wing.room import shared\n")
    assert private_imports(pkg) == ["kdb.core <- kdb.wing._mine"]


#: The house's size: the top of ``kdb/`` holds the core and the public module paths, every
#: other module a wing (a folder) small enough to read as one room.
# 12: kdb.registry, the one table every layer reads, sits at the root with the base.
CORE_MODULES_MAX, WING_MODULES_MAX = 12, 12
#: A function is one step: at most this many lines of body (its docstring aside) and this
#: many positional parameters (``self`` and ``cls`` aside; keyword-only ones are free). A
#: function that mirrors another library's signature says so on its ``def`` lines
#: ("mirrors ...") and may take what that signature takes.
FUNCTION_LINES_MAX, POSITIONAL_MAX = 60, 7
#: The public paths at the top: one facade per device API, and the documented entry points.
PUBLIC_PATHS = {"opencl.py", "cuda.py", "hip.py", "triton.py", "torch.py", "pytest.py"}


def _modules_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.py") if p.name != "__init__.py")


def test_the_house_keeps_its_size():
    core = [m for m in _modules_in(PACKAGE) if m not in PUBLIC_PATHS]
    assert len(core) <= CORE_MODULES_MAX, core
    for init in PACKAGE.rglob("__init__.py"):
        if init.parent != PACKAGE and init.parent.name != "versions":
            rooms = _modules_in(init.parent) + [
                d.name for d in init.parent.iterdir() if (d / "__init__.py").is_file()]
            assert len(rooms) <= WING_MODULES_MAX, (init.parent.relative_to(PACKAGE), rooms)


def oversized_functions(package: Path) -> list[str]:
    """``module:line name`` of each function longer than :data:`FUNCTION_LINES_MAX` or with
    more than :data:`POSITIONAL_MAX` positional parameters (and no "mirrors" on its ``def``
    lines), with what it has."""
    out = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            where = f"{path.relative_to(package)}:{node.lineno} {node.name}"
            body = node.body
            doc = body[0] if body and isinstance(body[0], ast.Expr) and isinstance(
                body[0].value, ast.Constant) and isinstance(body[0].value.value, str) else None
            length = node.end_lineno - body[0].lineno + 1 - (
                doc.end_lineno - doc.lineno + 1 if doc else 0)
            if length > FUNCTION_LINES_MAX:
                out.append(f"{where}: {length} lines")
            params = [a.arg for a in node.args.posonlyargs + node.args.args]
            positional = len(params) - (params[:1] in (["self"], ["cls"]))
            header = "\n".join(lines[node.lineno - 1:body[0].lineno - 1])
            if positional > POSITIONAL_MAX and "mirrors" not in header:
                out.append(f"{where}: {positional} positional parameters")
    return out


def test_every_function_is_one_step():
    """No function over 60 lines or with more than 7 positional parameters (issue 30)."""
    assert oversized_functions(PACKAGE) == []


def test_the_size_check_sees_a_long_and_a_wide_function(tmp_path):
    pkg = tmp_path / "kdb"
    pkg.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_LINES_MAX + 1))
    (pkg / "m.py").write_text(
        f'def long():\n    """Docstring lines do not count."""\n{body}\n\n'
        "def wide(a, b, c, d, e, f, g, h):\n    pass\n\n\n"
        "def free(a, b, c, d, e, f, g, *, h):\n    pass\n\n\n"
        "def compile(a, b, c, d, e, f, g, h):  # mirrors lib.compile\n    pass\n\n\n"
        "class C:\n    def method(self, a, b, c, d, e, f, g):\n        pass\n")
    assert oversized_functions(pkg) == [f"m.py:1 long: {FUNCTION_LINES_MAX + 1} lines",
                                        "m.py:66 wide: 8 positional parameters"]


def test_every_package_of_the_tree_ships_in_the_wheel():
    """pyproject.toml lists the packages by name: a new wing left out would be missing from
    the wheel while every test of the checkout passes."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: kdb depends on tomli there
        import tomli as tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))
                 ["tool"]["setuptools"]["packages"])
    found = {_name(init, PACKAGE) for init in PACKAGE.rglob("__init__.py")}
    assert found - listed == set()

def test_the_checks_see_a_cycle_a_lazy_import_and_an_upward_import(tmp_path):
    pkg = tmp_path / "kdb"
    (pkg / "backends").mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '1'\nfrom . import codec\n")
    (pkg / "backends" / "__init__.py").write_text("")
    (pkg / "backends" / "gpu.py").write_text("from .. import tier\n")
    (pkg / "tier.py").write_text("def f():\n    from . import db\n")
    (pkg / "db.py").write_text("from . import tier\nfrom .backends import gpu\n")
    (pkg / "keys.py").write_text("TYPE_CHECKING = False\nif TYPE_CHECKING:\n"
                                 "    from . import db\n")
    (pkg / "codec.py").write_text("from . import __version__\n")  # the package root itself
    hook = tmp_path / "_hook.py"
    hook.write_text("def f():\n    import kdb.keys\n")
    graph = import_graph(pkg, {"_hook": hook})
    assert graph["kdb.keys"] == set()  # type-only imports are not run-time edges
    assert graph["kdb.db"] == {"kdb.tier", "kdb.backends", "kdb.backends.gpu"}
    assert graph["_hook"] == {"kdb.keys"}
    assert graph["kdb.codec"] == {"kdb"} and graph["kdb"] == {"kdb.codec"}
    assert cycles(graph) == [["kdb", "kdb.codec"], ["kdb.backends.gpu", "kdb.db", "kdb.tier"]]
    table = layers("## Layers\n| **1. low** | `kdb.keys`, `kdb.tier` |\n"
                   "| **2. high** | `kdb.db`, `kdb.backends.*` |\n")
    assert [n for n, _ in table] == ["1. low", "2. high"]
    assert layer_of("kdb.backends.gpu", table) == [1]
    assert layer_of("kdb.tier", table)[0] < layer_of("kdb.db", table)[0]  # tier -> db is upward
