"""CUDA requests: the arguments of a build checked, the compiler chosen, and its key.

A request is everything :func:`kdb.cuda.compile` and :class:`kdb.cuda.SourceModule` look up:
the source, the arch, the output kind, the options and include directories, and the
compiler's identity (:mod:`.nvcc` or :mod:`.nvrtc`), or none where none is installed.
"""

from __future__ import annotations

import os
import re
import shlex
import struct
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from ... import config
from ...errors import BackendUnavailableError, InvalidArgumentError, UnsupportedTypeError
from ..includes import UncertainIncludes, read_headers, temporal_options
from ...keys import HashAttributes
from . import hostcc
from . import nvrtc as _nvrtc
from ..common import label, source_text
from .nvcc import ARCH_RE as _ARCH_RE
from .nvcc import NvccIdentity, find_nvcc, identity
from .nvrtc import NvrtcIdentity
from .search import VARIABLES as _SEARCH_VARIABLES
from .search import cuda_search
from ..optsearch import searching_site

BACKEND = "cuda"

#: Output kinds and the nvcc flag that makes each.
OUTPUTS = {"cubin": "-cubin", "ptx": "-ptx", "fatbin": "-fatbin"}

#: Variables nvcc reads that change what it produces. The nvcc guide documents the first
#: three. ``nvcc.profile`` writes ``PTXAS_FLAGS +=``, ``CUDAFE_FLAGS +=``, ``INCLUDES +=``
#: and ``SYSTEM_INCLUDES +=``: nvcc keeps what the environment holds and adds the profile's
#: (``PTXAS_FLAGS=-O0`` is ptxas's -O0, ``INCLUDES=-I<dir>`` one more directory). The
#: profile's other ``+=`` names are not about device code: ``LIBRARIES`` links, and
#: ``PATH`` / ``LD_LIBRARY_PATH`` get the toolkit's own directories first, so its cicc and
#: ptxas run, whose identity is in the key. No ``CUDA_*`` variable changes nvcc's output:
#: ``CUDA_CACHE_*`` steer the driver's JIT cache, ``CUDA_HOME`` / ``KDB_NVCC`` only choose
#: the nvcc. ``CCC_OVERRIDE_OPTIONS`` edits the arguments of clang's driver, which
#: preprocesses the device code where clang is nvcc's host compiler.
ENV_VARS = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN", "PTXAS_FLAGS",
            "CUDAFE_FLAGS", "INCLUDES", "SYSTEM_INCLUDES", "CCC_OVERRIDE_OPTIONS")

#: Options that kdb sets itself (arch, output kind, output file): pass ``arch=`` / ``output=``.
RESERVED_OPTIONS = frozenset({
    "-arch", "--gpu-architecture", "-gencode", "--generate-code", "-code", "--gpu-code",
    "-o", "--output-file", "-odir", "--output-directory", "-cubin", "--cubin", "-ptx",
    "--ptx", "-fatbin", "--fatbin", "-c", "--compile", "-E", "--preprocess",
})
#: Options that make nvcc write a make rule of the headers (instead of, or beside, the
#: binary, where kdb reads its own ``-MD`` list): kdb finds the headers itself.
DEPENDENCY_OPTIONS = frozenset({
    "-M", "--generate-dependencies", "-MM", "--generate-nonsystem-dependencies",
    "-MD", "--generate-dependencies-with-compile", "-MMD",
    "--generate-nonsystem-dependencies-with-compile", "-MF", "--dependency-output",
    "-MT", "--dependency-target-name", "-MP", "--generate-dependency-targets",
})

# Arguments nest one deep, written as in opencl/keys.py: one way to match, a miss is linear
# ([^)]* rescanned the rest of the source from every "__launch_bounds__(" left open).
_KERNEL_RE = re.compile(r"__global__\s+(?:__launch_bounds__\s*\([^()]*(?:\([^()]*\)[^()]*)*\)"
                        r"\s*)?void\s+(\w+)")
_EM_CUDA = 190


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
        try:
            return shlex.split(options)
        except ValueError as err:  # "No closing quotation": a KdbError, still a ValueError
            raise InvalidArgumentError(
                f"nvcc options {options[:80]!r} cannot be split like a shell line ({err}); "
                "close the quote or pass the options as a list") from None
    try:
        items = list(options)
    except TypeError:
        raise UnsupportedTypeError(
            f"nvcc options must be a string or a list of strings, not {type(options).__name__}"
        ) from None
    out = []
    for opt in items:
        if not isinstance(opt, str):
            raise UnsupportedTypeError(
                f"nvcc options must be strings; got {type(opt).__name__} ({opt!r})")
        out.append(opt)
    return out


