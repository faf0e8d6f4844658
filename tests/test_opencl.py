"""End to end on the real PoCL device: kdb.opencl.build and install() against real SQLite files.

Every test compiles real kernels with PoCL (0.2-1 s a build), so each one builds as few
programs as its behaviour needs. Subprocess tests set ``KDB_CACHE_DIR`` explicitly.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

cl = pytest.importorskip("pyopencl")

import kdb  # noqa: E402
import kdb.opencl  # noqa: E402
from kdb.storing import background
from kdb.file import codec
from kdb import bookkeeping  # noqa: E402
from kdb.backends.opencl import internal_options  # noqa: E402
from conftest import attributes_of, kill_workers  # noqa: E402

#: Two kernels, so kernel lookup by name is exercised; N comes from the build options.
SRC = """
__kernel void axpb(__global const float *x, __global float *y, const float a) {
    int i = get_global_id(0);
    y[i] = a * x[i] + N;
}
__kernel void twice(__global float *y) {
    int i = get_global_id(0);
    y[i] = 2.0f * y[i];
}
"""

HDR_SRC = """
#include "myhdr.h"
__kernel void axpb(__global const float *x, __global float *y, const float a) {
    int i = get_global_id(0);
    y[i] = a * x[i] + SCALE;
}
"""

BAD_SRC = """
__kernel void broken(__global float *y) {
    y[get_global_id(0)] = undefined_thing_kdb;
}
"""


# -- helpers ------------------------------------------------------------------------------

def run_axpb(ctx, prg, a: float = 2.0, n: int = 64, kernel=None) -> tuple[np.ndarray, np.ndarray]:
    """Launch ``axpb`` from ``prg``: returns (x, y) with y = a*x + N read back."""
    q = cl.CommandQueue(ctx)
    x = np.arange(n, dtype=np.float32)
    mf = cl.mem_flags
    xb = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=x)
    yb = cl.Buffer(ctx, mf.WRITE_ONLY, x.nbytes)
    knl = kernel if kernel is not None else cl.Kernel(prg, "axpb")
    knl(q, (n,), None, xb, yb, np.float32(a))
    y = np.empty_like(x)
    cl.enqueue_copy(q, y, yb)
    q.finish()
    return x, y


def arch(ctx) -> str:
    return kdb.opencl.arch_of(ctx.devices[0])


def user_path(cache_dir: Path, arch_id: str) -> Path:
    return cache_dir / "v1" / f"{arch_id}.kdb"


def _user_rows(cache_dir: Path, arch_id: str, query: str, as_dicts: bool = False) -> list:
    """Rows of ``query`` on the user file (none when the file or its table does not exist)."""
    path = user_path(cache_dir, arch_id)
    if not path.exists():
        return []
    conn = sqlite3.connect(path)
    if as_dicts:
        conn.row_factory = sqlite3.Row
    try:
        rows = conn.execute(query).fetchall()
    except sqlite3.OperationalError as err:
        if "no such table" in str(err):
            return []
        raise
    finally:
        conn.close()
    return [dict(r) for r in rows] if as_dicts else rows


def kernel_rows(cache_dir: Path, arch_id: str) -> list[dict]:
    """Every entry of the user file (empty when the file or its table does not exist)."""
    return _user_rows(cache_dir, arch_id, "SELECT * FROM kernels ORDER BY created", True)


def table_rows(cache_dir: Path, arch_id: str, table: str) -> list[tuple]:
    return _user_rows(cache_dir, arch_id, f"SELECT * FROM {table}")  # noqa: S608 - fixed names


def stored_raw(row: dict) -> bytes | None:
    return codec.decode(row["codec"], row["blob"], row["raw_size"], row["checksum"])


def flush() -> None:
    kdb.default_db().flush()


@pytest.fixture
def kdb_installed():
    """kdb.opencl.install() for one test, undone whatever happens."""
    kdb.opencl.install()
    try:
        yield
    finally:
        kdb.opencl.uninstall()


@pytest.fixture
def quiet_tempdir(tmp_path, monkeypatch):
    """pyopencl saves the source of a failed build to a temporary file; keep it in tmp_path."""
    import tempfile

    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


# -- miss then hit across processes -------------------------------------------------------

#: Start of a child process: PoCL, kdb.opencl, and ``axpb_ok`` to run and check the kernel.
CHILD_PRELUDE = """
    import json
    import numpy as np
    import pyopencl as cl
    import kdb.opencl
    from kdb import bookkeeping

    plat = [p for p in cl.get_platforms() if "Portable Computing Language" in p.name][0]

    def axpb_ok(ctx, q, prg, a, n, size):
        x = np.arange(size, dtype=np.float32)
        mf = cl.mem_flags
        xb = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=x)
        yb = cl.Buffer(ctx, mf.WRITE_ONLY, x.nbytes)
        prg.axpb(q, x.shape, None, xb, yb, np.float32(a))
        y = np.empty_like(x)
        cl.enqueue_copy(q, y, yb)
        return bool(np.allclose(y, a * x + n))
"""

CHILD_BUILD = CHILD_PRELUDE + """
    ctx = cl.Context(plat.get_devices())
    prg = kdb.opencl.build(ctx, SRC, ["-DN=7"])
    print(json.dumps({"compiles": len(bookkeeping.records()),
                      "correct": axpb_ok(ctx, cl.CommandQueue(ctx), prg, 3, 7, 256),
                      "arch": kdb.opencl.arch_of(ctx.devices[0])}))
