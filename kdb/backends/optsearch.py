"""The include search a compiler driver's options give (nvcc, hipcc): one assembly.

kdb runs nvcc and hipcc on a copy of the program in a temporary directory, so the include
options a caller gives are made absolute against the caller's working directory and handed
to the compiler in one normal form (``-I``, ``-isystem``, ``-iquote``, ``-include``), each
once; the headers they find enter the key by content. :mod:`.cuda.search` and
:mod:`.hip.search` read their compiler's spellings and variables into the lists this
assembles.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

from .includes import IncludeSearch


@dataclass(frozen=True)
class OptionSearch:
    """A request's include search: ``rest`` (the options without include options, for the
    key and the command), ``args`` (the include options kdb hands the compiler, absolute),
    the :class:`IncludeSearch` the key's headers come from, and ``problem`` when kdb cannot
    be sure what the build reads."""

    rest: tuple[str, ...]
    args: tuple[str, ...]
    search: IncludeSearch
    dirs: tuple[str, ...]  # the -I and -isystem dirs of the options, for kdb explain

    @property
    def problem(self) -> str | None:
        return self.search.problem


#: The default include directory where a site installs headers by hand (``make install`` of
#: CUTLASS or CUB; no system package writes there): what a build finds there comes with
#: neither the compiler nor the system, so it enters the key by content.
SITE_INCLUDE = "/usr/local/include"


def searching_site(found: OptionSearch, defaults: Sequence[str]
                   ) -> tuple[OptionSearch, tuple[str, ...]]:
    """``found`` also searching the site directory, after the request's own, where
    ``defaults`` (a compiler's default include directories) hold it; and the rest of
    ``defaults``, whose headers come with the compiler or the system's packages and are
    keyed by their identity, not by content."""
    if SITE_INCLUDE not in defaults:
        return found, tuple(defaults)
    s = found.search
    search = IncludeSearch(s.quote, (*s.dirs, (SITE_INCLUDE,)), s.forced, s.problem)
    return replace(found, search=search), tuple(d for d in defaults if d != SITE_INCLUDE)


def absolute(paths: list[str], base: str, what: str) -> tuple[list[str], str | None]:
    """``paths`` made absolute against ``base``; a problem where one is relative and there
    is no ``base`` (relative to the compiler's own temporary directory: nothing kdb can
    name), ``what`` naming where it came from.

    >>> absolute(["/a/./b", "c"], "/w", "an option"), absolute(["c"], "", "CPATH")[1]
    ((['/a/b', '/w/c'], None), "CPATH names the relative path 'c'")
    """
    out, problem = [], None
    for p in paths:
        if os.path.isabs(p):
            out.append(tidy(p))
        elif base:
            out.append(tidy(os.path.join(base, p)))
        else:
            problem = problem or f"{what} names the relative path {p!r}"
    return out, problem


def pass_on(opt: str, options: Iterator[str], opaque: tuple[str, ...]
            ) -> tuple[list[str], str | None]:
    """``opt``, an option whose value is the next element of ``options`` and meant for
    another tool (``-Xclang -include``, ``-Xcompiler -I/x``), kept with that value as they
    are, never read as an include option; and a problem where ``opt`` is one of ``opaque``
    (it may change where headers are found).

    >>> pass_on("-Xclang", iter(["-include", "f.h"]), ("-Xclang",))[0]
    ['-Xclang', '-include']
    """
    value = next(options, None)
    problem = (f"the option {opt!r} may change where headers are found (kdb does not read "
               "it)") if opt in opaque else None
    return [opt] + ([] if value is None else [value]), problem


def tidy(path: str) -> str:
    """``path`` without ``.`` and empty parts, its ``..`` kept: the system resolves
    ``link/..`` from where ``link`` leads, as the compiler does (``os.path.normpath`` would
    drop both and name another directory).

    >>> tidy("/w/./a//link/../inc/"), tidy("//x/./y")
    ('/w/a/link/../inc', '/x/y')
    """
    parts = [p for p in path.split("/") if p not in ("", ".")]
    return ("/" if path.startswith("/") else "") + "/".join(parts) or "."


def assemble(rest: list[str], given: dict[str, list[str]], more: dict[str, list[str]],
             include_dirs, cwd: str, problem: str | None) -> OptionSearch:
    """The search of a build whose options gave ``given`` (``{"dirs", "system", "forced"}``
    and, for clang, ``"quote"`` and ``"after"`` (``-idirafter``, searched after the system
    directories): as written) and ``include_dirs``, plus ``more`` (absolute already: other
    readings of the options, the variables the compiler reads), which the compiler finds by
    itself and kdb only follows."""
    own = {w: absolute(v, cwd, "an option")[0] for w, v in given.items() if w != "forced"}
    own["dirs"] = [tidy(os.path.join(cwd, d)) for d in include_dirs] + own["dirs"]
    # -include: the compiler looks in its working directory (kdb's copy's), then the path
    own["forced"] = [os.path.join(cwd, f) if cwd and os.path.isfile(os.path.join(cwd, f))
                     else f for f in given["forced"]]
    own = {w: list(dict.fromkeys(v)) for w, v in own.items()}
    quote, after = own.get("quote", []), own.get("after", [])
    args = ([f"-I{d}" for d in own["dirs"]] + [a for d in own["system"] for a in ("-isystem", d)]
            + [a for d in quote for a in ("-iquote", d)]
            + [a for d in after for a in ("-idirafter", d)]
            + [a for f in own["forced"] for a in ("-include", f)])
    dirs = (own["dirs"] + own["system"] + more.get("dirs", []) + more.get("system", [])
            + after + more.get("after", []))
    search = IncludeSearch(quote=[(d,) for d in quote + more.get("quote", [])],
                           dirs=[(d,) for d in dict.fromkeys(dirs)],
                           forced=[(f,) for f in dict.fromkeys(own["forced"]
                                                               + more.get("forced", []))],
                           problem=problem)
    return OptionSearch(tuple(rest), tuple(args), search,
                        tuple(own["dirs"] + own["system"] + after))
