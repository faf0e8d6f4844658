"""HIP requests: the arguments of a build checked, the compiler chosen, and its key.

A request is everything :func:`kdb.hip.compile` looks up: the source, the target, the
options and include directories, the compiler's identity (:mod:`.hipcc` or :mod:`.hiprtc`),
or none where none is installed, and the variables hipcc reads. The key's ``arch`` is the
processor (``gfx90a``: one system file per processor, whatever its features); the full
target ID (``gfx90a:sramecc+:xnack-``) is in its internal options, so each feature setting
is its own entry.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from ... import config
from ...errors import BackendUnavailableError, InvalidArgumentError, UnsupportedTypeError
from ...keys import HashAttributes
from ..common import label, source_text
from ..includes import UncertainIncludes, read_headers, temporal_options
from . import hipcc as _hipcc
from . import hiprtc as _hiprtc
from .hipcc import HipccIdentity
from .hiprtc import HiprtcIdentity
from .search import VARIABLES as _SEARCH_VARIABLES
from .search import hip_search
from ..optsearch import searching_site
from .targets import canonical, check_known, parse_target

BACKEND = "hip"
#: The compilers ``compile(..., compiler=)`` takes; ``None`` picks hipcc where found, else HIPRTC.
COMPILERS = ("hipcc", "hiprtc")
#: Options that name the target: pass ``arch=``.
ARCH_OPTIONS = frozenset({"--offload-arch", "--amdgpu-target"})
#: Options that make the build write a list of the headers: kdb finds them itself.
DEPENDENCY_OPTIONS = frozenset({"-MD", "-MF", "-M", "-MM", "-MMD", "-MT", "-MP", "-MQ"})
#: Options kdb sets itself (the target, what is written, and where).
RESERVED_OPTIONS = ARCH_OPTIONS | DEPENDENCY_OPTIONS | frozenset({
    "--genco", "--cuda-device-only", "-o", "-c", "-E", "--no-gpu-bundle-output",
    "--gpu-bundle-output", "-x",
})
_KERNEL_RE = re.compile(r"__global__\s+(?:__launch_bounds__\s*\([^()]*(?:\([^()]*\)[^()]*)*\)"
                        r"\s*)?void\s+(\w+)")


def split_options(options: str | Sequence[str] | None) -> list[str]:
    """Options as a list; a string is split the way a shell would.

    >>> split_options("-DN=4 -ffast-math")
    ['-DN=4', '-ffast-math']
    """
    if options is None:
        return []
    if isinstance(options, str):
        try:
            return shlex.split(options)
        except ValueError as err:
            raise InvalidArgumentError(
                f"HIP options {options[:80]!r} cannot be split like a shell line ({err}); "
                "close the quote or pass the options as a list") from None
    if isinstance(options, (bytes, bytearray)) or not isinstance(options, Iterable):
        raise UnsupportedTypeError("HIP options must be a string or a list of strings, not "
                                   f"{type(options).__name__}")
    out = list(options)
    for opt in out:
        if not isinstance(opt, str):
            raise UnsupportedTypeError(
                f"HIP options must be strings; got {type(opt).__name__} ({opt!r})")
        _check_option(opt)
    return out


def _check_option(opt: str) -> None:
    """An option kdb sets itself is refused, with what to do instead."""
    name = opt.split("=", 1)[0]
    if name in ARCH_OPTIONS:
        raise InvalidArgumentError(f"option {opt!r} is set by kdb: pass arch= (e.g. 'gfx90a' "
                                   "or 'gfx90a:sramecc+:xnack-') instead")
    if name in DEPENDENCY_OPTIONS:
        raise InvalidArgumentError(
            f"option {opt!r} writes a list of the headers: leave it out (kdb finds every "
            "header the build reads; `kdb explain` shows them)")
    if name in RESERVED_OPTIONS:
        raise InvalidArgumentError(
            f"option {opt!r} is set by kdb, which builds a code object (--genco) and returns "
            "its bytes: leave it out")


def kernel_names(source: str) -> list[str]:
    """``__global__`` function names in HIP source (for labels).

    >>> kernel_names('extern "C" __global__ void add(float *a) {}')
    ['add']
    """
    return _KERNEL_RE.findall(source)


def compiler_rank(compiler: Iterable[tuple[str, str]]) -> tuple[int, ...]:
    """How new the compiler of stored attributes is, for serving where none is installed.

    >>> compiler_rank([("hipcc_version", "HIP version: 5.2.21153-0\\nclang version 15.0.6")])
    (5, 2, 21153)
    """
    for name, value in compiler:
        if name in ("hipcc_version", "hiprtc_version"):
            m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", value)
            if m:
                return tuple(int(g or 0) for g in m.groups())
    return (0, 0, 0)


def compiler_kind(compiler: Iterable[tuple[str, str]]) -> str | None:
    """``"hipcc"`` or ``"hiprtc"``: which compiler stored attributes name."""
    names = {name for name, _ in compiler}
    return next((k for k in COMPILERS if f"{k}_version" in names), None)


Identity = HipccIdentity | HiprtcIdentity


def _configured(explicit: object, variable: str) -> bool:
    if explicit is not None:
        return True
    return bool((config.read_variables((variable,))[variable] or "").strip())


def find_compiler(compiler: str | None = None, hipcc: str | os.PathLike[str] | None = None,
                  memo_dir: str | os.PathLike[str] | None = None
                  ) -> tuple[str | None, Identity | None, str]:
    """``(kind, identity, "")`` of the compiler to run, or ``(None, None, why)`` when none
    is installed. A compiler named in ``KDB_HIPCC`` / ``KDB_HIPRTC`` (or ``hipcc=``) that
    is not there raises: that is a mistake to fix, not a machine without a compiler."""
    if compiler not in (None, *COMPILERS):
        raise InvalidArgumentError(f"compiler {compiler!r} is not one of None, 'hipcc', "
                                   "'hiprtc' (None: hipcc where one is found, else HIPRTC)")
    if hipcc is not None and compiler == "hiprtc":
        raise InvalidArgumentError("hipcc= names a hipcc, but compiler='hiprtc': drop one")
    why = []
    if compiler in (None, "hipcc") or hipcc is not None:
        try:
            path = _hipcc.find_hipcc(hipcc)
            return "hipcc", _hipcc.identity(path, memo_dir), ""
        except BackendUnavailableError as err:
            if _configured(hipcc, config.ENV_HIPCC):
                raise
            why.append(str(err))
        if compiler == "hipcc":
            return None, None, why[0]
    try:
        path = _hiprtc.find_hiprtc()
        return "hiprtc", _hiprtc.identity(path, memo_dir), ""
    except BackendUnavailableError as err:
        if _configured(None, config.ENV_HIPRTC):
            raise
        why.append(str(err))
    return None, None, " ".join(why)


@dataclass(frozen=True)
class Request:
    """One checked HIP build request and its key."""

    text: str
    target: str  # the canonical target ID
    options: tuple[str, ...]  # without include options
    include_args: tuple[str, ...]
    include_dirs: tuple[str, ...]
    tool: Identity | None
    attrs: HashAttributes
    wanted: str | None = None
    missing: str = ""
    uncertain: str | None = None
    header_files: frozenset = frozenset()
    search: Any = None
    cwd: str = ""
    system_dirs: tuple[str, ...] = ()  # hipcc's default include dirs, unkeyed

    def headers_now(self) -> tuple[tuple[str, str], ...]:
        """The key's headers as they are now, found as the key found them."""
        return read_headers(self.text, self.search, self.cwd, main_in_cwd=False,
                            cwd_in_path=False)

    def command(self, src: str, out: str) -> list[str]:
        assert isinstance(self.tool, HipccIdentity)
        return [self.tool.path, "--genco", "--no-gpu-bundle-output",
                f"--offload-arch={self.target}", *self.options, *self.include_args,
                "-o", out, src]

    def details(self) -> dict[str, Any]:
        """Machine-local facts kept beside the entry for ``kdb explain``, never in the key."""
        import platform as _platform

        tool = self.tool
        return {"compiler": tool.path if tool else "", "release": tool.release if tool else "",
                "target": self.target, "include_dirs": list(self.include_dirs),
                "host": _platform.node()}


