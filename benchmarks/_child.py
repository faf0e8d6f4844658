"""A benchmark's child process: ``python _child.py TASK JSON-ARGS``.

It times its own phases with :func:`time.perf_counter` and prints one line,
``BENCH-JSON:{...}``, holding ``phases`` (seconds), ``t_begin`` (its first statement) and
``t_end`` (its last statement before exit), so the parent can split the process's wall time
into start-up, phases and exit. Heavy imports happen inside the phases that pay for them.
"""

import time

T_BEGIN = time.perf_counter()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import _workloads  # noqa: E402

clock = time.perf_counter


def _pocl_device(cl: Any) -> Any:
    """The first PoCL device, or the first of the platform ``KDB_BENCH_PLATFORM`` names."""
    platforms = cl.get_platforms()
    want = os.environ.get("KDB_BENCH_PLATFORM", "Portable Computing Language")
    for plat in platforms:
        if want in plat.name:
            return plat.get_devices()[0]
    return platforms[0].get_devices()[0]


def _compiles() -> int | None:
    mod = sys.modules.get("kdb.bookkeeping")
    return None if mod is None else len(mod.records())


# -- OpenCL start-up ------------------------------------------------------------------------

def task_opencl(a: dict[str, Any]) -> dict[str, Any]:
    """A start-up: import, context, build every program, launch each kernel once.

    mode: ``pyopencl`` (plain ``Program(ctx, src).build()``), ``kdb`` (``kdb.opencl.build``),
    ``kdb-install`` (``kdb.opencl.install()``, then plain pyopencl code), ``floor`` (binaries
    read from plain files, ``Program(ctx, [dev], [binary]).build()``).
    workload: ``kernels`` (the generated small kernels) or ``scan`` (pyopencl's scan kernels).
    """
    mode, workload = a["mode"], a["workload"]
    ph: dict[str, float] = {}
    t = clock()
    import numpy as np
    import pyopencl as cl

    ph["import_pyopencl"] = clock() - t
    t = clock()
    dev = _pocl_device(cl)
    ctx = cl.Context([dev])
    queue = cl.CommandQueue(ctx)
    ph["context"] = clock() - t
    if mode.startswith("kdb"):
        t = clock()
        import kdb.opencl

        if mode == "kdb-install":
            kdb.opencl.install()
        ph["import_kdb"] = clock() - t

    info: dict[str, Any] = {}
    if workload == "kernels":
        progs = _workloads.kernels(a["kernels"])
        mf = cl.mem_flags
        inp = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR,
                        hostbuf=np.linspace(0, 1, _workloads.GLOBAL_SIZE, dtype=np.float32))
        out = cl.Buffer(ctx, mf.WRITE_ONLY, 4 * _workloads.GLOBAL_SIZE)
        t = clock()
        if mode == "kdb":
            built = [kdb.opencl.build(ctx, p["source"]) for p in progs]
        elif mode == "floor":
            built = []
            for p in progs:
                with open(os.path.join(a["bin_dir"], p["name"] + ".bin"), "rb") as f:
                    binary = f.read()
                built.append(cl.Program(ctx, [dev], [binary]).build())
        else:
            built = [cl.Program(ctx, p["source"]).build() for p in progs]
        ph["build"] = clock() - t
        t = clock()
        for p, prg in zip(progs, built):
            getattr(prg, p["name"])(queue, (_workloads.GLOBAL_SIZE,), None, out, inp,
                                    np.float32(1.5))
            queue.finish()
        ph["launch"] = clock() - t
        info["programs"] = len(progs)
    elif workload == "scan":
        t = clock()
        import pyopencl.array as cl_array
        from pyopencl.scan import InclusiveScanKernel

        ph["import_scan"] = clock() - t
        t = clock()
        scan = InclusiveScanKernel(ctx, np.int32, "a+b", neutral="0")
        ph["build"] = clock() - t
        t = clock()
        n = 50_000  # the sum, n (n - 1) / 2, still fits in an int32
        arr = cl_array.arange(queue, n, dtype=np.int32)
        scan(arr)
        last = int(arr[-1].get())
        ph["launch"] = clock() - t
        if last != n * (n - 1) // 2:
            raise SystemExit(f"scan result {last} is wrong")
    else:
        raise SystemExit(f"unknown workload {workload!r}")
    return {"phases": ph, "compiles": _compiles(), **info}


# -- hit cost in a warm process -------------------------------------------------------------

