"""A program served by kdb is a pyopencl.Program in every observable way.

pyopencl's public Program API is run on the same source through ``install()`` (a program
compiled here, and one loaded from stored binaries) and through plain pyopencl, and every
answer is compared. Code that checks types, reads ``prg.source`` or compares kernels'
programs must not be able to tell them apart.
"""

from __future__ import annotations

import pytest

from kdb import KernelDB

cl = pytest.importorskip("pyopencl")

SOURCE = """#define N 4
__kernel void twice(__global float *a) { a[get_global_id(0)] *= 2; }
__kernel void fill(__global int *b) { b[get_global_id(0)] = N; }
"""


def _answers(prg, dev) -> dict:
    """Every program and build info, made comparable across two programs."""
    out: dict = {}
    for name in dir(cl.program_info):
        if name.startswith("_") or name == "to_string":
            continue
        try:
            value = prg.get_info(getattr(cl.program_info, name))
        except cl.Error as err:
            value = ("error", err.code)
        if name == "BINARIES":
            value = [bool(b) for b in value]
        elif name == "BINARY_SIZES":
            value = [s > 0 for s in value]
        elif name == "DEVICES":
            value = [d.int_ptr for d in value]
        elif name == "CONTEXT":
            value = value.int_ptr
        elif name == "REFERENCE_COUNT":
            continue  # how many handles the caller keeps, not the program
        out[name] = value
    for name in dir(cl.program_build_info):
        if name.startswith("_") or name == "to_string":
            continue
        try:
            out["build." + name] = prg.get_build_info(dev, getattr(cl.program_build_info, name))
        except cl.Error as err:
            out["build." + name] = ("error", err.code)
    out["source"] = prg.source
    out["kernel_names"] = prg.kernel_names
    out["all_kernels"] = sorted(k.function_name for k in prg.all_kernels())
    return out


@pytest.fixture
def served(cl_ctx, cache_dir):
    """Programs through install(): compiled here, and loaded from the stored binaries."""
    import kdb.opencl

    db = KernelDB()
    kdb.opencl.install(db)
    try:
        compiled = cl.Program(cl_ctx, SOURCE).build()
        db.flush()  # stored now (KDB_STORE_AT_EXIT=wait in the tests)
        other = cl.Context(cl_ctx.devices)  # not the memory tier: the user file answers
        loaded = cl.Program(other, SOURCE).build()
        yield compiled, loaded, other
    finally:
        kdb.opencl.uninstall()


def test_a_program_loaded_from_the_store_answers_as_pyopencl_does(served):
    import kdb.opencl

    _, loaded, ctx = served
    assert kdb.opencl.installed()
    dev = ctx.devices[0]
    assert type(loaded._get_prg()).__name__ == "_StoredProgram"  # really loaded
    kdb.opencl.uninstall()
    plain = cl.Program(ctx, SOURCE).build()
    assert _answers(loaded, dev) == _answers(plain, dev)


def test_the_program_is_a_plain_pyopencl_program(served):
    for prg in served[:2]:
        assert type(prg) is cl.Program
        again = cl.Program.from_int_ptr(prg.int_ptr)
        assert again == prg and type(again) is type(prg)
        assert prg.twice.program == prg
        assert prg.source == SOURCE
        assert prg.get_info(cl.program_info.SOURCE) == SOURCE


def test_its_kernels_run(served, cl_ctx):
    import numpy as np

    _, loaded, ctx = served
    q = cl.CommandQueue(ctx)
    a = np.arange(8, dtype=np.float32)
    buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)
    knl = cl.Kernel(loaded, "twice")
    knl(q, a.shape, None, buf)
    out = np.empty_like(a)
    cl.enqueue_copy(q, out, buf)
    assert (out == 2 * a).all()


def test_a_failed_build_raises_pyopencl_s_error_with_its_log(served, cl_ctx):
    with pytest.raises(cl.RuntimeError) as info:
        cl.Program(cl_ctx, "__kernel void broken( { }").build()
    assert "build program failure" in str(info.value).lower() or "BUILD_PROGRAM" in str(
        info.value)