"""


def test_miss_then_hit_across_two_processes(cache_dir, run_py):
    env = {"KDB_CACHE_DIR": str(cache_dir)}
    code = f"SRC = {SRC!r}\n" + textwrap.dedent(CHILD_BUILD)

    first = run_py(code, env=env)
    out1 = json.loads(first.stdout.strip().splitlines()[-1])
    assert out1 == {"compiles": 1, "correct": True, "arch": out1["arch"]}
    assert "this start-up compiled 1 kernel" in first.stderr
    # The child stored its binary before it exited (background writer finished at exit).
    rows = kernel_rows(cache_dir, out1["arch"])
    assert len(rows) == 1 and stored_raw(rows[0])
    assert len(table_rows(cache_dir, out1["arch"], "compile_log")) == 1

    second = run_py(code, env=env)
    out2 = json.loads(second.stdout.strip().splitlines()[-1])
    assert out2 == {"compiles": 0, "correct": True, "arch": out1["arch"]}
    assert "this start-up compiled" not in second.stderr
    assert len(table_rows(cache_dir, out1["arch"], "compile_log")) == 1
    rows = kernel_rows(cache_dir, out1["arch"])
    assert len(rows) == 1 and rows[0]["hits"] >= 1
    counters = dict(table_rows(cache_dir, out1["arch"], "counters"))
    assert counters.get("hits.user", 0) >= 1


# Builds a program whose quoted include PoCL may find in its cache directory; prints V.
CHILD_QUOTED = """
import os, numpy as np, pyopencl as cl, kdb.opencl
kdb.opencl.install()
ctx = cl.Context(cl.get_platforms()[0].get_devices()[:1])
prg = cl.Program(ctx, '#include "v.h"\\n__kernel void k(__global int *o) { o[0] = V; }').build()
o = np.zeros(1, np.int32)
buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, o.nbytes)
queue = cl.CommandQueue(ctx)
prg.k(queue, (1,), None, buf)
cl.enqueue_copy(queue, o, buf)
print(int(o[0]))
"""


def test_a_quoted_include_pocl_finds_in_its_cache_directory_is_keyed(cache_dir, run_py,
                                                                    tmp_path):
    """PoCL compiles the program as a file in its cache directory, so a quoted include is
    looked up there before the working directory: a process whose PoCL cache held another
    ``v.h`` than the working directory's was served the other's kernel."""
    work, first, second = tmp_path / "work", tmp_path / "pocl-a", tmp_path / "pocl-b"
    for d in (work, first, second):
        d.mkdir()
    (work / "v.h").write_text("#define V 1\n")
    (first / "v.h").write_text("#define V 5\n")
    code = f"import os; os.chdir({str(work)!r})\n" + CHILD_QUOTED

    def value(pocl: Path) -> int:
        return int(run_py(code, env={"KDB_CACHE_DIR": str(cache_dir),
                                     "POCL_CACHE_DIR": str(pocl)}).stdout.split()[-1])

    assert value(first) == 5
    assert value(second) == 1
    assert value(first) == 5


# -- what makes a key miss -----------------------------------------------------------------

def test_header_edit_misses(cache_dir, cl_ctx, tmp_path):
    inc = tmp_path / "include"
    inc.mkdir()
    hdr = inc / "myhdr.h"
    hdr.write_text("#define SCALE 2\n")
    opts = ["-I", str(inc)]

    prg = kdb.opencl.build(cl_ctx, HDR_SRC, opts)
    x, y = run_axpb(cl_ctx, prg, a=1.0)
    np.testing.assert_allclose(y, x + 2)
    flush()
    assert len(bookkeeping.records()) == 1

    kdb.opencl.build(cl_ctx, HDR_SRC, opts)  # unchanged header: a hit
    assert len(bookkeeping.records()) == 1

    hdr.write_text("#define SCALE 30\n")  # the edit a user makes; the source is unchanged
    prg = kdb.opencl.build(cl_ctx, HDR_SRC, opts)
    x, y = run_axpb(cl_ctx, prg, a=1.0)
    np.testing.assert_allclose(y, x + 30)
    recs = bookkeeping.records()
    assert len(recs) == 2 and recs[0].key != recs[1].key
    flush()
    assert len(kernel_rows(cache_dir, arch(cl_ctx))) == 2


def test_option_change_misses_and_same_options_hit(cache_dir, cl_ctx):
    prg1 = kdb.opencl.build(cl_ctx, SRC, ["-DN=1"])
    prg2 = kdb.opencl.build(cl_ctx, SRC, ["-DN=2"])
    assert len(bookkeeping.records()) == 2
    x, y1 = run_axpb(cl_ctx, prg1)
    _, y2 = run_axpb(cl_ctx, prg2)
    np.testing.assert_allclose(y1, 2 * x + 1)
    np.testing.assert_allclose(y2, 2 * x + 2)
    flush()

    again = kdb.opencl.build(cl_ctx, SRC, "-DN=1")  # a string splits to the same options
    assert len(bookkeeping.records()) == 2
    _, y = run_axpb(cl_ctx, again)
    np.testing.assert_allclose(y, 2 * x + 1)


def test_pyopencls_own_options_changed_between_builds_are_built_with(cache_dir, cl_ctx,
                                                                    kdb_installed,
                                                                    monkeypatch):
    """A program may change pyopencl's module-level options between builds
    (``cl.enable_debugging()`` adds ``-g -O0`` on AMD's platform): the next build of the
    same source and options is built with them, as pyopencl builds it, not with a plan kept
    from before."""
    src = "#ifndef X\n#define X 0\n#endif\n__kernel void k(__global int *a) { a[0] = X; }"

    def first(prg) -> int:
        a = np.zeros(1, np.int32)
        buf = cl.Buffer(cl_ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)
        queue = cl.CommandQueue(cl_ctx)
        prg.k(queue, (1,), None, buf)
        cl.enqueue_copy(queue, a, buf)
        return int(a[0])

    assert first(cl.Program(cl_ctx, src).build()) == 0
    monkeypatch.setattr(cl, "_DEFAULT_BUILD_OPTIONS", [*cl._DEFAULT_BUILD_OPTIONS, "-DX=5"])
    assert first(cl.Program(cl_ctx, src).build()) == 5


def test_a_header_that_uses_its_own_path_is_keyed_with_it(cache_dir, cl_ctx, tmp_path):
    """A header's ``__FILE__`` is the path it was found at: the same bytes under another
    ``-I`` give another kernel (the hunter's: 43 from a long path, 21 from a short one, and
    kdb served 43 to both). Keyed with its path; other headers stay path-free."""
    text = "__constant char here[] = __FILE__;\n"
    src = ('#include "p.h"\n__kernel void k(__global int *o) { o[0] = sizeof(here); }\n')
    long_dir, short_dir = tmp_path / "a" / "very" / "long" / "include" / "dir", tmp_path / "b"
    for d in (long_dir, short_dir):
        d.mkdir(parents=True)
        (d / "p.h").write_text(text)

    def size(d: Path) -> int:
        prg = kdb.opencl.build(cl_ctx, src, [f"-I{d}"])
        o = np.zeros(1, np.int32)
        buf = cl.Buffer(cl_ctx, cl.mem_flags.READ_WRITE, o.nbytes)
        queue = cl.CommandQueue(cl_ctx)
        prg.k(queue, (1,), None, buf)
        cl.enqueue_copy(queue, o, buf)
        return int(o[0])

    first = size(long_dir)
    flush()
    assert first == len(str(long_dir / "p.h")) + 1
    assert size(short_dir) == len(str(short_dir / "p.h")) + 1


# -- a portable key ------------------------------------------------------------------------

def _machine_local_strings(tmp_path: Path, *more: str) -> list[str]:
    import site

    local = [str(tmp_path), "/tmp", sys.prefix, os.path.dirname(cl.__file__),
             os.path.realpath(os.path.dirname(cl.__file__)), *more]
    local += [p for p in site.getsitepackages() if p]
    home = str(Path.home())
    if len(home) > 1:
        local.append(home)
    return local


def test_key_is_equal_across_virtual_environments(cache_dir, cl_ctx, tmp_path):
    dev = cl_ctx.devices[0]
    # Two "environments": the same headers in unrelated places, spelled differently.
    env_a = tmp_path / "venv-a" / "include"
    env_b = tmp_path / "elsewhere" / "venv-b" / "deeper" / "inc"
    for d in (env_a, env_b):
        d.mkdir(parents=True)
        (d / "myhdr.h").write_text('#include "inner.h"\n#define SCALE (INNER + 1)\n')
        (d / "inner.h").write_text("#define INNER 4\n")
    # pyopencl adds -I <its site-packages dir>/pyopencl/cl to every build: a copy of that
    # directory elsewhere stands for another virtual environment's install.
    added_a = internal_options(cl_ctx)
    cl_dir = os.path.join(os.path.dirname(cl.__file__), "cl")
    assert cl_dir in added_a or os.path.realpath(cl_dir) in map(os.path.realpath, added_a)
    other_cl = tmp_path / "other-venv" / "site-packages" / "pyopencl" / "cl"
    shutil.copytree(cl_dir, other_cl)
    added_b = [str(other_cl) if os.path.realpath(o) == os.path.realpath(cl_dir) else o
               for o in added_a]
    assert added_b != added_a

    src = "#include <pyopencl-complex.h>\n" + HDR_SRC
    a = kdb.opencl.attributes_for(dev, src, ["-I", str(env_a), "-DN=1"], added_a)
    b = kdb.opencl.attributes_for(dev, src, [f"-I{env_b}", "-DN=1"], added_b)
    assert a.key == b.key
    headers = dict(a.headers)
    # The headers were found (by content), not recorded as missing.
    for name in ("myhdr.h", "myhdr.h>inner.h", "pyopencl-complex.h"):
        assert headers[name] != "missing", name

    text = a.encoded().decode("utf-8")
    for local in _machine_local_strings(tmp_path, str(cache_dir)):
        assert local not in text, local

    # The same place with different content is a different key (the check can fail).
    (env_b / "inner.h").write_text("#define INNER 40\n")
    c = kdb.opencl.attributes_for(dev, src, [f"-I{env_b}", "-DN=1"], added_b)
    assert c.key != a.key


def test_a_relative_include_dir_in_a_working_directory_that_is_gone_builds(cache_dir, cl_ctx,
                                                                            tmp_path,
                                                                            monkeypatch):
    """pyopencl builds ``-Iinc`` where the working directory was removed; with kdb the check
    for a temporary include directory raised FileNotFoundError (realpath of a relative path
    needs the working directory)."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    prg = kdb.opencl.build(cl_ctx, "__kernel void y(__global int *a) { a[0] = 1; }", ["-Iinc"])
    assert prg.y is not None


@pytest.mark.parametrize("variable", ["POCL_EXTRA_BUILD_FLAGS", "AMD_OCL_BUILD_OPTIONS",
                                      "IGC_ExtraOCLOptions", "OCLGRIND_BUILD_OPTIONS"])
def test_options_a_driver_adds_from_its_environment_are_keyed_with_their_headers(
        variable, cl_ctx, tmp_path, monkeypatch):
    """Each OpenCL's variable of options it adds to every build: its value, and the headers
    its -I finds, are in the key (Oclgrind's was not: a binary built with -DX=2 in it was
    served to a process without it)."""
    dev = cl_ctx.devices[0]
    src = '#include "scale.h"\n' + SRC
    (tmp_path / "scale.h").write_text("#define SCALE 3\n")
    plain = kdb.opencl.attributes_for(dev, SRC, [], internal_options(cl_ctx))
    monkeypatch.setenv(variable, "-DX=2")
    assert kdb.opencl.attributes_for(dev, SRC, [], internal_options(cl_ctx)).key != plain.key
    monkeypatch.setenv(variable, f"-I{tmp_path}")
    before = kdb.opencl.attributes_for(dev, src, [], internal_options(cl_ctx))
    (tmp_path / "scale.h").write_text("#define SCALE 5\n")
    assert kdb.opencl.attributes_for(dev, src, [], internal_options(cl_ctx)).key != before.key


def test_back_end_attributes_are_what_the_constructor_makes_of_them(cl_ctx, tmp_path, monkeypatch):
    """The back end's attributes are what the constructor makes of the same fields: its keys
    are those of the same attributes built any other way (explain, pack, a framework)."""
    monkeypatch.setenv("POCL_WORK_GROUP_METHOD", "cbs")
    monkeypatch.setenv("AMD_OCL_BUILD_OPTIONS", "-O3")
    (tmp_path / "b.h").write_text("#define B 2\n")
    (tmp_path / "a.h").write_text('#include "b.h"\n#define A 1\n')
    src = '#include "a.h"\n#include <pyopencl-complex.h>\n' + SRC
    dev = cl_ctx.devices[0]
    a = kdb.opencl.attributes_for(dev, src, ["-DZ=1", "-I", str(tmp_path), "-DA=2"],
                                  internal_options(cl_ctx), name="k")
    again = kdb.HashAttributes(**{f: getattr(a, f) for f in kdb.HashAttributes.FIELDS})
    assert again == a
    assert again.encoded() == a.encoded() and again.key == a.key
    assert len(a.headers) >= 3 and len(a.environment) == 2 and len(a.compiler) >= 5


def test_stored_key_holds_no_path_and_hits_from_another_include_dir(cache_dir, cl_ctx, tmp_path):
    dev = cl_ctx.devices[0]
    dirs = [tmp_path / "env1" / "inc", tmp_path / "env2" / "x" / "inc"]
    for d in dirs:
        d.mkdir(parents=True)
        (d / "myhdr.h").write_text("#define SCALE 5\n")

    kdb.opencl.build(cl_ctx, HDR_SRC, ["-I", str(dirs[0])])
    flush()
    (row,) = kernel_rows(cache_dir, arch(cl_ctx))
    [(_, _, text)] = attributes_of(cache_dir / "v1" / f"{arch(cl_ctx)}.kdb")
    for local in _machine_local_strings(tmp_path, str(cache_dir)):
        assert local not in text, local
    # The device's marketing name and the host stay out of the key, but are kept beside it.
    details = json.loads(row["details"])
    assert dev.name not in text and dev.name.split("-", 1)[-1] not in text
    assert details["device"] == dev.name
    assert platform.node() not in text and details["host"] == platform.node()
    assert kdb.HashAttributes.from_canonical(text).key == row["key"]

    # The same header content behind another path: a hit, and the right results.
    again = kdb.opencl.build(cl_ctx, HDR_SRC, ["-I", str(dirs[1])])
    assert len(bookkeeping.records()) == 1
    x, y = run_axpb(cl_ctx, again, a=1.0)
    np.testing.assert_allclose(y, x + 5)


def test_every_variable_a_compiler_reads_is_another_key(cache_dir, cl_ctx, monkeypatch):
    """Each variable with which an OpenCL runtime changes what it compiles (PoCL's, Intel's
    ``CL_CONFIG_*``, AMD's, Intel's GPU compiler's) gives another key when set."""
    from kdb.backends.opencl.keys import ENV_VARS

    dev = cl_ctx.devices[0]
    src = "__kernel void f(__global int *a) { a[0] = 1; }"
    keys = {kdb.opencl.attributes_for(dev, src, [], []).key}
    for name in ENV_VARS:
        monkeypatch.setenv(name, "-DX=1" if name.endswith(("FLAGS", "OPTIONS")) else "1")
        keys.add(kdb.opencl.attributes_for(dev, src, [], []).key)
        monkeypatch.delenv(name)
    assert len(keys) == len(ENV_VARS) + 1
    assert {"CL_CONFIG_USE_FAST_RELAXED_MATH", "POCL_WILOOPS_MAX_UNROLL_COUNT"} <= set(ENV_VARS)


@pytest.mark.parametrize("form", ["separate", "one element", "joined", "string"])
def test_attributes_for_keys_a_build_as_the_build_stores_it(cache_dir, cl_ctx, tmp_path,
                                                             monkeypatch, form):
    """``kdb.opencl.attributes_for`` (public: explain, pack, a framework's own lookups) and
    a build through kdb compute the key in two places: for each form of the options a
    caller passes, both give the key the build stored (issue 30: no second way to key)."""
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "myhdr.h").write_text("#define SCALE 3\n")
    monkeypatch.chdir(tmp_path)
    options = {"separate": ["-I", "inc", "-DN=8"], "one element": ["-I inc -DN=8"],
               "joined": ["-Iinc", "-DN=8"], "string": "-I inc -DN=8"}[form]
    kdb.opencl.build(cl_ctx, HDR_SRC, options)
    flush()
    [(stored, _, _)] = attributes_of(cache_dir / "v1" / f"{arch(cl_ctx)}.kdb")
    from kdb.backends.opencl import split_options

    given = split_options(options)
    attrs = kdb.opencl.attributes_for(cl_ctx.devices[0], HDR_SRC, given,
                                      internal_options(cl_ctx))
    assert attrs.key == stored


