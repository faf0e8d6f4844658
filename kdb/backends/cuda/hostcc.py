"""The host compiler nvcc runs: part of nvcc's identity, because it shapes the device code.

nvcc preprocesses a ``.cu`` for the device with the host compiler (``gcc -E -x c++
-D__CUDA_ARCH__=900 ...``) and tells cicc which compiler that was (``--gnu_version=120200``,
``--clang_version=150000``) and its default C++ dialect. The device code sees that
compiler's predefined macros (``__GNUC__``, ``__clang__``, its ``-march`` defaults), and
CUDA's own headers branch on them. So one nvcc with another host compiler (a ``module load
gcc/13``, ``NVCC_CCBIN``, ``-ccbin``) builds another cubin from the same source, and the
compiler nvcc would run enters the key by its predefined macros (``-dM -E -x c++``: its
version, target, dialect and defaults, and no path, so that one compiler installed at
another place is the same key), remembered per machine by the binary's stamp.

nvcc picks it as it documents: the last ``-ccbin`` / ``--compiler-bindir`` of
``NVCC_PREPEND_FLAGS``, the options and ``NVCC_APPEND_FLAGS``; else ``NVCC_CCBIN``; else
``gcc``. A directory means its ``gcc``; a bare name is looked up on nvcc's ``PATH`` (its own
directories first, as its dry run shows).
"""

from __future__ import annotations

import os
import shlex
import shutil
from dataclasses import dataclass
from typing import Mapping, Sequence

from .. import stdlibs

#: The host compiler nvcc runs on Linux when nothing names one.
DEFAULT = "gcc"

_OPTIONS = ("-ccbin", "--compiler-bindir")


def named(options: Sequence[str], variables: Mapping[str, str | None]) -> str:
    """What names the host compiler for this build (a path, a directory or a bare name).

    >>> named(["-O3", "-ccbin", "clang-15"], {"NVCC_CCBIN": "g++-12"})
    'clang-15'
    >>> named([], {"NVCC_CCBIN": "g++-12", "NVCC_APPEND_FLAGS": "--compiler-bindir=/opt/gcc13"})
    '/opt/gcc13'
    >>> named([], {})
    'gcc'
    """
    words = [*_split(variables.get("NVCC_PREPEND_FLAGS")), *options,
             *_split(variables.get("NVCC_APPEND_FLAGS"))]
    found = None
    it = iter(words)
    for word in it:
        name, eq, value = word.partition("=")
        if name in _OPTIONS:
            found = value if eq else next(it, None)
    return found or (variables.get("NVCC_CCBIN") or "").strip() or DEFAULT


def _split(text: str | None) -> list[str]:
    try:
        return shlex.split(text or "")
    except ValueError:  # unbalanced quotes: nvcc refuses such flags, and so the build fails
        return (text or "").split()


def resolve(spec: str, nvcc_dir: str, cwd: str) -> str | None:
    """The host compiler file ``spec`` names for an nvcc in ``nvcc_dir``; None where there
    is none (nvcc fails then, and nothing is stored)."""
    if os.sep in spec or spec in (".", ".."):
        path = os.path.join(cwd, os.path.expanduser(spec))
        if os.path.isdir(path):
            path = os.path.join(path, DEFAULT)
        return os.path.realpath(path) if os.path.isfile(path) else None
    top = os.path.dirname(nvcc_dir)
    search = os.pathsep.join([os.path.join(top, "nvvm", "bin"), nvcc_dir,
                              os.environ.get("PATH", os.defpath)])
    found = shutil.which(spec, path=search)
    return os.path.realpath(found) if found else None


@dataclass(frozen=True)
class HostCompiler:
    """The host compiler a build's nvcc runs: the key's pairs, and the directories it
    searches with no option (real paths; what nvcc reads there comes with that compiler or
    the system, as the toolkit's own headers do)."""

    pairs: tuple[tuple[str, str], ...]
    include_dirs: tuple[str, ...] = ()
    named: str = ""  # what named it (``gcc``, a ``-ccbin`` value)
    path: str | None = None  # the file it is (machine-local: never in a key)

    @property
    def label(self) -> str:
        """Its kind and version (``gcc 12.2.0``), or ``missing: gcc``."""
        return self.pairs[0][1]

    @property
    def stdlib(self) -> str:
        """The C and C++ libraries it finds (``libstdc++ 12 20220819, glibc 2.36``), or ''."""
        return dict(self.pairs).get("host_stdlib", "")

    @property
    def missing(self) -> bool:
        """Whether no such compiler is there: nvcc then builds nothing at all."""
        return self.pairs[0][1].startswith("missing: ")


_identities: dict[tuple, HostCompiler] = {}
#: Where each name was found, per ``PATH`` (a lookup stats every directory on it).
_found: dict[tuple, str | None] = {}


def identity(spec: str, nvcc_dir: str, cwd: str, memo_dir: str | os.PathLike[str]) -> HostCompiler:
    """The host compiler ``spec`` names: ``host_compiler`` (its kind and ``__VERSION__``, to
    read) and ``host_compiler_macros_sha256`` (what tells compilers apart); one that is not
    there is named as missing (the build fails, and nothing is stored)."""
    where = (spec, nvcc_dir, os.environ.get("PATH"), cwd if os.sep in spec else "")
    path = _found[where] if where in _found else _found.setdefault(
        where, resolve(spec, nvcc_dir, cwd))
    try:
        st = os.stat(path) if path is not None else None
    except OSError:
        st = None
    if path is None or st is None:
        return HostCompiler((("host_compiler", f"missing: {spec}"),), named=spec, path=path)
    memo = (path, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    found = _identities.get(memo)
    if found is None:
        rec = stdlibs.facts(path, memo_dir)
        dirs = rec.get("include_dirs")
        found = HostCompiler((("host_compiler", str(rec.get("version", ""))),
                              ("host_compiler_macros_sha256", str(rec.get("macros", ""))),
                              ("host_stdlib", str(rec.get("stdlib", "")))),
                             tuple(d for d in dirs if isinstance(d, str))
                             if isinstance(dirs, list) else (), spec, path)
        _identities[memo] = found
    return found