def task_hit_warm(a: dict[str, Any]) -> dict[str, Any]:
    """Per size: one kdb hit against reading the same compressed bytes from a file and
    decompressing them (and against a bare sqlite3 SELECT + decompress), interleaved."""
    import sqlite3

    import kdb
    import zstandard

    db = kdb.KernelDB()
    dctx = zstandard.ZstdDecompressor()
    conn = sqlite3.connect(f"file:{a['user_file']}?mode=ro", uri=True)
    out: dict[str, Any] = {}
    for e in a["entries"]:
        kw = _workloads.hit_attrs(e["size"])
        attrs = kdb.HashAttributes(**kw)
        t = clock()
        first = db.get(attrs)
        t_first = clock() - t
        if first is None or len(first) != e["size"]:
            raise SystemExit(f"entry of {e['size']} bytes did not hit")
        s: dict[str, list[float]] = {"kdb": [], "kdb_lookup": [], "file": [], "sqlite": []}
        for _ in range(a["reps"]):
            t0 = clock()
            b1 = db.get(kdb.HashAttributes(**kw))  # a request builds its attributes
            t1 = clock()
            b2 = db.get(attrs)  # the store alone: attributes and key already built
            t2 = clock()
            with open(e["file"], "rb") as f:
                b3 = dctx.decompress(f.read())
            t3 = clock()
            row = conn.execute("SELECT blob FROM kernels WHERE key = ?", (e["key"],)).fetchone()
            b4 = dctx.decompress(row[0])
            t4 = clock()
            s["kdb"].append(t1 - t0)
            s["kdb_lookup"].append(t2 - t1)
            s["file"].append(t3 - t2)
            s["sqlite"].append(t4 - t3)
            if not (len(b1) == len(b2) == len(b3) == len(b4) == e["size"]):
                raise SystemExit("sizes differ")
        out[str(e["size"])] = {"first": t_first, **s}
    return {"sizes": out}


# -- scale ----------------------------------------------------------------------------------

def task_scale(a: dict[str, Any]) -> dict[str, Any]:
    """Hits on random entries of a large user file, and ``kdb stats`` on it."""
    import kdb
    from kdb import config
    from kdb.admin import report

    attrs = [kdb.HashAttributes(**_workloads.scale_attrs(i)) for i in a["indices"]]
    for x in attrs:
        x.key  # noqa: B018 - hashed before the clock starts; the hit is what is measured
    db = kdb.KernelDB()
    t = clock()
    first = db.get(attrs[0])
    t_first = clock() - t
    if first is None:
        raise SystemExit("scale entry did not hit")
    hits = []
    for x in attrs[1:]:
        t = clock()
        b = db.get(x)
        hits.append(clock() - t)
        if b is None:
            raise SystemExit("scale entry did not hit")
    user_dir = config.user_dir()
    stats = []
    for _ in range(a["stats_reps"]):
        t = clock()
        st = report.stats(user_dir)
        stats.append(clock() - t)
    return {"first_hit": t_first, "hits": hits, "stats": stats,
            "entries_seen": st.get("entries")}


# -- CUDA -----------------------------------------------------------------------------------

def task_cuda(a: dict[str, Any]) -> dict[str, Any]:
    """``kdb.cuda.compile`` once (a miss or a hit, as the cache holds), then warm calls;
    ``compiler``: ``"nvcc"``, ``"nvrtc"`` or None (nvcc where found, else NVRTC, else the
    stored builds)."""
    ph: dict[str, float] = {}
    t = clock()
    import kdb.cuda

    ph["import_kdb_cuda"] = clock() - t
    t = clock()
    compiler = a.get("compiler")
    first = kdb.cuda.compile(a["source"], arch=a["arch"], compiler=compiler)
    ph["first_call"] = clock() - t
    warm = []
    for _ in range(a["reps"]):
        t = clock()
        again = kdb.cuda.compile(a["source"], arch=a["arch"], compiler=compiler)
        warm.append(clock() - t)
    size = len(first) if isinstance(first, (bytes, bytearray)) else None
    same = bytes(first) == bytes(again) if size is not None and a["reps"] else None
    return {"phases": ph, "warm_calls": warm, "binary_size": size, "same": same,
            "result_type": type(first).__name__, "compiles": _compiles()}


TASKS = {"opencl": task_opencl, "hit-warm": task_hit_warm, "scale": task_scale,
         "cuda": task_cuda}


def main() -> None:
    task, args = sys.argv[1], json.loads(sys.argv[2])
    out = TASKS[task](args)
    out["t_begin"] = T_BEGIN
    out["t_end"] = clock()
    sys.stdout.write("BENCH-JSON:" + json.dumps(out) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
