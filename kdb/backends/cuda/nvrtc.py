"""NVRTC, CUDA's runtime compiler library: cubins and PTX for any ``sm_XX`` with no toolkit.

NVIDIA publishes NVRTC on PyPI (``nvidia-cuda-nvrtc``: ``libnvrtc.so`` and the
``libnvrtc-builtins.so`` it loads), so ``pip install 'kdb[cuda]'`` gives a machine that has
only the driver, or nothing at all, a CUDA compiler. kdb calls its C API through
:mod:`ctypes`: the library kdb identifies is the very file it loads, and a lookup imports
nothing (``cuda-bindings`` would load its own copy, found by its own rules).

The compiler enters the key by content: NVRTC's version and the GNU build ID (else sha256)
of both libraries, worked out once per machine (``<cache root>/nvrtc.json``, per path, size
and mtime) and once per process. Paths never enter the key: the wheel's files are the same
bytes on every machine, so a system database built with them hits everywhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ... import config
from ..digests import file_stamp, library_id, machine_memo, stamps_hold
from ...errors import BackendUnavailableError, CompileError

#: Where the ``nvidia-cuda-nvrtc`` wheels put the library, under the ``nvidia`` package:
#: 13.x in ``cu13/lib``, 12.x in ``cuda_nvrtc/lib``.
_WHEEL_DIRS = ("cu13/lib", "cuda_nvrtc/lib", "cu12/lib")
_INSTALL = ("pip install 'kdb[cuda]' (NVIDIA's nvidia-cuda-nvrtc wheel, no toolkit needed), "
            f"or set {config.ENV_NVRTC}=/path/to/libnvrtc.so")


@dataclass(frozen=True)
class Nvrtc:
    """The ``libnvrtc.so`` kdb loads and how it was found."""

    path: str
    found_by: str  # "argument", "KDB_NVRTC", "wheel <dir>" or "CUDA_HOME"


@dataclass(frozen=True)
class NvrtcIdentity:
    """What identifies an NVRTC: its version and its libraries' build IDs (or digests)."""

    path: str  # metadata, never in the key
    version: str  # "13.5"
    libraries: tuple[tuple[str, str], ...]  # (library name, build id or sha256)

    @property
    def compiler(self) -> tuple[tuple[str, str], ...]:
        """The key's compiler attributes."""
        return (("nvrtc_version", self.version), *self.libraries)

    @property
    def release(self) -> str:
        return f"NVRTC {self.version}"


def _libraries_in(directory: str) -> str | None:
    for name in ("libnvrtc.so", *sorted(os.listdir(directory), reverse=True)):
        if name.startswith("libnvrtc.so") and os.path.isfile(os.path.join(directory, name)):
            return os.path.join(directory, name)
    return None


