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
from typing import Mapping, Sequence

from ..optsearch import OptionSearch, assemble
from ..optsearch import absolute as _absolute

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


#: A HIP build's include search (:class:`..optsearch.OptionSearch`).
HipSearch = OptionSearch


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


def hip_search(options: Sequence[str], include_dirs: Sequence[str], hipcc: bool,
               variables: Mapping[str, str | None], cwd: str) -> HipSearch:
    """The include search of a HIP build: ``options`` (an element one option),
    ``include_dirs`` (kdb's argument), ``hipcc`` (else HIPRTC), the :data:`VARIABLES` read."""
    rest, found, problem = _parse(options)
    more: dict[str, list[str]] = {"dirs": [], "system": [], "quote": [], "forced": []}
    if hipcc:
        problem = problem or _environment(variables, more)
    return assemble(rest, found, more, include_dirs, cwd, problem)


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
