"""One process of the ``suite`` scenario: unmodified pyopencl client code, like one file of
a framework's test suite. ``python _suite_workload.py PART SCALE`` runs part ``array``
(pyopencl.array arithmetic and math over several dtypes, reductions) or ``kernels``
(hand-written kernels that ``#include`` headers, ElementwiseKernel, scans); every program
is launched and its result checked against numpy. Scale 0 is a small suite for the
``--quick`` runs of the scenarios that run it many times (about 15 programs).

With ``KDB_SUITE=1`` the process routes its builds through kdb the way a user who cannot
change the code would: ``kdb.opencl.install()`` before the workload runs. The code below
never mentions kdb. It prints one ``BENCH-JSON:`` line: programs built, compiles kdb
performed, seconds.

With ``SUITE_RESIZE=1`` (the ``fresh`` scenario) the part runs again at two other sizes, its
programs launched with other global and local sizes, as a suite's later tests reuse them;
with kdb, the process first waits until the store worker has stored what it built (a long
suite on a quiet machine, whose stores land before its later tests launch).
"""

import time

T_BEGIN = time.perf_counter()

import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import numpy as np  # noqa: E402
import pyopencl as cl  # noqa: E402

if os.environ.get("KDB_SUITE") == "1":
    import kdb.opencl

    kdb.opencl.install()

import pyopencl.array as cla  # noqa: E402
import pyopencl.clmath as clmath  # noqa: E402
from pyopencl.elementwise import ElementwiseKernel  # noqa: E402
from pyopencl.reduction import ReductionKernel  # noqa: E402
from pyopencl.scan import ExclusiveScanKernel, InclusiveScanKernel  # noqa: E402

from _counting import report as _report  # noqa: E402 - counts what the client asks for


def _queue() -> cl.CommandQueue:
    """On the first PoCL, or the first platform ``KDB_BENCH_PLATFORM`` names."""
    want = os.environ.get("KDB_BENCH_PLATFORM", "Portable Computing Language")
    for plat in cl.get_platforms():
        if want in plat.name:
            # Held here: Intel's runtime lets a context go with its last Context object, and
            # the queue's context then answers INVALID_CONTEXT (PoCL's queue keeps it).
            _CONTEXTS.append(cl.Context(plat.get_devices()[:1]))
            return cl.CommandQueue(_CONTEXTS[-1])
    raise SystemExit(f"no {want} platform")


_CONTEXTS: list = []


def _close(got, want, what: str) -> None:
    if not np.allclose(got, want, rtol=1e-4, atol=1e-4, equal_nan=True):
        raise AssertionError(f"{what}: wrong result")


def _small_array(q: cl.CommandQueue, f: float = 1.0) -> None:
    """Scale 0, the ``--quick`` runs of the scenarios that run the suite many times over
    (``busy``, ``batch``): a few of part ``array``'s programs of each kind, float32 only."""
    rng = np.random.default_rng(0)
    n = max(1, int(1000 * f))
    a_h, b_h = (rng.random(n) * 10 + 1).astype(np.float32), (rng.random(n) * 10 + 1).astype(
        np.float32)
    a, b = cla.to_device(q, a_h), cla.to_device(q, b_h)
    _close((a + b).get(), a_h + b_h, "add")
    _close((2 * a + 3 * b).get(), 2 * a_h + 3 * b_h, "axpby")
    _close(cla.sum(a).get(), a_h.sum(dtype=np.float64), "sum")
    _close(cla.dot(a, b).get(), np.dot(a_h.astype(np.float64), b_h), "dot")
    _close(clmath.sin(a).get(), np.sin(a_h), "sin")
    k = ReductionKernel(q.context, np.float32, neutral="0", reduce_expr="a+b",
                        map_expr="x[i]*x[i]", arguments="__global const float *x", name="sumsq")
    _close(k(a).get(), (a_h ** 2).sum(), "sumsq")