# -- damaged entries -----------------------------------------------------------------------

def test_corrupt_blob_is_recompiled_and_replaced(cache_dir, cl_ctx, caplog):
    arch_id = arch(cl_ctx)
    kdb.opencl.build(cl_ctx, SRC, ["-DN=5"])
    flush()
    (row,) = kernel_rows(cache_dir, arch_id)
    blob = bytearray(row["blob"])
    for i in range(len(blob) // 2, len(blob) // 2 + 16):
        blob[i] ^= 0xFF
    conn = sqlite3.connect(user_path(cache_dir, arch_id))
    with conn:
        conn.execute("UPDATE kernels SET blob = ? WHERE key = ?", (bytes(blob), row["key"]))
    conn.close()
    assert stored_raw(kernel_rows(cache_dir, arch_id)[0]) is None

    caplog.set_level("WARNING", logger="kdb")
    prg = kdb.opencl.build(cl_ctx, SRC, ["-DN=5"])
    assert len(bookkeeping.records()) == 2  # compiled again
    x, y = run_axpb(cl_ctx, prg)
    np.testing.assert_allclose(y, 2 * x + 5)
    assert "checksum mismatch" in caplog.text
    assert f"({row['name']}) dropped" in caplog.text  # named as stored, not "unnamed"

    flush()
    (fixed,) = kernel_rows(cache_dir, arch_id)
    assert fixed["key"] == row["key"]
    assert stored_raw(fixed) is not None  # a sound entry replaced the corrupt one
    hit = kdb.opencl.build(cl_ctx, SRC, ["-DN=5"])
    assert len(bookkeeping.records()) == 2
    _, y = run_axpb(cl_ctx, hit)
    np.testing.assert_allclose(y, 2 * x + 5)


def test_binary_the_driver_refuses_is_a_miss_and_replaced(cache_dir, cl_ctx, caplog):
    arch_id = arch(cl_ctx)
    dev = cl_ctx.devices[0]
    attrs = kdb.opencl.attributes_for(dev, SRC, ["-DN=6"], internal_options(cl_ctx))
    garbage = b"not a PoCL binary " * 64
    assert kdb.default_db().put(attrs, garbage)  # a valid checksum, under the right key
    (row,) = kernel_rows(cache_dir, arch_id)
    assert stored_raw(row) == garbage

    caplog.set_level("WARNING", logger="kdb")
    before = bookkeeping.process_counts()
    prg = kdb.opencl.build(cl_ctx, SRC, ["-DN=6"])
    recs = bookkeeping.records()
    assert len(recs) == 1 and recs[0].key == attrs.key  # built from source
    # one build call: compiled, not also served (kdb run counted it twice)
    counts = {k: v - before.get(k, 0) for k, v in bookkeeping.process_counts().items()}
    assert {k: v for k, v in counts.items() if k.startswith(("hits.", "compiles", "misses"))
            and v} == {"compiles": 1, "misses": 1}, counts
    x, y = run_axpb(cl_ctx, prg)
    np.testing.assert_allclose(y, 2 * x + 6)
    assert "refused" in caplog.text

    flush()
    (fixed,) = kernel_rows(cache_dir, arch_id)
    assert fixed["key"] == attrs.key
    raw = stored_raw(fixed)
    assert raw is not None and raw != garbage
    hit = kdb.opencl.build(cl_ctx, SRC, ["-DN=6"])
    assert len(bookkeeping.records()) == 1
    _, y = run_axpb(cl_ctx, hit)
    np.testing.assert_allclose(y, 2 * x + 6)


# -- pyopencl's behaviour kept --------------------------------------------------------------

def _build(mode: str, ctx, src: str, options):
    if mode == "build":
        return kdb.opencl.build(ctx, src, options)
    return cl.Program(ctx, src).build(options)


def _check_like_pyopencl(ctx, prg) -> None:
    dev = ctx.devices[0]
    assert isinstance(prg, cl.Program)
    bins = prg.binaries
    assert len(bins) == 1 and len(bins[0]) > 0
    assert prg.get_info(cl.program_info.NUM_DEVICES) == 1
    assert prg.get_info(cl.program_info.DEVICES) == [dev]
    assert prg.get_info(cl.program_info.CONTEXT) == ctx
    assert prg.get_info(cl.program_info.BINARY_SIZES) == [len(bins[0])]
    assert sorted(prg.get_info(cl.program_info.KERNEL_NAMES).split(";")) == ["axpb", "twice"]
    assert prg.num_kernels == 2
    CL_BUILD_SUCCESS = 0  # pyopencl exposes no enum for cl_build_status
    assert prg.get_build_info(dev, cl.program_build_info.STATUS) == CL_BUILD_SUCCESS
    assert isinstance(prg.get_build_info(dev, cl.program_build_info.LOG), str)
    assert "-DN=3" in prg.get_build_info(dev, cl.program_build_info.OPTIONS)
    assert (prg.get_build_info(dev, cl.program_build_info.BINARY_TYPE)
            == cl.program_binary_type.EXECUTABLE)
    knl = prg.axpb  # attribute access names a kernel
    assert knl.function_name == "axpb"
    twice = cl.Kernel(prg, "twice")
    assert twice.program == prg
    assert sorted(k.function_name for k in prg.all_kernels()) == ["axpb", "twice"]
    with pytest.raises(AttributeError):
        prg.no_such_kernel  # noqa: B018
    x, y = run_axpb(ctx, prg, kernel=knl)
    np.testing.assert_allclose(y, 2 * x + 3)


@pytest.mark.parametrize("state", ["miss", "hit"])
@pytest.mark.parametrize("mode", ["build", "install"])
def test_program_behaves_like_pyopencl(mode, state, cache_dir, cl_ctx, request):
    if mode == "install":
        request.getfixturevalue("kdb_installed")
    if state == "hit":
        _build(mode, cl_ctx, SRC, ["-DN=3"])
        flush()
        assert len(kernel_rows(cache_dir, arch(cl_ctx))) == 1
    prg = _build(mode, cl_ctx, SRC, ["-DN=3"])
    assert len(bookkeeping.records()) == 1  # the hit compiled nothing
    _check_like_pyopencl(cl_ctx, prg)


def test_hit_keeps_program_source(cache_dir, cl_ctx, kdb_installed):
    """OpenCL keeps no source for a program made from binaries; kdb's hit still answers it."""
    cl.Program(cl_ctx, SRC).build(["-DN=3"])
    flush()
    prg = cl.Program(cl_ctx, SRC).build(["-DN=3"])
    assert len(bookkeeping.records()) == 1  # the second build was a hit
    assert prg.get_info(cl.program_info.SOURCE) == SRC
    assert prg.source == SRC
    assert isinstance(prg, cl.Program)
    direct = kdb.opencl.build(cl_ctx, SRC, ["-DN=3"])
    assert direct.source == SRC and len(bookkeeping.records()) == 1


def test_install_build_returns_the_same_program_object(cache_dir, cl_ctx, kdb_installed):
    for _ in range(2):  # miss, then hit
        p = cl.Program(cl_ctx, SRC)
        assert p.build(["-DN=3"]) is p
        flush()
    assert len(bookkeeping.records()) == 1


@pytest.mark.parametrize("source", ["", "  \n", b""], ids=["empty", "blank", "empty-bytes"])
def test_a_program_with_no_text_builds_after_install_as_in_pyopencl(cache_dir, cl_ctx,
                                                                    kdb_installed, source):
    """pyopencl builds a program of no text (no kernels); after install() it still does,
    and kdb stores nothing for it (``kdb.opencl.build`` itself refuses an empty source)."""
    prg = cl.Program(cl_ctx, source).build()
    assert prg.get_info(cl.program_info.NUM_KERNELS) == 0
    assert len(bookkeeping.records()) == 0
    with pytest.raises(kdb.InvalidArgumentError, match="source is empty"):
        kdb.opencl.build(cl_ctx, source)


def test_pyopencls_own_cache_settings_do_not_turn_kdb_off(cache_dir, cl_ctx, kdb_installed,
                                                          monkeypatch):
    """``cache_dir=False`` and ``PYOPENCL_NO_CACHE`` are settings of pyopencl's binary cache,
    which kdb replaces: such builds are stored and served (docs/adoption.md)."""
    monkeypatch.setenv("PYOPENCL_NO_CACHE", "1")
    for _ in range(2):  # miss, then hit
        prg = cl.Program(cl_ctx, SRC).build(["-DN=13"], cache_dir=False)
        flush()
    x, y = run_axpb(cl_ctx, prg, a=2.0)
    np.testing.assert_allclose(y, 2 * x + 13)
    assert len(bookkeeping.records()) == 1
    assert len(kernel_rows(cache_dir, arch(cl_ctx))) == 1


def test_failed_build_after_install_raises_pyopencls_error(cache_dir, cl_ctx, kdb_installed,
                                                          quiet_tempdir):
    dev = cl_ctx.devices[0]
    for _ in range(2):  # never cached: the second attempt fails the same way
        prg = cl.Program(cl_ctx, BAD_SRC)
        with pytest.raises(cl.RuntimeError) as info:
            prg.build(["-DN=1"])
        assert "undefined_thing_kdb" in str(info.value)  # the build log
        assert "-DN=1" in str(info.value)  # pyopencl appends the options
        # The program answers for the build that failed, as pyopencl's does (it answered
        # for a new, unbuilt one: an empty log, INVALID_PROGRAM, and a warning).
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert "undefined_thing_kdb" in prg.get_build_info(dev, cl.program_build_info.LOG)
            assert prg.get_build_info(dev, cl.program_build_info.STATUS) == -2  # ERROR
    flush()
    assert bookkeeping.records() == []
    assert kernel_rows(cache_dir, arch(cl_ctx)) == []
    assert table_rows(cache_dir, arch(cl_ctx), "compile_log") == []


def test_failed_build_raises_compile_error_with_log(cache_dir, cl_ctx):
    with pytest.raises(kdb.CompileError) as info:
        kdb.opencl.build(cl_ctx, BAD_SRC, ["-DN=1"])
    err = info.value
    assert isinstance(err, kdb.KdbError)
    assert err.log and "undefined_thing_kdb" in err.log
    assert "undefined_thing_kdb" in str(err)
    assert isinstance(err.__cause__, cl.RuntimeError)
    flush()
    assert bookkeeping.records() == []
    assert kernel_rows(cache_dir, arch(cl_ctx)) == []
    assert table_rows(cache_dir, arch(cl_ctx), "compile_log") == []


def test_binary_and_linked_programs_pass_through_install(cache_dir, cl_ctx):
    original = cl.Program.build
    bins = cl.Program(cl_ctx, SRC).build(["-DN=3"]).binaries  # plain pyopencl, before install
    kdb.opencl.install()
    try:
        assert kdb.opencl.installed() and cl.Program.build is not original
        kdb.opencl.install()  # idempotent
        from_bin = cl.Program(cl_ctx, cl_ctx.devices, bins).build(["-DN=3"])
        x, y = run_axpb(cl_ctx, from_bin)
        np.testing.assert_allclose(y, 2 * x + 3)

        compiled = cl.Program(cl_ctx, SRC)
        with warnings.catch_warnings():  # pyopencl's own "pre-build attribute access" note
            warnings.simplefilter("ignore")
            compiled.compile(["-DN=4"])
        linked = cl.link_program(cl_ctx, [compiled])
        _, y = run_axpb(cl_ctx, linked)
        np.testing.assert_allclose(y, 2 * x + 4)
    finally:
        kdb.opencl.uninstall()
    assert cl.Program.build is original and not kdb.opencl.installed()
    flush()
    assert bookkeeping.records() == []
    assert kernel_rows(cache_dir, arch(cl_ctx)) == []


def test_il_programs_pass_through_install(cache_dir, cl_ctx, kdb_installed):
    dev = cl_ctx.devices[0]
    il_version = getattr(dev, "il_version", "") or ""
    spirv = Path(__file__).parent / "data" / "opencl" / "axpb.spv"
    if not il_version.strip() or not spirv.exists():
        pytest.skip(f"device has no IL support (il_version={il_version!r}) or no SPIR-V file")
    prg = cl.Program(cl_ctx, spirv.read_bytes()).build(["-DN=3"])
    x, y = run_axpb(cl_ctx, prg)
    np.testing.assert_allclose(y, 2 * x + 3)
    flush()
    assert bookkeeping.records() == []
    assert kernel_rows(cache_dir, arch(cl_ctx)) == []


# -- device identity -----------------------------------------------------------------------

def test_arch_id_and_compiler_identity_come_from_the_device(cl_ctx):
    dev = cl_ctx.devices[0]
    if "HSTR:" not in dev.version or "x86_64" not in dev.version:
        pytest.skip(f"not a PoCL x86-64 device: {dev.version}")
    assert re.fullmatch(r"pocl-x86_64-[a-z0-9_-]+", kdb.opencl.arch_of(dev))
    ident = dict(kdb.opencl.compiler_identity(dev))
    assert ident["platform"] == dev.platform.name
    assert ident["driver_version"] == dev.driver_version
    from kdb.backends.opencl.binaries import library_of
    from kdb.backends.digests import elf_build_id

    lib = library_of(dev.platform.int_ptr)
    assert lib and "pocl" in os.path.basename(lib)
    build_id = elf_build_id(lib)
    if build_id:  # the linker's content hash, read from the ELF note
        assert ident["library"] == f"gnu-build-id:{build_id}"
        assert build_id in subprocess.run(["readelf", "-n", lib], capture_output=True,
                                          text=True).stdout or not shutil.which("readelf")
    else:
        assert ident["library"] == "sha256:" + hashlib.sha256(Path(lib).read_bytes()).hexdigest()
    for name, value in ident.items():
        assert "/" not in value and lib not in value, (name, value)


# -- storage -------------------------------------------------------------------------------

def test_disable_cache_builds_and_stores_nothing(cache_dir, cl_ctx, monkeypatch):
    monkeypatch.setenv("KDB_DISABLE_CACHE", "1")
    for _ in range(2):
        prg = kdb.opencl.build(cl_ctx, SRC, ["-DN=8"])
        x, y = run_axpb(cl_ctx, prg)
        np.testing.assert_allclose(y, 2 * x + 8)
    flush()
    assert len(bookkeeping.records()) == 2  # every build compiles
    assert not user_path(cache_dir, arch(cl_ctx)).exists()


def test_user_file_after_a_miss_holds_compressed_binaries(cache_dir, cl_ctx):
    arch_id = arch(cl_ctx)
    prg = kdb.opencl.build(cl_ctx, SRC, ["-DN=9"])
    flush()
    assert user_path(cache_dir, arch_id).is_file()
    (row,) = kernel_rows(cache_dir, arch_id)
    assert row["codec"] == codec.ZSTD
    assert 0 < row["stored_size"] < row["raw_size"]
    assert stored_raw(row) == prg.binaries[0]
    assert row["name"] == "axpb,twice" and row["arch"] == arch_id


def test_program_is_returned_before_its_binaries_are_stored(cache_dir, cl_ctx):
    db = kdb.default_db()  # made now: a new default db drains the writer's queue
    gate = threading.Event()
    released = []
    # Hold the writer: nothing can be stored until the gate opens. Had the build waited
    # for the store, the gate would time out instead of being opened by this test.
    background.submit(lambda: released.append(gate.wait(30)))
    try:
        prg = kdb.opencl.build(cl_ctx, SRC, ["-DN=10"])
        x, y = run_axpb(cl_ctx, prg)
        np.testing.assert_allclose(y, 2 * x + 10)
        assert kernel_rows(cache_dir, arch(cl_ctx)) == []
    finally:
        gate.set()
    db.flush()
    assert released == [True]
    (row,) = kernel_rows(cache_dir, arch(cl_ctx))
    assert stored_raw(row) == prg.binaries[0]


# -- unmodified pyopencl code --------------------------------------------------------------

CHILD_ELWISE = """
    import json
    import numpy as np
    import pyopencl as cl
    import pyopencl.array as cla
    import kdb.opencl
    from kdb import bookkeeping

    kdb.opencl.install()
    from pyopencl.elementwise import ElementwiseKernel

    plat = [p for p in cl.get_platforms() if "Portable Computing Language" in p.name][0]
    ctx = cl.Context(plat.get_devices())
    q = cl.CommandQueue(ctx)
    k = ElementwiseKernel(ctx, "const float *x, float *y, float a", "y[i] = a * x[i] + 1.0f",
                          "kdb_axpb_elwise")
    x = cla.to_device(q, np.arange(1000, dtype=np.float32))
    y = cla.empty_like(x)
    k(x, y, np.float32(3))
    print(json.dumps({"compiles": len(bookkeeping.records()),
                      "correct": bool(np.allclose(y.get(), 3 * x.get() + 1))}))
"""


def test_elementwise_kernel_served_after_install(cache_dir, run_py):
    env = {"KDB_CACHE_DIR": str(cache_dir)}
    first = json.loads(run_py(CHILD_ELWISE, env=env).stdout.strip().splitlines()[-1])
    assert first["correct"] and first["compiles"] >= 1
    second = json.loads(run_py(CHILD_ELWISE, env=env).stdout.strip().splitlines()[-1])
    assert second == {"compiles": 0, "correct": True}


def test_a_kernel_declared_through_a_macro_names_its_entry(cache_dir, cl_ctx):
    """pyopencl's scans declare their kernels as ``KERNEL REQD_WG_SIZE(...) void name``, which
    no scan of the text finds: the entry is named by the kernels the driver lists (the text's
    order first), not "program", and a name in a comment only is left out."""
    src = ("#define KERNEL __kernel\n#define WG(n) __attribute__((reqd_work_group_size(n, 1, 1)))\n"
           "// __kernel void not_here(void) {}\n"
           "__kernel void seen(__global float *a) { a[0] = 1.0f; }\n"
           "KERNEL WG(1) void hidden(__global float *a) { a[0] = 2.0f; }\n")
    kdb.opencl.build(cl_ctx, src)
    flush()
    assert [r["name"] for r in kernel_rows(cache_dir, arch(cl_ctx))] == ["seen,hidden"]
    assert [r.name for r in bookkeeping.records()] == ["seen,hidden"]


def test_a_repeated_build_in_one_process_is_served_from_memory(cache_dir, cl_ctx):
    """Built, its binaries not yet stored: building it again neither compiles nor waits."""
    first = kdb.opencl.build(cl_ctx, SRC, ["-DN=11"])
    again = kdb.opencl.build(cl_ctx, SRC, ["-DN=11"])
    assert len(bookkeeping.records()) == 1
    assert again == first  # the same cl_program, as pyopencl compares programs
    flush()
    assert len(kernel_rows(cache_dir, arch(cl_ctx))) == 1


def test_devices_given_as_none_an_iterator_or_twice_build_and_serve_as_pyopencl_does(
        cache_dir, cl_ctx, kdb_installed, caplog):
    """``build(devices=[])`` builds for the program's devices and an iterator is read once
    (both raised IndexError); ``[dev, dev]`` builds once for the device, as clBuildProgram
    does, and is served: clCreateProgramWithBinary refuses a device named twice, and the
    sound entry was dropped at every start as a binary the driver refused."""
    dev = cl_ctx.devices[0]
    caplog.set_level("WARNING", logger="kdb")
    for i, devices in enumerate(([], iter([dev]), [dev, dev], (dev, dev))):
        prg = cl.Program(cl_ctx, SRC).build(options=[f"-DN={40 + i % 2}"], devices=devices)
        x, y = run_axpb(cl_ctx, prg)
        np.testing.assert_allclose(y, 2 * x + 40 + i % 2)
    flush()
    assert len(bookkeeping.records()) == 2  # -DN=40 and -DN=41, each compiled once
    assert len(kernel_rows(cache_dir, arch(cl_ctx))) == 2
    other = cl.Context([dev])  # another context: loaded from the user file, not memory
    again = cl.Program(other, SRC).build(options=["-DN=41"], devices=[dev, dev])
    _, y = run_axpb(other, again)
    np.testing.assert_allclose(y, 2 * x + 41)
    assert "refused" not in caplog.text and len(bookkeeping.records()) == 2
    assert len(kernel_rows(cache_dir, arch(cl_ctx))) == 2


def test_a_build_whose_include_copies_went_meanwhile_builds_from_the_originals(
        cache_dir, cl_ctx, tmp_path, monkeypatch):
    """A temporary include directory is built from its copy in the cache; the cache removed
    under a build (``rm -rf ~/.cache/kdb``) took the copy with it, and the program's build
    failed ('h.h' file not found). It is built as asked instead, and gives its result."""
    import kdb.backends.opencl as backend

    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "h.h").write_text("#define N 3\n")
    copies = cache_dir / "v1" / "includes"
    with_copies = backend._with_copies

    def then_removed(*args, **kwargs):  # the copy made and checked, then gone
        plan = with_copies(*args, **kwargs)
        assert str(copies).encode() in plan.opt_bytes
        shutil.rmtree(copies)
        return plan

    monkeypatch.setattr(backend, "_with_copies", then_removed)
    prg = kdb.opencl.build(cl_ctx, '#include "h.h"\n' + SRC, ["-I", str(inc)])
    x, y = run_axpb(cl_ctx, prg)
    np.testing.assert_allclose(y, 2 * x + 3)


