"""Early stores (kdb.backends.opencl.early): what PoCL's own cache holds for a program a process
compiled is kept at its exit, as a provisional entry, and put back for the next process's
build, so a run whose store worker never ran (killed with its job, starved on a busy machine)
leaves its next run nothing to compile.

Real processes, real PoCL builds and launches, a real store worker; "never ran" is a worker
kept from starting by holding its spool's lock, as a killed or starved one would be.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kdb import KernelDB
from kdb.config import private_dir
from kdb.storing import spool
from conftest import kill_workers, sql

cl = pytest.importorskip("pyopencl")
early = pytest.importorskip("kdb.backends.opencl.early")

DETACH = {"KDB_STORE_AT_EXIT": "detach"}

#: Three programs built and launched; prints the compiles and the kernels' results.
RUN = """
    import json
    import numpy as np
    import pyopencl as cl
    import kdb.opencl, kdb.bookkeeping
    plat = [p for p in cl.get_platforms() if "Portable" in p.name][0]
    ctx = cl.Context(plat.get_devices()[:1])
    q = cl.CommandQueue(ctx)
    got = []
    for i in range(3):
        prg = kdb.opencl.build(ctx, "__kernel void e%d(__global float *a) "
                               "{ a[get_global_id(0)] += %d.0f; }" % (i, i + 1))
        a = np.zeros(64, np.float32)
        buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)
        getattr(prg, "e%d" % i)(q, (64,), (16,), buf)
        cl.enqueue_copy(q, a, buf)
        got.append(float(a[5]))
    print(json.dumps({"compiles": len(kdb.bookkeeping.records()), "got": got}))
