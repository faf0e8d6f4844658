"""The OpenCL tests that matter, on every CPU OpenCL implementation installed (issue 37,
point 2): pip's PoCL (where it builds on this CPU), Debian's PoCL, Intel's CPU runtime,
Oclgrind (a simulator whose binaries are LLVM IR), Mesa's Rusticl on llvmpipe (its own
OpenCL C front end; its binaries are SPIR-V, made native when they are loaded).

Each implementation runs alone (an ICD folder naming only it, the platform picked by its
library), through ``kdb.opencl.install()`` with unmodified pyopencl code: programs from
source, one with a header found through ``-I``, ``pyopencl.array`` arithmetic and a
reduction. For each: correct results; a second process compiles nothing; an edited header
recompiles exactly its program and gives the new result; the store worker (the default at
exit) stores what a process compiled; and on PoCL, ``POCL_KERNEL_CACHE=0`` serves the same
entries. An implementation that is absent skips with the reason.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import pytest

from conftest import pip_pocl
from test_opencl_impls import _debian_pocl, _intel_runtime, _oclgrind, _rusticl
from test_spool import wait_for_worker

pytest.importorskip("pyopencl")

#: An unmodified client: builds, launches, checks; prints its compiles and results.
CLIENT = r"""
import json, os, sys
import numpy as np
import pyopencl as cl
import pyopencl.array as cla
import kdb.opencl, kdb.bookkeeping
from kdb.backends.opencl.binaries import library_of
kdb.opencl.install()
want = os.environ["IMPL_LIBRARY"]
plat = [p for p in cl.get_platforms() if want in (library_of(p.int_ptr) or "")][0]
ctx = cl.Context(plat.get_devices()[:1])
q = cl.CommandQueue(ctx)
n = 256
a = np.arange(n, dtype=np.float32)
out = {}
prg = cl.Program(ctx, "__kernel void twice(__global float *x) "
                 "{ x[get_global_id(0)] *= 2.0f; }").build()
buf = cla.to_device(q, a)
prg.twice(q, (n,), None, buf.data)
out["twice"] = bool(np.allclose(buf.get(), 2 * a))
hdr = cl.Program(ctx, '#include "scale.h"\n__kernel void scaled(__global float *x) '
                 "{ x[get_global_id(0)] *= SCALE; }").build(options=["-I", sys.argv[1]])
buf = cla.to_device(q, a)
hdr.scaled(q, (n,), None, buf.data)
out["scale"] = float(buf.get()[1])
y = cla.to_device(q, a)
out["axpb"] = bool(np.allclose((3 * y + 1).get(), 3 * a + 1))
out["sum"] = float(cla.sum(y).get())
out["compiles"] = len(kdb.bookkeeping.records())
out["platform"] = plat.version
print(json.dumps(out))
"""


def _pip_library() -> str:
    works, said = pip_pocl()
    if not works:
        pytest.skip(f"pip's PoCL builds no kernel on this CPU ({said})")
    import pyopencl

    found = glob.glob(os.path.join(os.path.dirname(pyopencl.__file__), ".libs", "libpocl*"))
    if not found:
        pytest.skip("pyopencl brings no PoCL of its own here")
    return found[0]


IMPLS = {"pip-pocl": _pip_library, "debian-pocl": _debian_pocl, "intel": _intel_runtime,
         "oclgrind": _oclgrind, "rusticl": _rusticl}
#: What an implementation needs in its environment to list a CPU device.
IMPL_ENV = {"rusticl": {"RUSTICL_ENABLE": "llvmpipe"}}


@pytest.fixture(params=sorted(IMPLS))
def impl(request, tmp_path) -> dict:
    """One implementation alone: its name, and the environment its processes run in."""
    library = IMPLS[request.param]()
    folder = tmp_path / "icds"
    folder.mkdir()
    if request.param != "pip-pocl":  # pip's is pyopencl's own: listed with no ICD at all
        (folder / "impl.icd").write_text(library + "\n")
    return {"name": request.param, "pocl": "pocl" in request.param,
            "env": {"OCL_ICD_VENDORS": str(folder),
                    "IMPL_LIBRARY": os.path.realpath(library),
                    **IMPL_ENV.get(request.param, {})}}


def _run(run_py, impl: dict, include: Path, cache: Path, **env: str) -> dict:
    code = f"import sys; sys.argv[1:] = [{str(include)!r}]\n" + CLIENT
    got = run_py(code, env={**impl["env"], "KDB_CACHE_DIR": str(cache), **env})
    return json.loads(got.stdout.strip().splitlines()[-1])


def _correct(out: dict, scale: float) -> None:
    assert out["twice"] and out["axpb"], out
    assert out["scale"] == scale, out
    assert out["sum"] == sum(range(256)), out


def test_an_implementation_serves_what_it_compiled_and_recompiles_what_changed(
        run_py, impl, tmp_path):
    include = tmp_path / "include"
    include.mkdir()
    (include / "scale.h").write_text("#define SCALE 5.0f\n")
    cache = tmp_path / "cache"
    first = _run(run_py, impl, include, cache)
    _correct(first, 5.0)
    assert first["compiles"] >= 4, first  # twice, scaled, the array kernels, the reduction
    second = _run(run_py, impl, include, cache)
    _correct(second, 5.0)
    assert second["compiles"] == 0, second
    (include / "scale.h").write_text("#define SCALE 7.0f\n")
    third = _run(run_py, impl, include, cache)
    _correct(third, 7.0)
    assert third["compiles"] == 1, third  # the program that includes it, alone
    if impl["pocl"]:
        uncached = _run(run_py, impl, include, cache, POCL_KERNEL_CACHE="0")
        _correct(uncached, 7.0)
        assert uncached["compiles"] == 0, uncached


def test_an_implementation_s_programs_are_stored_by_the_store_worker(run_py, impl, tmp_path):
    include = tmp_path / "include"
    include.mkdir()
    (include / "scale.h").write_text("#define SCALE 5.0f\n")
    cache = tmp_path / "cache"
    first = _run(run_py, impl, include, cache, KDB_STORE_AT_EXIT="detach")
    _correct(first, 5.0)
    wait_for_worker(cache)
    log = cache / "v1" / "store-worker.log"
    assert not log.exists() or "could not store" not in log.read_text(), log.read_text()
    second = _run(run_py, impl, include, cache, KDB_STORE_AT_EXIT="detach")
    _correct(second, 5.0)
    assert second["compiles"] == 0, second
