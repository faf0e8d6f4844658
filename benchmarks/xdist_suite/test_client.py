"""A client's test file (the ``xdist`` scenario): pyopencl programs the way a framework's
tests build them, through ``pyopencl.array``, ``pyopencl.elementwise``,
``pyopencl.reduction`` and ``pyopencl.scan``, every result checked against numpy. The code
never mentions kdb: ``pytest --kdb`` adopts it. ``XDIST_SCALE=0`` (the benchmarks' --quick)
keeps a few cases of each kind.
"""

import os

import numpy as np
import pyopencl as cl
import pyopencl.array as cla
import pyopencl.clmath as clmath
import pytest
from pyopencl.elementwise import ElementwiseKernel
from pyopencl.reduction import ReductionKernel
from pyopencl.scan import ExclusiveScanKernel, GenericScanKernel, InclusiveScanKernel

FULL = os.environ.get("XDIST_SCALE", "1") != "0"
DTYPES = [np.float32, np.float64] if FULL else [np.float32]
OPS = ["add", "mul", "axpby", "div", "sin", "exp", "sqrt", "maximum"][: 8 if FULL else 3]
REDUCE = ["sum", "max", "dot", "sumsq", "sumabs"][: 5 if FULL else 2]
N = 1000


@pytest.fixture(scope="session")
def queue():
    for plat in cl.get_platforms():
        if "Portable Computing Language" in plat.name:
            return cl.CommandQueue(cl.Context(plat.get_devices()[:1]))
    pytest.skip("no PoCL platform")


def _data(dtype, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.random(N) * 10 + 1).astype(dtype), (rng.random(N) * 10 + 1).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_array_elementwise(queue, op, dtype):
    a_h, b_h = _data(dtype)
    a, b = cla.to_device(queue, a_h), cla.to_device(queue, b_h)
    got, want = {
        "add": (lambda: a + b, lambda: a_h + b_h),
        "mul": (lambda: a * b, lambda: a_h * b_h),
        "axpby": (lambda: 2 * a + 3 * b, lambda: 2 * a_h + 3 * b_h),
        "div": (lambda: a / b, lambda: a_h / b_h),
        "sin": (lambda: clmath.sin(a), lambda: np.sin(a_h)),
        "exp": (lambda: clmath.exp(a / 10), lambda: np.exp(a_h / 10)),
        "sqrt": (lambda: clmath.sqrt(a), lambda: np.sqrt(a_h)),
        "maximum": (lambda: cla.maximum(a, b), lambda: np.maximum(a_h, b_h)),
    }[op]
    np.testing.assert_allclose(got().get(), want(), rtol=1e-4)


@pytest.mark.parametrize("i", range(6 if FULL else 2))
def test_elementwise_kernel(queue, i):
    x_h = np.linspace(0, 1, N).astype(np.float32)
    x, y = cla.to_device(queue, x_h), cla.empty(queue, N, np.float32)
    k = ElementwiseKernel(queue.context, "float *y, const float *x",
                          f"y[i] = x[i] * {i + 1}.5f - {i}", name=f"client_ew{i}")
    k(y, x)
    np.testing.assert_allclose(y.get(), x_h * (i + 1.5) - i, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("what", REDUCE)
def test_reduction(queue, what, dtype):
    a_h, b_h = _data(dtype, 1)
    a, b = cla.to_device(queue, a_h), cla.to_device(queue, b_h)
    if what in ("sum", "max", "dot"):
        got = {"sum": cla.sum(a), "max": cla.max(a), "dot": cla.dot(a, b)}[what].get()
        want = {"sum": a_h.sum(dtype=np.float64), "max": a_h.max(),
                "dot": np.dot(a_h.astype(np.float64), b_h)}[what]
    else:
        ctype = cl.tools.dtype_to_ctype(dtype)
        expr = {"sumsq": "x[i]*x[i]", "sumabs": "fabs(x[i])"}[what]
        k = ReductionKernel(queue.context, dtype, neutral="0", reduce_expr="a+b",
                            map_expr=expr, arguments=f"__global const {ctype} *x", name=what)
        got = k(a).get()
        want = (a_h.astype(np.float64) ** 2).sum() if what == "sumsq" else abs(a_h).sum()
    np.testing.assert_allclose(got, want, rtol=1e-4)


@pytest.mark.parametrize("kind", ["inclusive", "exclusive", "generic"][: 3 if FULL else 1])
def test_scan(queue, kind):
    a_h = np.arange(1, 2001, dtype=np.int32)
    a = cla.to_device(queue, a_h)
    if kind == "inclusive":
        InclusiveScanKernel(queue.context, np.int32, "a+b", neutral="0")(a)
        want = np.cumsum(a_h)
    elif kind == "exclusive":
        ExclusiveScanKernel(queue.context, np.int32, "a+b", neutral="0")(a)
        want = np.cumsum(a_h) - a_h
    else:  # a running maximum written through GenericScanKernel's output statement
        out = cla.empty_like(a)
        GenericScanKernel(queue.context, np.int32, arguments="__global int *x, __global int *y",
                          input_expr="x[i]", scan_expr="max(a, b)", neutral="0",
                          output_statement="y[i] = item;")(a, out)
        a, want = out, np.maximum.accumulate(a_h)
    np.testing.assert_array_equal(a.get(), want)
