"""Loading HIP code objects on an AMD GPU: ctypes on ``libamdhip64``, no other package.

:func:`probe` asks a child process whether a device exists (a HIP runtime may abort the
process that initialises it on a machine it does not like); :class:`Runtime` loads the
library in this process to load, launch and copy. :func:`load_module` is kdb's side: the code
object from :func:`kdb.hip.compile` for the device's target, and one the runtime refuses is
dropped from the user tier and built again, once. Nothing here is imported by ``kdb.hip``.
"""

from __future__ import annotations

import ctypes
import os
import re
from typing import Any, Iterable, Sequence

from ... import logs
from ...errors import BackendUnavailableError
from . import hiprtc

log = logs.get("kdb")

NO_GPU = "no AMD GPU here"
#: hipDeviceProp_t's layout changes between ROCm releases (and hipGetDeviceProperties with it):
#: a buffer larger than any, searched for the gcnArchName string, reads every one.
_PROPS_BYTES = 8192
_ARCH_RE = re.compile(rb"(gfx[0-9a-f]{3,4}(?::[a-z]+[+-])*)\x00")
_HIP_MEMCPY_H2D, _HIP_MEMCPY_D2H = 1, 2
#: hipModuleLoadData's answers that refuse the code object itself (hip_runtime_api.h):
#: InvalidImage, NoBinaryForGpu, InvalidKernelFile, InvalidSource, SharedObjectInitFailed.
#: Any other (no device, out of memory) says nothing about the stored entry.
REFUSED = frozenset({200, 209, 218, 300, 303})

_PROBE = r"""
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
lib.hipGetErrorString.restype = ctypes.c_char_p
n, v = ctypes.c_int(0), ctypes.c_int(0)
s = lib.hipGetDeviceCount(ctypes.byref(n))
lib.hipRuntimeGetVersion(ctypes.byref(v))
print(json.dumps({"status": s, "error": lib.hipGetErrorString(s).decode(), "count": n.value,
                  "runtime": v.value}))
"""


def probe(path: str | None = None) -> dict[str, Any]:
    """What the HIP runtime says in a child process: ``count`` devices, ``status`` and
    ``error`` of ``hipGetDeviceCount`` (``hipErrorNoDevice`` without a GPU), ``runtime``
    version, ``kfd`` (whether ``/dev/kfd`` exists); a missing library raises."""
    import json
    import subprocess
    import sys

    lib = _library(path)
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE, lib], capture_output=True,
                              text=True, timeout=120)
        got = json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as err:
        said = locals().get("proc")
        tail = said.stderr.strip()[-400:] if said is not None else ""
        raise BackendUnavailableError(
            f"the HIP runtime {lib} failed in a child process ({err}) {tail}; check the ROCm "
            f"install ({hiprtc.INSTALL}) and the GPU's driver (amdgpu, /dev/kfd)") from err
    return {**got, "path": lib, "kfd": os.path.exists("/dev/kfd")}


def _library(path: str | None) -> str:
    """The ``libamdhip64`` to load (HIPRTC's: HIPRTC lives in the runtime), or what to
    install. ``KDB_HIPRTC`` chooses the compiler, not the runtime (ROCm 6's HIPRTC is a
    library of its own, ``libhiprtc.so``, with no runtime in it)."""
    try:
        return hiprtc.find_hiprtc(path, variable=False)
    except BackendUnavailableError as err:
        raise BackendUnavailableError(f"no HIP runtime to load code objects with: {err}") \
            from err


def require_device(path: str | None = None) -> dict[str, Any]:
    """:func:`probe`'s answer when it found a device, else a BackendUnavailableError that
    says why (no ``/dev/kfd``, the runtime's error)."""
    got = probe(path)
    if got["count"] > 0 and got["status"] == 0:
        return got
    kfd = "" if got["kfd"] else "no /dev/kfd (the amdgpu driver's compute device); "
    raise BackendUnavailableError(
        f"{NO_GPU}: {kfd}hipGetDeviceCount says {got['error']} ({got['count']} devices). "
        "Loading needs an AMD GPU and its driver; kdb.hip.compile works without one")


