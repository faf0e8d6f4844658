"""hipcc: finding it, the environment it runs in, and its identity for the key.

hipcc is a Perl script that picks a platform and a clang and adds flags of its own
(``-O3``, ``-mllvm`` options, the device libraries); Debian's picks NVIDIA's wherever
``nvcc`` is on PATH and ``clang++`` is not, so kdb always runs it with ``HIP_PLATFORM=amd``.
The compiler enters the key by content: ``hipcc --version`` (HIP's and clang's versions),
the sha256 of the script and its modules, the GNU build IDs of clang, lld and their LLVM
libraries, and the sha256 of the device libraries and HIP's headers, all found through
hipcc's own verbose report, never by path. That costs a few subprocesses, so it is done once
per machine (``<cache root>/hipcc.json``) and once per process.

The hipcc is ``hipcc=``, else ``KDB_HIPCC``, else ``$ROCM_PATH/bin/hipcc``, else PATH's; the
variable is not in the key, the identity of the hipcc it names is (a wrapper script is a
compiler of its own; a link runs, and is keyed with, the ``hipcc.pl`` beside it).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ... import config
from ..digests import file_stamp, library_id, machine_digest, machine_memo, stamps_hold
from ...errors import BackendUnavailableError
from .. import stdlibs
from ..includes import search_list
from .targets import ROCM52, sort_processors

#: The variables Debian's hipcc 5.2 (hipcc.pl, hipvars.pm) and its clang read that change
#: the code object it writes (``CCC_OVERRIDE_OPTIONS``: clang's driver edits its own
#: arguments by it, ``x-DFOO=1 +-DFOO=7``). Left out: HIP_PLATFORM (kdb sets it), HIPCC_VERBOSE (prints),
#: HCC_AMDGPU_TARGET (read only with no --offload-arch), HIPCC_LINK_FLAGS_APPEND and
#: CUDA_PATH (link steps and NVIDIA's platform, never run by --genco on AMD's).
ENV_VARS = ("HIP_PATH", "ROCM_PATH", "HIP_CLANG_PATH", "HIP_ROCCLR_HOME", "HSA_PATH",
            "HIP_LIB_PATH", "DEVICE_LIB_PATH", "HIP_DEVICE_LIB_PATH", "HIP_COMPILER",
            "HIP_RUNTIME", "HIPCC_COMPILE_FLAGS_APPEND", "HIP_CLANG_HCC_COMPAT_MODE",
            "HIP_COMPILE_CXX_AS_HIP", "CCC_OVERRIDE_OPTIONS")
INSTALL = "apt-get install hipcc (Debian/Ubuntu: ROCm 5.2's hipcc, clang and device libraries)"
_PROBE_TIMEOUT_S = 120.0
#: Any target kdb knows to exist: a probe that names one runs no GPU enumerator.
_PROBE_ARCH = "gfx900"


@dataclass(frozen=True)
class HipccIdentity:
    """What identifies a hipcc: its ``--version`` text and its pieces' digests."""

    path: str  # the hipcc kdb runs: metadata, never in the key
    version: str
    digests: tuple[tuple[str, str], ...]  # (piece name, sha256 or build id)
    system_dirs: tuple[str, ...] = ()  # clang's default include dirs: metadata
    llvm: tuple[str, ...] = ()  # the processors its LLVM knows: metadata
    built: tuple[str, ...] = ()  # those its device libraries cover: metadata

    @property
    def compiler(self) -> tuple[tuple[str, str], ...]:
        """The key's compiler attributes."""
        return (("hipcc_version", self.version),
                *((f"{name}_id", digest) for name, digest in self.digests))

    @property
    def release(self) -> str:
        m = re.search(r"HIP version: (\S+)", self.version)
        return f"hipcc {m.group(1)}" if m else "hipcc"

    @property
    def stdlib(self) -> str:
        """The C and C++ libraries its clang finds (:mod:`..stdlibs`), without the digest."""
        return dict(self.digests).get("stdlib", "").partition(";")[0]


