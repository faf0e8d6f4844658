"""nvcc: finding it, and its identity for the key.

The compiler enters the key by content: nvcc's full ``--version`` output and the sha256 of
each toolkit piece that makes device code (nvcc, cicc, ptxas, fatbinary, libdevice,
nvcc.profile), located through nvcc's own ``-dryrun`` report, never by path. That costs two
subprocesses and reading the whole toolkit, so it is done once per machine (remembered in
``<cache root>/nvcc.json`` per nvcc path, size and mtime, each piece re-checked by size and
mtime) and once per process: a warm process does not run nvcc at all.

Left out of the key on purpose: the host compiler nvcc preprocesses with (gcc). Its version
reaches device code only through predefined macros; keying on it would make a packaged
``sm_90.kdb`` miss on every machine with another gcc. Pass ``-ccbin`` (an option, so in the
key) to pin one.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import config
from ..digests import file_stamp, machine_digest, machine_memo, stamps_hold
from ...errors import BackendUnavailableError
from ..includes import search_list
from . import search

if TYPE_CHECKING:
    import subprocess

# subprocess, tempfile and glob are imported where nvcc runs: a hit never needs them.

#: The arch ids nvcc names: real (``sm_XX``, with an ``a``/``f`` feature suffix) and virtual.
ARCH_RE = re.compile(r"(sm|compute)_(\d{2,3})([af]?)\Z")
_RELEASE_RE = re.compile(r"release\s+([^\n]+)")
_PROBE_TIMEOUT_S = 120.0

#: The variables that choose the nvcc (not in the key: the nvcc's identity is).
_FIND_VARIABLES = (config.ENV_NVCC, "CUDA_HOME", "PATH")


@dataclass(frozen=True)
class Nvcc:
    """The nvcc kdb runs (possibly a wrapper script) and how it was found."""

    path: str
    found_by: str  # "argument", "KDB_NVCC", "CUDA_HOME" or "PATH"


def _executable(candidate: str) -> str | None:
    if os.sep in candidate or (os.altsep and os.altsep in candidate):
        p = os.path.abspath(os.path.expanduser(candidate))
        return p if os.path.isfile(p) and os.access(p, os.X_OK) else None
    return shutil.which(candidate)


_found: dict[tuple, Nvcc] = {}


def find_nvcc(explicit: str | os.PathLike[str] | None = None) -> Nvcc:
    """The nvcc to run: ``explicit``, else ``KDB_NVCC``, else ``$CUDA_HOME/bin/nvcc``, else PATH."""
    variables = config.read_variables(_FIND_VARIABLES)
    memo = (None if explicit is None else os.fspath(explicit), *variables.values())
    found = _found.get(memo)
    if found is None or not os.access(found.path, os.X_OK):
        found = _found[memo] = _find_nvcc(explicit, variables)
    return found


def _find_nvcc(explicit: str | os.PathLike[str] | None, variables: dict[str, str | None]
               ) -> Nvcc:
    if explicit is not None:
        found = _executable(os.fspath(explicit))
        if found is None:
            raise BackendUnavailableError(
                f"nvcc={os.fspath(explicit)!r} is not an executable file: pass the path of "
                "nvcc (e.g. /usr/local/cuda/bin/nvcc)")
        return Nvcc(found, "argument")
    env = (variables[config.ENV_NVCC] or "").strip()
    if env:
        found = _executable(env)
        if found is None:
            raise BackendUnavailableError(
                f"{config.ENV_NVCC}={env!r} is not an executable file: point it at nvcc "
                "(e.g. /usr/local/cuda/bin/nvcc), or unset it to use CUDA_HOME or PATH")
        return Nvcc(found, config.ENV_NVCC)
    home = (variables["CUDA_HOME"] or "").strip()
    if home:
        found = _executable(os.path.join(home, "bin", "nvcc"))
        if found is not None:
            return Nvcc(found, "CUDA_HOME")
    found = shutil.which("nvcc", path=variables["PATH"])
    if found is not None:
        return Nvcc(os.path.abspath(found), "PATH")
    where = f"CUDA_HOME={home!r} has no bin/nvcc" if home else "CUDA_HOME is not set"
    raise BackendUnavailableError(
        f"nvcc not found: {config.ENV_NVCC} is not set, {where}, and no nvcc is on PATH. "
        f"Install the CUDA toolkit and set {config.ENV_NVCC}=/path/to/nvcc or "
        "CUDA_HOME=/path/to/cuda (the directory holding bin/nvcc).")


# -- compiler identity --------------------------------------------------------------------

@dataclass(frozen=True)
class NvccIdentity:
    """What identifies an nvcc: its ``--version`` text and its toolkit pieces' digests."""

    path: str  # the nvcc kdb runs: metadata, never in the key
    version: str
    toolkit: str  # the toolkit's root directory: metadata, never in the key
    digests: tuple[tuple[str, str], ...]  # (piece name, sha256)
    #: The directories nvcc and its host preprocessor search with no option (the toolkit's
    #: and the system's headers, real paths): metadata, never in the key.
    system_dirs: tuple[str, ...] = ()

    @property
    def compiler(self) -> tuple[tuple[str, str], ...]:
        """The key's compiler attributes."""
        return (("nvcc_version", self.version),
                *((f"{name}_sha256", digest) for name, digest in self.digests))

    @property
    def release(self) -> str:
        """The short release, e.g. ``13.0, V13.0.88``."""
        m = _RELEASE_RE.search(self.version)
        return m.group(1).strip() if m else (self.version.splitlines() or [""])[-1]


