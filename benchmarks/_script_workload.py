"""The process of the ``script`` scenario: a plain pyopencl script as a new user writes it,
about 30 programs in one process (elementwise arithmetic and math over float32 and float64,
reductions, an inclusive, an exclusive and a generic scan); every result checked.

With ``KDB_SCRIPT=1`` it routes its builds through kdb the way a user who adds one line
would: ``kdb.opencl.install()`` before anything is built. It prints one ``BENCH-JSON:``
line: programs built, compiles kdb performed, seconds.
"""

import time

T_BEGIN = time.perf_counter()

import os  # noqa: E402

import numpy as np  # noqa: E402
import pyopencl as cl  # noqa: E402

if os.environ.get("KDB_SCRIPT") == "1":
    import kdb.opencl

    kdb.opencl.install()

import pyopencl.array as cla  # noqa: E402
import pyopencl.clmath as clmath  # noqa: E402
from pyopencl.reduction import ReductionKernel  # noqa: E402
from pyopencl.scan import ExclusiveScanKernel, GenericScanKernel, InclusiveScanKernel  # noqa: E402

from _counting import report as _report  # noqa: E402 - counts what the script asks for


def _close(got, want, what: str) -> None:
    if not np.allclose(got, want, rtol=1e-4, atol=1e-4):
        raise AssertionError(f"{what}: wrong result")


def main() -> None:
    plat = [p for p in cl.get_platforms() if "Portable Computing Language" in p.name]
    if not plat:
        raise SystemExit("no PoCL platform")
    ctx = cl.Context(plat[0].get_devices()[:1])
    q = cl.CommandQueue(ctx)
    start = time.perf_counter()
    rng = np.random.default_rng(0)
    n = 4096
    for dt in (np.float32, np.float64):
        a_h = (rng.random(n) + 1).astype(dt)
        b_h = (rng.random(n) + 1).astype(dt)
        a, b = cla.to_device(q, a_h), cla.to_device(q, b_h)
        _close((a + b).get(), a_h + b_h, "add")
        _close((a * b).get(), a_h * b_h, "mul")
        _close((a / b).get(), a_h / b_h, "div")
        for name in ("sin", "exp", "log"):
            _close(getattr(clmath, name)(a).get(), getattr(np, name)(a_h), name)
        _close(cla.sum(a).get(), a_h.sum(), "sum")
        ctype = cl.tools.dtype_to_ctype(dt)
        sumsq = ReductionKernel(ctx, dt, neutral="0", reduce_expr="a+b", map_expr="x[i]*x[i]",
                                arguments=f"__global const {ctype} *x", name="sumsq")
        _close(sumsq(a).get(), (a_h * a_h).sum(), "sumsq")
    i_h = np.arange(1, n + 1, dtype=np.int32)
    i = cla.to_device(q, i_h)
    InclusiveScanKernel(ctx, np.int32, "a+b", neutral="0")(i)
    _close(i.get(), np.cumsum(i_h), "inclusive scan")
    f_h = np.ones(n, dtype=np.float32)
    f = cla.to_device(q, f_h)
    ExclusiveScanKernel(ctx, np.float32, "a+b", neutral="0")(f)
    _close(f.get(), np.arange(n, dtype=np.float32), "exclusive scan")
    x_h = rng.integers(0, 1000, n).astype(np.int32)
    x, out = cla.to_device(q, x_h), cla.empty(q, n, np.int32)
    running_max = GenericScanKernel(
        ctx, np.int32, arguments="__global const int *x, __global int *out",
        input_expr="x[i]", scan_expr="max(a, b)", neutral="0",
        output_statement="out[i] = item;")
    running_max(x, out)
    _close(out.get(), np.maximum.accumulate(x_h), "generic scan")
    q.finish()
    seconds = time.perf_counter() - start
    _report(seconds, T_BEGIN)


if __name__ == "__main__":
    main()
