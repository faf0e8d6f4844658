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


def _adversarial_opencl() -> dict[str, object]:
    """Sources of about ``size`` bytes, built to make a backtracking scan blow up."""
    group = "__attribute__((x(y))) "
    return {
        "attribute groups, no void":
            lambda size: "__kernel " + "__attribute__((x)) " * (size // 19) + "int f() {}",
        "such kernels": lambda size: ("__kernel " + group * 200 + "int f() {}\n") * (size // 4400),
        "unclosed attributes": lambda size: "kernel __attribute__((" * (size // 22),
        "nested groups in one attribute": lambda size: "kernel __attribute__((a" + "(b)" * (size // 3),
        "two-deep groups": lambda size: "kernel __attribute__((a" + "(b(c)d)" * (size // 7),
        "blanks after kernel": lambda size: "kernel " + " " * size,
        "one-group kernels": lambda size: "kernel __attribute__((a)) " * (size // 26),
        "inside one attribute": lambda size: "kernel __attribute__((" + "a" * size,
    }


def _adversarial_cuda() -> dict[str, object]:
    return {
        "unclosed launch bounds": lambda size: "__global__ __launch_bounds__(" * (size // 29),
        "nested groups": lambda size: "__global__ __launch_bounds__(a" + "(b)" * (size // 3),
        "blanks": lambda size: "__global__ " + " " * size,
    }


def _scan_cpu_time(rx, source: str, runs: int = 2) -> float:
    """The least CPU time of ``runs`` scans (and labels) of ``source``: the least is the one
    other work on the machine disturbed least."""
    spent = []
    for _ in range(runs):
        with _limit(10):
            start = time.process_time()
            rx.findall(source)
            label(rx, source, "program")
            spent.append(time.process_time() - start)
    return min(spent)


@pytest.mark.parametrize("rx, case, make",
                         [pytest.param(OPENCL_RE, k, v, id=f"opencl: {k}")
                          for k, v in _adversarial_opencl().items()]
                         + [pytest.param(CUDA_RE, k, v, id=f"cuda: {k}")
                            for k, v in _adversarial_cuda().items()])
def test_kernel_scan_is_linear_in_the_source(rx, case, make):
    """Four times the source costs about four times the scan, not 16 (quadratic) or more,
    and each scan finishes within the 10 s guard. Both sizes are past the step a scan's
    backtracking stack takes when it outgrows the CPU's cache (0.01 s at 512 KB, 0.09 s at
    1 MB for CUDA's nested groups, then linear). The OpenCL scan once took 3 s for 24 attribute
    groups (x4 per two more); CUDA's rescanned the rest of the source from each unclosed
    ``__launch_bounds__(`` (20 s for 232 KB). The figure is a ratio of CPU times, so a busy
    machine (CI's may be) slows both sides alike."""
    small = _scan_cpu_time(rx, make(MB), runs=3)
    large = _scan_cpu_time(rx, make(4 * MB))
    assert large < 10 * small + 0.02, (case, small, large)


def test_label_names_the_first_four_and_stops_scanning():
    rx = re.compile(r"void (\w+)")
    assert label(rx, "void a() void b() void c() void d() void e() void f()", "p") \
        == "a,b,c,d,..."
    assert label(rx, "void a() void b()", "p") == "a,b"
    assert label(rx, "nothing", "p") == "p"