_identities: dict[tuple[str, int, int], NvccIdentity] = {}


def identity(nvcc: Nvcc | str, memo_dir: str | os.PathLike[str] | None = None) -> NvccIdentity:
    """The identity of ``nvcc``: once per process, and once per machine in ``memo_dir``."""
    path = nvcc.path if isinstance(nvcc, Nvcc) else os.fspath(nvcc)
    try:
        st = os.stat(path)
    except OSError as err:
        raise BackendUnavailableError(
            f"cannot use nvcc at {path}: {err}; set {config.ENV_NVCC} or CUDA_HOME") from err
    memo = (path, st.st_size, st.st_mtime_ns)
    ident = _identities.get(memo)
    if ident is None:
        root = Path(memo_dir) if memo_dir is not None else config.cache_root()
        rec = machine_memo(root, "nvcc", path, lambda: _probe(path, root), _still_valid)
        ident = NvccIdentity(path, rec["version"], rec["toolkit"],
                             tuple(sorted(rec["sha256"].items())), tuple(rec["include_dirs"]))
        _identities[memo] = ident
    return ident


def _run(cmd: list[str], cwd: str | None = None) -> subprocess.CompletedProcess:
    import subprocess

    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, timeout=_PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise BackendUnavailableError(
            f"cannot run {shlex.join(cmd)}: {err}; set {config.ENV_NVCC} or CUDA_HOME to a "
            "working nvcc") from err


def _probe(path: str, memo_dir: Path) -> dict[str, Any]:
    """Run nvcc twice (``--version``, ``-dryrun``) and digest the toolkit pieces it drives."""
    import tempfile

    proc = _run([path, "--version"])
    version = proc.stdout.decode("utf-8", "replace").replace("\r\n", "\n").strip()
    if proc.returncode != 0 or not version:
        raise BackendUnavailableError(
            f"{path} --version failed (exit {proc.returncode}): "
            f"{proc.stderr.decode('utf-8', 'replace').strip()}; is it nvcc?")
    variables: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="kdb-nvcc-probe-") as tmp:
        dry = _run([path, "-dryrun", "-cubin", "-o", "probe.cubin", "probe.cu"], cwd=tmp)
    for line in (dry.stderr + dry.stdout).decode("utf-8", "replace").splitlines():
        if line.startswith("#$ ") and "=" in line and not line[3:].startswith(('"', " ")):
            name, _, value = line[3:].partition("=")
            if re.fullmatch(r"[A-Za-z_]+", name):
                variables.setdefault(name, value.strip())
    pieces = _pieces(path, variables)
    stamps, sha = {}, {}
    for name, p in pieces.items():
        stamps[name] = file_stamp(p)
        sha[name] = machine_digest(p, memo_dir)
    here = variables.get("_HERE_") or os.path.dirname(os.path.realpath(path))
    return {"version": version, "toolkit": os.path.normpath(os.path.join(here, os.pardir)),
            "stamps": stamps, "sha256": sha, "include_dirs": _default_dirs(path),
            "probe": PROBE_REVISION}


