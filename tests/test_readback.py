"""A program stored by the process that built it, while its kernels run: PoCL before 6.0
aborts a process that reads a program's binaries while a kernel with a fixed work-group
size runs (kdb.backends.opencl.readback), so such a program is read by a helper process."""

from __future__ import annotations

import json

import pytest

from conftest import stored_entries

pytest.importorskip("pyopencl")

#: Builds three programs whose kernels have a fixed work-group size, and for each, stores
#: it (flush, in a thread) while launches of it run; then the results, and compiles.
_LAUNCH_WHILE_STORING = r'''
import json, threading, time
import numpy as np, pyopencl as cl
import kdb, kdb.bookkeeping, kdb.opencl
plat = [p for p in cl.get_platforms() if "Portable Computing Language" in p.name][0]
ctx = cl.Context(plat.get_devices()[:1]); q = cl.CommandQueue(ctx)
results = []
for v in range(3):
    src = ("__kernel __attribute__((reqd_work_group_size(16, 1, 1)))\n"
           "void spin(__global float *a, int n) { float x = a[get_global_id(0)];\n"
           "  for (int i = 0; i < n; i++) x = x * 0.5f + %d.0f;\n"
           "  a[get_global_id(0)] = x; }\n" % (v + 1))
    prg = kdb.opencl.build(ctx, src, [], name="spin%d" % v)
    k = cl.Kernel(prg, "spin")
    a = np.zeros(4096, np.float32)
    buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)
    k.set_args(buf, np.int32(20000))
    stored = threading.Event()
    t = threading.Thread(target=lambda: (time.sleep(0.3), kdb.default_db().flush(),
                                         stored.set()))
    t.start()
    launches = 0
    while not stored.is_set() or launches < 4:
        cl.enqueue_nd_range_kernel(q, k, (4096,), (16,)); launches += 1
        if launches % 4 == 0: q.finish()
    t.join()
    cl.enqueue_copy(q, a, buf); q.finish()
    results.append(float(a[0]))
print(json.dumps({"results": results, "compiles": len(kdb.bookkeeping.records())}))
'''


def test_storing_while_its_fixed_size_kernels_run_does_not_abort_the_process(cache_dir,
                                                                              run_py):
    env = {"KDB_CACHE_DIR": str(cache_dir), "KDB_STORE_AT_EXIT": "wait"}
    first = json.loads(run_py(_LAUNCH_WHILE_STORING, env=env).stdout.splitlines()[-1])
    assert first["compiles"] == 3
    assert first["results"] == [2.0, 4.0, 6.0]  # x = x/2 + v converges to 2v
    assert stored_entries(cache_dir) == 3
    again = json.loads(run_py(_LAUNCH_WHILE_STORING, env=env).stdout.splitlines()[-1])
    assert again == {"results": [2.0, 4.0, 6.0], "compiles": 0}  # the helper's binaries


def test_which_programs_are_read_elsewhere(cl_ctx, monkeypatch):
    import pyopencl as cl

    from kdb.backends.opencl import readback

    devs = cl_ctx.devices[:1]
    fixed = cl._Program(cl_ctx, b"__kernel __attribute__((reqd_work_group_size(8, 1, 1)))"
                                b" void k(__global int *a) { a[0] = 1; }")
    fixed.build(b"", devs)
    free = cl._Program(cl_ctx, b"__kernel void k(__global int *a) { a[0] = 1; }")
    free.build(b"", devs)
    before_fix = readback._pocl_before_fix(devs[0].platform.version)
    assert readback.at_risk(fixed, devs) is before_fix
    assert readback.at_risk(free, devs) is False
    monkeypatch.setenv("POCL_BINARY_SPECIALIZE_WG", "0-0-0-goffs0")
    assert readback.at_risk(free, devs) is before_fix


@pytest.mark.parametrize("version, before", [
    ("OpenCL 3.0 PoCL 3.1+debian  Linux, None+Asserts, RELOC", True),
    ("OpenCL 3.0 PoCL 3.0-rc2  Linux, Release", True),
    ("OpenCL 3.0 PoCL 5.0+debian  Linux", True),
    ("OpenCL 3.0 PoCL 6.0  Linux, Release", False),
    ("OpenCL 3.0 PoCL 7.1-pre main-0-g1234", False),
    ("OpenCL 3.0 LINUX", False),  # not PoCL
])
def test_the_pocl_versions_that_abort(version, before):
    from kdb.backends.opencl import readback

    assert readback._pocl_before_fix(version) is before


def test_a_helper_that_cannot_build_says_why(cl_ctx):
    import pyopencl as cl

    from kdb.backends.opencl import readback
    from kdb.backends.opencl.stores import program_spec

    devs = cl_ctx.devices[:1]
    spec = program_spec("__kernel void k(__global int *a) { a[0] = ; }", b"", devs)
    ptrs = spec.pop("ptrs")
    with pytest.raises(readback.HelperError, match="could not read the binaries: .*Build"):
        readback.read_elsewhere(spec, ptrs)
    good = program_spec("__kernel void k(__global int *a) { a[0] = 1; }", b"", devs)
    got = readback.read_elsewhere(good, good.pop("ptrs"))  # the same helper answers on
    assert list(got) == [devs[0].int_ptr] and got[devs[0].int_ptr]
    assert isinstance(devs[0], cl.Device)