def _check_options(options: Iterable[str]) -> None:
    for opt in options:
        if opt.split("=", 1)[0] in DEPENDENCY_OPTIONS:  # -M returned the rule as a "cubin"
            raise InvalidArgumentError(
                f"option {opt!r} writes a list of the headers, not a binary: leave it out "
                "(kdb finds every header the build reads; `kdb explain` shows them)")
        if opt.split("=", 1)[0] in RESERVED_OPTIONS:
            raise InvalidArgumentError(
                f"option {opt!r} is set by kdb: pass arch= (e.g. 'sm_90') and output= "
                "('cubin', 'ptx' or 'fatbin') instead")


def _check_variables() -> None:
    """nvcc adds ``NVCC_PREPEND_FLAGS`` and ``NVCC_APPEND_FLAGS`` to its arguments: one
    that sets what kdb sets (``-arch=sm_90`` appended to an sm_80 build) made another arch's
    cubin, or PTX, stored and served as the sm_80 cubin."""
    variables = config.read_variables(("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS"))
    for name, value in variables.items():
        if not value:
            continue  # the usual case: nothing to split, on every request, hits too
        try:
            words = shlex.split(value)
        except ValueError:
            continue  # the include search says so (the build is not cached)
        for opt in words:
            head = opt.split("=", 1)[0]
            if head in RESERVED_OPTIONS or head in DEPENDENCY_OPTIONS:
                raise InvalidArgumentError(
                    f"{name} holds {opt!r}, which decides what nvcc writes, and kdb sets "
                    "that for each build (the arch from arch=, the kind of binary from "
                    f"output=): remove it from {name} for the processes that use kdb")


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


def environment() -> tuple[tuple[str, str], ...]:
    """The nvcc-relevant environment variables that are set."""
    variables = config.read_variables(ENV_VARS)
    return tuple((k, v) for k in ENV_VARS if (v := variables[k]) is not None)



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
    if explicit is not None:
        return True
    return bool((config.read_variables((variable,))[variable] or "").strip())


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
    options: tuple[str, ...]  # without include options
    include_args: tuple[str, ...]  # the include options, absolute, in kdb's normal form
    include_dirs: tuple[str, ...]  # the -I and -isystem dirs of the request (for explain)
    tool: NvccIdentity | NvrtcIdentity | None  # None: no compiler here
    attrs: HashAttributes
    wanted: str | None = None  # the compiler asked for (None: any)
    missing: str = ""  # why no compiler was found
    uncertain: str | None = None  # why kdb cannot be sure what the build reads (not cached)
    header_files: frozenset = frozenset()  # (st_dev, st_ino) of the headers the key holds
    search: Any = None  # the IncludeSearch the key's headers came from
    cwd: str = ""  # the caller's working directory when the request was made
    host_dirs: tuple[str, ...] = ()  # its host compiler's default include dirs, unkeyed

    @property
    def nvcc(self) -> NvccIdentity:
        assert isinstance(self.tool, NvccIdentity)
        return self.tool

    def headers_now(self) -> tuple[tuple[str, str], ...]:
        """The key's headers as they are now, found as the key found them (the working
        directory of the request, not the caller's current one)."""
        return read_headers(self.text, self.search, self.cwd,
                            main_in_cwd=isinstance(self.tool, NvrtcIdentity), cwd_in_path=False)

    def command(self, src: str, out: str) -> list[str]:
        return [self.nvcc.path, OUTPUTS[self.output], f"-arch={self.arch}", *self.options,
                *self.include_args, "-o", out, src]

    def details(self) -> dict[str, Any]:
        """Machine-local facts kept beside the entry for ``kdb explain``, never in the key."""
        import platform as _platform

        tool = self.tool
        where = ({"nvrtc": tool.path} if isinstance(tool, NvrtcIdentity)
                 else {"nvcc": tool.path, "toolkit": tool.toolkit} if tool else {})
        return {**where, "release": tool.release if tool else "",
                "include_dirs": list(self.include_dirs), "host": _platform.node()}