def _wheel_library() -> tuple[str, str] | None:
    """``(library, directory)`` from the ``nvidia`` package Python would import."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        for sub in _WHEEL_DIRS:
            d = os.path.join(root, sub)
            if os.path.isdir(d):
                found = _libraries_in(d)
                if found:
                    return found, sub
    return None


_found: dict[tuple, Nvrtc | str] = {}


def find_nvrtc(explicit: str | os.PathLike[str] | None = None) -> Nvrtc:
    """``explicit``, else ``KDB_NVRTC``, else the ``nvidia-cuda-nvrtc`` wheel, else
    ``$CUDA_HOME/lib64``; a :class:`kdb.BackendUnavailableError` says how to get one."""
    import sys

    variables = config.read_variables(_FIND_VARIABLES)
    memo = (None if explicit is None else os.fspath(explicit), *variables.values(),
            tuple(sys.path))
    found = _found.get(memo)
    if found is None or (isinstance(found, Nvrtc) and not os.path.isfile(found.path)):
        try:
            found = _find(explicit, variables)
        except BackendUnavailableError as err:
            found = str(err)
        _found[memo] = found
    if isinstance(found, str):
        raise BackendUnavailableError(found)
    return found


#: The variables that choose the library (not in the key: the library's identity is).
_FIND_VARIABLES = (config.ENV_NVRTC, "CUDA_HOME")


def _find(explicit: str | os.PathLike[str] | None, variables: dict[str, str | None]) -> Nvrtc:
    for given, how in ((explicit, "argument"), (variables[config.ENV_NVRTC], config.ENV_NVRTC)):
        if given is None or not os.fspath(given).strip():
            continue
        p = os.path.abspath(os.path.expanduser(os.fspath(given)))
        if os.path.isdir(p):
            p = _libraries_in(p) or p
        if not os.path.isfile(p):
            raise BackendUnavailableError(
                f"{'nvrtc=' if how == 'argument' else how + '='}{os.fspath(given)!r} is not "
                "libnvrtc.so (or a directory holding it): point it at the library, or unset "
                "it to use the nvidia-cuda-nvrtc wheel")
        return Nvrtc(p, how)
    wheel = _wheel_library()
    if wheel is not None:
        return Nvrtc(wheel[0], f"wheel nvidia/{wheel[1]}")
    home = (variables["CUDA_HOME"] or "").strip()
    if home:
        for sub in ("lib64", "lib"):
            d = os.path.join(home, sub)
            found = _libraries_in(d) if os.path.isdir(d) else None
            if found:
                return Nvrtc(found, "CUDA_HOME")
    raise BackendUnavailableError(
        f"NVRTC not found: {config.ENV_NVRTC} is not set, the nvidia-cuda-nvrtc wheel is not "
        f"installed, and CUDA_HOME has no lib64/libnvrtc.so. Install it: {_INSTALL}.")


_identities: dict[tuple[str, int, int], NvrtcIdentity] = {}


def identity(nvrtc: Nvrtc | str, memo_dir: str | os.PathLike[str] | None = None) -> NvrtcIdentity:
    """The identity of ``nvrtc``: once per process, and once per machine in ``memo_dir``."""
    path = nvrtc.path if isinstance(nvrtc, Nvrtc) else os.fspath(nvrtc)
    try:
        st = os.stat(path)
    except OSError as err:
        raise BackendUnavailableError(f"cannot use NVRTC at {path}: {err}; {_INSTALL}") from err
    memo = (path, st.st_size, st.st_mtime_ns)
    ident = _identities.get(memo)
    if ident is None:
        root = Path(memo_dir) if memo_dir is not None else config.cache_root()
        rec = machine_memo(root, "nvrtc", path, lambda: _probe(path, root), _still_valid)
        ident = NvrtcIdentity(path, rec["version"], tuple(sorted(rec["libraries"].items())))
        _identities[memo] = ident
    return ident


def _builtins(path: str) -> str | None:
    """``libnvrtc-builtins.so``, which NVRTC loads from its own directory."""
    d = os.path.dirname(os.path.realpath(path))
    names = sorted(n for n in os.listdir(d) if n.startswith("libnvrtc-builtins.so"))
    real = {os.path.realpath(os.path.join(d, n)) for n in names}
    return sorted(real)[-1] if real else None


def _probe(path: str, memo_dir: Path) -> dict[str, Any]:
    lib = _load(path)
    import ctypes

    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    libraries = {"libnvrtc": library_id(path, memo_dir)}
    stamps = [file_stamp(path)]
    builtins = _builtins(path)
    if builtins is not None:
        libraries["libnvrtc-builtins"] = library_id(builtins, memo_dir)
        stamps.append(file_stamp(builtins))
    return {"version": f"{major.value}.{minor.value}", "libraries": libraries,
            "stamps": stamps}


def _still_valid(rec: Any) -> bool:
    try:
        return (stamps_hold(rec["stamps"]) and isinstance(rec["version"], str)
                and isinstance(rec["libraries"], dict))
    except (KeyError, TypeError, AttributeError):
        return False


_libs: dict[str, Any] = {}


def _load(path: str) -> Any:
    lib = _libs.get(path)
    if lib is None:
        import ctypes

        try:
            lib = ctypes.CDLL(path)
        except OSError as err:
            raise BackendUnavailableError(f"cannot load NVRTC from {path}: {err}; {_INSTALL}") \
                from err
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        _libs[path] = lib
    return lib


def supported_arches(path: str) -> list[str]:
    """The real arches (``sm_XX``) this NVRTC builds cubins for (``nvrtcGetSupportedArchs``)."""
    import ctypes

    lib = _load(path)
    n = ctypes.c_int()
    _check(lib, lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)), "nvrtcGetNumSupportedArchs")
    archs = (ctypes.c_int * n.value)()
    _check(lib, lib.nvrtcGetSupportedArchs(archs), "nvrtcGetSupportedArchs")
    return [f"sm_{a}" for a in archs]


def _check(lib: Any, status: int, what: str) -> None:
    if status != 0:
        raise BackendUnavailableError(
            f"NVRTC {what} failed: {lib.nvrtcGetErrorString(status).decode('utf-8', 'replace')}")


def run(path: str, text: str, arch: str, output: str, options: Sequence[str],
        include_args: Sequence[str], name: str) -> tuple[bytes, str]:
    """Compile ``text`` with the NVRTC at ``path``; returns (cubin or PTX, NVRTC's log).

    ``include_args``: the include options, one an element. A cubin is built for ``arch``
    (``-arch=sm_XX``); PTX for its virtual arch
    (``-arch=compute_XX``), which is what nvcc's ``-ptx -arch=sm_XX`` writes. A failed
    build raises :class:`kdb.CompileError` with NVRTC's log.
    """
    import ctypes

    lib = _load(path)
    target = arch if output == "cubin" else "compute_" + arch.split("_", 1)[1]
    opts = [f"-arch={target}", *options, *include_args]
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode("utf-8"), b"kernel.cu",
                                       0, None, None), "nvrtcCreateProgram")
    try:
        argv = (ctypes.c_char_p * len(opts))(*(o.encode("utf-8") for o in opts))
        status = lib.nvrtcCompileProgram(prog, len(opts), argv)
        size = ctypes.c_size_t()
        said = ""
        if lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)) == 0 and size.value > 1:
            buf = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, buf)
            said = buf.value.decode("utf-8", "replace")
        if status != 0:
            why = lib.nvrtcGetErrorString(status).decode("utf-8", "replace")
            raise CompileError(
                f"NVRTC failed ({why}) building {name} for {arch}; fix the source or "
                f"options. Options: {' '.join(opts)}", log=said, options=list(options))
        get_size, get = ((lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN) if output == "cubin"
                         else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX))
        _check(lib, get_size(prog, ctypes.byref(size)), "reading the output size")
        buf = ctypes.create_string_buffer(size.value)
        _check(lib, get(prog, buf), "reading the output")
        data = buf.raw
        if output == "ptx":
            data = data.rstrip(b"\0")  # NVRTC counts the terminating NUL; nvcc's file has none
        if not data:  # -dlto: LTO IR instead, which kdb does not hold; never store nothing
            raise CompileError(
                f"NVRTC built no {output} of {name} for {arch} (an option such as -dlto makes "
                f"LTO IR instead, which kdb.cuda does not return); drop it. Options: "
                f"{' '.join(opts)}", log=said, options=list(options))
        return data, said
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
