"""The key sees what the compiler reads: real PoCL builds over every include form.

Each case builds a kernel that returns the header's ``K``, builds it again unchanged (a hit),
edits the header and builds again: the program must return the new value. Where kdb cannot
be sure what a build reads, it builds without the cache, says so, and stores nothing.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

cl = pytest.importorskip("pyopencl")

import kdb  # noqa: E402
import kdb.opencl  # noqa: E402
from kdb import bookkeeping
from kdb.storing import spool  # noqa: E402
from kdb.storing.jobs import StoreJob  # noqa: E402
from kdb.backends.opencl import stores as clstore  # noqa: E402
from kdb.errors import CompileError  # noqa: E402
from conftest import sql, stored_entries as stored  # noqa: E402

KERNEL = "__kernel void k(__global int *o) { o[0] = K; }\n"


def result(ctx, prg) -> int:
    q = cl.CommandQueue(ctx)
    buf = cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, 4)
    prg.k(q, (1,), None, buf)
    out = np.zeros(1, np.int32)
    cl.enqueue_copy(q, out, buf)
    q.finish()
    return int(out[0])


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def not_copied(directory: Path) -> None:
    """Make ``directory`` (in the temporary directory) one kdb builds from as it is, not
    from a copy named by its content (:mod:`kdb.backends.opencl.tempincludes`: a link in
    it refuses the copy), so a header edited there reaches the compiler."""
    (directory / "link.h").symlink_to("h.h")


#: id: (the include line(s), options given the include dir ``d``, the header K lives in,
#: relative to the working directory ``w``). d is w/inc.
CASES = {
    "cwd, quoted, no -I": ('#include "h.h"', lambda d: [], "h.h"),
    "cwd, angle, no -I": ("#include <h.h>", lambda d: [], "h.h"),
    "-I d": ('#include "h.h"', lambda d: ["-I", d], "inc/h.h"),
    "['-I ' + d]": ('#include "h.h"', lambda d: ["-I " + d], "inc/h.h"),
    "['-DX=1 -I' + d]": ('#include "h.h"', lambda d: ["-DX=1 -I" + d], "inc/h.h"),
    "'-DX=1 -I d'": ('#include "h.h"', lambda d: "-DX=1 -I " + d, "inc/h.h"),
    "-Idir": ("#include <h.h>", lambda d: ["-I" + d], "inc/h.h"),
    "-I relative": ("#include <h.h>", lambda d: ["-I", "inc"], "inc/h.h"),
    "-I=dir (clang: literal)": ("#include <h.h>", lambda d: ["-I=inc"], "=inc/h.h"),
    "#\\ newline include": ('#\\\ninclude "h.h"', lambda d: ["-I", d], "inc/h.h"),
    "# /* comment */ include": ('#/* x */include "h.h"', lambda d: ["-I", d], "inc/h.h"),
    "nested, own dir first": ('#include "sub/n.h"', lambda d: ["-I", d], "inc/sub/m.h"),
    # A temporary -I directory the search reaches another way too (the working directory,
    # or a directory within another -I one): built as asked, not from a copy, which would
    # be a second file where the key holds one (every build compiled, none was stored).
    "-I . (the working directory)": ('#include "h.h"', lambda d: ["-I", "."], "h.h"),
    "-I d/sub and -I d": ('#include "sub/n.h"', lambda d: ["-I", d + "/sub", "-I", d],
                          "inc/sub/m.h"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_editing_the_header_changes_the_result(case, cache_dir, cl_ctx, tmp_path, monkeypatch):
    include, options, where = CASES[case]
    work = tmp_path / "work"
    d = work / "inc"
    write(d / "sub" / "n.h", '#include "m.h"\n')
    write(d / "m.h", "#define K 99\n")  # shadowed by sub/m.h: the compiler never reads it
    monkeypatch.chdir(work)
    header = work / where
    src = include + "\n" + KERNEL
    opts = options(str(d))

    write(header, "#define K 2\n")
    assert result(cl_ctx, kdb.opencl.build(cl_ctx, src, opts)) == 2
    kdb.default_db().flush()
    compiles = len(bookkeeping.records())
    assert result(cl_ctx, kdb.opencl.build(cl_ctx, src, opts)) == 2
    assert len(bookkeeping.records()) == compiles  # unchanged header: a hit

    write(header, "#define K 3\n")
    assert result(cl_ctx, kdb.opencl.build(cl_ctx, src, opts)) == 3  # want 3 got 3
    assert len(bookkeeping.records()) == compiles + 1


#: Directive spellings PoCL's clang reads (each checked with a plain pyopencl build): id ->
#: the line that includes ``h.h``.
SPELLINGS = {
    "byte-order mark": '\ufeff#include "h.h"',
    "CR-only line ends": '// first line\r#include "h.h"\r',
    "form feed before #": '\f#include "h.h"',
    "vertical tab after #": '#\vinclude "h.h"',
    "digraph %:": '%:include "h.h"',
    "trigraph ??=": '??=include "h.h"',
    "splice with blanks before the line end": '#inc\\ \nlude "h.h"',
    "trigraph splice ??/": '#inc??/\nlude "h.h"',
    "CR LF splice": '#inc\\\r\nlude "h.h"',
}


@pytest.mark.parametrize("where", ["source", "header"])
@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_every_directive_spelling_the_compiler_reads_sees_the_header_edit(
        spelling, where, cache_dir, cl_ctx, tmp_path, monkeypatch):
    """A stale binary was served for each of these: the scan did not see the include."""
    monkeypatch.chdir(tmp_path)
    line = SPELLINGS[spelling]
    header = write(tmp_path / "inc" / "h.h", "#define K 1\n")
    if where == "header":  # the spelling inside an included header (a BOM opens its file)
        (tmp_path / "inc" / "outer.h").write_bytes((line + "\n").encode("utf-8"))
        line = '#include "outer.h"'
    src, opts = line + "\n" + KERNEL, ["-I", str(tmp_path / "inc")]
    assert result(cl_ctx, kdb.opencl.build(cl_ctx, src, opts)) == 1
    kdb.default_db().flush()
    write(header, "#define K 2\n")
    assert result(cl_ctx, kdb.opencl.build(cl_ctx, src, opts)) == 2


@pytest.mark.parametrize("options", [["-I {inc} -DN=8"], ["-I", "{inc} -DN=8"],
                                     ["-I{inc} -DN=8 -cl-fast-relaxed-math"]])
def test_an_option_element_that_starts_with_an_include_dir_keeps_its_other_options(
        options, cache_dir, cl_ctx, tmp_path):
    """``["-I inc -DN=8"]`` was left out of the key whole: N=8 got N=4's binary."""
    inc = write(tmp_path / "inc" / "h.h", "#define K N\n").parent
    src = '#include "h.h"\n' + KERNEL
    assert result(cl_ctx, kdb.opencl.build(cl_ctx, src, [f"-I {inc} -DN=4"])) == 4
    kdb.default_db().flush()
    opts = [o.format(inc=inc) for o in options]
    assert result(cl_ctx, kdb.opencl.build(cl_ctx, src, opts)) == 8
    kdb.opencl.install()
    try:  # an unmodified pyopencl program: install() keys it the same way
        assert result(cl_ctx, cl.Program(cl_ctx, src).build(options=opts)) == 8
    finally:
        kdb.opencl.uninstall()


