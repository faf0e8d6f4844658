"""What a hit imports: a fresh process that serves a hit loads the hit path and nothing of the
miss path, the writer, SQLAlchemy or alembic (the import rules of the whole package are
tests/test_architecture.py's). Standard modules such as pathlib, re, typing and logging are
not watched: a program that uses kdb has imported them already (pyopencl does)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import kdb

PACKAGE = Path(kdb.__file__).resolve().parent

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
    for name in ("kdb.adopt.tally", "kdb.storing.background", "kdb.claims", "kdb.storing.spool", "kdb.worker.supervisor",
                 "kdb.shared.tier", "kdb.storing.jobs", "kdb.shared.keeper"):
        assert name not in loaded, name

#: What a hit never loads: the database layers, and the modules of a miss or a store.
NEVER_ON_A_HIT = ("sqlalchemy", "alembic", "kdb.file.migrate", "kdb.claims",
                  "kdb.storing.spool", "kdb.shared.tier")

_REPORT = f"""
import atexit, sys
watch = {NEVER_ON_A_HIT!r}
loaded = lambda: " ".join(m for m in watch if m in sys.modules)
atexit.register(lambda: print("exit", loaded()))  # runs after kdb's exit hooks
"""

def _fresh(code: str, env: dict[str, str]) -> tuple[dict[str, list[str]], str]:
    """Run ``code`` in a fresh interpreter that sees only the kdb source tree and the
    installed packages: ``-S``, so no ``.pth`` file (an editable install's finder imports
    pathlib and re) runs first. Returns the watched modules by report line, and stderr."""
    import os
    import sysconfig

    paths = [str(PACKAGE.parent), sysconfig.get_paths()["purelib"],
             sysconfig.get_paths()["platlib"]]
    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.run([sys.executable, "-S", "-c", _REPORT + textwrap.dedent(code)],
                          check=True, capture_output=True, text=True, env=env)
    out = {}
    for line in proc.stdout.splitlines():
        tag, _, names = line.partition(" ")
        out[tag] = names.split()
    return out, proc.stderr

def _a_stored_kernel(cache: Path) -> None:
    db = kdb.KernelDB(cache_dir=cache)
    assert db.put(kdb.HashAttributes(backend="opencl", source="__kernel void k() {}",
                                     arch="hitarch", name="k"), b"binary")
    db.close()

_HIT = """
import kdb
db = kdb.KernelDB(use_system={use_system})
hit = db.lookup(kdb.HashAttributes(backend="opencl", source="__kernel void k() {{}}",
                                   arch="hitarch", name="k"))
