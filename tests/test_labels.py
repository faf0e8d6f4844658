"""Kernel names for labels: the OpenCL and CUDA scans find what they found before, and take
time linear in the source on every input (they run on every miss, over the user's source)."""

from __future__ import annotations

import re
import signal
import time
from contextlib import contextmanager

import pytest

from kdb.backends.common import label
from kdb.backends.cuda.keys import _KERNEL_RE as CUDA_RE
from kdb.backends.cuda.keys import kernel_names as cuda_names

pytest.importorskip("pyopencl")
from kdb.backends.opencl.keys import _KERNEL_RE as OPENCL_RE  # noqa: E402
from kdb.backends.opencl.keys import kernel_names as opencl_names  # noqa: E402

MB = 1 << 20


@contextmanager
def _limit(seconds: float):
    """Stop a runaway scan (the regex engine checks signals) and report its CPU time."""
    def stop(*_):
        raise TimeoutError(f"the scan ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("source, names", [
    ("__kernel void add(int a) {} kernel void mul() {}", ["add", "mul"]),
    ("__kernel __attribute__((reqd_work_group_size(16, 1, 1))) void wg(int a) {}", ["wg"]),
    ("kernel __attribute__((reqd_work_group_size(WG(1), 1, 1)))\n"
     "  __attribute__ ((vec_type_hint(float4)))void two(int a) {}", ["two"]),
    ("__kernel __attribute__((a)) __attribute__((b(c))) void three() {}", ["three"]),
    ("__kernel __attribute__((x) void broken() {} __kernel void after() {}", ["after"]),
    ("my_kernel void no() {} __kernel int nor() {}", []),
])
def test_opencl_kernel_names(source, names):
    assert opencl_names(source) == names


@pytest.mark.parametrize("source, names", [
    ("__global__ void add(float *a) {} __global__ void mul() {}", ["add", "mul"]),
    ("__global__ __launch_bounds__(256, 2) void lb(float *a) {}", ["lb"]),
    ("__global__ __launch_bounds__(BLOCK(2), 4) void nested(float *a) {}", ["nested"]),
    ("__global__ __launch_bounds__(256 void open() {} __global__ void after() {}", ["after"]),
])
def test_cuda_kernel_names(source, names):
    assert cuda_names(source) == names


def _adversarial_opencl() -> dict[str, str]:
    group = "__attribute__((x(y))) "
    return {
        "200 attribute groups, no void": "__kernel " + "__attribute__((x)) " * 200 + "int f() {}",
        "1 MB of such kernels": ("__kernel " + group * 200 + "int f() {}\n") * (MB // 4400),
        "1 MB of unclosed attributes": "kernel __attribute__((" * (MB // 22),
        "1 MB of nested groups in one attribute": "kernel __attribute__((a" + "(b)" * (MB // 3),
        "1 MB of two-deep groups": "kernel __attribute__((a" + "(b(c)d)" * (MB // 7),
        "1 MB of blanks after kernel": "kernel " + " " * MB,
        "1 MB of one-group kernels": "kernel __attribute__((a)) " * (MB // 26),
        "1 MB inside one attribute": "kernel __attribute__((" + "a" * MB,
    }


def _adversarial_cuda() -> dict[str, str]:
    return {
        "1 MB of unclosed launch bounds": "__global__ __launch_bounds__(" * (MB // 29),
        "1 MB of nested groups": "__global__ __launch_bounds__(a" + "(b)" * (MB // 3),
        "1 MB of blanks": "__global__ " + " " * MB,
    }


@pytest.mark.parametrize("rx, case, source",
                         [pytest.param(OPENCL_RE, k, v, id=f"opencl: {k}")
                          for k, v in _adversarial_opencl().items()]
                         + [pytest.param(CUDA_RE, k, v, id=f"cuda: {k}")
                            for k, v in _adversarial_cuda().items()])
def test_kernel_scan_is_linear_in_the_source(rx, case, source):
    """Each such source is scanned (and labelled) in well under a second of CPU time. The
    OpenCL scan took 3 s for 24 attribute groups (x4 per two more); CUDA's rescanned the
    rest of the source from each unclosed ``__launch_bounds__(`` (20 s for 232 KB)."""
    with _limit(10):
        start = time.process_time()
        rx.findall(source)
        label(rx, source, "program")
        spent = time.process_time() - start
    assert spent < 0.6, (case, spent)


def test_label_names_the_first_four_and_stops_scanning():
    rx = re.compile(r"void (\w+)")
    assert label(rx, "void a() void b() void c() void d() void e() void f()", "p") \
        == "a,b,c,d,..."
    assert label(rx, "void a() void b()", "p") == "a,b"
    assert label(rx, "nothing", "p") == "p"