def test_headers_found_through_pocl_extra_build_flags_are_read(cache_dir, cl_ctx, tmp_path,
                                                               monkeypatch):
    """The variable's value was keyed, but the headers its ``-I`` finds were not read."""
    header = write(tmp_path / "extra" / "h.h", "#define K 1\n")
    monkeypatch.setenv("POCL_EXTRA_BUILD_FLAGS", f"-I{header.parent}")
    src = '#include <h.h>\n' + KERNEL
    assert result(cl_ctx, kdb.opencl.build(cl_ctx, src)) == 1
    kdb.default_db().flush()
    write(header, "#define K 2\n")
    assert result(cl_ctx, kdb.opencl.build(cl_ctx, src)) == 2


@pytest.mark.parametrize("swap", ["rewritten, mtime set back", "symlink swapped"])
def test_a_header_replaced_by_one_of_the_same_size_and_mtime_changes_the_result(
        swap, cache_dir, cl_ctx, tmp_path, monkeypatch):
    """Header digests are memoised per process; a header that kept its size and mtime
    (``cp -p``, ``tar``, ``rsync -t``, a symlink flipped between two checkouts) is still
    another header."""
    from kdb.backends import digests

    monkeypatch.setattr(digests, "_SETTLED_S", 0.3)  # memoised 0.3 s after a change, not 2 s
    inc = tmp_path / "inc"
    src = '#include "h.h"\n' + KERNEL
    first = write(inc / ("h.h" if swap == "rewritten, mtime set back" else "a.h"),
                  "#define K 2\n")
    was = first.stat()
    if first.name == "a.h":
        (inc / "b.h").write_text("#define K 3\n")
        os.utime(inc / "b.h", ns=(was.st_atime_ns, was.st_mtime_ns))
        (inc / "h.h").symlink_to("a.h")
    time.sleep(0.4)
    for _ in range(2):  # the second build: a hit, its digest from the memo
        assert result(cl_ctx, kdb.opencl.build(cl_ctx, src, ["-I", str(inc)])) == 2
    if first.name == "a.h":
        (inc / "h.tmp").symlink_to("b.h")
        os.replace(inc / "h.tmp", inc / "h.h")  # atomic: the path never misses
    else:
        first.write_text("#define K 3\n")
        os.utime(first, ns=(was.st_atime_ns, was.st_mtime_ns))
    assert result(cl_ctx, kdb.opencl.build(cl_ctx, src, ["-I", str(inc)])) == 3


