"""`kdb demo`: real OpenCL kernels built twice in fresh processes, cold cache then warm.

The demo runs a set of OpenCL programs of several kinds (elementwise, reductions and scans in
local memory, tiled matrix multiply, stencil, atomics, a program that includes a header, float
and complex variants chosen with ``-D`` options) on the default device, checks every result
against numpy, and does it twice, each time in a fresh Python process: first on an empty kdb
cache, then on the cache the first run filled. It prints a table of the two build phases.

Each run gets its own, empty ``POCL_CACHE_DIR``, so PoCL's own cache helps neither run: the
warm run's speed-up is kdb's alone. Launches are timed apart from the build phase: in the
cold run the first launch of each kernel JIT-compiles its work-group function. kdb reads
the binaries back after the start-up burst, when the kernels have run, and PoCL's binaries
then carry the work-group functions it compiled for those launches (measured: 50 KB before a
launch, 64 KB after; a first launch from the latter in a fresh process took 18 ms, not
82 ms), so the warm run's first launches skip the JIT too.

The parent process imports neither pyopencl nor numpy; the worker (``python -m kdb.demo
--worker``) does the OpenCL work and reports JSON. This module prints: it is the CLI's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from . import config

KERNEL_DIR = Path(__file__).resolve().parent / "demo_kernels"
MISSING_SYSTEM_DB = "no system kernel database"
_TIMEOUT_S = 600


@dataclass(frozen=True)
class DemoProgram:
    """One OpenCL program of the demo: its source file, build options and check."""

    name: str
    file: str
    options: tuple[str, ...]
    check: str  # name of the _check_* function that launches it and compares with numpy
    kind: str


PROGRAMS: tuple[DemoProgram, ...] = (
    DemoProgram("axpy_f32", "axpy.cl", ("-DREAL=float",), "axpy", "elementwise, float32"),
    DemoProgram("axpy_f64", "axpy.cl", ("-DREAL=double",), "axpy", "elementwise, float64"),
    DemoProgram("reduce_sum", "reduce.cl", ("-DWG=64",), "reduce", "reduction, local memory"),
    DemoProgram("matmul_tiled", "matmul.cl", ("-DTILE=8",), "matmul", "tiled matrix multiply"),
    DemoProgram("conv1d", "conv1d.cl", ("-DRADIUS=2",), "conv1d", "1D stencil / convolution"),
    DemoProgram("scan_wg", "scan.cl", ("-DWG=128",), "scan", "prefix sum per work-group"),
    DemoProgram("histogram", "histogram.cl", ("-DBINS=64",), "histogram", "local atomics"),
    DemoProgram("transpose", "transpose.cl", ("-DTILE=16",), "transpose", "tiled transpose"),
    DemoProgram("cmul_c64", "cmul.cl", (), "cmul", "complex64, #include header"),
    DemoProgram("cmul_c128", "cmul.cl", ("-DCPLX_DOUBLE",), "cmul", "complex128, #include header"),
    DemoProgram("nbody", "nbody.cl", ("-DSOFTENING=1e-3f",), "nbody", "n-body, float4 math"),
)


def select(kernels: int | Sequence[str] | str | None) -> list[DemoProgram]:
    """The demo programs to run: all (None), the first ``n`` (an int, or a string of digits),
    or those named (a sequence of names, or one comma-separated string).

    >>> [p.name for p in select(2)]
    ['axpy_f32', 'axpy_f64']
    >>> [p.name for p in select("scan_wg,nbody")]
    ['scan_wg', 'nbody']
    """
    from .errors import InvalidArgumentError

    if kernels is None:
        return list(PROGRAMS)
    if isinstance(kernels, str) and kernels.strip().isdigit():
        kernels = int(kernels)
    if isinstance(kernels, int) and not isinstance(kernels, bool):
        if not 1 <= kernels <= len(PROGRAMS):
            raise InvalidArgumentError(
                f"the demo has {len(PROGRAMS)} programs; ask for 1 to {len(PROGRAMS)}, "
                f"not {kernels}")
        return list(PROGRAMS[:kernels])
    names = kernels.split(",") if isinstance(kernels, str) else list(kernels)
    names = [str(n).strip() for n in names if str(n).strip()]
    by_name = {p.name: p for p in PROGRAMS}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise InvalidArgumentError(
            f"unknown demo kernel(s) {', '.join(unknown)}; choose from {', '.join(by_name)}")
    if not names:
        raise InvalidArgumentError("no demo kernels selected")
    return [by_name[n] for n in names]


# -- the worker: runs in a fresh interpreter ---------------------------------------------

def _check_axpy(cl: Any, np: Any, queue: Any, prg: Any, p: DemoProgram) -> str:
    dtype = np.float64 if "double" in " ".join(p.options) else np.float32
    n = 100_003
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype)
    a = dtype(2.5)
    mf = cl.mem_flags
    xb = cl.Buffer(queue.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=x)
    yb = cl.Buffer(queue.context, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=y)
    prg.axpy(queue, (n,), None, a, xb, yb, np.uint32(n))
    out = np.empty_like(y)
    cl.enqueue_copy(queue, out, yb)
    # The device may fuse a*x + y into one FMA: allow for the rounding near cancellations.
    f32 = dtype == np.float32
    return _compare(np, out, a * x + y, rtol=1e-5 if f32 else 1e-12, atol=1e-5 if f32 else 1e-12)


def _check_reduce(cl: Any, np: Any, queue: Any, prg: Any, p: DemoProgram) -> str:
    wg, n = 64, 50_000
    groups = -(-n // wg)
    x = np.random.default_rng(2).random(n, dtype=np.float32)
    mf = cl.mem_flags
    xb = cl.Buffer(queue.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=x)
    pb = cl.Buffer(queue.context, mf.WRITE_ONLY, groups * 4)
    prg.reduce_sum(queue, (groups * wg,), (wg,), xb, pb, np.uint32(n))
    partial = np.empty(groups, np.float32)
    cl.enqueue_copy(queue, partial, pb)
    want = np.add.reduceat(x.astype(np.float64), np.arange(0, n, wg))
    return _compare(np, partial, want, rtol=1e-5)


def _check_matmul(cl: Any, np: Any, queue: Any, prg: Any, p: DemoProgram) -> str:
    m, n, k = 64, 48, 80
    rng = np.random.default_rng(3)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    mf = cl.mem_flags
    ab = cl.Buffer(queue.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a)
    bb = cl.Buffer(queue.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=b)
    cb = cl.Buffer(queue.context, mf.WRITE_ONLY, m * n * 4)
    prg.matmul(queue, (n, m), (8, 8), ab, bb, cb, np.uint32(m), np.uint32(n), np.uint32(k))
    c = np.empty((m, n), np.float32)
    cl.enqueue_copy(queue, c, cb)
    return _compare(np, c, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)


def _check_conv1d(cl: Any, np: Any, queue: Any, prg: Any, p: DemoProgram) -> str:
    n = 10_000
    x = np.random.default_rng(4).standard_normal(n).astype(np.float32)
    w = np.array([0.1, 0.2, 0.4, 0.2, 0.1], np.float32)
    mf = cl.mem_flags
    xb = cl.Buffer(queue.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=x)
    wb = cl.Buffer(queue.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=w)
    yb = cl.Buffer(queue.context, mf.WRITE_ONLY, n * 4)
    prg.conv1d(queue, (n,), None, xb, wb, yb, np.int32(n))
    y = np.empty(n, np.float32)
    cl.enqueue_copy(queue, y, yb)
    # y[i] = sum_k w[k + R] x[i + k]: a correlation, i.e. a convolution with w reversed.
    return _compare(np, y, np.convolve(x, w[::-1], mode="same"), rtol=1e-5, atol=1e-6)


def _check_scan(cl: Any, np: Any, queue: Any, prg: Any, p: DemoProgram) -> str:
    wg, groups = 128, 40
    x = np.random.default_rng(5).integers(-100, 100, wg * groups, dtype=np.int32)
    mf = cl.mem_flags
    xb = cl.Buffer(queue.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=x)
    yb = cl.Buffer(queue.context, mf.WRITE_ONLY, x.nbytes)
    prg.scan_wg(queue, (x.size,), (wg,), xb, yb)
    y = np.empty_like(x)
    cl.enqueue_copy(queue, y, yb)
    return _compare(np, y, np.cumsum(x.reshape(groups, wg), axis=1).ravel())


def _check_histogram(cl: Any, np: Any, queue: Any, prg: Any, p: DemoProgram) -> str:
    n, bins = 100_000, 64
    x = np.random.default_rng(6).integers(0, 1 << 20, n, dtype=np.uint32)
    mf = cl.mem_flags
    xb = cl.Buffer(queue.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=x)
    hb = cl.Buffer(queue.context, mf.READ_WRITE | mf.COPY_HOST_PTR,
                   hostbuf=np.zeros(bins, np.uint32))
    wg = 128
    prg.histogram(queue, (-(-n // wg) * wg,), (wg,), xb, hb, np.uint32(n))
    h = np.empty(bins, np.uint32)
    cl.enqueue_copy(queue, h, hb)
    return _compare(np, h, np.bincount(x % bins, minlength=bins))


def _check_transpose(cl: Any, np: Any, queue: Any, prg: Any, p: DemoProgram) -> str:
    rows, cols = 96, 160
    a = np.random.default_rng(7).standard_normal((rows, cols)).astype(np.float32)
    mf = cl.mem_flags
    ab = cl.Buffer(queue.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a)
    tb = cl.Buffer(queue.context, mf.WRITE_ONLY, a.nbytes)
    prg.transpose(queue, (cols, rows), (16, 16), ab, tb, np.uint32(rows), np.uint32(cols))
    t = np.empty((cols, rows), np.float32)
    cl.enqueue_copy(queue, t, tb)
    return _compare(np, t, a.T)


def _check_cmul(cl: Any, np: Any, queue: Any, prg: Any, p: DemoProgram) -> str:
    dtype = np.complex128 if "-DCPLX_DOUBLE" in p.options else np.complex64
    n = 20_000
    rng = np.random.default_rng(8)

    def rand() -> Any:
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dtype)

    x, y, z = rand(), rand(), rand()
    mf = cl.mem_flags
    xb = cl.Buffer(queue.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=x)
    yb = cl.Buffer(queue.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=y)
    zb = cl.Buffer(queue.context, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=z)
    prg.cmul_acc(queue, (n,), None, xb, yb, zb, np.uint32(n))
    out = np.empty_like(z)
    cl.enqueue_copy(queue, out, zb)
    return _compare(np, out, x * np.conj(y) + z,
                    rtol=1e-5 if dtype == np.complex64 else 1e-12, atol=1e-6)


def _check_nbody(cl: Any, np: Any, queue: Any, prg: Any, p: DemoProgram) -> str:
    n, soft = 512, 1e-3
    rng = np.random.default_rng(9)
    pos = np.empty((n, 4), np.float32)
    pos[:, :3] = rng.standard_normal((n, 3))
    pos[:, 3] = rng.random(n) + 0.5
    mf = cl.mem_flags
    pb = cl.Buffer(queue.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=pos)
    ab = cl.Buffer(queue.context, mf.WRITE_ONLY, pos.nbytes)
    prg.nbody_accel(queue, (n,), None, pb, ab, np.uint32(n))
    acc = np.empty_like(pos)
    cl.enqueue_copy(queue, acc, ab)
    p64 = pos.astype(np.float64)
    d = p64[None, :, :3] - p64[:, None, :3]
    inv = (np.einsum("ijk,ijk->ij", d, d) + soft) ** -1.5
    want = np.einsum("ijk,ij->ik", d, inv * p64[None, :, 3])
    return _compare(np, acc[:, :3], want, rtol=1e-3, atol=1e-3)


def _compare(np: Any, got: Any, want: Any, rtol: float = 0.0, atol: float = 0.0) -> str:
    """'' when ``got`` matches ``want``, else what differs."""
    if got.shape != want.shape:
        return f"shape {got.shape} != expected {want.shape}"
    if np.allclose(got, want, rtol=rtol, atol=atol):
        return ""
    bad = ~np.isclose(got, want, rtol=rtol, atol=atol)
    i = int(np.flatnonzero(bad)[0])
    return (f"{int(bad.sum())} of {got.size} values differ; first at flat index {i}: "
            f"{got.ravel()[i]!r} != {want.ravel()[i]!r}")


_CHECKS: dict[str, Callable[..., str]] = {
    "axpy": _check_axpy, "reduce": _check_reduce, "matmul": _check_matmul,
    "conv1d": _check_conv1d, "scan": _check_scan, "histogram": _check_histogram,
    "transpose": _check_transpose, "cmul": _check_cmul, "nbody": _check_nbody,
}


def _default_device(cl: Any) -> Any:
    """The PoCL device if there is one, else whatever pyopencl picks (``PYOPENCL_CTX``)."""
    if not os.environ.get("PYOPENCL_CTX"):
        for plat in cl.get_platforms():
            if "Portable Computing Language" in plat.name and plat.get_devices():
                return plat.get_devices()[0]
    return cl.create_some_context(interactive=False).devices[0]


def worker(out_path: str, kernels: Sequence[str] | str | None = None) -> int:
    """Build, launch and check the demo programs in this process; write the figures as JSON."""
    import numpy as np
    import pyopencl as cl

    from . import latency
    from . import opencl as kdb_opencl
    from .db import default_db

    programs = select(kernels)
    device = _default_device(cl)
    ctx = cl.Context([device])
    queue = cl.CommandQueue(ctx)
    db = default_db()
    include = ["-I", str(KERNEL_DIR)]
    sources = {p.file: (KERNEL_DIR / p.file).read_text() for p in programs}

    built, per_build = [], []
    start = time.perf_counter()
    for p in programs:
        t = time.perf_counter()
        built.append(kdb_opencl.build(ctx, sources[p.file], [*p.options, *include], name=p.name))
        per_build.append(time.perf_counter() - t)
    build_s = time.perf_counter() - start
    compiles = len(latency.records())

    results = []
    start = time.perf_counter()
    for p, prg, b in zip(programs, built, per_build):
        t = time.perf_counter()
        try:
            problem = _CHECKS[p.check](cl, np, queue, prg, p)
        except Exception as err:  # noqa: BLE001 - a failed launch is a failed check, reported
            problem = f"{type(err).__name__}: {err}"
        results.append({"name": p.name, "kind": p.kind, "options": list(p.options),
                        "build_s": b, "launch_check_s": time.perf_counter() - t,
                        "ok": not problem, "problem": problem})
    launch_s = time.perf_counter() - start

    start = time.perf_counter()
    db.flush()  # the background writer stores the cold run's binaries; wait for it here
    store_s = time.perf_counter() - start

    figures = {
        "pid": os.getpid(), "device": device.name, "platform": device.platform.name,
        "arch": kdb_opencl.arch_of(device), "kernels": len(programs), "compiles": compiles,
        "compiled": [r.name for r in latency.records()], "build_s": build_s,
        "launch_check_s": launch_s, "store_wait_s": store_s,
        "ok": all(r["ok"] for r in results), "results": results,
        "user_file": str(db.user_dir / f"{kdb_opencl.arch_of(device)}.kdb"),
    }
    Path(out_path).write_text(json.dumps(figures, indent=2))
    return 0 if figures["ok"] else 1


# -- the parent: two fresh processes and a table ------------------------------------------

def _run_child(label: str, cache_dir: Path, pocl_dir: Path, work: Path,
               programs: list[DemoProgram]) -> tuple[dict[str, Any] | None, str, int, float]:
    out = work / f"{label}.json"
    env = dict(os.environ)
    env["KDB_CACHE_DIR"] = str(cache_dir)
    env["POCL_CACHE_DIR"] = str(pocl_dir)
    # Store before exiting, not through the store worker: the warm run starts right after
    # and should show hits, not compile what the worker has not stored yet.
    env["KDB_STORE_AT_EXIT"] = "wait"
    cmd = [sys.executable, "-m", "kdb.demo", "--worker", str(out),
           "--kernels", ",".join(p.name for p in programs)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        stderr = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else ""
        return None, stderr + f"\n{label} run killed after {_TIMEOUT_S} s", -1, _TIMEOUT_S
    wall = time.perf_counter() - start
    if proc.stdout.strip():
        print(textwrap.indent(proc.stdout.rstrip(), f"  {label} stdout | "))
    figures = json.loads(out.read_text()) if out.exists() else None
    return figures, proc.stderr, proc.returncode, wall


def _show_stderr(label: str, text: str, already: set[str]) -> None:
    """Print a child's stderr, each line wrapped and indented; skip lines shown before."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    new = [ln for ln in lines if ln not in already]
    if new:
        print(f"{label} run, worker's stderr:")
        for ln in new:
            print(textwrap.fill(ln, width=100, initial_indent="  | ", subsequent_indent="  |     ",
                                break_on_hyphens=False, break_long_words=False))
    repeated = len(lines) - len(new)
    if repeated:
        print(f"{label} run, worker's stderr: {repeated} line(s) as in the cold run "
              "(the missing-system-db warning is given once per process)")
    already.update(lines)


