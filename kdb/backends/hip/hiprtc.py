"""HIPRTC, HIP's runtime compiler: code objects for an explicit target with no hipcc.

Debian ships it inside the HIP runtime (``libamdhip64.so.5``, package ``libamdhip64-5``),
with its builtins in ``libhiprtc-builtins5`` and the compiling done by ``libamd_comgr``.
kdb calls its C API through :mod:`ctypes` in a child process (:data:`_CHILD` says why), so
the library it identifies is the one it loads, and a lookup loads nothing. The compiler enters the key as HIPRTC's version and the
GNU build IDs of the three libraries, worked out once per machine
(``<cache root>/hiprtc.json``) and once per process.

HIPRTC 5.2 aborts the process on a target it does not know, so every target is checked
against the processors this ROCm builds (:mod:`.targets`) before it gets here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ... import config
from ..digests import file_stamp, library_id, machine_memo, stamps_hold
from ...errors import BackendUnavailableError, CompileError
from .targets import ROCM52

INSTALL = ("apt-get install libamdhip64-5 libhiprtc-builtins5 (Debian/Ubuntu; hipcc brings "
           "both)")
_NAMES = ("libamdhip64.so", "libamdhip64.so.5", "libamdhip64.so.6")


@dataclass(frozen=True)
class HiprtcIdentity:
    """What identifies a HIPRTC: its version and its libraries' build IDs."""

    path: str  # metadata, never in the key
    version: str
    libraries: tuple[tuple[str, str], ...]
    built: tuple[str, ...] = ROCM52  # the processors it builds: metadata

    @property
    def compiler(self) -> tuple[tuple[str, str], ...]:
        """The key's compiler attributes."""
        return (("hiprtc_version", self.version), *self.libraries)

    @property
    def release(self) -> str:
        return f"HIPRTC {self.version}"


#: The variables HIPRTC's comgr reads that change the code object it builds: the roots
#: whose ``include`` it searches (:mod:`.search`), and where LLVM and the device libraries
#: are. In the key where set.
ENV_VARS = ("HIP_PATH", "ROCM_PATH", "LLVM_PATH", "HIP_DEVICE_LIB_PATH")


def environment() -> tuple[tuple[str, str], ...]:
    """The variables of :data:`ENV_VARS` that are set, for the key."""
    variables = config.read_variables(ENV_VARS)
    return tuple((k, v) for k in ENV_VARS if (v := variables[k]) is not None)


def _dirs() -> list[str]:
    """Where the HIP runtime is installed: ``$ROCM_PATH/lib``, ``/opt/rocm/lib``, the
    system's library directories."""
    import sysconfig

    rocm = (config.read_variables(("ROCM_PATH",))["ROCM_PATH"] or "").strip()
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    out = [os.path.join(rocm, "lib")] if rocm else []
    out += ["/opt/rocm/lib", *(f"{d}/{multiarch}" for d in ("/usr/lib", "/lib") if multiarch),
            "/usr/lib64", "/usr/lib"]
    return out


#: How to point kdb at a HIPRTC, for the messages that say there is none that works.
POINT = f"set {config.ENV_HIPRTC}=/path/to/libamdhip64.so (or ROCm 6's libhiprtc.so)"


def find_hiprtc(explicit: str | os.PathLike[str] | None = None, *, variable: bool = True
                ) -> str:
    """The HIPRTC library to load: ``explicit``, else ``KDB_HIPRTC`` (unless ``variable``
    is false: the HIP runtime's own lookup), else the first ``libamdhip64`` of
    :func:`_dirs`."""
    return locate_hiprtc(explicit, variable=variable)[0]


def locate_hiprtc(explicit: str | os.PathLike[str] | None = None, *, variable: bool = True
                  ) -> tuple[str, str]:
    """``(path, found_by)`` of the library :func:`find_hiprtc` finds; ``found_by`` is
    ``"argument"``, ``"KDB_HIPRTC"``, ``"ROCM_PATH"`` or ``"library search"``."""
    if explicit is not None:
        p = os.path.abspath(os.fspath(explicit))
        if not os.path.isfile(p):
            raise BackendUnavailableError(
                f"hiprtc={os.fspath(explicit)!r} is not libamdhip64.so: point it at the library")
        return p, "argument"
    variables = config.read_variables((config.ENV_HIPRTC, "ROCM_PATH"))
    env = (variables[config.ENV_HIPRTC] or "").strip() if variable else ""
    if env:
        p = os.path.abspath(os.path.expanduser(env))
        if not os.path.isfile(p):
            raise BackendUnavailableError(
                f"{config.ENV_HIPRTC}={env!r} is not a file: point it at the library HIPRTC is "
                "in (libamdhip64.so; ROCm 6 and later: libhiprtc.so), or unset it to search "
                "$ROCM_PATH/lib, /opt/rocm/lib and the system's library directories")
        return p, config.ENV_HIPRTC
    rocm = (variables["ROCM_PATH"] or "").strip()
    for d in _dirs():
        for name in _NAMES:
            p = os.path.join(d, name)
            if os.path.isfile(p):
                return p, ("ROCM_PATH" if rocm and d == os.path.join(rocm, "lib")
                           else "library search")
    unset, point = (f"; {config.ENV_HIPRTC} is not set", f"; or {POINT}") if variable else ("", "")
    raise BackendUnavailableError(
        f"HIPRTC not found (libamdhip64.so in $ROCM_PATH/lib, /opt/rocm/lib or the system's "
        f"library directories{unset}). Install it: {INSTALL}{point}")


_identities: dict[tuple, HiprtcIdentity] = {}