def test_an_include_inside_a_comment_does_not_count(cache_dir, cl_ctx, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "h.h", "#define K 5\n")
    other = write(tmp_path / "other.h", "#define K 6\n")
    src = ('/* #include "other.h" */\n// #include "other.h"\n#include "h.h"\n'
           '__constant char s[] = "#include \\"other.h\\"";\n' + KERNEL)
    assert result(cl_ctx, kdb.opencl.build(cl_ctx, src)) == 5
    kdb.default_db().flush()
    other.write_text("#define K 7\n")
    assert result(cl_ctx, kdb.opencl.build(cl_ctx, src)) == 5
    assert len(bookkeeping.records()) == 1  # the commented-out header's edit is no miss


@pytest.mark.parametrize("flag", ["--include-directory", "--include-directory=", "-isystem",
                                  "-iquote", "-include"])
def test_include_forms_pocl_refuses_fail_as_in_pyopencl(flag, cache_dir, cl_ctx, tmp_path):
    """PoCL accepts only -I among the include options; other drivers' clang takes these
    (kdb.backends.includes reads them: tests/test_includes.py). Here: the same refusal, no entry."""
    d = str(write(tmp_path / "inc" / "h.h", "#define K 2\n").parent)
    value = d + "/h.h" if flag == "-include" else d
    opts = [flag + value] if flag.endswith("=") else [flag, value]
    src = ("" if flag == "-include" else '#include "h.h"\n') + KERNEL
    with pytest.raises(cl.Error):
        cl.Program(cl_ctx, src).build(options=opts)
    with pytest.raises(CompileError):
        kdb.opencl.build(cl_ctx, src, opts)
    kdb.default_db().flush()
    assert stored(cache_dir) == 0


# -- what kdb cannot be sure of: built, not cached -----------------------------------------

def test_a_macro_include_is_built_uncached_with_one_warning(cache_dir, cl_ctx, tmp_path,
                                                             caplog):
    h = write(tmp_path / "h.h", "#define K 2\n")
    src = '#define HDR "h.h"\n#include HDR\n' + KERNEL
    opts = ["-I", str(tmp_path)]
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert result(cl_ctx, kdb.opencl.build(cl_ctx, src, opts)) == 2
        h.write_text("#define K 3\n")
        assert result(cl_ctx, kdb.opencl.build(cl_ctx, src, opts)) == 3
    warned = [r for r in caplog.records if "macro" in r.getMessage()]
    assert len(warned) == 1 and "without the cache" in warned[0].getMessage()
    kdb.default_db().flush()
    assert stored(cache_dir) == 0 and not spool.jobs(cache_dir / "v1")


def test_a_fifo_header_is_built_uncached(cache_dir, cl_ctx, tmp_path, caplog):
    fifo = tmp_path / "h.h"
    os.mkfifo(fifo)
    done = threading.Event()

    def feed() -> None:  # each time the compiler opens the FIFO, give it the header
        while not done.is_set():
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as err:
                if err.errno != errno.ENXIO:
                    raise
                done.wait(0.01)
                continue
            os.write(fd, b"#define K 4\n")
            os.close(fd)
            done.wait(0.05)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        with caplog.at_level(logging.WARNING, logger="kdb"):
            prg = kdb.opencl.build(cl_ctx, '#include "h.h"\n' + KERNEL, ["-I", str(tmp_path)])
    finally:
        done.set()
        feeder.join(5)
    assert result(cl_ctx, prg) == 4
    assert any("not a regular file" in r.getMessage() for r in caplog.records)
    kdb.default_db().flush()
    assert stored(cache_dir) == 0