def _request(source: str | bytes, arch: str, options: str | Sequence[str] | None,
             include_dirs: Iterable[str | os.PathLike[str]] | None, output: str, *,
             nvcc: str | os.PathLike[str] | None, memo_dir: str | os.PathLike[str] | None,
             name: str | None, compiler: str | None = None) -> _Request:
    text = _text(source)
    check_arch(arch, output)
    given = split_options(options)
    if isinstance(include_dirs, (str, os.PathLike)):
        raise InvalidArgumentError("include_dirs must be a sequence of directories, not one")
    if compiler == "nvrtc" and output == "fatbin":
        raise InvalidArgumentError("NVRTC builds cubins and PTX, not fatbins: use "
                                   "output='cubin' or 'ptx', or compiler='nvcc'")
    kind, ident, missing = find_compiler(compiler, nvcc, memo_dir)
    cwd = _cwd()
    host = _host(kind, ident, tuple(given), cwd, memo_dir)
    if host is not None and host.missing and compiler is None and nvcc is None \
            and output != "fatbin":
        # nvcc builds nothing without its host compiler: NVRTC where it is found, else what
        # is stored is served, as on a machine without nvcc.
        kind, ident, why = find_compiler("nvrtc", None, memo_dir)
        missing = f"nvcc's host compiler ({host.named}) is not installed. {why}".strip()
        host = None
    if kind == "nvrtc" and output == "fatbin":
        raise BackendUnavailableError(
            "a fatbin needs nvcc, and none was found (NVRTC, found instead, builds cubins and "
            f"PTX only): install the CUDA toolkit and set {config.ENV_NVCC} or CUDA_HOME")
    found = cuda_search(given, [os.fspath(d) for d in include_dirs or ()], kind != "nvrtc",
                        config.read_variables(_SEARCH_VARIABLES), cwd)
    _check_options(found.rest)
    if kind == "nvcc":
        _check_variables()
    # nvcc's host compiler searches /usr/local/include too: what it finds there is keyed
    found, host_dirs = searching_site(found, host.include_dirs if host else ())
    files: set[tuple[int, int]] = set()
    env = () if kind == "nvrtc" else environment()
    try:
        if found.problem:
            raise UncertainIncludes("option", found.problem)
        if (err := temporal_options((*given, *(v for _, v in env)))) is not None:
            raise err
        # nvcc compiles a copy in a directory of its own; NVRTC looks beside the program in
        # the working directory; neither puts the working directory on the path.
        headers = read_headers(text, found.search, cwd, main_in_cwd=kind == "nvrtc",
                               cwd_in_path=False, files=files)
        uncertain = None
    except UncertainIncludes as err:
        headers, uncertain = (("?", "uncertain"),), str(err)
    attrs = HashAttributes(
        backend=BACKEND,
        source=text,
        arch=arch,
        build_options=found.rest,
        internal_options=(OUTPUTS[output],),
        headers=headers,
        compiler=(*ident.compiler, *(host.pairs if host else ())) if ident else (),
        # nvcc reads these variables; NVRTC reads none. With no compiler, the entries built
        # with the same variables are the ones to serve.
        environment=env,
        name=name or _label(text),
    )
    args = found.args if kind != "nvrtc" else _nvrtc_args(found.args)
    return _Request(text, arch, output, found.rest, args, found.dirs, ident, attrs, compiler,
                    missing, uncertain, frozenset(files), found.search, cwd, host_dirs)


def _host(kind: str | None, ident, options: tuple[str, ...], cwd: str,
          memo_dir: str | os.PathLike[str] | None) -> hostcc.HostCompiler | None:
    """For nvcc, the host compiler it runs on the device code too (:mod:`.hostcc`)."""
    if kind != "nvcc" or ident is None:
        return None
    return host_compiler(ident, options, cwd, memo_dir)


def host_compiler(ident: NvccIdentity, options: Sequence[str] = (), cwd: str = ".",
                  memo_dir: str | os.PathLike[str] | None = None) -> hostcc.HostCompiler:
    """The host compiler the nvcc of ``ident`` runs for a build with ``options`` (``kdb
    info``: with none), under this process's variables."""
    spec = hostcc.named(options, config.read_variables(ENV_VARS))
    root = memo_dir if memo_dir is not None else config.cache_root()
    return hostcc.identity(spec, os.path.join(ident.toolkit, "bin"), cwd or ".", root)


def _cwd() -> str:
    try:
        return os.getcwd()
    except OSError:  # a deleted working directory: relative paths name nothing
        return ""


def _nvrtc_args(args: tuple[str, ...]) -> tuple[str, ...]:
    """nvcc's normal form of the include options as NVRTC takes them, an element each."""
    out, it = [], iter(args)
    for a in it:
        if a == "-isystem":
            out.append("-I" + next(it))
        elif a == "-include":
            out.append("--pre-include=" + next(it))
        else:
            out.append(a)
    return tuple(out)


def attributes_for(source: str | bytes, arch: str = "sm_90",
                   options: str | Sequence[str] | None = (),
                   include_dirs: Iterable[str | os.PathLike[str]] | None = (),
                   output: str = "cubin", *, nvcc: str | os.PathLike[str] | None = None,
                   memo_dir: str | os.PathLike[str] | None = None,
                   name: str | None = None, compiler: str | None = None) -> HashAttributes:
    """The hash attributes :func:`compile` looks up for these arguments (with no compiler
    installed: an empty compiler identity, whose key is the compiler-free key)."""
    return _request(source, arch, options, include_dirs, output, nvcc=nvcc,
                    memo_dir=memo_dir, name=name,
                    compiler=compiler).attrs