def part_array(q: cl.CommandQueue, scale: int, f: float = 1.0) -> None:
    if scale < 1:
        return _small_array(q, f)
    rng = np.random.default_rng(0)
    n = max(1, int(1000 * f))
    floats = [np.float32, np.float64][: max(1, min(2, scale))]
    ints = [np.int32, np.int64]
    for dt in floats + ints:
        a_h = (rng.random(n) * 10 + 1).astype(dt)
        b_h = (rng.random(n) * 10 + 1).astype(dt)
        a, b = cla.to_device(q, a_h), cla.to_device(q, b_h)
        _close((a + b).get(), a_h + b_h, "add")
        _close((a - b).get(), a_h - b_h, "sub")
        _close((a * b).get(), a_h * b_h, "mul")
        _close((2 * a + 3 * b).get(), 2 * a_h + 3 * b_h, "axpby")
        _close((a + 5).get(), a_h + 5, "add scalar")
        _close((a * 3).get(), a_h * 3, "mul scalar")
        _close((a > b).get(), a_h > b_h, "compare")
        _close(cla.maximum(a, b).get(), np.maximum(a_h, b_h), "maximum")
        _close(cla.minimum(a, b).get(), np.minimum(a_h, b_h), "minimum")
        _close(cla.if_positive(a - b, a, b).get(), np.where(a_h - b_h > 0, a_h, b_h), "if_positive")
        _close(cla.sum(a).get(), a_h.sum(dtype=np.float64), "sum")
        _close(cla.max(a).get(), a_h.max(), "max")
        _close(cla.min(a).get(), a_h.min(), "min")
        _close(cla.dot(a, b).get(), np.dot(a_h.astype(np.float64), b_h), "dot")
        _close(abs(a).get(), abs(a_h), "abs")
        if dt in floats:
            _close((a / b).get(), a_h / b_h, "div")
            _close((a ** 2).get(), a_h ** 2, "pow")
            _close((-a).get(), -a_h, "neg")
            for name in ("sin", "cos", "tan", "exp", "log", "log10", "sqrt", "tanh", "sinh",
                         "cosh", "atan", "floor", "ceil", "fabs", "exp2", "log2", "cbrt",
                         "erf", "asinh", "expm1", "log1p", "rint", "round", "trunc"):
                want = (np.vectorize(math.erf)(a_h) if name == "erf"
                        else getattr(np, {"fabs": "abs"}.get(name, name))(a_h))
                _close(getattr(clmath, name)(a).get(), want, name)
            _close(clmath.atan2(a, b).get(), np.arctan2(a_h, b_h), "atan2")
            _close(clmath.fmod(a, b).get(), np.fmod(a_h, b_h), "fmod")
        for other in floats:
            if other is not dt:
                o_h = b_h.astype(other)
                _close((a + cla.to_device(q, o_h)).get(), a_h + o_h, "mixed add")
    for i, (name, expr) in enumerate([("sumsq", "x[i]*x[i]"), ("sumabs", "fabs(x[i])"),
                                      ("sumcube", "x[i]*x[i]*x[i]"), ("sumexp", "exp(x[i])"),
                                      ("sumsin", "sin(x[i])"), ("sumlog", "log(x[i])")]
                                     [: 2 * scale]):
        for dt in floats:
            x_h = (rng.random(n) + 1).astype(dt)
            k = ReductionKernel(q.context, dt, neutral="0", reduce_expr="a+b", map_expr=expr,
                                arguments=f"__global const {cl.tools.dtype_to_ctype(dt)} *x",
                                name=name)
            want = {"sumsq": (x_h ** 2).sum(), "sumabs": abs(x_h).sum(),
                    "sumcube": (x_h ** 3).sum(), "sumexp": np.exp(x_h).sum(),
                    "sumsin": np.sin(x_h).sum(), "sumlog": np.log(x_h).sum()}[name]
            _close(k(cla.to_device(q, x_h)).get(), want, name)