# -- what is stored is what was keyed (the store worker) -----------------------------------

#: A child that builds with the store worker held off (it holds the spool's lock), then
#: does ``AFTER`` to the header before it exits: the job is stored later, by the worker.
HELD_OFF = """
    import fcntl, json, os, shutil
    from pathlib import Path
    import numpy as np
    import pyopencl as cl
    import kdb.opencl
    from kdb import config; from kdb.storing import spool

    spool_dir = config.private_dir(spool.spool_dir(Path(os.environ["KDB_CACHE_DIR"]) / "v1"))
    lock = os.open(spool_dir / spool.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    plat = [p for p in cl.get_platforms() if "Portable" in p.name][0]
    ctx = cl.Context(plat.get_devices()[:1])
    prg = kdb.opencl.build(ctx, SRC, ["-I", INC])
    q = cl.CommandQueue(ctx)
    buf = cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, 4)
    prg.k(q, (1,), None, buf)
    out = np.zeros(1, np.int32)
    cl.enqueue_copy(q, out, buf)
    AFTER
    print(json.dumps({"result": int(out[0])}))
"""

RUN = """
    import json
    import numpy as np
    import pyopencl as cl
    import kdb.opencl
    from kdb import bookkeeping
    plat = [p for p in cl.get_platforms() if "Portable" in p.name][0]
    ctx = cl.Context(plat.get_devices()[:1])
    prg = kdb.opencl.build(ctx, SRC, ["-I", INC])
    q = cl.CommandQueue(ctx)
    buf = cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, 4)
    prg.k(q, (1,), None, buf)
    out = np.zeros(1, np.int32)
    cl.enqueue_copy(q, out, buf)
    print(json.dumps({"result": int(out[0]), "compiles": len(bookkeeping.records())}))
"""


def store_jobs(user_dir: Path) -> list[StoreJob]:
    jobs = [StoreJob.from_dict(spool.read_job(p)) for p in spool.jobs(user_dir)]
    return [j for j in jobs if j.kind == "store"]


