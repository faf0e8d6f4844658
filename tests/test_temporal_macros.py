"""A program that uses ``__DATE__``, ``__TIME__`` or ``__TIMESTAMP__`` is never the same
twice: each build bakes in its own date and time. kdb served the first build's stamp to every
later process (OpenCL, nvcc, NVRTC, hipcc alike). Now such a build, whether the program or a
header it reads uses the macro, is compiled and not stored, logged with why, and a pack of it
fails naming the kernel.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import shutil

import numpy as np
import pytest

import kdb
import kdb.cuda
import kdb.hip
import kdb.opencl
from kdb import bookkeeping
from kdb.backends.includes import temporal_macro
from kdb.errors import PackError
from conftest import stored_entries as stored

NVCC = shutil.which("nvcc")
HIPCC = shutil.which("hipcc")

CL_STAMP = ('__kernel void stamp(__global char *out) {\n'
            '    const char s[] = STAMP;\n'
            '    for (int i = 0; i < sizeof(s); i++) out[i] = s[i];\n'
            '}\n')
CU_STAMP = '__device__ char stamp[] = __DATE__ " " __TIME__;\n' \
           '__global__ void k(char *a) { a[0] = stamp[threadIdx.x]; }\n'


@pytest.fixture
def db(cache_dir):
    bookkeeping.forget_compiles()
    d = kdb.KernelDB()
    yield d
    d.close()
    bookkeeping.forget_compiles()


def _uncached_records(why: str) -> list:
    return [r for r in bookkeeping.records()
            if r.reason.startswith(bookkeeping.UNCACHED) and why in r.reason]


def _parse_stamp(text: str) -> dt.datetime:
    """``__DATE__ " " __TIME__`` as the compiler wrote it (``Dec  5 2026 18:00:34``)."""
    return dt.datetime.strptime(" ".join(text.split()), "%b %d %Y %H:%M:%S")


def _is_now(stamp: dt.datetime, before: dt.datetime) -> bool:
    return before.replace(microsecond=0) <= stamp <= dt.datetime.now()


@pytest.mark.parametrize("text, found", [
    ("char s[] = __DATE__;", "__DATE__"),
    ("x = __TIMESTAMP__", "__TIMESTAMP__"),
    ("x = __TI\\\nME__", "__TIME__"),  # a line splice joins it
    ("x = __TI??/\nME__", "__TIME__"),  # the trigraph of a backslash, then a splice
    ("// built __DATE__\n/* __TIME__ */ int x;", None),  # comments only
    ("int my__TIME__x, __TIME__S, __DATE___;", None),  # part of another name
    ("int x;", None),
])
def test_the_macros_are_found_where_the_preprocessor_sees_them(text, found):
    assert temporal_macro(text) == found


def test_an_opencl_program_using_the_time_is_built_each_time_and_never_stored(
        cl_ctx, db, cache_dir, caplog):
    cl = pytest.importorskip("pyopencl")
    queue = cl.CommandQueue(cl_ctx)
    src = CL_STAMP.replace("STAMP", '__DATE__ " " __TIME__')
    with caplog.at_level(logging.WARNING, logger="kdb"):
        for _ in range(2):
            before = dt.datetime.now()
            prg = kdb.opencl.build(cl_ctx, src, db=db)
            out = np.zeros(64, np.uint8)
            buf = cl.Buffer(cl_ctx, cl.mem_flags.WRITE_ONLY, out.nbytes)
            prg.stamp(queue, (1,), None, buf)
            cl.enqueue_copy(queue, out, buf)
            assert _is_now(_parse_stamp(bytes(out).split(b"\0")[0].decode()), before)
    db.flush()
    assert stored(cache_dir) == 0
    # each build compiled (its stamp is now); the log names it once for this process
    assert len(_uncached_records("the program uses __DATE__")) == 1
    warned = [r.getMessage() for r in caplog.records if "__DATE__" in r.getMessage()]
    assert len(warned) == 1 and "without the cache" in warned[0]


#: A child process's OpenCL builds (PoCL takes some variables at its first build, and kdb
#: stores nothing built under other values: a fresh process for tests that set them).
CL_CHILD = """
import json, os, sys
import pyopencl as cl
import kdb, kdb.opencl
from kdb import bookkeeping
ctx = [cl.Context(p.get_devices()) for p in cl.get_platforms()
       if "Portable Computing Language" in p.name][0]