"""


def _user_file(cache: Path) -> Path:
    return next((cache / "v1").glob("pocl-*.kdb"))


def _run(code: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def _hold_worker_lock(cache: Path, env: dict) -> int:
    """Hold the spool's worker lock: no store worker runs for this environment's jobs."""
    sdir = private_dir(spool.spool_dir(cache / "v1", env))
    fd = os.open(sdir / spool.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _entries(cache: Path) -> list[tuple[bytes, dict]]:
    rows = sql(_user_file(cache), "SELECT codec, blob, raw_size, checksum, details FROM kernels")
    from kdb.file import codec

    return [(codec.decode(*r[:4]), json.loads(r[4] or "{}")) for r in rows]


def test_a_run_whose_worker_never_ran_leaves_the_next_run_nothing_to_compile(cache_dir,
                                                                              tmp_path):
    env = {**os.environ, **DETACH, "KDB_CACHE_DIR": str(cache_dir),
           "POCL_CACHE_DIR": str(tmp_path / "pocl-1")}
    held = _hold_worker_lock(cache_dir, env)
    try:
        first = _run(RUN, env)
        assert first["compiles"] == 3 and first["got"] == [1.0, 2.0, 3.0]
        entries = _entries(cache_dir)
        assert len(entries) == 3
        assert all(early.is_early(b) and d["provisional"] for b, d in entries)
        # The files came with what the launches generated: the next start JITs nothing.
        assert all(any(p.endswith(".so") for p, _ in early.unpack(b)[1]) for b, _ in entries)
        # A fresh machine's PoCL cache (a CI runner, a new node): nothing is compiled.
        fresh = tmp_path / "pocl-2"
        second = _run(RUN, {**env, "POCL_CACHE_DIR": str(fresh)})
        assert second == {"compiles": 0, "got": [1.0, 2.0, 3.0]}
        assert len(list(fresh.glob("*/*/program.bc"))) == 3
        assert len(list(fresh.glob("*/*/*/*/*.so"))) == 3
    finally:
        os.close(held)
    # The worker was killed with the job: the next run that is served an early entry starts
    # it again, and it stores the full binaries in their place.
    third = _run(RUN, {**env, "POCL_CACHE_DIR": str(tmp_path / "pocl-3")})
    assert third == {"compiles": 0, "got": [1.0, 2.0, 3.0]}
    from test_spool import wait_for_worker

    wait_for_worker(cache_dir)
    entries = _entries(cache_dir)
    assert len(entries) == 3 and not any(early.is_early(b) or d.get("provisional")
                                         for b, d in entries)
    assert all(b.startswith(b"poclbin\0") for b, _ in entries)


def _attrs(cl_ctx, source: str):
    from kdb.backends.opencl.keys import attributes_for

    return attributes_for(cl_ctx.devices[0], source, [], [])


def test_a_provisional_entry_replaces_no_binary_and_a_store_replaces_it(cache_dir,
                                                                              cl_ctx):
    db = KernelDB()
    one = _attrs(cl_ctx, "__kernel void p1(__global int *a) { a[0] = 1; }")
    two = _attrs(cl_ctx, "__kernel void p2(__global int *a) { a[0] = 2; }")
    stand_in = early.pack("AB/CDEFGHIJKLMNOPABCDEFGHIJKLMNOPABCDEFG", [("program.bc", b"BC")])
    assert db.put(one, b"a binary")
    db.tiers.storing.store_provisional([(one, stand_in, 0.1, None), (two, stand_in, 0.1, None)])
    assert db.get(one) == b"a binary"
    assert db.get(two) == stand_in
    assert db.tiers.user_file(two.arch).stored([one.key, two.key]) == {one.key}
    newer = early.pack("AB/CDEFGHIJKLMNOPABCDEFGHIJKLMNOPABCDEFH", [("program.bc", b"BC")])
    db.tiers.storing.store_provisional([(two, newer, 0.1, None)])  # a stand-in replaces a stand-in
    assert db.get(two) == newer
    assert db.put(two, b"its binary")
    assert db.get(two) == b"its binary"


def test_files_pocl_does_not_use_cost_one_compile_and_are_replaced(cache_dir, cl_ctx,
                                                                     tmp_path):
    """An early entry whose files PoCL does not take (here: under a build hash no build
    computes) is a miss: the build that tried them counts as one compile, its
    result right, and the entry replaced by what that compile stores."""
    import kdb.opencl

    source = "__kernel void w(__global float *a) { a[get_global_id(0)] = 7.0f; }"
    db = KernelDB()
    attrs = _attrs(cl_ctx, source)
    bogus = early.pack("AB/CDEFGHIJKLMNOPABCDEFGHIJKLMNOPABCDEFG",
                       [("program.bc", b"not bitcode")])
    db.tiers.storing.store_provisional([(attrs, bogus, 0.1, None)])
    from kdb import bookkeeping

    before = len(bookkeeping.records())
    prg = kdb.opencl.build(cl_ctx, source, db=db)
    assert len(bookkeeping.records()) == before + 1  # compiled
    import numpy as np

    q = cl.CommandQueue(cl_ctx)
    a = np.zeros(16, np.float32)
    buf = cl.Buffer(cl_ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)
    prg.w(q, (16,), None, buf)
    cl.enqueue_copy(q, a, buf)
    assert a[3] == 7.0
    from kdb.storing.stores import drain

    drain()
    assert db.get(attrs).startswith(b"poclbin\0")  # replaced by the compile's binary


@pytest.mark.parametrize("path", ["../x", "k/16-1-1/../../x", "/abs", "k/16-1-1/j.so",
                                  "k/1-2/k.so", "program.bc/x"])
def test_an_early_entry_with_a_path_pocl_would_not_write_is_refused(path):
    good = ("program.bc", b"BC")
    name = "AB/CDEFGHIJKLMNOPABCDEFGHIJKLMNOPABCDEFG"
    assert early.unpack(early.pack(name, [good])) == (name, [good])
    assert early.unpack(early.pack(name, [good, (path, b"x")])) is None
    assert early.unpack(early.pack("../../../../etc/passwd/xxxxxxxxxxxxxxxxxxxxxx",
                                   [good])) is None


def test_the_directory_each_build_used_is_found_and_an_overlapped_one_left_out():
    from types import SimpleNamespace as NS

    def build(key, start, end):
        return early.Build(None, (NS(key=key, arch="pocl-x"),), start, end, ())

    ms = 1_000_000
    builds = [build("a", 0, 100 * ms), build("b", 200 * ms, 300 * ms),
              build("c", 400 * ms, 500 * ms)]
    dirs = {"AA/" + "A" * 37: (90 * ms, 50 * ms),      # a's: written and touched in a
            "BB/" + "B" * 37: (290 * ms, -1),          # b's: a PoCL cache hit in b
            "CC/" + "C" * 37: (450 * ms, 420 * ms),    # c overlapped another process's
            "DD/" + "D" * 37: (460 * ms, 455 * ms)}    # compile: two directories, neither
    assert early.match(builds, dirs) == {0: "AA/" + "A" * 37, 1: "BB/" + "B" * 37}
    # Told apart by the kernels their program.bc names (another process's other program):
    assert early.match(builds, dirs, lambda name, b: name.startswith("DD"))[2] == "DD/" + "D" * 37
    # A store worker's rebuild touched a's directory during b's build: b's own is the one
    # whose program.bc b wrote.
    dirs = {"AA/" + "A" * 37: (250 * ms, 50 * ms), "BB/" + "B" * 37: (290 * ms, 280 * ms)}
    assert early.match(builds, dirs) == {0: "AA/" + "A" * 37, 1: "BB/" + "B" * 37}


def test_a_build_used_the_files_put_back_by_last_accessed_or_by_compiling_nothing_else(tmp_path):
    """PoCL 3 touches the directory's ``last_accessed``; PoCL 1.2 and 1.3 write none, and
    every waiting process there counted a compile of every program it was served ("its
    build hash differs"): a build that compiled no other directory used the one put back."""
    top = str(tmp_path)
    ours, other = "AB/" + "C" * 37, "DE/" + "F" * 37
    early.put_back(top, ours, [("program.bc", b"BC")])
    since = os.stat(tmp_path / ours / "program.bc").st_mtime_ns + 10**9
    stamp = tmp_path / ours / "last_accessed"

    assert early.used(top, ours, since)  # old PoCL: nothing else compiled
    (tmp_path / other).mkdir(parents=True)
    (tmp_path / other / "program.bc").write_bytes(b"X")
    os.utime(tmp_path / other / "program.bc", ns=(since, since))
    assert not early.used(top, ours, since)  # it compiled another hash's program instead
    stamp.write_bytes(b"")
    os.utime(stamp, ns=(since + 1, since + 1))
    assert early.used(top, ours, since)  # PoCL 3: it touched ours
    os.utime(stamp, ns=(since - 10**9, since - 10**9))
    assert not early.used(top, ours, since)  # touched before the build only


def test_a_pack_from_the_user_file_ships_binaries_not_provisional_entries(cache_dir, cl_ctx,
                                                                          tmp_path):
    """A provisional entry stands in on the machine that kept it (PoCL's hash holds its
    option text, pyopencl's own -I path included): `kdb pack --from-db` leaves it out."""
    from click.testing import CliRunner

    from kdb.cli import cli

    db = KernelDB()
    kept = _attrs(cl_ctx, "__kernel void q1(__global int *a) { a[0] = 1; }")
    binary = _attrs(cl_ctx, "__kernel void q2(__global int *a) { a[0] = 2; }")
    assert db.put(binary, b"a binary")
    db.tiers.storing.store_provisional([(kept, early.pack("AB/" + "C" * 37, [("program.bc", b"B")]),
                                         0.1, None)])
    db.close()
    out = tmp_path / "pack"
    res = CliRunner().invoke(cli, ["--cache-dir", str(cache_dir), "pack", "--arch", kept.arch,
                                   "--from-db", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert sql(out / f"{kept.arch}.kdb", "SELECT key FROM kernels") == [(binary.key,)]


#: Two programs with their stores left queued (no worker): one with an include directory in
#: the temporary directory, one without; prints the job files' ``first`` flags by kernel.
FIRST = """
    import json, pathlib
    import pyopencl as cl
    import kdb.opencl, kdb.storing.spool
    kdb.storing.spool.ensure_worker = lambda spool: None
    plat = [p for p in cl.get_platforms() if "Portable" in p.name][0]
    ctx = cl.Context(plat.get_devices()[:1])
    inc = {inc!r}
    # A header that names __FILE__: no copy of its directory is faithful (tempincludes).
    pathlib.Path(inc, "one.h").write_text("#define ONE 1\\n#define WHERE __FILE__\\n")
    kdb.opencl.build(ctx, '#include "one.h"\\n__kernel void t(__global int *a) {{ a[0] = ONE; }}',
                     options=["-I", inc])
    kdb.opencl.build(ctx, "__kernel void s(__global int *a) {{ a[0] = 2; }}")
"""


def test_a_store_nothing_stands_in_for_is_queued_first(cache_dir, tmp_path):
    """A program built with an include directory in the temporary directory (a test's
    ``tmp_path``) that kdb cannot copy faithfully (a header names ``__FILE__``) gets an
    early entry the next process cannot use (PoCL's build hash holds the path, and the next
    process names another): its job is marked ``first``, which the store worker takes
    before older jobs; a program without one is not."""
    inc = tmp_path / "inc"
    inc.mkdir()
    env = {**os.environ, **DETACH, "KDB_CACHE_DIR": str(cache_dir),
           "POCL_CACHE_DIR": str(tmp_path / "pocl")}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(FIRST.format(inc=str(inc)))],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    flags = {}
    for path in (cache_dir / "v1" / "spool").glob("*/*.job"):
        job = json.loads(path.read_text())
        if job.get("kind") == "store":
            flags[job["entries"][0]["name"]] = job.get("first", False)
    assert flags == {"t": True, "s": False}, flags


#: A program whose header is in a new temporary directory in every process (a test's
#: ``tmp_path``, a script's ``mkdtemp``); prints the compiles, the result and the options
#: PoCL was given.
TEMP_INCLUDE = """
    import json, tempfile, pathlib
    import numpy as np
    import pyopencl as cl
    import kdb.opencl, kdb.bookkeeping
    inc = tempfile.mkdtemp(prefix="inc-")
    pathlib.Path(inc, "sub").mkdir()
    pathlib.Path(inc, "two.h").write_text('#include "sub/three.h"\\n#define TWO (THREE - 1)\\n')
    pathlib.Path(inc, "sub", "three.h").write_text("#define THREE 3\\n")
    plat = [p for p in cl.get_platforms() if "Portable" in p.name][0]
    ctx = cl.Context(plat.get_devices()[:1])
    q = cl.CommandQueue(ctx)
    prg = cl.Program(ctx, '#include "two.h"\\n__kernel void u(__global float *a) '
                          '{ a[get_global_id(0)] = TWO; }').build(options=["-I", inc])
    a = np.zeros(16, np.float32)
    buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)
    prg.u(q, (16,), None, buf)
    cl.enqueue_copy(q, a, buf)
    opts = prg.get_build_info(ctx.devices[0], cl.program_build_info.OPTIONS)
    print(json.dumps({"compiles": len(kdb.bookkeeping.records()), "got": float(a[3]),
                      "inc": inc, "options": opts}))
"""


def test_a_temporary_include_directory_of_another_name_compiles_nothing_again(cache_dir,
                                                                             tmp_path):
    """Each process makes its own temporary include directory with the same headers: the
    build is given a copy named by their content (kdb.backends.opencl.tempincludes), so the
    next process's build computes the same PoCL build hash and its early entry stands in,
    with no store worker ever run. A header changed since is a new copy and a compile."""
    env = {**os.environ, **DETACH, "KDB_CACHE_DIR": str(cache_dir),
           "POCL_CACHE_DIR": str(tmp_path / "pocl-1"), "KDB_AUTO": "1"}
    held = _hold_worker_lock(cache_dir, env)
    try:
        first = _run(TEMP_INCLUDE, env)
        assert first["compiles"] == 1 and first["got"] == 2.0, first
        copies = list((cache_dir / "v1" / "includes").iterdir())
        assert len(copies) == 1 and str(copies[0]) in first["options"], first
        assert first["inc"] not in first["options"]
        second = _run(TEMP_INCLUDE, {**env, "POCL_CACHE_DIR": str(tmp_path / "pocl-2")})
        assert second["compiles"] == 0 and second["got"] == 2.0, second
        assert second["inc"] != first["inc"]
        changed = TEMP_INCLUDE.replace("THREE 3", "THREE 5")
        third = _run(changed, env)
        assert third["compiles"] == 1 and third["got"] == 4.0, third
        assert len(list((cache_dir / "v1" / "includes").iterdir())) == 2
    finally:
        os.close(held)


def test_the_keep_at_exit_is_the_first_stores_hook_whatever_a_miss_registers_later():
    """The keep runs first of the exit phase ``STORES``: the phase's other hooks (a store-ahead
    child's close, claims handed over) may take seconds while the store worker rebuilds the
    same programs in PoCL's cache, touching the directories the keep matches by time. So it
    is registered when the back end is imported, not when a miss first loads :mod:`.early`."""
    code = """
        import pyopencl, kdb.opencl
        from kdb import lifecycle
        from kdb.storing import holding, queued
        holding._register_exit(); queued._register()  # what a miss may register first
        first = [h for p, h in lifecycle._exit_hooks if p == lifecycle.STORES][0]
        print(first.__module__, first.__name__)
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True,
                         capture_output=True, text=True).stdout.split()
    assert out == ["kdb.backends.opencl", "_keep_early_at_exit"], out


#: pyopencl's inclusive scan, run once: its programs declare their kernels through a macro.
SCAN = """
    import json
    import numpy as np
    import pyopencl as cl, pyopencl.array as cla
    from pyopencl.scan import InclusiveScanKernel
    import kdb.opencl, kdb.bookkeeping
    kdb.opencl.install()
    plat = [p for p in cl.get_platforms() if "Portable" in p.name][0]
    ctx = cl.Context(plat.get_devices()[:1])
    q = cl.CommandQueue(ctx)
    a = cla.arange(q, 3000, dtype=np.int32)
    InclusiveScanKernel(ctx, np.int32, "a+b", neutral="0")(a)
    print(json.dumps({"compiles": len(kdb.bookkeeping.records()), "last": int(a[-1].get())}))
"""


def test_a_scans_early_entries_carry_its_kernels_code(cache_dir, tmp_path):
    """A scan's programs name no kernel in a way their text shows (``KERNEL REQD_WG_SIZE(...)
    void scan_lev1``): kept at exit, each still carries its kernels' work-group functions,
    found by the names the driver lists, so the next start on a fresh PoCL cache neither
    compiles nor generates them."""
    env = {**os.environ, **DETACH, "KDB_CACHE_DIR": str(cache_dir),
           "POCL_CACHE_DIR": str(tmp_path / "pocl-1")}
    held = _hold_worker_lock(cache_dir, env)
    try:
        first = _run(SCAN, env)
        assert first["compiles"] >= 2 and first["last"] == 2999 * 3000 // 2
        entries = _entries(cache_dir)
        assert entries and all(early.is_early(b) and d["provisional"] for b, d in entries)
        assert all(any(p.endswith(".so") for p, _ in early.unpack(b)[1]) for b, _ in entries)
        second = _run(SCAN, {**env, "POCL_CACHE_DIR": str(tmp_path / "pocl-2")})
        assert second == {"compiles": 0, "last": first["last"]}
    finally:
        os.close(held)
        kill_workers(cache_dir)  # its jobs stay unstored: no worker goes on beside later tests