def _hold_off_the_worker(cache_dir: Path) -> int:
    """Hold this environment's spool lock: a worker seems to run, so none is started."""
    import fcntl

    from kdb import config

    d = config.private_dir(spool.spool_dir(cache_dir / "v1"))
    fd = os.open(d / spool.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _child(code: str, src: str, inc: Path, after: str = "pass") -> str:
    return (f"SRC = {src!r}\nINC = {str(inc)!r}\n"
            + textwrap.dedent(code).replace("AFTER", after))


def test_a_header_edited_before_the_worker_stores_is_not_stored(cache_dir, run_py, tmp_path):
    h = write(tmp_path / "inc" / "h.h", "#define K 2\n")
    not_copied(h.parent)
    src = '#include "h.h"\n' + KERNEL
    edit = f"open({str(h)!r}, 'w').write('#define K 3\\n')"
    first = run_py(_child(HELD_OFF, src, h.parent, edit), env={"KDB_STORE_AT_EXIT": "detach"})
    assert json.loads(first.stdout.splitlines()[-1]) == {"result": 2}
    v1 = cache_dir / "v1"
    assert len(store_jobs(v1)) == 1
    assert spool.wait(v1, 300) == 0  # the worker runs the job while the header says 3

    h.write_text("#define K 2\n")  # restored: the key of the first build again
    again = json.loads(run_py(_child(RUN, src, h.parent)).stdout.splitlines()[-1])
    assert again["result"] == 2  # not the binary of K 3 under the key of K 2
    # Served by the early entry its process kept at exit: PoCL's files of the K 2 build,
    # whose headers were checked right after it (kdb.backends.opencl.early), not a store.
    assert again["compiles"] == 0
    assert not _full_entries(cache_dir)


def test_a_deleted_header_drops_the_job_and_says_why(cache_dir, run_py, tmp_path):
    h = write(tmp_path / "tmpinc" / "h.h", "#define K 2\n")
    not_copied(h.parent)
    src = '#include "h.h"\n' + KERNEL
    gone = f"shutil.rmtree({str(h.parent)!r})"
    first = run_py(_child(HELD_OFF, src, h.parent, gone), env={"KDB_STORE_AT_EXIT": "detach"})
    assert json.loads(first.stdout.splitlines()[-1]) == {"result": 2}
    [job] = store_jobs(cache_dir / "v1")
    db = kdb.KernelDB(use_system=False)
    with pytest.raises(clstore.HeaderChangedError,
                       match=r"job dropped: header 'h.h' is gone since the build"):
        clstore.rebuild_and_store(db, job)
    db.flush()
    assert not _full_entries(cache_dir)  # an early entry of the build, at most


def _full_entries(cache_dir) -> list:
    """The user file's entries that are binaries, not provisional stand-ins (early
    entries, kept at exit from PoCL's cache, keyed by the headers the build read)."""
    from kdb.file.rows import PROVISIONAL

    files = list((cache_dir / "v1").glob("*.kdb"))
    rows = [r for f in files for r in sql(f, "SELECT key, details FROM kernels")]
    return [k for k, d in rows if not json.loads(d or "{}").get(PROVISIONAL)]


def test_a_header_edited_while_the_worker_rebuilds_is_not_stored(cache_dir, cl_ctx, tmp_path,
                                                                 monkeypatch):
    """The digests are taken again after the rebuild: an edit during it drops the job."""
    h = write(tmp_path / "inc" / "h.h", "#define K 2\n")
    not_copied(h.parent)
    src = '#include "h.h"\n' + KERNEL
    monkeypatch.setenv("KDB_STORE_AT_EXIT", "detach")
    held = _hold_off_the_worker(cache_dir)
    try:
        assert result(cl_ctx, kdb.opencl.build(cl_ctx, src, ["-I", str(h.parent)])) == 2
    finally:
        os.close(held)
    [job] = store_jobs(cache_dir / "v1")
    real_build = cl._Program.build

    def build_then_edit(self, *args, **kwargs):
        out = real_build(self, *args, **kwargs)
        h.write_text("#define K 3\n")
        return out

    monkeypatch.setattr(cl._Program, "build", build_then_edit)
    db = kdb.KernelDB(use_system=False)
    with pytest.raises(clstore.HeaderChangedError, match="header 'h.h' was edited"):
        clstore.rebuild_and_store(db, job)
    db.flush()
    assert stored(cache_dir) == 0


#: A child whose build reads a header saved between kdb's digest and the compiler's read:
#: the edit is made when the compile starts (a real PoCL compile reads the new header).
SAVED_WHILE_COMPILING = """
    import json, logging, sys
    import numpy as np
    import pyopencl as cl
    import kdb.opencl
    from kdb import bookkeeping
    logging.getLogger("kdb").addHandler(logging.StreamHandler(sys.stderr))
    real = cl._Program.build

    def build(self, *args, **kwargs):
        open(HEADER, "w").write("#define K 3\\n")
        return real(self, *args, **kwargs)

    cl._Program.build = build
    plat = [p for p in cl.get_platforms() if "Portable" in p.name][0]
    ctx = cl.Context(plat.get_devices()[:1])
    prg = kdb.opencl.build(ctx, SRC, ["-I", INC])
    q = cl.CommandQueue(ctx)
    buf = cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, 4)
    prg.k(q, (1,), None, buf)
    out = np.zeros(1, np.int32)
    cl.enqueue_copy(q, out, buf)
    print(json.dumps({"result": int(out[0])}))
"""


@pytest.mark.parametrize("store", ["wait", "detach"])
def test_a_header_saved_while_the_process_compiles_is_not_stored(store, cache_dir, run_py,
                                                                 tmp_path):
    """The key holds the header as it was before the compile; the compiler read it after
    it was saved. The process (``wait``; ``detach``: its store worker) checks the headers
    again before it stores, so the binary of ``K 3`` never lands under the key of ``K 2``."""
    h = write(tmp_path / "inc" / "h.h", "#define K 2\n")
    not_copied(h.parent)
    src = '#include "h.h"\n' + KERNEL
    code = f"HEADER = {str(h)!r}\n" + _child(SAVED_WHILE_COMPILING, src, h.parent)
    first = run_py(code, env={"KDB_STORE_AT_EXIT": store})
    assert json.loads(first.stdout.splitlines()[-1]) == {"result": 3}  # what it read
    if store == "wait":
        assert first.stderr.count("header 'h.h' was edited since the build of k") == 1
    assert spool.wait(cache_dir / "v1", 300) == 0
    assert stored(cache_dir) == 0

    h.write_text("#define K 2\n")  # the key of the first build again
    again = json.loads(run_py(_child(RUN, src, h.parent)).stdout.splitlines()[-1])
    assert again == {"result": 2, "compiles": 1}  # compiled: not the binary of K 3


# -- sources pyopencl accepts --------------------------------------------------------------

LATIN1 = """
    import json
    import numpy as np
    import pyopencl as cl
    import kdb.opencl
    from kdb import bookkeeping
    kdb.opencl.install()
    plat = [p for p in cl.get_platforms() if "Portable" in p.name][0]
    ctx = cl.Context(plat.get_devices()[:1])
    prg = cl.Program(ctx, b"/* caf\\xe9 */ __kernel void k(__global int *o) { o[0] = 8; }").build()
    q = cl.CommandQueue(ctx)
    buf = cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, 4)
    prg.k(q, (1,), None, buf)
    out = np.zeros(1, np.int32)
    cl.enqueue_copy(q, out, buf)
    print(json.dumps({"result": int(out[0]), "compiles": len(bookkeeping.records())}))
"""


@pytest.mark.parametrize("store", ["wait", "detach"])  # stored by this process, or the worker
def test_a_source_that_is_not_utf8_builds_and_is_cached_by_its_bytes(store, cache_dir, run_py):
    out = run_py(textwrap.dedent(LATIN1), env={"KDB_STORE_AT_EXIT": store})
    first = json.loads(out.stdout.splitlines()[-1])
    assert first == {"result": 8, "compiles": 1}
    assert spool.wait(cache_dir / "v1", 300) == 0
    second = json.loads(run_py(textwrap.dedent(LATIN1)).stdout.splitlines()[-1])
    assert second == {"result": 8, "compiles": 0}  # a hit in a second process


def test_sources_differing_in_undecodable_bytes_get_two_keys(cache_dir, cl_ctx):
    a = kdb.opencl.build(cl_ctx, b"/* \xe9 */ " + KERNEL.replace("K", "1").encode())
    b = kdb.opencl.build(cl_ctx, b"/* \xe8 */ " + KERNEL.replace("K", "1").encode())
    assert result(cl_ctx, a) == result(cl_ctx, b) == 1
    keys = {r.key for r in bookkeeping.records()}
    assert len(keys) == 2
    kdb.default_db().flush()
    assert stored(cache_dir) == 2


def test_kdb_trace_names_the_reason_for_each_uncached_build(cache_dir, run_py, tmp_path):
    write(tmp_path / "h.h", "#define K 2\n")
    code = _child(RUN, '#define HDR "h.h"\n#include HDR\n' + KERNEL, tmp_path)
    code = code.replace("prg = kdb.opencl.build(ctx, SRC, [\"-I\", INC])",
                        "prg = kdb.opencl.build(ctx, SRC, ['-I', INC])\n"
                        "prg = kdb.opencl.build(ctx, SRC, ['-I', INC])")
    out = run_py(code, env={"KDB_TRACE": "1"})
    assert json.loads(out.stdout.splitlines()[-1])["result"] == 2
    assert out.stderr.count("not cached: #include 'HDR' names its header by a macro") == 2
    assert out.stderr.count("such programs are built without the cache") == 1


def test_a_program_built_after_the_build_variables_changed_is_not_stored_under_them(
        cache_dir, run_py):
    """PoCL reads POCL_EXTRA_BUILD_FLAGS at a process's first build only: a program built
    after the variable changed was built with its first value, so its binary is not the
    one its key (holding the new value) names. Such a program is not stored here."""
    code = """
        import os, numpy as np, pyopencl as cl, kdb.opencl
        ctx = cl.Context([d for p in cl.get_platforms() if 'Portable' in p.name
                          for d in p.get_devices()][:1])
        def run(src):
            prg = kdb.opencl.build(ctx, src)
            q = cl.CommandQueue(ctx)
            buf = cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, 4)
            prg.k(q, (1,), None, buf)
            out = np.zeros(1, np.int32)
            cl.enqueue_copy(q, out, buf)
            return int(out[0])
        first = "__kernel void k(__global int *o) { o[0] = N; }"
        second = "__kernel void k(__global int *o) { o[0] = N + 0; }"
        if os.environ.get("PHASE") == "one":
            print(run(first))
            os.environ["POCL_EXTRA_BUILD_FLAGS"] = "-DN=5"
            print(run(second))
        else:
            print(run(second))
    """
    env = {"KDB_STORE_AT_EXIT": "wait", "POCL_EXTRA_BUILD_FLAGS": "-DN=2"}
    one = run_py(code, env={**env, "PHASE": "one"}).stdout.split()
    assert one[0] == "2"  # one[1] is what this PoCL made of the change (2 here: read once)
    two = run_py(code, env={**env, "PHASE": "two", "POCL_EXTRA_BUILD_FLAGS": "-DN=5"})
    assert two.stdout.split() == ["5"]