src, inc = {src!r}, {inc!r}
db = kdb.KernelDB()
for header in {headers!r}:
    if header is not None:
        with open(os.path.join(inc, "stamp.h"), "w") as f:
            f.write(header)
    kdb.opencl.build(ctx, src, {options!r}, db=db)
    db.flush()
db.close()
print(json.dumps([r.reason for r in bookkeeping.records()]))
"""


def _child_builds(run_py, cache_dir, src: str, inc, headers, options=(), env=None) -> list:
    """The log reasons of a child's builds of ``src``, once per header text in ``headers``
    (None: as it is), and how many entries it stored."""
    code = CL_CHILD.format(src=src, inc=str(inc), headers=list(headers), options=list(options))
    out = run_py(code, env={"KDB_STORE_AT_EXIT": "wait", **(env or {})})
    return json.loads(out.stdout.splitlines()[-1]), stored(cache_dir)


def test_an_opencl_header_using_the_date_makes_its_programs_uncached(cl_ctx, cache_dir,
                                                                     tmp_path, run_py):
    src = '#include "stamp.h"\n' + CL_STAMP
    reasons, n = _child_builds(run_py, cache_dir, src, tmp_path,
                               ["#define STAMP __TIMESTAMP__\n", '#define STAMP "fixed"\n'],
                               [f"-I{tmp_path}"])
    assert reasons[0].startswith("not cached: header 'stamp.h' uses __TIMESTAMP__"), reasons
    assert not reasons[1].startswith("not cached"), reasons  # the same header without it
    assert n == 1  # ... is cached again


def _ptx_stamp(ptx: bytes) -> dt.datetime:
    """The ``stamp`` array of :data:`CU_STAMP` as the PTX initializes it."""
    m = re.search(rb"stamp\[\d+\] = \{([\d, ]+)\}", ptx)
    assert m, ptx[:2000]
    return _parse_stamp(bytes(int(b) for b in m.group(1).split(b",")).split(b"\0")[0].decode())


@pytest.mark.parametrize("compiler", ["nvcc", "nvrtc"])
def test_a_cuda_program_using_the_time_is_built_each_time_and_never_stored(
        compiler, db, cache_dir):
    if compiler == "nvcc" and NVCC is None:
        pytest.skip("nvcc is not on PATH")
    try:
        kdb.cuda.find_nvrtc()
    except kdb.BackendUnavailableError:
        if compiler == "nvrtc":
            pytest.skip("NVRTC not found (pip install nvidia-cuda-nvrtc, the test extra)")
    for _ in range(2):
        before = dt.datetime.now()
        ptx = kdb.cuda.compile(CU_STAMP, "sm_90", output="ptx", db=db, compiler=compiler)
        assert _is_now(_ptx_stamp(ptx), before)
    db.flush()
    assert stored(cache_dir) == 0
    assert len(_uncached_records("the program uses __DATE__")) == 1  # once per process
    assert "cannot be cached" not in (bookkeeping.summary() or "")
    assert "kdb cannot cache them" in (bookkeeping.summary() or "")
    from kdb.admin.explain import explain

    why = explain(db.user_dir, "k")["why"]  # kdb explain: why every start compiles it
    assert why.startswith("kdb does not cache this build") and "__DATE__" in why, why


@pytest.mark.skipif(HIPCC is None, reason="hipcc is not on PATH (apt-get install hipcc)")
def test_a_hip_program_using_the_time_is_built_each_time_and_never_stored(db, cache_dir):
    src = '#include <hip/hip_runtime.h>\n' + CU_STAMP
    for _ in range(2):
        kdb.hip.compile(src, "gfx90a", db=db, compiler="hipcc")
    db.flush()
    assert stored(cache_dir) == 0
    assert len(_uncached_records("the program uses __DATE__")) == 1  # once per process


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
def test_a_pack_of_a_program_using_the_time_fails_naming_it(tmp_path):
    from kdb.pack import build as packing

    manifest = tmp_path / "cuda.toml"
    manifest.write_text(f'[[kernel]]\nname = "stamped"\nsource = """{CU_STAMP}"""\n'
                        'backend = "cuda"\ncompiler = "nvcc"\n\n'
                        '[[kernel]]\nname = "plain"\nsource = "__global__ void p() {}"\n'
                        'backend = "cuda"\ncompiler = "nvcc"\n')
    with pytest.raises(PackError, match=r"'stamped' could not be packed .* uses __DATE__"):
        packing.pack(["sm_90"], out_dir=tmp_path / "sys", manifest=manifest)
    results = packing.pack(["sm_90"], out_dir=tmp_path / "sys2", manifest=manifest,
                           keep_going=True)
    assert [name for name, _ in results[0].failures] == ["stamped"]


def test_an_opencl_option_naming_the_time_makes_the_build_uncached(cl_ctx, cache_dir,
                                                                 tmp_path, run_py):
    """``-DSTAMP=__TIME__`` expands to the time as surely as the macro in the source does,
    and so does one in a variable the runtime adds to the options."""
    for options, env, macro in ((["-DSTAMP=__DATE__"], {}, "__DATE__"),
                                ([], {"POCL_EXTRA_BUILD_FLAGS": "-DSTAMP=__TIME__"}, "__TIME__")):
        reasons, n = _child_builds(run_py, cache_dir, CL_STAMP, tmp_path, [None], options, env)
        assert reasons == [f"not cached: the option '-DSTAMP={macro}' uses {macro}, which the "
                           "compiler fills in at each build"], reasons
        assert n == 0


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
def test_a_cuda_option_naming_the_time_makes_the_build_uncached(db, cache_dir, monkeypatch):
    src = '__device__ char stamp[] = STAMP;\n__global__ void k(char *a) { a[0] = stamp[0]; }\n'
    kdb.cuda.compile(src, "sm_90", ["-DSTAMP=__TIME__"], output="ptx", db=db,
                     compiler="nvcc")
    monkeypatch.setenv("NVCC_APPEND_FLAGS", "-DSTAMP=__DATE__")
    kdb.cuda.compile(src, "sm_90", output="ptx", db=db, compiler="nvcc")
    db.flush()
    assert stored(cache_dir) == 0
    assert len(_uncached_records("uses __TIME__")) == 1
    assert len(_uncached_records("uses __DATE__")) == 1


@pytest.mark.skipif(HIPCC is None, reason="hipcc is not on PATH (apt-get install hipcc)")
def test_a_hip_option_naming_the_time_makes_the_build_uncached(db, cache_dir):
    src = ('#include <hip/hip_runtime.h>\n__device__ char stamp[] = STAMP;\n'
           '__global__ void k(char *a) { a[0] = stamp[0]; }\n')
    kdb.hip.compile(src, "gfx90a", ["-DSTAMP=__TIME__"], db=db, compiler="hipcc")
    db.flush()
    assert stored(cache_dir) == 0
    assert len(_uncached_records("the option '-DSTAMP=__TIME__' uses __TIME__")) == 1


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
def test_kdb_pack_from_the_log_leaves_out_builds_kdb_does_not_cache(db, cache_dir, tmp_path):
    """A workload's log names its uncached builds too (they compile at every start), but
    they have no entry: ``kdb pack --from-log`` packs the rest and does not call them
    missing."""
    from click.testing import CliRunner

    from kdb.cli import cli

    kdb.cuda.compile(CU_STAMP, "sm_90", output="ptx", db=db, compiler="nvcc")
    kdb.cuda.compile("__global__ void plain(int *a) { a[0] = 1; }", "sm_90", output="ptx",
                     db=db, compiler="nvcc")
    db.close()
    result = CliRunner().invoke(cli, ["pack", "--arch", "sm_90", "--from-log", "--out",
                                      str(tmp_path / "out")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "no stored binary" not in result.output, result.output
    assert stored(cache_dir) == 1
    import sqlite3

    with sqlite3.connect(tmp_path / "out" / "sm_90.kdb") as conn:
        assert conn.execute("SELECT name FROM kernels").fetchall() == [("plain",)]


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
def test_a_loop_that_builds_one_uncached_program_logs_it_once(db, cache_dir):
    """Each build compiles, but the start-up latency log names such a program once per
    process: a service that builds one per request would otherwise grow the log without
    end. The exit summary counts it beside the cached ones."""
    before = bookkeeping.process_counts().get("compiles", 0)
    for _ in range(4):
        kdb.cuda.compile(CU_STAMP, "sm_90", output="ptx", db=db, compiler="nvcc")
    kdb.cuda.compile("__global__ void plain(int *a) { a[0] = 1; }", "sm_90", output="ptx",
                     db=db, compiler="nvcc")
    db.flush()
    assert len(_uncached_records("uses __DATE__")) == 1
    # Counted each time it compiled (kdb stats, kdb run's report): it was counted once.
    assert bookkeeping.process_counts().get("compiles", 0) - before == 5
    assert "Later starts load 1 of them from the cache; 1 cannot be cached" in \
        bookkeeping.summary()