def run_env(overrides: dict[str, str] | None = None, drop: tuple[str, ...] = (),
            tmp: str | None = None) -> dict[str, str]:
    """The environment hipcc runs in: the caller's, on AMD's platform; its temporary files in
    ``tmp``, kdb's own temporary directory, removed with all it holds (clang makes a
    directory of its own there for each HIP compile, ``kernel-<6 hex digits>``, and never
    removes it: two a build, left in ``/tmp`` for ever otherwise)."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "HIP_PLATFORM": "amd", **({"TMPDIR": tmp} if tmp else {}),
            **(overrides or {})}


#: The variables that choose the hipcc (not in the key: the hipcc's identity is).
_FIND_VARIABLES = (config.ENV_HIPCC, "ROCM_PATH", "PATH")
#: How to point kdb at a hipcc, for the messages that say there is none that works.
POINT = (f"set {config.ENV_HIPCC}=/path/to/hipcc (or ROCM_PATH=/path/to/rocm, holding "
         "bin/hipcc)")


def _executable(candidate: str, path: str | None) -> str | None:
    """``candidate`` as an absolute path if it is an executable file; a bare name is looked
    up on ``path``."""
    if os.sep in candidate or (os.altsep and os.altsep in candidate):
        p = os.path.abspath(os.path.expanduser(candidate))
        return p if os.path.isfile(p) and os.access(p, os.X_OK) else None
    found = shutil.which(candidate, path=path)
    return os.path.abspath(found) if found else None


def find_hipcc(explicit: str | os.PathLike[str] | None = None) -> str:
    """The hipcc to run: ``explicit``, else ``KDB_HIPCC``, else ``$ROCM_PATH/bin/hipcc``,
    else the one on PATH."""
    return locate_hipcc(explicit)[0]


def locate_hipcc(explicit: str | os.PathLike[str] | None = None) -> tuple[str, str]:
    """``(path, found_by)`` of the hipcc :func:`find_hipcc` finds; ``found_by`` is
    ``"argument"``, ``"KDB_HIPCC"``, ``"ROCM_PATH"`` or ``"PATH"``."""
    variables = config.read_variables(_FIND_VARIABLES)
    if explicit is not None:
        p = os.path.abspath(os.fspath(explicit))
        if not (os.path.isfile(p) and os.access(p, os.X_OK)):
            raise BackendUnavailableError(
                f"hipcc={os.fspath(explicit)!r} is not an executable file: pass the path of "
                "hipcc (e.g. /usr/bin/hipcc)")
        return p, "argument"
    env = (variables[config.ENV_HIPCC] or "").strip()
    if env:
        found = _executable(env, variables["PATH"])
        if found is None:
            raise BackendUnavailableError(
                f"{config.ENV_HIPCC}={env!r} is not an executable file: point it at hipcc "
                "(e.g. /usr/bin/hipcc or /opt/rocm/bin/hipcc), or unset it to use ROCM_PATH "
                "or PATH")
        return found, config.ENV_HIPCC
    rocm = (variables["ROCM_PATH"] or "").strip()
    if rocm:
        found = _executable(os.path.join(rocm, "bin", "hipcc"), None)
        if found is not None:
            return found, "ROCM_PATH"
    found = shutil.which("hipcc", path=variables["PATH"])
    if found is None:
        raise BackendUnavailableError(
            f"hipcc not found on PATH (nor in $ROCM_PATH/bin; {config.ENV_HIPCC} is not set). "
            f"Install it: {INSTALL}, or ROCm's own packages; or {POINT}")
    return os.path.abspath(found), "PATH"


def environment() -> tuple[tuple[str, str], ...]:
    """The variables of :data:`ENV_VARS` that are set, for the key."""
    variables = config.read_variables(ENV_VARS)
    return tuple((k, v) for k in ENV_VARS if (v := variables[k]) is not None)


_identities: dict[tuple, HipccIdentity] = {}


def identity(path: str, memo_dir: str | os.PathLike[str] | None = None) -> HipccIdentity:
    """The identity of the hipcc at ``path`` in this environment: once per process, and once
    per machine in ``memo_dir`` for each setting of the variables that reach its probes
    (those that add options, such as HIPCC_COMPILE_FLAGS_APPEND, are in the key, not here)."""
    env = tuple((k, v) for k, v in environment() if k not in _PROBE_DROPS)
    try:
        st = os.stat(path)
    except OSError as err:
        raise BackendUnavailableError(
            f"cannot use hipcc at {path}: {err}; {POINT} of a working hipcc, or install one: "
            f"{INSTALL}") from err
    memo = (path, st.st_size, st.st_mtime_ns, env)
    ident = _identities.get(memo)
    if ident is None:
        root = Path(memo_dir) if memo_dir is not None else config.cache_root()
        rec = machine_memo(root, "hipcc", path, lambda: _probe(path, root, env),
                           lambda r: _still_valid(r, env) and _same_script(r, path),
                           variant=_variant(env))
        ident = HipccIdentity(path, rec["version"], tuple(sorted(rec["ids"].items())),
                              tuple(rec["include_dirs"]), tuple(rec["llvm"]),
                              tuple(rec["built"]))
        _identities[memo] = ident
    return ident


def _variant(env: tuple) -> str:
    """The memo's variant for the variables hipcc was probed with ("" for none set)."""
    if not env:
        return ""
    import hashlib

    return hashlib.sha256(repr(env).encode("utf-8", "surrogateescape")).hexdigest()[:16]


