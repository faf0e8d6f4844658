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
"""

from __future__ import annotations

import hashlib
import os
import re

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