def identity(path: str, memo_dir: str | os.PathLike[str] | None = None) -> HiprtcIdentity:
    """The identity of the HIPRTC in ``path``: once per process, and once per machine."""
    try:
        st = os.stat(path)
    except OSError as err:
        raise BackendUnavailableError(
            f"cannot use HIPRTC at {path}: {err}; {POINT}, or install it: {INSTALL}") from err
    memo = (path, st.st_size, st.st_mtime_ns)
    ident = _identities.get(memo)
    if ident is None:
        root = Path(memo_dir) if memo_dir is not None else config.cache_root()
        rec = machine_memo(root, "hiprtc", path, lambda: _probe(path, root), _still_valid)
        ident = HiprtcIdentity(path, rec["version"], tuple(sorted(rec["libraries"].items())))
        _identities[memo] = ident
    return ident


def _companions(path: str) -> dict[str, str]:
    """The libraries HIPRTC loads from its own directory: its builtins and comgr."""
    d = os.path.dirname(os.path.realpath(path))
    out = {}
    for prefix, name in (("libhiprtc-builtins.so", "libhiprtc-builtins"),
                         ("libamd_comgr.so", "libamd_comgr")):
        found = sorted(os.path.realpath(os.path.join(d, n)) for n in os.listdir(d)
                       if n.startswith(prefix))
        if found:
            out[name] = found[-1]
    return out


def _probe(path: str, memo_dir: Path) -> dict[str, Any]:
    got = _in_child({"op": "version", "path": path})
    if got["status"] != 0:
        raise BackendUnavailableError(f"HIPRTC hiprtcVersion failed: {got['error']}; is "
                                      f"{path} HIPRTC? {POINT}, or install it: {INSTALL}")
    files = {"libamdhip64": os.path.realpath(path), **_companions(path)}
    return {"version": got["version"],
            "libraries": {n: library_id(p, memo_dir) for n, p in files.items()},
            "stamps": [file_stamp(p) for p in files.values()]}


def _still_valid(rec: Any) -> bool:
    try:
        return (stamps_hold(rec["stamps"]) and isinstance(rec["version"], str)
                and isinstance(rec["libraries"], dict))
    except (KeyError, TypeError, AttributeError):
        return False


#: What a child process runs: HIPRTC loads comgr and its own LLVM, which can clash with
#: another LLVM in the caller's process (PoCL's, seen aborting in clGetPlatformIDs), and
#: HIPRTC 5.2 aborts on a target it does not know; a child keeps both out of the caller.
_CHILD = r"""
import ctypes, json, sys
a = json.loads(sys.stdin.read())
lib = ctypes.CDLL(a["path"])
lib.hiprtcGetErrorString.restype = ctypes.c_char_p
err = lambda s: lib.hiprtcGetErrorString(s).decode("utf-8", "replace")
if a["op"] == "version":
    ma, mi = ctypes.c_int(), ctypes.c_int()
    s = lib.hiprtcVersion(ctypes.byref(ma), ctypes.byref(mi))
    print(json.dumps({"status": s, "error": err(s), "version": f"{ma.value}.{mi.value}"}))
    sys.exit(0)
prog = ctypes.c_void_p()
s = lib.hiprtcCreateProgram(ctypes.byref(prog), a["text"].encode(), b"kernel.hip", 0, None, None)
out = {"status": s, "error": err(s), "log": "", "stage": "create"}
if s == 0:
    opts = [o.encode() for o in a["options"]]
    s = lib.hiprtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    if lib.hiprtcGetProgramLogSize(prog, ctypes.byref(n)) == 0 and n.value > 1:
        buf = ctypes.create_string_buffer(n.value)
        lib.hiprtcGetProgramLog(prog, buf)
        out["log"] = buf.value.decode("utf-8", "replace")
    out.update(status=s, error=err(s), stage="compile")
    if s == 0:
        s = lib.hiprtcGetCodeSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value)
        s = s or lib.hiprtcGetCode(prog, buf)
        out.update(status=s, error=err(s), stage="code", code=buf.raw.hex())
    lib.hiprtcDestroyProgram(ctypes.byref(prog))
print(json.dumps(out))
"""


def _in_child(request: dict[str, Any]) -> dict[str, Any]:
    """Run :data:`_CHILD` on ``request``; a child that dies is a BackendUnavailableError."""
    import json
    import subprocess
    import sys

    proc = None
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(request),
                              capture_output=True, text=True, timeout=600)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as err:
        # The child's own last line says why (a file that is no library: "invalid ELF
        # header"); an empty output's IndexError said nothing.
        lines = proc.stderr.strip().splitlines() if proc is not None else []
        why = lines[-1] if lines else f"{type(err).__name__}: {err}"
        raise BackendUnavailableError(
            f"HIPRTC at {request['path']} failed in its process: {why}; {POINT}, or "
            f"install it: {INSTALL}") from None


def run(path: str, text: str, target: str, options: Sequence[str], name: str
        ) -> tuple[bytes, str]:
    """Compile ``text`` for ``target`` (a checked target ID) with the HIPRTC in ``path``, in
    a child process; returns (code object, HIPRTC's log). A failed build raises
    :class:`kdb.CompileError`."""
    opts = [f"--offload-arch={target}", *options]
    got = _in_child({"op": "compile", "path": path, "text": text, "options": opts})
    if got["status"] != 0 and got["stage"] == "compile":
        raise CompileError(
            f"HIPRTC failed ({got['error']}) building {name} for {target}; fix the source or "
            f"options. Options: {' '.join(opts)}", log=got["log"], options=tuple(options))
    if got["status"] != 0:
        raise BackendUnavailableError(f"HIPRTC {got['stage']} failed: {got['error']}; {INSTALL}")
    return bytes.fromhex(got["code"]), got["log"]