def test_include_copies_in_a_directory_others_can_write_are_not_built_from(
        cache_dir, cl_ctx, tmp_path, monkeypatch, caplog):
    """``v1/includes`` was never checked: its owner could swap a header in after kdb
    checked the copy. Such a directory is refused, once, and the build reads the original."""
    import logging

    import kdb.backends.opencl as backend

    inc = tmp_path / "inc"  # below TMPDIR: a temporary include directory
    inc.mkdir()
    (inc / "h.h").write_text("#define N 3\n")
    copies = cache_dir / "v1" / "includes"
    copies.mkdir(parents=True)
    copies.chmod(0o777)
    seen = []
    with_copies = backend._with_copies
    monkeypatch.setattr(backend, "_with_copies",
                        lambda *a, **k: seen.append(with_copies(*a, **k)) or seen[-1])
    with caplog.at_level(logging.WARNING, logger="kdb"):
        prg = kdb.opencl.build(cl_ctx, '#include "h.h"\n' + SRC, ["-I", str(inc)])
    x, y = run_axpb(cl_ctx, prg)
    np.testing.assert_allclose(y, 2 * x + 3)
    assert seen and all(str(copies).encode() not in plan.opt_bytes for plan in seen)
    assert list(copies.iterdir()) == []
    assert "includes is refused: group or others can write it" in caplog.text


