"""The demo's OpenCL programs, their checks against numpy, and the worker that builds,
launches and checks them in a fresh interpreter (``python -m kdb.demo.runs --worker``).

Only the worker imports pyopencl and numpy; the parent (:mod:`kdb.demo.runs`) needs neither.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"


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
    from ..errors import InvalidArgumentError

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

    from .. import bookkeeping
    from .. import opencl as kdb_opencl
    from ..db import default_db

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
    compiles = len(bookkeeping.records())

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
        "compiled": [r.name for r in bookkeeping.records()], "build_s": build_s,
        "launch_check_s": launch_s, "store_wait_s": store_s,
        "ok": all(r["ok"] for r in results), "results": results,
        "user_file": str(db.user_dir / f"{kdb_opencl.arch_of(device)}.kdb"),
    }
    Path(out_path).write_text(json.dumps(figures, indent=2))
    return 0 if figures["ok"] else 1