def _table(runs: list[tuple[str, dict[str, Any]]], speedup: float | None) -> str:
    head = ("run", "kernels", "compiles", "build s", "launch+check s", "results", "build speed-up")
    rows = [head]
    for label, f in runs:
        ok = sum(r["ok"] for r in f["results"])
        rows.append((label, str(f["kernels"]), str(f["compiles"]), f"{f['build_s']:.3f}",
                     f"{f['launch_check_s']:.3f}", f"{ok}/{f['kernels']} ok",
                     "1.0x" if label == "cold" else
                     (f"{speedup:.1f}x" if speedup is not None else "n/a")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = []
    for n, r in enumerate(rows):
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(kernels: int | Sequence[str] | str | None = None,
         json_out: str | os.PathLike[str] | None = None,
         cache_dir: str | os.PathLike[str] | None = None, keep: bool = False) -> int:
    """Run the demo: a cold and a warm run in fresh processes; print the table; exit code.

    ``kernels`` picks the programs: ``None`` for all, an int for the first ``n``, or names.
    ``json_out`` writes the figures. The kdb cache is ``cache_dir``, else ``KDB_CACHE_DIR``,
    else a new temporary directory, removed at the end unless ``keep``. Returns 0 when every
    result matched numpy and the warm run compiled nothing, else 1.
    """
    programs = select(kernels)
    if cache_dir is None and os.environ.get(config.ENV_CACHE_DIR):
        cache_dir, origin = os.environ[config.ENV_CACHE_DIR], f" (from {config.ENV_CACHE_DIR})"
    else:
        origin = ""
    work = Path(tempfile.mkdtemp(prefix="kdb-demo-"))
    temporary = cache_dir is None
    if temporary:
        cache = work / "kdb-cache"
        origin = " (temporary, kept)" if keep else " (temporary, removed at the end)"
    else:
        cache = Path(cache_dir).expanduser().resolve()
    try:
        return _demo(programs, json_out, cache, origin, work, temporary)
    finally:
        if temporary and keep:  # keep the kdb cache, drop PoCL's caches and the reports
            for entry in work.iterdir():
                if entry != cache:
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        else:
            shutil.rmtree(work, ignore_errors=True)


def _demo(programs: list[DemoProgram], json_out: str | os.PathLike[str] | None, cache: Path,
          origin: str, work: Path, temporary: bool) -> int:
    print(f"kdb demo: {len(programs)} OpenCL programs, built in two fresh processes "
          f"(cold cache, then warm)")
    print(f"kdb cache: {cache}{origin}")
    print("PoCL's own cache: a fresh, empty POCL_CACHE_DIR for each run, so it helps neither "
          "run\n")

    runs: list[tuple[str, dict[str, Any]]] = []
    failures: list[str] = []
    shown: set[str] = set()
    warned_cold = False
    for label in ("cold", "warm"):
        pocl = work / f"pocl-{label}"
        pocl.mkdir(parents=True, exist_ok=True)
        figures, stderr, rc, wall = _run_child(label, cache, pocl, work, programs)
        if label == "cold":
            warned_cold = MISSING_SYSTEM_DB in stderr
        _show_stderr(label, stderr, shown)
        if figures is None:
            failures.append(f"{label} run failed (exit code {rc}) before reporting figures")
            break
        figures["wall_s"] = wall
        figures["missing_system_db_warning"] = MISSING_SYSTEM_DB in stderr
        figures["exit_code"] = rc
        runs.append((label, figures))
        for r in figures["results"]:
            if not r["ok"]:
                failures.append(f"{label} run: {r['name']} is wrong: {r['problem']}")
        if rc != 0 and figures["ok"]:
            failures.append(f"{label} run exited with code {rc}")

    speedup = None
    if len(runs) == 2:
        cold, warm = runs[0][1], runs[1][1]
        if warm["build_s"] > 0:
            speedup = cold["build_s"] / warm["build_s"]
        if warm["compiles"]:
            disabled = config.flag(config.ENV_DISABLE_CACHE)
            failures.append(f"the warm run compiled {warm['compiles']} program(s) "
                            f"({', '.join(warm['compiled'])}); expected none"
                            + (" (KDB_DISABLE_CACHE is set)" if disabled else ""))
        if cold["compiles"] != cold["kernels"]:
            print(f"note: the cold run was not cold: {cold['kernels'] - cold['compiles']} of "
                  f"{cold['kernels']} programs were already in {cache} or a system database")

    if runs:
        print()
        print(_table(runs, speedup))
        print()
        f = runs[0][1]
        print(f"device: {f['device']} ({f['platform']}), arch {f['arch']}")
        print(f"user file: {f['user_file']}")
        if speedup is not None and runs[0][1]["compiles"] == len(programs):
            print(f"warm build phase {speedup:.1f}x faster than cold: "
                  f"{runs[0][1]['build_s']:.3f} s -> {runs[1][1]['build_s']:.3f} s for "
                  f"{len(programs)} programs")
        if len(runs) > 1:
            print("kdb stores binaries in the background, after the start-up burst: the cold "
                  "run then spent\n  "
                  f"{runs[0][1]['store_wait_s']:.3f} s at its end reading them back from PoCL "
                  "and storing them; read after\n  the launches, they carry the "
                  "work-group code PoCL compiled, so the warm run's launches skip its JIT")
        if not warned_cold:
            print("note: the cold run gave no missing-system-db warning "
                  "(a system database for this arch was found, or kdb's warnings are silenced)")

    if json_out is not None:
        doc = {
            "programs": [{"name": p.name, "file": p.file, "options": list(p.options),
                          "kind": p.kind} for p in programs],
            "cache_dir": str(cache), "cache_temporary": temporary,
            "pocl_cache": "fresh empty POCL_CACHE_DIR per run",
            "runs": {label: f for label, f in runs},
            "build_speedup": speedup,
            "missing_system_db_warning_cold": warned_cold,
            "ok": not failures, "failures": failures,
        }
        Path(json_out).write_text(json.dumps(doc, indent=2))
        print(f"figures written to {json_out}")

    for msg in failures:
        print(f"FAILED: {msg}", file=sys.stderr)
    return 1 if failures else 0


def _cli(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kdb.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", help="how many programs, or comma-separated names "
                        "(default: all)")
    parser.add_argument("--json", dest="json_out", metavar="PATH", help="write the figures here")
    parser.add_argument("--cache-dir", help="kdb cache to use (default: KDB_CACHE_DIR, else a "
                        "temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary cache")
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.kernels)
    from .errors import KdbError

    try:
        return main(args.kernels, args.json_out, args.cache_dir, args.keep)
    except KdbError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(_cli())