assert hit.binary == b"binary" and hit.tier == {tier!r}, hit
print("hit", loaded())
"""

def test_a_hit_loads_neither_the_database_layers_nor_the_miss_path(tmp_path):
    """A hit from the user tier (with and without the system tier, the first start that
    warns and scans the entry points and the next that reads their memo) and from the
    system tier imports none of :data:`NEVER_ON_A_HIT`, before or at exit."""
    user = tmp_path / "user"
    _a_stored_kernel(user)
    env = {"KDB_CACHE_DIR": str(user), "KDB_SYSTEM_DB_PATH": ""}
    assert not (user / "entry-points.txt").exists()
    first, err = _fresh(_HIT.format(use_system=True, tier="user"), env)
    assert "no system kernel database for arch 'hitarch'" in err
    assert (user / "entry-points.txt").exists()  # written at the first start's exit
    again, _ = _fresh(_HIT.format(use_system=True, tier="user"), env)
    user_only, _ = _fresh(_HIT.format(use_system=False, tier="user"), env)

    system = tmp_path / "system"
    system.mkdir()
    with sqlite3.connect(user / "v1" / "hitarch.kdb") as src, \
            sqlite3.connect(system / "hitarch.kdb") as dst:
        src.backup(dst)
        dst.execute("PRAGMA journal_mode=DELETE")  # as kdb pack writes a system file
    from_system, _ = _fresh(_HIT.format(use_system=True, tier="system"),
                            {"KDB_CACHE_DIR": str(tmp_path / "empty"),
                             "KDB_SYSTEM_DB_PATH": str(system)})
    for name, run in [("first start", first), ("memo read", again), ("user only", user_only),
                      ("system tier", from_system)]:
        assert run["hit"] == [], (name, run)
        assert run["exit"] == [], (name, run)


def test_import_kdb_loads_no_typing_and_only_its_modules_write_type_checking_by_hand():
    """``import kdb`` alone loads no ``typing`` (a framework that imports kdb at start-up and
    never misses pays nothing for it); so the modules it loads spell ``TYPE_CHECKING = False``
    by hand, and every other module imports it from ``typing``, where it is already loaded."""
    out = subprocess.run([sys.executable, "-c", "import sys, kdb; print('typing' in sys.modules,"
                          " *sorted(m for m in sys.modules if m.split('.')[0] == 'kdb'))"],
                         check=True, capture_output=True, text=True).stdout.split()
    assert out[0] == "False"
    by_hand = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
               for p in PACKAGE.rglob("*.py")
               if "\nTYPE_CHECKING = False" in p.read_text(encoding="utf-8")}
    assert by_hand <= set(out[1:]), by_hand - set(out[1:])


def test_import_kdb_opencl_after_pyopencl_loads_no_hashlib_json_or_shlex():
    """A framework that imported pyopencl pays for kdb's own modules only: hashlib with
    OpenSSL (3.3 ms), json (1.3 ms) and shlex load where a miss, a non-PoCL arch id or a
    quoted option string needs them, not at ``import kdb.opencl`` (docs/figures.md)."""
    import pytest

    pytest.importorskip("pyopencl")
    code = ("import sys, pyopencl; before = set(sys.modules); import kdb.opencl; "
            "print(' '.join(sorted(set(sys.modules) - before)))")
    added = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                           text=True).stdout.split()
    assert "kdb.backends.opencl" in added
    assert not {"hashlib", "json", "shlex"} & set(added), added


#: What an OpenCL hit never loads: the store side, the claims, the early entries' module and
#: the trust policy (a policy variable loads it), each imported where a miss needs it.
NEVER_ON_AN_OPENCL_HIT = ("kdb.claims", "kdb.backends.opencl.stores", "kdb.backends.opencl.early",
                          "kdb.storing.stores", "kdb.storing.jobs", "kdb.signing.policy")


def test_an_opencl_hit_in_a_fresh_process_loads_no_store_side(run_py, cache_dir):
    """A process whose every build hits (``install()``, programs with and without an
    ``#include``) imports none of :data:`NEVER_ON_AN_OPENCL_HIT`; the process that compiled
    them did, and stored them."""
    import pytest

    pytest.importorskip("pyopencl")
    (cache_dir.parent / "inc").mkdir()
    (cache_dir.parent / "inc" / "two.h").write_text("#define TWO 2.0f\n")
    code = f"""
        import sys, pyopencl as cl, kdb.opencl
        kdb.opencl.install()
        ctx = cl.Context(cl.get_platforms()[0].get_devices())
        cl.Program(ctx, "__kernel void one(__global float *a) {{ a[0] = 1.0f; }}").build()
        cl.Program(ctx, '#include "two.h"\\n__kernel void two(__global float *a) {{ a[0] = TWO; }}'
                   ).build(options=["-I", {str(cache_dir.parent / "inc")!r}])
        print(" ".join(m for m in {NEVER_ON_AN_OPENCL_HIT!r} if m in sys.modules))
        from kdb.bookkeeping import process_counts
        print(process_counts())
    """
    first = run_py(code).stdout.splitlines()
    assert "kdb.backends.opencl.stores" in first[0].split()  # a miss loads the store side
    second = run_py(code).stdout.splitlines()
    assert eval(second[1]).get("hits.user") == 2, second  # noqa: S307 - our child's dict
    assert second[0] == "", second