def request(source: str | bytes, arch: str, options: str | Sequence[str] | None,
            include_dirs: Iterable[str | os.PathLike[str]] | None, *,
            hipcc: str | os.PathLike[str] | None = None,
            memo_dir: str | os.PathLike[str] | None = None, name: str | None = None,
            compiler: str | None = None) -> Request:
    """The checked request and its key; an arch the installed compiler does not build is
    :class:`kdb.InvalidArgumentError` naming those it does."""
    text = source_text(source, "HIP")
    target = canonical(arch)
    processor = config.check_arch(parse_target(target)[0])
    given = split_options(options)
    if isinstance(include_dirs, (str, os.PathLike)):
        raise InvalidArgumentError("include_dirs must be a sequence of directories, not one")
    kind, ident, missing = find_compiler(compiler, hipcc, memo_dir)
    if ident is not None:
        llvm = ident.llvm if isinstance(ident, HipccIdentity) else ident.built
        check_known(target, list(llvm), list(ident.built), kind or "")
    cwd = _cwd()
    found = hip_search(given, [os.fspath(d) for d in include_dirs or ()], kind != "hiprtc",
                       config.read_variables(_SEARCH_VARIABLES), cwd)
    # clang searches /usr/local/include by default: what hipcc finds there is keyed
    found, system_dirs = searching_site(
        found, ident.system_dirs if isinstance(ident, HipccIdentity) else ())
    files: set[tuple[int, int]] = set()
    env = _hiprtc.environment() if kind == "hiprtc" else _hipcc.environment()
    try:
        if found.problem:
            raise UncertainIncludes("option", found.problem)
        if (err := temporal_options((*given, *(v for _, v in env)))) is not None:
            raise err
        headers = read_headers(text, found.search, cwd, main_in_cwd=False, cwd_in_path=False,
                               files=files)
        uncertain = None
    except UncertainIncludes as err:
        headers, uncertain = (("?", "uncertain"),), str(err)
    attrs = HashAttributes(
        backend=BACKEND, source=text, arch=processor, build_options=found.rest,
        internal_options=("--genco", f"--offload-arch={target}"), headers=headers,
        compiler=ident.compiler if ident else (),
        environment=env,
        name=name or label(_KERNEL_RE, text, "module"))
    return Request(text, target, found.rest, found.args, found.dirs, ident, attrs, compiler,
                   missing, uncertain, frozenset(files), found.search, cwd, system_dirs)


def _cwd() -> str:
    try:
        return os.getcwd()
    except OSError:
        return ""


def attributes_for(source: str | bytes, arch: str = "gfx90a",
                   options: str | Sequence[str] | None = (),
                   include_dirs: Iterable[str | os.PathLike[str]] | None = (), *,
                   hipcc: str | os.PathLike[str] | None = None,
                   memo_dir: str | os.PathLike[str] | None = None, name: str | None = None,
                   compiler: str | None = None) -> HashAttributes:
    """The hash attributes :func:`kdb.hip.compile` looks up for these arguments."""
    return request(source, arch, options, include_dirs, hipcc=hipcc, memo_dir=memo_dir,
                   name=name, compiler=compiler).attrs
