"""CUDA through nvcc: cubins (or PTX, fatbins) for any ``sm_XX``, served from kdb.

``compile(source, arch="sm_90")`` returns a cubin from the system ``sm_90.kdb``, else the user
tier, else from nvcc (``-cubin -arch=sm_90``, run in a temporary directory), stored in the
background. nvcc cross-compiles, so this half needs no GPU and never imports pycuda.
:class:`SourceModule` is the loading half: the cubin for the current context's device, loaded
with ``pycuda.driver.module_from_buffer``.

The compiler enters the key by content: nvcc's full ``--version`` output and the sha256 of
each toolkit piece that makes device code (nvcc, cicc, ptxas, fatbinary, libdevice,
nvcc.profile), located through nvcc's own ``-dryrun`` report, never by path. That costs two
subprocesses and ~150 MB of reading, so it is done once per machine (remembered in
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
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from .. import config, logs
from ..db import KernelDB, default_db
from ..digests import machine_digest, machine_memo
from ..errors import (
    BackendUnavailableError,
    CompileError,
    InvalidArgumentError,
    UnsupportedTypeError,
)
from ..includes import header_digests, split_include_options
from ..keys import HashAttributes
from . import nvrtc as _nvrtc
from .common import label, source_text
from .nvrtc import Nvrtc, NvrtcIdentity, find_nvrtc

if TYPE_CHECKING:
    import subprocess

# subprocess, tempfile and glob are imported where nvcc runs: a hit never needs them.

log = logs.get("kdb")
BACKEND = "cuda"

#: Output kinds and the nvcc flag that makes each.
OUTPUTS = {"cubin": "-cubin", "ptx": "-ptx", "fatbin": "-fatbin"}

#: Variables nvcc reads that change what it produces (the nvcc guide documents them; nvcc
#: 13.0's binary reads exactly these). No ``CUDA_*`` variable changes nvcc's output:
#: ``CUDA_CACHE_*`` steer the driver's JIT cache, ``CUDA_HOME`` / ``KDB_NVCC`` only choose
#: the nvcc, whose identity is in the key already.
ENV_VARS = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN")

#: Options that kdb sets itself (arch, output kind, output file): pass ``arch=`` / ``output=``.
RESERVED_OPTIONS = frozenset({
    "-arch", "--gpu-architecture", "-gencode", "--generate-code", "-code", "--gpu-code",
    "-o", "--output-file", "-odir", "--output-directory", "-cubin", "--cubin", "-ptx",
    "--ptx", "-fatbin", "--fatbin", "-c", "--compile", "-E", "--preprocess",
})

_ARCH_RE = re.compile(r"(sm|compute)_(\d{2,3})([af]?)\Z")
_KERNEL_RE = re.compile(r"__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+(\w+)")
_RELEASE_RE = re.compile(r"release\s+([^\n]+)")
_EM_CUDA = 190
_PROBE_TIMEOUT_S = 120.0


# -- arguments ----------------------------------------------------------------------------

def check_arch(arch: object, output: str = "cubin") -> str:
    """``arch`` if nvcc can build ``output`` for it, else :class:`kdb.InvalidArgumentError`.

    >>> check_arch("sm_90"), check_arch("sm_90a"), check_arch("compute_80", "ptx")
    ('sm_90', 'sm_90a', 'compute_80')
    """
    if output not in OUTPUTS:
        raise InvalidArgumentError(
            f"output {output!r} is not one of {', '.join(map(repr, OUTPUTS))}")
    if not isinstance(arch, str) or not _ARCH_RE.match(arch):
        raise InvalidArgumentError(
            f"CUDA arch {arch!r} is not valid: use 'sm_XX' (a real GPU, e.g. 'sm_90', "
            "'sm_90a') or 'compute_XX' (a virtual arch, for output='ptx' or 'fatbin')")
    if output == "cubin" and arch.startswith("compute_"):
        raise InvalidArgumentError(
            f"a cubin needs a real arch: use {'sm_' + arch[len('compute_'):]!r}, or "
            "output='ptx' for the virtual arch")
    return config.check_arch(arch)


def split_options(options: str | Sequence[str] | None) -> list[str]:
    """Options as a list; a string is split the way a shell would.

    >>> split_options("-DN=4 -use_fast_math")
    ['-DN=4', '-use_fast_math']
    """
    if options is None:
        return []
    if isinstance(options, str):
        return shlex.split(options)
    out = []
    for opt in options:
        if not isinstance(opt, str):
            raise UnsupportedTypeError(
                f"nvcc options must be strings; got {type(opt).__name__} ({opt!r})")
        out.append(opt)
    return out


def _check_options(options: Iterable[str]) -> None:
    for opt in options:
        if opt.split("=", 1)[0] in RESERVED_OPTIONS:
            raise InvalidArgumentError(
                f"option {opt!r} is set by kdb: pass arch= (e.g. 'sm_90') and output= "
                "('cubin', 'ptx' or 'fatbin') instead")


def kernel_names(source: str) -> list[str]:
    """``__global__`` function names in CUDA source (for labels).

    >>> kernel_names("__global__ void add(float *a) {} __global__ void mul() {}")
    ['add', 'mul']
    """
    return _KERNEL_RE.findall(source)


def _label(source: str) -> str:
    return label(_KERNEL_RE, source, "module")


def _text(source: str | bytes) -> str:
    return source_text(source, "CUDA")


def cubin_arch(binary: bytes) -> str:
    """The ``sm_XX`` a cubin was built for, read from its ELF header.

    The SM version sits in ``e_flags``: bits 8-15 from ELF ABI version 8 (CUDA 12.8 and
    later; checked against nvcc 13.0's sm_75 to sm_120 cubins), bits 0-7 before.
    """
    data = bytes(binary[:64])
    if len(data) < 52 or data[:4] != b"\x7fELF" or struct.unpack_from("<H", data, 18)[0] != _EM_CUDA:
        raise InvalidArgumentError("not a cubin (an ELF file for EM_CUDA)")
    flags = struct.unpack_from("<I", data, 48 if data[4] == 2 else 36)[0]
    sm = (flags >> 8) & 0xFF if data[8] >= 8 else flags & 0xFF
    return f"sm_{sm}"


# -- finding nvcc -------------------------------------------------------------------------

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
    env = os.environ
    memo = (None if explicit is None else os.fspath(explicit), env.get(config.ENV_NVCC),
            env.get("CUDA_HOME"), env.get("PATH"))
    found = _found.get(memo)
    if found is None or not os.access(found.path, os.X_OK):
        found = _found[memo] = _find_nvcc(explicit)
    return found


def _find_nvcc(explicit: str | os.PathLike[str] | None) -> Nvcc:
    if explicit is not None:
        found = _executable(os.fspath(explicit))
        if found is None:
            raise BackendUnavailableError(
                f"nvcc={os.fspath(explicit)!r} is not an executable file: pass the path of "
                "nvcc (e.g. /usr/local/cuda/bin/nvcc)")
        return Nvcc(found, "argument")
    env = os.environ.get(config.ENV_NVCC, "").strip()
    if env:
        found = _executable(env)
        if found is None:
            raise BackendUnavailableError(
                f"{config.ENV_NVCC}={env!r} is not an executable file: point it at nvcc "
                "(e.g. /usr/local/cuda/bin/nvcc), or unset it to use CUDA_HOME or PATH")
        return Nvcc(found, config.ENV_NVCC)
    home = os.environ.get("CUDA_HOME", "").strip()
    if home:
        found = _executable(os.path.join(home, "bin", "nvcc"))
        if found is not None:
            return Nvcc(found, "CUDA_HOME")
    found = shutil.which("nvcc")
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
                             tuple(sorted(rec["sha256"].items())))
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
        st = os.stat(p)
        stamps[name] = f"{p}|{st.st_size}|{st.st_mtime_ns}"
        sha[name] = machine_digest(p, memo_dir)
    here = variables.get("_HERE_") or os.path.dirname(os.path.realpath(path))
    return {"version": version, "toolkit": os.path.normpath(os.path.join(here, os.pardir)),
            "stamps": stamps, "sha256": sha}


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
    """A remembered identity holds while every piece has the size and mtime it had."""
    try:
        for stamp in rec["stamps"].values():
            p, size, mtime = stamp.rsplit("|", 2)
            st = os.stat(p)
            if st.st_size != int(size) or st.st_mtime_ns != int(mtime):
                return False
        return isinstance(rec["version"], str) and isinstance(rec["sha256"], dict)
    except (OSError, KeyError, TypeError, ValueError, AttributeError):
        return False


def environment() -> tuple[tuple[str, str], ...]:
    """The nvcc-relevant environment variables that are set."""
    environ = os.environ
    return tuple((k, environ[k]) for k in ENV_VARS if k in environ)


def target_arches(nvcc: Nvcc | str) -> list[str]:
    """The real arches (``sm_XX``) this nvcc builds cubins for (``--list-gpu-code``)."""
    path = nvcc.path if isinstance(nvcc, Nvcc) else os.fspath(nvcc)
    proc = _run([path, "--list-gpu-code"])
    found = [a for a in proc.stdout.decode("utf-8", "replace").split() if _ARCH_RE.match(a)]
    return sorted(set(found), key=lambda a: int("".join(c for c in a if c.isdigit()) or 0))


# -- choosing a compiler ------------------------------------------------------------------

#: The compilers ``compile(..., compiler=)`` takes; ``None`` picks nvcc where found, else NVRTC.
COMPILERS = ("nvcc", "nvrtc")

#: Version spellings, most precise first: nvcc's "V13.0.88", its "release 13.0", NVRTC's "13.5".
_VERSION_RES = tuple(re.compile(p) for p in (r"V(\d+)\.(\d+)\.(\d+)", r"release (\d+)\.(\d+)",
                                             r"^(\d+)\.(\d+)$"))


def compiler_rank(compiler: Iterable[tuple[str, str]]) -> tuple[int, ...]:
    """How new the compiler of stored attributes is, for serving where none is installed.

    >>> compiler_rank([("nvcc_version", "Cuda compilation tools, release 13.0, V13.0.88")])
    (13, 0, 88)
    >>> compiler_rank([("nvrtc_version", "13.5"), ("libnvrtc", "gnu-build-id:ab")])
    (13, 5, 0)
    """
    for name, value in compiler:
        if name in ("nvcc_version", "nvrtc_version"):
            for pattern in _VERSION_RES:
                m = pattern.search(value.strip())
                if m:
                    nums = [int(g) for g in m.groups()]
                    return tuple(nums + [0] * (3 - len(nums)))
    return (0, 0, 0)


def compiler_kind(compiler: Iterable[tuple[str, str]]) -> str | None:
    """``"nvcc"`` or ``"nvrtc"``: which compiler stored attributes name.

    >>> compiler_kind([("nvrtc_version", "13.5")])
    'nvrtc'
    """
    names = {name for name, _ in compiler}
    return next((k for k in COMPILERS if f"{k}_version" in names), None)


def _configured(explicit: object, variable: str) -> bool:
    return explicit is not None or bool(os.environ.get(variable, "").strip())


def find_compiler(compiler: str | None = None, nvcc: str | os.PathLike[str] | None = None,
                  memo_dir: str | os.PathLike[str] | None = None
                  ) -> tuple[str | None, NvccIdentity | NvrtcIdentity | None, str]:
    """``(kind, identity, "")`` of the compiler to run, or ``(None, None, why)`` when none is
    installed. A compiler named in ``KDB_NVCC`` / ``KDB_NVRTC`` (or ``nvcc=``) that is not
    there raises: that is a mistake to fix, not a machine without a compiler."""
    if compiler not in (None, *COMPILERS):
        raise InvalidArgumentError(
            f"compiler {compiler!r} is not one of None, 'nvcc', 'nvrtc' (None: nvcc where "
            "one is found, else NVRTC)")
    if nvcc is not None and compiler == "nvrtc":
        raise InvalidArgumentError("nvcc= names an nvcc, but compiler='nvrtc': drop one")
    why = []
    if compiler in (None, "nvcc") or nvcc is not None:
        try:
            return "nvcc", identity(find_nvcc(nvcc), memo_dir), ""
        except BackendUnavailableError as err:
            if _configured(nvcc, config.ENV_NVCC):
                raise
            why.append(str(err).split(". ", 1)[0] + ".")  # what is missing, not the remedy
        if compiler == "nvcc" or nvcc is not None:
            return None, None, why[0]
    try:
        return "nvrtc", _nvrtc.identity(_nvrtc.find_nvrtc(), memo_dir), ""
    except BackendUnavailableError as err:
        if _configured(None, config.ENV_NVRTC):
            raise
        why.append(str(err).split(". ", 1)[0] + ".")
    return None, None, " ".join(why)


# -- requests -----------------------------------------------------------------------------

@dataclass(frozen=True)
class _Request:
    text: str
    arch: str
    output: str
    options: tuple[str, ...]  # without -I
    include_dirs: tuple[str, ...]  # absolute
    tool: NvccIdentity | NvrtcIdentity | None  # None: no compiler here
    attrs: HashAttributes
    wanted: str | None = None  # the compiler asked for (None: any)
    missing: str = ""  # why no compiler was found

    @property
    def nvcc(self) -> NvccIdentity:
        assert isinstance(self.tool, NvccIdentity)
        return self.tool

    def command(self, src: str, out: str) -> list[str]:
        return [self.nvcc.path, OUTPUTS[self.output], f"-arch={self.arch}", *self.options,
                *(f"-I{d}" for d in self.include_dirs), "-o", out, src]

    def details(self) -> dict[str, Any]:
        """Machine-local facts kept beside the entry for ``kdb explain``, never in the key."""
        import platform as _platform

        tool = self.tool
        where = ({"nvrtc": tool.path} if isinstance(tool, NvrtcIdentity)
                 else {"nvcc": tool.path, "toolkit": tool.toolkit} if tool else {})
        return {**where, "release": tool.release if tool else "",
                "include_dirs": list(self.include_dirs), "host": _platform.node()}


def _request(source: str | bytes, arch: str, options: str | Sequence[str] | None,
             include_dirs: Iterable[str | os.PathLike[str]] | None, output: str,
             nvcc: str | os.PathLike[str] | None, memo_dir: str | os.PathLike[str] | None,
             name: str | None, compiler: str | None = None) -> _Request:
    text = _text(source)
    check_arch(arch, output)
    rest, option_dirs = split_include_options(split_options(options))
    _check_options(rest)
    if isinstance(include_dirs, (str, os.PathLike)):
        raise InvalidArgumentError("include_dirs must be a sequence of directories, not one")
    if compiler == "nvrtc" and output == "fatbin":
        raise InvalidArgumentError("NVRTC builds cubins and PTX, not fatbins: use "
                                   "output='cubin' or 'ptx', or compiler='nvcc'")
    dirs = tuple(os.path.abspath(os.fspath(d)) for d in (*(include_dirs or ()), *option_dirs))
    kind, ident, missing = find_compiler(compiler, nvcc, memo_dir)
    if kind == "nvrtc" and output == "fatbin":
        raise BackendUnavailableError(
            "a fatbin needs nvcc, and none was found (NVRTC, found instead, builds cubins and "
            f"PTX only): install the CUDA toolkit and set {config.ENV_NVCC} or CUDA_HOME")
    attrs = HashAttributes(
        backend=BACKEND,
        source=text,
        arch=arch,
        build_options=tuple(rest),
        internal_options=(OUTPUTS[output],),
        headers=header_digests(text, dirs),
        compiler=ident.compiler if ident else (),
        # nvcc reads these variables; NVRTC reads none. With no compiler, the entries built
        # with the same variables are the ones to serve.
        environment=() if kind == "nvrtc" else environment(),
        name=name or _label(text),
    )
    return _Request(text, arch, output, tuple(rest), dirs, ident, attrs, compiler, missing)


def attributes_for(source: str | bytes, arch: str = "sm_90",
                   options: str | Sequence[str] | None = (),
                   include_dirs: Iterable[str | os.PathLike[str]] | None = (),
                   output: str = "cubin", *, nvcc: str | os.PathLike[str] | None = None,
                   memo_dir: str | os.PathLike[str] | None = None,
                   name: str | None = None, compiler: str | None = None) -> HashAttributes:
    """The hash attributes :func:`compile` looks up for these arguments (with no compiler
    installed: an empty compiler identity, whose key is the compiler-free key)."""
    return _request(source, arch, options, include_dirs, output, nvcc, memo_dir, name,
                    compiler).attrs


# -- compiling ----------------------------------------------------------------------------

def _run_nvcc(req: _Request) -> bytes:
    """nvcc in a temporary directory; its failure is a :class:`kdb.CompileError`."""
    import subprocess
    import tempfile

    out_name = f"kernel.{req.output}"
    with tempfile.TemporaryDirectory(prefix="kdb-nvcc-") as tmp:
        with open(os.path.join(tmp, "kernel.cu"), "w", encoding="utf-8") as f:
            f.write(req.text)
        cmd = req.command("kernel.cu", out_name)
        try:
            proc = subprocess.run(cmd, cwd=tmp, capture_output=True)
        except OSError as err:
            raise BackendUnavailableError(
                f"cannot run {req.nvcc.path}: {err}; set {config.ENV_NVCC} or CUDA_HOME "
                "to a working nvcc") from err
        said = (proc.stderr + proc.stdout).decode("utf-8", "replace")
        out_path = os.path.join(tmp, out_name)
        if proc.returncode != 0 or not os.path.isfile(out_path):
            why = f"exit status {proc.returncode}" if proc.returncode else "no output file"
            err = CompileError(
                f"nvcc failed ({why}) building {req.attrs.name} for {req.arch}; fix the "
                f"source or options. Command (run in a temporary directory): "
                f"{shlex.join(cmd)}", log=said, options=req.options)
            err.command = cmd  # type: ignore[attr-defined]
            raise err
        with open(out_path, "rb") as f:
            data = f.read()
    if said.strip():
        log.debug("kdb: nvcc said, building %s: %s", req.attrs.name, said.strip())
    return data


def _build(req: _Request) -> bytes:
    """Run the request's compiler (nvcc or NVRTC); its failure is a :class:`kdb.CompileError`."""
    if isinstance(req.tool, NvrtcIdentity):
        data, said = _nvrtc.run(req.tool.path, req.text, req.arch, req.output, req.options,
                                req.include_dirs, req.attrs.name)
        if said.strip():
            log.debug("kdb: NVRTC said, building %s: %s", req.attrs.name, said.strip())
        return data
    return _run_nvcc(req)


def _stored_builds(db: KernelDB, req: _Request) -> list:
    """With no compiler here: the stored builds that match on all but the compiler, newest
    compiler first (:mod:`kdb.fallback`); none raises, naming the arch and what to install."""
    from .. import fallback
    from ..discovery import dist_name

    accept = None if req.wanted is None else (lambda c: compiler_kind(c) == req.wanted)
    found = fallback.candidates(db, req.attrs, compiler_rank, accept)
    if found:
        return found
    which = f"{req.wanted} " if req.wanted else ""
    raise BackendUnavailableError(
        f"no {which}compiler is installed and no stored binary of {req.attrs.name} for "
        f"{req.arch} matches this request ({req.output}, these options and headers). Install "
        f"the system database for {req.arch} (pip install {dist_name(req.arch)}, or the "
        f"package your framework publishes; KDB_SYSTEM_DB_PATH for a directory), or a "
        f"compiler: pip install 'kdb[cuda]' (NVRTC, no toolkit needed), or the CUDA toolkit "
        f"({config.ENV_NVCC} or CUDA_HOME). Looked for: {req.missing}")


def _compile_and_store(db: KernelDB, req: _Request) -> bytes:
    """A miss: compile now, log the compile, store the result in the background."""
    start = time.perf_counter()
    binary = _build(req)
    seconds = time.perf_counter() - start
    rec = db.record_compile(req.attrs, seconds)
    db.put_later(req.attrs, lambda: binary, compile_seconds=seconds, details=req.details(),
                 log=rec)
    return binary


def compile(source: str | bytes, arch: str = "sm_90",  # noqa: A001 - the natural name
            options: str | Sequence[str] | None = (),
            include_dirs: Iterable[str | os.PathLike[str]] | None = (),
            output: str = "cubin", *, db: KernelDB | None = None, name: str | None = None,
            nvcc: str | os.PathLike[str] | None = None, compiler: str | None = None) -> bytes:
    """The cubin (or PTX, or fatbin) of ``source`` for ``arch``, from kdb when it holds it.

    ``compiler``: ``"nvcc"``, ``"nvrtc"``, or ``None`` (nvcc where one is found, else
    NVRTC); NVRTC builds no fatbins. ``-I`` directories (in ``include_dirs`` or
    ``options``) are passed to the compiler; the headers they bring in enter the key by
    content. With no compiler installed, the stored build of the newest compiler that
    matches on everything else answers (:mod:`kdb.fallback`). Raises
    :class:`kdb.CompileError` with the compiler's message when it fails,
    :class:`kdb.BackendUnavailableError` when there is no compiler and no stored build.
    """
    db = db or default_db()
    req = _request(source, arch, options, include_dirs, output, nvcc, db.cache_root, name,
                   compiler)
    if req.tool is None:
        from ..fallback import served

        best = _stored_builds(db, req)[0]
        served(db, req.attrs, best)
        return best.binary
    return db.get_or_compile(req.attrs, lambda: _build(req), details=req.details())


# -- loading (pycuda) ---------------------------------------------------------------------

_INSTALL_HINT = "pip install 'kdb[pycuda]'"


def _pycuda_driver() -> Any:
    """``pycuda.driver``, or a :class:`kdb.BackendUnavailableError` saying what is missing."""
    try:
        import pycuda  # noqa: F401
    except ImportError as err:
        raise BackendUnavailableError(
            f"kdb.cuda.SourceModule needs pycuda, which is not installed: {_INSTALL_HINT} "
            "(pycuda builds against the CUDA toolkit, and loading a module needs a GPU and "
            "its driver). kdb.cuda.compile() works without it.") from err
    try:
        import pycuda.driver as drv
    except ImportError as err:
        raise BackendUnavailableError(
            f"pycuda is installed but pycuda.driver does not load ({err}): it needs the NVIDIA "
            "driver's libcuda.so.1, which exists only where a GPU and its driver are "
            "installed. kdb.cuda.compile() works without it.") from err
    return drv


def _context_arch(drv: Any) -> str:
    error = getattr(drv, "Error", Exception)
    try:
        major, minor = drv.Context.get_device().compute_capability()
    except error as err:
        raise BackendUnavailableError(
            f"no current CUDA context ({err}): create one first (import pycuda.autoinit, or "
            "pycuda.driver.Device(0).make_context()); loading a module needs a GPU") from err
    return f"sm_{major}{minor}"


def _pycuda_include_dirs() -> list[str]:
    try:
        from pycuda.compiler import _find_pycuda_include_path

        return [_find_pycuda_include_path()]
    except Exception as err:  # noqa: BLE001 - pycuda's private helper; its headers are optional
        log.debug("kdb: pycuda's include directory not found: %s", err)
        return []


class SourceModule:
    """A drop-in for ``pycuda.compiler.SourceModule`` whose cubin comes from kdb.

    Same arguments and behaviour as pycuda's (the source wrapped in ``extern "C"`` unless
    ``no_extern_c``; ``options=None`` means ``PYCUDA_DEFAULT_NVCC_FLAGS``; pycuda's include
    directory added), built for ``arch`` or the current context's device and loaded with
    ``pycuda.driver.module_from_buffer``. ``keep`` and ``cache_dir`` are accepted and
    ignored: kdb is the cache. A stored cubin the driver refuses is dropped and rebuilt.
    """

    def __init__(self, source: str | bytes, nvcc: str = "nvcc",
                 options: str | Sequence[str] | None = None, keep: bool = False,
                 no_extern_c: bool = False, arch: str | None = None, code: str | None = None,
                 cache_dir: Any = None, include_dirs: Sequence[str] = (), *,
                 db: KernelDB | None = None, name: str | None = None,
                 compiler: str | None = None) -> None:
        del keep, cache_dir
        if code is not None:
            raise InvalidArgumentError(
                "kdb.cuda.SourceModule builds one cubin for arch=; code= is not supported")
        drv = _pycuda_driver()
        device_arch = _context_arch(drv)
        arch = arch or device_arch
        text = _text(source)
        if not no_extern_c:
            text = 'extern "C" {\n%s\n}\n' % text
        if options is None:
            options = os.environ.get("PYCUDA_DEFAULT_NVCC_FLAGS", "").split()
        db = db or default_db()
        req = _request(text, arch, options, [*include_dirs, *_pycuda_include_dirs()],
                       "cubin", None if nvcc == "nvcc" else nvcc, db.cache_root, name,
                       compiler)
        self.arch = arch
        if req.tool is None:
            self.module = self._load_stored_build(drv, db, req)
            self._bind_module()
            return
        compiled = []

        def build() -> bytes:
            compiled.append(True)
            return _build(req)

        binary = db.get_or_compile(req.attrs, build, details=req.details())
        try:
            self.module = drv.module_from_buffer(binary)
        except getattr(drv, "Error", Exception) as err:
            if compiled:
                raise  # nvcc's own fresh output: not a cache fault
            db.discard(req.attrs, f"the driver refused the stored cubin ({err})")
            self.module = drv.module_from_buffer(_compile_and_store(db, req))
        self._bind_module()

    @staticmethod
    def _load_stored_build(drv: Any, db: KernelDB, req: _Request) -> Any:
        """No compiler here: load the best stored build the driver accepts, dropping those
        it refuses."""
        from ..fallback import served

        error = getattr(drv, "Error", Exception)
        builds = _stored_builds(db, req)
        for i, cand in enumerate(builds):
            try:
                module = drv.module_from_buffer(cand.binary)
            except error as err:
                db.discard(cand.attrs, f"the driver refused the stored cubin ({err})")
                if i == len(builds) - 1:
                    raise
                continue
            served(db, req.attrs, cand)
            return module
        raise AssertionError("unreachable: _stored_builds returns at least one build")

    def _bind_module(self) -> None:
        self.get_global = self.module.get_global
        self.get_texref = self.module.get_texref
        if hasattr(self.module, "get_surfref"):
            self.get_surfref = self.module.get_surfref

    def get_function(self, name: str) -> Any:
        return self.module.get_function(name)