#: The revision of :func:`_probe` a remembered identity needs: 2, the default directories
#: probed without CCC_OVERRIDE_OPTIONS (one probed with it may list a directory it added);
#: 3, without INCLUDES and SYSTEM_INCLUDES, for the same reason.
PROBE_REVISION = 3


def _default_dirs(path: str) -> list[str]:
    """The include directories nvcc searches with no option, as its host preprocessor
    lists them (``-Xcompiler -v``), real paths: headers found there come with the toolkit
    or the system, not from the program's own search."""
    import subprocess
    import tempfile

    # Nor clang's argument edits, where clang is the host compiler: "+-I<dir>" made <dir>
    # one of the defaults, whose headers a build's key holds only through the identity.
    env = {k: v for k, v in os.environ.items()
           if k not in search.VARIABLES and k != "CCC_OVERRIDE_OPTIONS"}
    with tempfile.TemporaryDirectory(prefix="kdb-nvcc-probe-") as tmp:
        open(os.path.join(tmp, "probe.cu"), "w").close()
        try:
            proc = subprocess.run([path, "-E", "-Xcompiler", "-v", "probe.cu", "-o", "probe.i"],
                                  cwd=tmp, env=env, capture_output=True,
                                  timeout=_PROBE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            return []
    return search_list((proc.stderr + proc.stdout).decode("utf-8", "replace"))


def _pieces(path: str, variables: dict[str, str]) -> dict[str, str]:
    """The toolkit files that make device code, by name (nvcc's dry run says where)."""
    import glob

    here = variables.get("_HERE_") or os.path.dirname(os.path.realpath(path))
    top = os.path.join(here, os.pardir)
    cicc_dir = variables.get("CICC_PATH") or os.path.join(top, "nvvm", "bin")
    libdevice_dir = variables.get("NVVMIR_LIBRARY_DIR") or os.path.join(top, "nvvm", "libdevice")
    tools = os.pathsep.join([cicc_dir, here, variables.get("PATH", "")])
    found = {
        "nvcc": shutil.which("nvcc", path=here) or os.path.realpath(path),
        "cicc": shutil.which("cicc", path=cicc_dir),
        "ptxas": shutil.which("ptxas", path=tools),
        "fatbinary": shutil.which("fatbinary", path=tools),
        "nvcc.profile": os.path.join(here, "nvcc.profile"),
    }
    for bc in sorted(glob.glob(os.path.join(libdevice_dir, "*.bc"))):
        found["libdevice/" + os.path.basename(bc)] = bc
    return {name: os.path.realpath(p) for name, p in found.items() if p and os.path.isfile(p)}


def _still_valid(rec: Any) -> bool:
    """A remembered identity holds while every piece has the size and mtime it had (one from
    an older probe is probed again)."""
    try:
        return (rec.get("probe") == PROBE_REVISION and stamps_hold(rec["stamps"].values())
                and isinstance(rec["version"], str)
                and isinstance(rec["sha256"], dict) and isinstance(rec["include_dirs"], list))
    except (KeyError, TypeError, AttributeError):
        return False


def target_arches(nvcc: Nvcc | str) -> list[str]:
    """The real arches (``sm_XX``) this nvcc builds cubins for (``--list-gpu-code``)."""
    path = nvcc.path if isinstance(nvcc, Nvcc) else os.fspath(nvcc)
    proc = _run([path, "--list-gpu-code"])
    found = [a for a in proc.stdout.decode("utf-8", "replace").split() if ARCH_RE.match(a)]
    return sorted(set(found), key=lambda a: int("".join(c for c in a if c.isdigit()) or 0))

