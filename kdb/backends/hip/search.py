"""Where hipcc and HIPRTC find headers: clang's include options and variables, one model.

kdb runs hipcc on a copy of the program in a temporary directory, so the include options a
caller gives are made absolute against the caller's working directory and handed to the
compiler in one normal form (``-I``, ``-isystem``, ``-iquote``, ``-include``), each once.
The key keeps the other options; the headers enter it by content
(:func:`kdb.backends.includes.read_headers`). What the model cannot be sure of (an options
file, ``-Xclang``, ``--sysroot``, a relative directory in a variable) makes the build
uncertain: it is built and not cached.

clang reads ``-I``/``--include-directory``, ``-isystem``, ``-iquote``, ``-idirafter`` and
``-include``, and ``CPATH``, ``C_INCLUDE_PATH``, ``CPLUS_INCLUDE_PATH``; hipcc adds the
options in ``HIPCC_COMPILE_FLAGS_APPEND``. HIPRTC reads only its options.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..includes import IncludeSearch

#: Include options: (spellings, where).
_FLAGS = ((("--include-directory", "-I"), "dirs"), (("-isystem", "-idirafter"), "system"),
          (("-iquote",), "quote"), (("-include",), "forced"))
#: Options whose value may change the include search in ways kdb does not model.
_OPAQUE = ("-Xclang", "-Xpreprocessor", "--sysroot", "-isysroot", "-nostdinc", "-nostdinc++",
           "-iprefix", "-iwithprefix", "-iwithprefixbefore", "--config", "-cxx-isystem")
_PATH_VARIABLES = (("CPATH", "dirs"), ("C_INCLUDE_PATH", "system"),
                   ("CPLUS_INCLUDE_PATH", "system"))
#: Every variable the model reads, for :func:`kdb.config.read_variables`.
VARIABLES = ("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "HIPCC_COMPILE_FLAGS_APPEND")


@dataclass(frozen=True)
class HipSearch:
    """A request's include search: ``rest`` (the options without include options), ``args``
    (the include options kdb hands the compiler, absolute), the :class:`IncludeSearch` the
    key's headers come from, and ``dirs`` (for ``kdb explain``)."""

    rest: tuple[str, ...]
    args: tuple[str, ...]
    search: IncludeSearch
    dirs: tuple[str, ...]

    @property
    def problem(self) -> str | None:
        return self.search.problem


def _match(opt: str, it) -> tuple[str, str | None] | None:
    """``(where, value)`` of an include option (its value taken from ``it`` when separate)."""
    for spellings, where in _FLAGS:
        for flag in spellings:
            if opt == flag:
                return where, next(it, None)
            if opt.startswith(flag + "=") and flag.startswith("--"):
                return where, opt[len(flag) + 1:]
            if opt.startswith(flag) and len(opt) > len(flag) and not flag.startswith("--"):
                return where, opt[len(flag):]
    return None


def _parse(options: Sequence[str]) -> tuple[list[str], dict[str, list[str]], str | None]:
    """``(other options, {where: [values]}, problem)`` of one option list."""
    rest: list[str] = []
    found: dict[str, list[str]] = {"dirs": [], "system": [], "quote": [], "forced": []}
    problem = None
    it = iter(options)
    for opt in it:
        got = _match(opt, it)
        if got is not None:
            if got[1] is not None:
                found[got[0]].append(got[1])
            continue
        if opt.startswith("@") or opt.split("=", 1)[0] in _OPAQUE:
            problem = problem or (f"the option {opt!r} may change where headers are found "
                                  "(kdb does not read it)")
        rest.append(opt)
    return rest, found, problem


def _absolute(paths: list[str], base: str, what: str) -> tuple[list[str], str | None]:
    out, problem = [], None
    for p in paths:
        if os.path.isabs(p):
            out.append(os.path.normpath(p))
        elif base:
            out.append(os.path.normpath(os.path.join(base, p)))
        else:
            problem = problem or f"{what} names the relative path {p!r}"
    return out, problem


def hip_search(options: Sequence[str], include_dirs: Sequence[str], hipcc: bool,
               variables: Mapping[str, str | None], cwd: str) -> HipSearch:
    """The include search of a HIP build: ``options`` (an element one option),
    ``include_dirs`` (kdb's argument), ``hipcc`` (else HIPRTC), the :data:`VARIABLES` read."""
    rest, found, problem = _parse(options)
    own = {w: _absolute(v, cwd, "an option")[0] for w, v in found.items() if w != "forced"}
    own["dirs"] = [os.path.normpath(os.path.join(cwd, d)) for d in include_dirs] + own["dirs"]
    own["forced"] = [os.path.join(cwd, f) if cwd and os.path.isfile(os.path.join(cwd, f))
                     else f for f in found["forced"]]
    more: dict[str, list[str]] = {"dirs": [], "system": [], "quote": [], "forced": []}
    if hipcc:
        problem = problem or _environment(variables, more)
    own = {w: list(dict.fromkeys(v)) for w, v in own.items()}
    args = ([f"-I{d}" for d in own["dirs"]] + [a for d in own["system"] for a in ("-isystem", d)]
            + [a for d in own["quote"] for a in ("-iquote", d)]
            + [a for f in own["forced"] for a in ("-include", f)])
    dirs = own["dirs"] + own["system"] + more["dirs"] + more["system"]
    search = IncludeSearch(quote=[(d,) for d in own["quote"] + more["quote"]],
                           dirs=[(d,) for d in dict.fromkeys(dirs)],
                           forced=[(f,) for f in dict.fromkeys(own["forced"] + more["forced"])],
                           problem=problem)
    return HipSearch(tuple(rest), tuple(args), search, tuple(own["dirs"] + own["system"]))


def _environment(variables: Mapping[str, str | None], more: dict[str, list[str]]) -> str | None:
    """Add the include search hipcc takes from its environment to ``more``; a problem when
    kdb cannot name what it finds (a relative path: relative to hipcc's own directory)."""
    problem = None
    value = (variables.get("HIPCC_COMPILE_FLAGS_APPEND") or "").strip()
    if value:
        try:
            _, found, why = _parse(shlex.split(value))
        except ValueError:
            found, why = {}, "HIPCC_COMPILE_FLAGS_APPEND cannot be split like a shell line"
        problem = problem or why
        for where, values in found.items():
            paths, why = _absolute(values, "", "HIPCC_COMPILE_FLAGS_APPEND")
            more[where] += paths
            problem = problem or why
    for name, where in _PATH_VARIABLES:
        entries = [e for e in (variables.get(name) or "").split(os.pathsep) if e]
        paths, why = _absolute(entries, "", name)
        more[where] += paths
        problem = problem or why
    return problem