HEADER = """
#ifndef SUITE_OPS_H
#define SUITE_OPS_H
#include "suite_consts.h"
inline float suite_f(float x, int i) { return x * SUITE_SCALE + (float)(i % SUITE_MOD); }
#endif
"""
CONSTS = "#define SUITE_SCALE 2.0f\n#define SUITE_MOD 7\n"
KERNEL = """
#include "suite_ops.h"
__kernel void k{i}(__global float *out, __global const float *in) {{
    int i = get_global_id(0);
    float acc = in[i];
    for (int j = 0; j < {loop}; ++j) acc = suite_f(acc, j + {i}) * 0.5f;
    out[i] = acc + {i}.0f;
}}
"""


def part_kernels(q: cl.CommandQueue, scale: int, f: float = 1.0) -> None:
    ctx = q.context
    inc = tempfile.mkdtemp(prefix="suite-inc-")
    with open(os.path.join(inc, "suite_ops.h"), "w") as fh:
        fh.write(HEADER)
    with open(os.path.join(inc, "suite_consts.h"), "w") as fh:
        fh.write(CONSTS)
    n = max(1, int(256 * f))
    x_h = np.linspace(0, 1, n).astype(np.float32)
    x = cla.to_device(q, x_h)
    out = cla.empty_like(x)
    for i in range((4, 40, 130)[min(scale, 2)]):
        loop = 1 + i % 5
        prg = cl.Program(ctx, KERNEL.format(i=i, loop=loop)).build(options=["-I", inc])
        getattr(prg, f"k{i}")(q, (n,), None, out.data, x.data)
        want = x_h.copy()
        for j in range(loop):
            want = (want * 2.0 + (j + i) % 7) * 0.5
        _close(out.get(), want + i, f"k{i}")
    shutil.rmtree(inc, ignore_errors=True)  # as a client's own fixture would
    for i in range(max(2, 12 * scale)):
        k = ElementwiseKernel(ctx, "float *y, const float *x", f"y[i] = x[i] * {i + 1}.5f - {i}",
                              name=f"ew{i}")
        k(out, x)
        _close(out.get(), x_h * (i + 1.5) - i, f"ew{i}")
    a_h = np.arange(1, max(2, int(2000 * f)) + 1, dtype=np.int32)
    scan = InclusiveScanKernel(ctx, np.int32, "a+b", neutral="0")
    a = cla.to_device(q, a_h)
    scan(a)
    _close(a.get(), np.cumsum(a_h), "inclusive scan")
    if scale >= 2:
        m = max(2, int(2000 * f))
        escan = ExclusiveScanKernel(ctx, np.float32, "a+b", neutral="0")
        ones = cla.to_device(q, np.ones(m, dtype=np.float32))
        escan(ones)
        _close(ones.get(), np.arange(m, dtype=np.float32), "exclusive scan")


#: The other sizes of ``SUITE_RESIZE=1``, as fractions of each part's own.
RESIZE = (0.031, 7.3)


def _stores_landed() -> None:
    """With kdb, wait until the store worker has stored every job of this user (a benchmark
    device: see the module's docstring); at once where nothing is queued."""
    if os.environ.get("KDB_SUITE") != "1":
        return
    from kdb import config
    from kdb.storing import spool

    user, deadline = config.user_dir(), time.monotonic() + 900
    while spool.jobs(user) and time.monotonic() < deadline:
        time.sleep(0.1)


def main() -> None:
    part, scale = sys.argv[1], int(sys.argv[2])
    q = _queue()
    start = time.perf_counter()
    run = {"array": part_array, "kernels": part_kernels}[part]
    run(q, scale)
    if os.environ.get("SUITE_RESIZE") == "1":
        _stores_landed()
        for f in RESIZE:
            run(q, scale, f)
    q.finish()
    seconds = time.perf_counter() - start
    _report(seconds, T_BEGIN)


if __name__ == "__main__":
    main()