MULTI_DEVICE_CHILD = CHILD_PRELUDE + """
    devs = plat.get_devices()
    ctx = cl.Context(devs)
    prg = kdb.opencl.build(ctx, SRC, ["-DN=5"], devices=devs[::-1] if REVERSED else None)
    sizes = [len(b) for b in prg.binaries]
    results = [axpb_ok(ctx, cl.CommandQueue(ctx, dev), prg, 2, 5, 64) for dev in devs]
    print(json.dumps({"devices": len(devs), "compiles": len(bookkeeping.records()),
                      "binaries": sizes, "correct": results}))
"""


@pytest.mark.parametrize("reversed_", [False, True], ids=["context-order", "reversed"])
def test_a_context_with_two_devices_stores_and_loads_a_binary_per_device(cache_dir, run_py,
                                                                         reversed_):
    """PoCL offers two CPU devices with POCL_DEVICES="basic pthread" (different drivers, so
    different compiler identities: two keys, two entries, one program built from both).
    ``reversed``: the build names the context's devices the other way round, and PoCL 3.0
    hands their binaries back in the build's order while it lists the devices in the
    context's: each device's entry must hold its own binary (before, each held the other's,
    the driver refused it at the next start, and every start compiled again)."""
    env = {"KDB_CACHE_DIR": str(cache_dir), "POCL_DEVICES": "basic pthread"}
    code = f"SRC = {SRC!r}\nREVERSED = {reversed_}\n" + textwrap.dedent(MULTI_DEVICE_CHILD)
    first = json.loads(run_py(code, env=env).stdout.strip().splitlines()[-1])
    if first["devices"] != 2:
        pytest.skip("this PoCL does not offer two devices")
    assert first["compiles"] == 2 and first["correct"] == [True, True]
    again = run_py(code, env=env)
    second = json.loads(again.stdout.strip().splitlines()[-1])
    assert "refused" not in again.stderr, again.stderr[-2000:]
    assert second["compiles"] == 0 and second["correct"] == [True, True]
    assert all(second["binaries"])  # each device got its own stored binary
    arch_ids = {p.stem for p in (cache_dir / "v1").glob("*.kdb")}
    assert len(arch_ids) == 1
    assert len(kernel_rows(cache_dir, arch_ids.pop())) == 2