def _run(cmd: list[str], cwd: str | None = None, env: dict[str, str] | None = None,
         drop: tuple[str, ...] = ()):
    import subprocess

    try:
        return subprocess.run(cmd, cwd=cwd, env=run_env(env, drop, tmp=cwd), capture_output=True,
                              timeout=_PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise BackendUnavailableError(
            f"cannot run {' '.join(cmd)}: {err}; {POINT} of a working hipcc, or install one: "
            f"{INSTALL}") from err


def _probe(path: str, memo_dir: Path, env: tuple) -> dict[str, Any]:
    """hipcc's verbose ``--version`` (its paths, its clang), and the digests of its pieces."""
    proc = _run([path, f"--offload-arch={_PROBE_ARCH}", "--version"], env={"HIPCC_VERBOSE": "3"},
                drop=_PROBE_DROPS)
    said = proc.stdout.decode("utf-8", "replace").replace("\r\n", "\n")
    if proc.returncode != 0 or "HIP version" not in said:
        raise BackendUnavailableError(
            f"{path} --version failed (exit {proc.returncode}): "
            f"{proc.stderr.decode('utf-8', 'replace').strip()[:400]}; is it hipcc? {POINT} "
            f"of a working hipcc, or install one: {INSTALL}")
    paths = dict(re.findall(r"^([A-Z_]+)=(.*)$", said, re.MULTILINE))
    cmd = re.search(r"^hipcc-cmd: (\S+)", said, re.MULTILINE)
    clang = os.path.realpath(cmd.group(1)) if cmd else ""
    if not os.path.isfile(clang):
        raise BackendUnavailableError(f"{path} names no clang that exists ({clang!r}); {INSTALL}")
    version = "\n".join(line for line in said.splitlines()
                        if not re.match(r"[A-Z_]+=|hipcc-cmd:|InstalledDir:", line)).strip()
    pieces = _pieces(path, clang, paths)
    ids, stamps = {}, []
    for name, p in pieces.items():
        stamps.append(file_stamp(p))
        ids[name] = (library_id(p, memo_dir) if name.startswith("bin/")
                     else "sha256:" + machine_digest(p, memo_dir))
    llvm, built = _processors(clang, paths.get("DEVICE_LIB_PATH", ""))
    include_dirs, ids["stdlib"], watched = _defaults(path)
    stamps += [file_stamp(p) for p in watched]
    return {"version": version, "ids": ids, "stamps": stamps, "env": [list(e) for e in env],
            "script": _script(path),
            "include_dirs": include_dirs, "llvm": llvm, "built": built}


def _pieces(path: str, clang: str, paths: dict[str, str]) -> dict[str, str]:
    """The files that make a code object, by name: hipcc's scripts, clang, lld and their
    LLVM libraries, the device libraries, HIP's headers."""
    bindir = os.path.dirname(clang)
    script = _script(path)
    found = {"hipcc": os.path.realpath(path), "hipcc.pl": script,
             "hipvars.pm": os.path.join(os.path.dirname(script), "hipvars.pm")}
    found["bin/clang"] = clang
    found["bin/lld"] = os.path.realpath(os.path.join(bindir, "ld.lld"))
    for lib in ("libclang-cpp.so*", "libLLVM*.so*"):
        for p in sorted(glob.glob(os.path.join(bindir, os.pardir, "lib", lib))):
            found["bin/" + os.path.basename(p)] = os.path.realpath(p)
    bitcode = paths.get("DEVICE_LIB_PATH", "")
    for bc in sorted(glob.glob(os.path.join(bitcode, "*.bc"))):
        found["bitcode/" + os.path.basename(bc)] = bc
    include = paths.get("HIP_INCLUDE_PATH", "")
    for h in sorted(glob.glob(os.path.join(include, "hip", "**", "*"), recursive=True)):
        found["include/" + os.path.relpath(h, include)] = h
    return {n: os.path.realpath(p) for n, p in found.items() if p and os.path.isfile(p)}


def _processors(clang: str, bitcode: str) -> tuple[list[str], list[str]]:
    """The processors the LLVM beside ``clang`` knows (``llc -mcpu=help``), and those of
    them the device libraries in ``bitcode`` cover (``oclc_isa_version_*.bc``)."""
    llc = os.path.join(os.path.dirname(clang), "llc")
    proc = _run([llc, "-march=amdgcn", "-mcpu=help"]) if os.path.isfile(llc) else None
    text = (proc.stdout + proc.stderr).decode("utf-8", "replace") if proc else ""
    llvm = sort_processors(re.findall(r"^\s+(gfx[0-9a-f]{3,4})\s", text, re.MULTILINE))
    isa = {"gfx" + m for m in re.findall(r"oclc_isa_version_([0-9a-f]+)\.bc",
                                         " ".join(os.listdir(bitcode)) if bitcode and
                                         os.path.isdir(bitcode) else "")}
    if not llvm:  # no llc to ask: what ROCm 5.2's device libraries hold
        llvm = list(ROCM52)
    return llvm, sort_processors(p for p in llvm if p in isa) if isa else list(llvm)


def _defaults(path: str) -> tuple[list[str], str, list[str]]:
    """What clang reads with no option: its include directories (``-v``, real paths), the C
    and C++ libraries there (:mod:`..stdlibs`: the key's ``stdlib``), and the files that
    identity depends on."""
    import tempfile

    from ..includes import dependency_paths

    with tempfile.TemporaryDirectory(prefix="kdb-hipcc-probe-") as tmp:
        with open(os.path.join(tmp, "probe.hip"), "w") as f:
            f.write(stdlibs.PROBE)
        proc = _run([path, "--genco", f"--offload-arch={_PROBE_ARCH}", "-dM", "-E", "-v",
                     "-MD", "-MF", "probe.d", "probe.hip", "-o", "probe.i"],
                    cwd=tmp, drop=_PROBE_DROPS)
        said = (proc.stderr + proc.stdout).decode("utf-8", "replace")
        try:
            with open(os.path.join(tmp, "probe.i"), encoding="utf-8", errors="replace") as f:
                macros = f.read()
            with open(os.path.join(tmp, "probe.d"), encoding="utf-8", errors="replace") as f:
                deps = [os.path.join(tmp, d) for d in dependency_paths(f.read())[1:]]
        except OSError:  # the probe failed: builds fail alike, and store nothing
            macros, deps = "", []
    return search_list(said), stdlibs.identity(macros), stdlibs.watched(deps, said)


#: Variables that add to the default search; unset for the probe of the defaults.
_SEARCH_VARIABLES = ("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "HIPCC_COMPILE_FLAGS_APPEND")
#: Unset for every probe: the search variables, and clang's own argument edits
#: (``CCC_OVERRIDE_OPTIONS="+-I/dir"``), which would make a directory they add one of the
#: compiler's defaults, whose headers a build's key holds only through its identity (an edit
#: of a header there was served stale). They are in the key, and ``-MD`` shows what they add.
_PROBE_DROPS = (*_SEARCH_VARIABLES, "CCC_OVERRIDE_OPTIONS")


def _script(path: str) -> str:
    """The ``hipcc.pl`` the hipcc at ``path`` runs, a real path: the one beside ``path`` as
    given, not beside the file it links to (hipcc takes its own directory unresolved, and
    hipcc.pl the ``hipvars.pm`` beside its real self). For hipcc run as itself, the same."""
    return os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(path)), "hipcc.pl"))


def _same_script(rec: Any, path: str) -> bool:
    """A remembered identity (kept per real path) is of the ``hipcc.pl`` this ``path`` runs:
    a link to hipcc elsewhere may run another. One remembered before ``script`` was kept
    named the one beside the real path."""
    legacy = os.path.join(os.path.dirname(os.path.realpath(path)), "hipcc.pl")
    return isinstance(rec, dict) and rec.get("script", os.path.realpath(legacy)) == _script(path)


def _still_valid(rec: Any, env: tuple) -> bool:
    """A remembered identity holds in the environment it was probed in, while every piece
    has the size and mtime it had."""
    try:
        if [tuple(e) for e in rec["env"]] != list(env) or not stamps_hold(rec["stamps"]):
            return False
        return all(isinstance(rec[k], list) for k in ("include_dirs", "llvm", "built")) \
            and "stdlib" in rec["ids"]  # one remembered before the libraries were keyed
    except (KeyError, TypeError, ValueError, AttributeError):
        return False