class Runtime:
    """``libamdhip64`` in this process: device 0's target, modules, memory and launches."""

    def __init__(self, path: str | None = None) -> None:
        self.path = _library(path)
        self.lib = ctypes.CDLL(self.path)
        self.lib.hipGetErrorString.restype = ctypes.c_char_p

    def check(self, status: int, what: str) -> None:
        """A HIP call's status as a kdb error naming the call and HIP's error."""
        if status != 0:
            said = self.lib.hipGetErrorString(status).decode("utf-8", "replace")
            err = BackendUnavailableError(f"{what} failed: {said} ({status})")
            err.hip_status = status  # type: ignore[attr-defined]
            raise err

    def arch(self, device: int = 0) -> str:
        """The device's target ID as the runtime names it, e.g. ``gfx90a:sramecc+:xnack-``."""
        props = ctypes.create_string_buffer(_PROPS_BYTES)
        self.check(self.lib.hipGetDeviceProperties(props, device), "hipGetDeviceProperties")
        m = _ARCH_RE.search(props.raw)
        if m is None:
            raise BackendUnavailableError(f"device {device} reports no gcnArchName; check the "
                                          "ROCm install")
        return m.group(1).decode()

    def load(self, code_object: bytes) -> ctypes.c_void_p:
        """``hipModuleLoadData``: the module, or a BackendUnavailableError the caller may
        take as a refusal of this code object."""
        module = ctypes.c_void_p()
        self.check(self.lib.hipModuleLoadData(ctypes.byref(module), code_object),
                   "hipModuleLoadData")
        return module

    def function(self, module: ctypes.c_void_p, name: str) -> ctypes.c_void_p:
        fn = ctypes.c_void_p()
        self.check(self.lib.hipModuleGetFunction(ctypes.byref(fn), module, name.encode()),
                   f"hipModuleGetFunction({name!r})")
        return fn

    def to_device(self, data: bytes) -> ctypes.c_void_p:
        ptr = ctypes.c_void_p()
        self.check(self.lib.hipMalloc(ctypes.byref(ptr), ctypes.c_size_t(len(data))),
                   "hipMalloc")
        self.check(self.lib.hipMemcpy(ptr, data, ctypes.c_size_t(len(data)), _HIP_MEMCPY_H2D),
                   "hipMemcpy to the device")
        return ptr

    def from_device(self, ptr: ctypes.c_void_p, size: int) -> bytes:
        out = ctypes.create_string_buffer(size)
        self.check(self.lib.hipMemcpy(out, ptr, ctypes.c_size_t(size), _HIP_MEMCPY_D2H),
                   "hipMemcpy from the device")
        return out.raw

    def free(self, ptr: ctypes.c_void_p) -> None:
        self.check(self.lib.hipFree(ptr), "hipFree")

    def launch(self, fn: ctypes.c_void_p, grid: Sequence[int], block: Sequence[int],
               args: Iterable[Any], shared: int = 0) -> None:
        """``hipModuleLaunchKernel`` with ``args`` as ctypes values (a pointer is a
        ``c_void_p``), then ``hipDeviceSynchronize``."""
        values = list(args)
        params = (ctypes.c_void_p * len(values))(
            *(ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values))
        g, b = (*grid, 1, 1)[:3], (*block, 1, 1)[:3]
        self.check(self.lib.hipModuleLaunchKernel(fn, *map(ctypes.c_uint, (*g, *b)),
                                                  ctypes.c_uint(shared), None, params, None),
                   "hipModuleLaunchKernel")
        self.check(self.lib.hipDeviceSynchronize(), "hipDeviceSynchronize")


def load_module(runtime: Runtime, source: str | bytes, options: Sequence[str] = (),
                db: Any = None, arch: str | None = None, **compile_kw: Any) -> ctypes.c_void_p:
    """``source`` built by :func:`kdb.hip.compile` for the device's target and loaded; a code
    object the runtime refuses is dropped from the user tier and compiled again, once (with
    no compiler here, the refusal is raised)."""
    from ...db import default_db
    from .builds import _compile_and_store, compile as hip_compile
    from .keys import request

    db = db or default_db()
    target = arch or runtime.arch()
    co = hip_compile(source, target, options, db=db, **compile_kw)
    try:
        return runtime.load(co)
    except BackendUnavailableError as err:
        if getattr(err, "hip_status", None) not in REFUSED:
            raise
        req = request(source, target, options, compile_kw.get("include_dirs"),
                      hipcc=compile_kw.get("hipcc"), memo_dir=db.cache_root,
                      name=compile_kw.get("name"), compiler=compile_kw.get("compiler"))
        db.tiers.storing.discard(req.attrs, f"the HIP runtime refused the code object ({err})")
        if req.tool is None:
            raise
        log.warning("kdb: the HIP runtime refused the code object of %s for %s (%s): "
                    "compiled again", req.attrs.name, target, err)
        return runtime.load(_compile_and_store(db, req))
