"""kdb.backends.hip.loading: HIP code objects loaded and launched through ctypes on
libamdhip64. Launching needs an AMD GPU (none here: those tests skip, saying so); what a
machine without one must do (say so clearly, drop only what the runtime refuses) runs here.
"""

from __future__ import annotations

import ctypes
import json
import logging
import struct

import pytest

import kdb
import kdb.hip
from kdb import BackendUnavailableError
from kdb.backends.hip import hiprtc as hip_hiprtc
from kdb.backends.hip import loading


def _runtime_found() -> str | None:
    try:
        return hip_hiprtc.find_hiprtc()
    except BackendUnavailableError:
        return None


LIB = _runtime_found()
needs_runtime = pytest.mark.skipif(
    LIB is None, reason="no HIP runtime (apt-get install libamdhip64-5)")


def _device() -> dict | None:
    if LIB is None:
        return None
    got = loading.probe()
    return got if got["count"] > 0 and got["status"] == 0 else None


DEVICE = _device()
needs_gpu = pytest.mark.skipif(DEVICE is None, reason="no AMD GPU here")
no_gpu_here = pytest.mark.skipif(LIB is None or DEVICE is not None,
                                 reason="needs the HIP runtime and no AMD GPU")

SAXPY = ('#include <hip/hip_runtime.h>\n'
         'extern "C" __global__ void saxpy(float *y, const float *x, float a, int n) {\n'
         '  int i = blockIdx.x * blockDim.x + threadIdx.x;\n'
         '  if (i < n) y[i] += a * x[i];\n'
         '}\n')


@no_gpu_here
def test_without_a_gpu_the_runtime_says_no_device_and_kdb_says_what_loading_needs():
    got = loading.probe()  # in a child process: a HIP runtime may abort the one it runs in
    assert got["count"] == 0 and got["status"] != 0 and got["error"].startswith("hipError")
    with pytest.raises(BackendUnavailableError, match="no AMD GPU here") as err:
        loading.require_device()
    assert got["error"] in str(err.value) and "kdb.hip.compile works without one" in str(err.value)


@no_gpu_here
def test_without_a_gpu_a_load_is_a_kdb_error_not_a_crash(run_py, tmp_path):
    code = f"""
        import json, kdb, kdb.hip
        from kdb.backends.hip import loading
        co = kdb.hip.compile({SAXPY!r}, "gfx90a")
        try:
            loading.Runtime().load(co)
        except kdb.BackendUnavailableError as err:
            print(json.dumps({{"error": str(err), "status": err.hip_status}}))
    """
    proc = run_py(code, env={"KDB_CACHE_DIR": str(tmp_path / "cache")})
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["error"].startswith("hipModuleLoadData failed: hipError")
    assert got["status"] not in loading.REFUSED  # no device: the entry is not to blame


def test_a_missing_runtime_is_one_error_naming_the_package(tmp_path, monkeypatch):
    monkeypatch.delenv("ROCM_PATH", raising=False)
    monkeypatch.setattr(hip_hiprtc, "_dirs", lambda: [str(tmp_path)])
    with pytest.raises(BackendUnavailableError, match="apt-get install libamdhip64-5"):
        loading.probe()
    with pytest.raises(BackendUnavailableError, match="no HIP runtime"):
        loading.Runtime()


class _Refusing:
    """A runtime whose device is gfx90a and whose first load answers ``status``."""

    def __init__(self, status: int) -> None:
        self.status, self.loaded = status, []

    def arch(self) -> str:
        return "gfx90a"

    def load(self, co: bytes):
        self.loaded.append(co)
        if len(self.loaded) == 1:
            err = BackendUnavailableError(f"hipModuleLoadData failed ({self.status})")
            err.hip_status = self.status  # as Runtime.check sets it
            raise err
        return "module"


@needs_runtime  # HIPRTC, in the runtime, compiles where hipcc is missing
def test_a_code_object_the_runtime_refuses_is_dropped_and_compiled_again(cache_dir, caplog,
                                                                        monkeypatch):
    from kdb.backends.hip import builds

    db = kdb.KernelDB()
    good = kdb.hip.compile(SAXPY, "gfx90a", db=db)
    db.flush()
    built = []
    real = builds._build
    monkeypatch.setattr(builds, "_build", lambda req: built.append(req) or real(req))
    rt = _Refusing(209)  # hipErrorNoBinaryForGpu
    with caplog.at_level(logging.WARNING):
        assert loading.load_module(rt, SAXPY, db=db) == "module"
    assert rt.loaded == [good, good] and len(built) == 1  # the first load was a hit
    assert "dropped: the HIP runtime refused the code object" in caplog.text
    db.flush()
    db.close()


@needs_runtime  # HIPRTC, in the runtime, compiles where hipcc is missing
def test_a_load_that_fails_for_another_reason_drops_nothing(cache_dir):
    db = kdb.KernelDB()
    kdb.hip.compile(SAXPY, "gfx90a", db=db)
    db.flush()
    attrs = kdb.hip.attributes_for(SAXPY, "gfx90a", memo_dir=db.cache_root)
    with pytest.raises(BackendUnavailableError, match="101"):
        loading.load_module(_Refusing(101), SAXPY, db=db)  # hipErrorInvalidDevice
    db.flush()
    assert db.lookup(attrs) is not None
    db.close()


@needs_gpu
def test_saxpy_compiled_by_kdb_runs_on_the_amd_gpu(cache_dir):
    rt = loading.Runtime()
    module = loading.load_module(rt, SAXPY)
    fn = rt.function(module, "saxpy")
    n = 1000
    x = struct.pack(f"{n}f", *range(n))
    y = struct.pack(f"{n}f", *([1.0] * n))
    dx, dy = rt.to_device(x), rt.to_device(y)
    rt.launch(fn, ((n + 255) // 256,), (256,), [dy, dx, ctypes.c_float(2.0), ctypes.c_int(n)])
    out = struct.unpack(f"{n}f", rt.from_device(dy, 4 * n))
    rt.free(dx)
    rt.free(dy)
    assert out == tuple(1.0 + 2.0 * i for i in range(n))