CHILD_LIBRARY = """
import json
import numpy as np
import pyopencl as cl
import pyopencl.array as cla
import pyopencl.clmath
from pyopencl.scan import InclusiveScanKernel
import kdb.opencl
from kdb import bookkeeping
kdb.opencl.install()
plat = [p for p in cl.get_platforms() if "Portable Computing Language" in p.name][0]
ctx = cl.Context(plat.get_devices()[:1])
q = cl.CommandQueue(ctx)
z = cla.to_device(q, np.arange(8, dtype=np.complex64) * (1 + 1j))
x = cla.to_device(q, np.arange(8, dtype=np.float32))
scan = InclusiveScanKernel(ctx, np.float32, "a+b", neutral="0")
ok = (np.allclose((z * z).get(), (np.arange(8) * (1 + 1j)) ** 2)
      and float(cla.sum(x).get()) == 28.0
      and np.allclose(scan(x.copy()).get(), np.cumsum(np.arange(8)))
      and np.allclose(pyopencl.clmath.exp(z).get(), np.exp(np.arange(8) * (1 + 1j)), rtol=1e-4))
print(json.dumps({"compiles": len(bookkeeping.records()), "correct": bool(ok)}))
"""


def test_pyopencl_library_programs_hit_in_a_second_process(cache_dir, run_py):
    """Complex elementwise (pyopencl-complex.h from pyopencl's own -I), reduction, scan:
    their headers enter the key by content and stay cacheable. Stored the default way, by
    the store worker (reading a scan's binaries back costs PoCL 3.0 40 s; the second
    process is served what PoCL's cache held of it meanwhile)."""
    env = {"KDB_CACHE_DIR": str(cache_dir), "KDB_STORE_AT_EXIT": "detach"}
    try:
        first = run_py(CHILD_LIBRARY, env=env)
        out1 = json.loads(first.stdout.strip().splitlines()[-1])
        assert out1["correct"] and out1["compiles"] >= 4
        assert "without the cache" not in first.stderr
        second = json.loads(run_py(CHILD_LIBRARY, env=env).stdout.strip().splitlines()[-1])
        assert second == {"compiles": 0, "correct": True}
    finally:
        kill_workers(cache_dir)


def test_binaries_doctests():
    import doctest

    from kdb.backends.opencl import binaries

    result = doctest.testmod(binaries)
    assert result.attempted >= 1 and result.failed == 0
