"""The C and C++ libraries a compiler finds by default, as part of its identity.

Device code reads their headers: HIP's and CUDA's own headers include ``<cmath>``,
``<cstddef>``, ``<stdlib.h>``. kdb does not key the headers of a compiler's default
directories by content (they come with the compiler or the system), so the compiler's
identity names what is there: the macros the libraries' configuration headers define (their
releases, ``__GLIBCXX__``, ``__GLIBC_MINOR__``, ``_LIBCPP_VERSION``, and every option they
were configured with). Which libstdc++ clang reads is not fixed by clang: it takes the
newest GCC installation it finds, so installing another GCC changes the headers of every
build with no change to clang. A machine memo of this is kept while the files it came from
stand as they were (:func:`watched`): the configuration headers, and the directory clang
chose its GCC installation from.

:func:`facts` is a C++ compiler's identity on these terms, once per machine: nvcc's host
compiler (:mod:`.cuda.hostcc`) and the compiler of Inductor's C++ modules (:mod:`.torch`).
hipcc's probe (:mod:`.hip.hipcc`) runs its own device compile and takes :func:`identity`.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from .digests import file_stamp, machine_memo, stamps_hold
from .includes import search_list

#: Seconds a probe of a compiler may take.
_PROBE_TIMEOUT_S = 60

#: What a probe compiles with ``-dM -E``: the C++ library's configuration (through
#: ``<cstddef>``) and the C library's (``<features.h>``), where they exist.
PROBE = ("#if __has_include(<cstddef>)\n#include <cstddef>\n#endif\n"
         "#if __has_include(<features.h>)\n#include <features.h>\n#endif\n")
#: How a label shows each library, by the macros that name its release (the digest holds
#: every macro).
_SHOWN = (("libstdc++ {_GLIBCXX_RELEASE} {__GLIBCXX__}", ("_GLIBCXX_RELEASE", "__GLIBCXX__")),
          ("libc++ {_LIBCPP_VERSION}", ("_LIBCPP_VERSION",)),
          ("glibc {__GLIBC__}.{__GLIBC_MINOR__}", ("__GLIBC__", "__GLIBC_MINOR__")))
#: The headers whose macros say which library release is there.
_CONFIG_RE = re.compile(r"/(?:bits/c\+\+config\.h|__config|features\.h)$")
_SELECTED_RE = re.compile(r"^Selected GCC installation: (.+)$", re.MULTILINE)


def identity(macros: str) -> str:
    """The libraries' label and the sha256 of the macros the probe saw (its ``-dM -E``
    output), for the key.

    >>> identity("#define __GLIBC__ 2\\n#define __GLIBC_MINOR__ 36\\n")[:30]
    'glibc 2.36; macros sha256:cad6'
    """
    lines = sorted(line for line in macros.splitlines() if line.startswith("#define "))
    defined = dict(line[len("#define "):].partition(" ")[::2] for line in lines)
    shown = [shape.format(**{m: defined[m].strip() for m in names})
             for shape, names in _SHOWN if all(m in defined for m in names)]
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    return f"{', '.join(shown) or 'no C library found'}; macros sha256:{digest}"


def watched(dependencies: list[str], verbose: str) -> list[str]:
    """The files a remembered :func:`identity` depends on: the configuration headers among
    the probe's ``dependencies`` (real paths), and the directory of the GCC installations
    clang chose from (``-v`` said which), which a new installation changes."""
    out = [os.path.realpath(p) for p in dependencies if _CONFIG_RE.search(p)]
    m = _SELECTED_RE.search(verbose)
    if m is not None:
        out.append(os.path.realpath(os.path.dirname(m.group(1).strip())))
    return sorted(set(p for p in out if os.path.exists(p)))


def libc() -> str:
    """The C library this process runs on (``glibc 2.36``), "" where it does not say: what a
    C extension built here links against, and a module built on a newer glibc may not load
    on an older one (Triton's host modules, Inductor's C++ modules)."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (AttributeError, ValueError, OSError):
        return ""


def facts(path: str, memo_dir: str | os.PathLike[str]) -> dict:
    """What the C++ compiler at ``path`` (a real path) is, remembered per machine in
    ``<memo_dir>/cxx.json`` while the compiler and the libraries' files it read stand as they
    were (:func:`probe`: ``version``, ``macros``, ``stdlib``, ``include_dirs``)."""
    return machine_memo(Path(memo_dir), "cxx", path, lambda: probe(path), _still_valid)


def probe(path: str) -> dict:
    """The macros the C++ compiler at ``path`` defines with the C and C++ libraries'
    configuration included (``-dM -E`` of :data:`PROBE`: the version, the target, the
    dialect, the libraries' releases and every default the code can see, and no path), as
    their sha256 and a label; its default include directories (``-v``); and the files that
    answer depends on (``-H``, :func:`watched`): one subprocess."""
    proc = _run(path, ["-dM", "-E", "-H", "-v", "-x", "c++", "-"], PROBE) \
        or _run(path, ["-dM", "-E", "-x", "c++", "-"])  # a compiler without -H or the headers
    lines = sorted(line for line in (proc.stdout if proc else "").splitlines() if line)
    if not lines:
        return {"version": f"unknown ({os.path.basename(path)} -dM -E failed)", "macros": "",
                "include_dirs": [], "stamps": [], "probe": PROBE_REVISION}
    defined = dict(line[len("#define "):].partition(" ")[::2] for line in lines
                   if line.startswith("#define "))
    kind = "clang" if "__clang__" in defined else "gcc" if "__GNUC__" in defined else "cc"
    said = proc.stderr if proc else ""
    read = re.findall(r"^\.+ (.+)$", said, re.MULTILINE)  # -H: a dot per nesting level
    return {"version": f"{kind} {defined.get('__VERSION__', '?').strip(chr(34))}",
            "macros": hashlib.sha256("\n".join(lines).encode()).hexdigest(),
            "stdlib": identity(proc.stdout if proc else "").partition(";")[0],
            "include_dirs": search_list(said),
            "stamps": [file_stamp(p) for p in watched(read, said)], "probe": PROBE_REVISION}


#: The revision of :func:`probe` a remembered value needs: 2, run without
#: CCC_OVERRIDE_OPTIONS (one run with it may list a directory it added as a default).
PROBE_REVISION = 2


def _still_valid(rec) -> bool:
    """A remembered probe holds while the libraries' files it read stand as they were (one
    remembered before they were watched is probed again)."""
    return isinstance(rec, dict) and rec.get("probe") == PROBE_REVISION \
        and isinstance(rec.get("stamps"), list) and stamps_hold(rec["stamps"])


def _run(path: str, args: list[str], given: str = ""):
    """``path args`` with ``given`` as its input, text out; None where it cannot run or
    fails."""
    import subprocess

    from .. import config

    # the include variables and clang's argument edits add to the search: the defaults are
    # wanted here (a directory they add is no default, and builds key its headers by content)
    env = config.child_environment(("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH",
                                    "CCC_OVERRIDE_OPTIONS"), LC_ALL="C")
    try:
        proc = subprocess.run([path, *args], input=given, capture_output=True, text=True,
                              errors="replace", env=env, timeout=_PROBE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc if proc.returncode == 0 else None
