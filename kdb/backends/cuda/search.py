"""Where nvcc and NVRTC find headers: their include options and variables, one model.

kdb runs nvcc on a copy of the program in a temporary directory, so the include options a
caller gives are made absolute against the caller's working directory and handed to the
compiler in one normal form (``-I``, ``-isystem``, ``-include``), each directory once. The
key keeps the other options; the headers enter it by content
(:func:`kdb.backends.includes.read_headers`). What the model cannot be sure of (an option
file, host-compiler options, a relative directory in a variable nvcc reads from the
environment) makes the build uncertain: it is built and not cached.

nvcc reads ``-I``/``--include-path``, ``-isystem``/``--system-include`` and
``-include``/``--pre-include``, each with a comma-separated list, and its host preprocessor
reads ``CPATH``, ``C_INCLUDE_PATH`` and ``CPLUS_INCLUDE_PATH``; ``NVCC_PREPEND_FLAGS`` and
``NVCC_APPEND_FLAGS`` add options, and ``INCLUDES`` / ``SYSTEM_INCLUDES`` (which
``nvcc.profile`` adds to) directories after the toolkit's. NVRTC reads only its options,
one per element, and
resolves quoted includes of the program from the working directory.
"""

from __future__ import annotations

import os
import shlex
from typing import Mapping, Sequence

from ..optsearch import OptionSearch, assemble, pass_on
from ..optsearch import absolute as _absolute

#: Include options with their long spellings: (short, long, where).
_FLAGS = (("-I", "--include-path", "dirs"), ("-isystem", "--system-include", "system"),
          ("-include", "--pre-include", "forced"))
#: Options whose value may change the include search in ways kdb does not model.
_OPAQUE = ("-Xcompiler", "--compiler-options", "-optf", "--options-file", "-Xpreprocessor")
#: Options that make nvcc read files other than headers, named by the option only.
_READS_FILES = ("--libdevice-directory", "-ldir")
#: Options whose value is the next element, never read as an option of nvcc's own:
#: ``-Xcompiler -I/x`` is the host compiler's ``-I``.
_PASS_ON = ("-Xcompiler", "--compiler-options", "-Xptxas", "--ptxas-options", "-Xnvlink",
            "--nvlink-options", "-Xlinker", "--linker-options", "-Xarchive",
            "--archive-options", "-Xfatbin", "--fatbin-options", "-optf", "--options-file")
#: The host preprocessor's variables: (name, where).
_PATH_VARIABLES = (("CPATH", "dirs"), ("C_INCLUDE_PATH", "system"),
                   ("CPLUS_INCLUDE_PATH", "system"))
#: Every variable the model reads, for :func:`kdb.config.read_variables`.
VARIABLES = ("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "NVCC_PREPEND_FLAGS",
             "NVCC_APPEND_FLAGS", "INCLUDES", "SYSTEM_INCLUDES")
#: Variables nvcc splits like a shell line and reads include options from.
_OPTION_VARIABLES = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "INCLUDES", "SYSTEM_INCLUDES")


#: A CUDA build's include search (:class:`..optsearch.OptionSearch`).
CudaSearch = OptionSearch


def _values(value: str, nvcc: bool) -> tuple[list[str], list[str]]:
    """``(the paths the compiler takes from an option value, other readings)``: nvcc splits
    a value at commas; ``=dir`` may be read as ``dir``. The search follows every reading
    (a superset is safe); the compiler is handed the first list."""
    taken = [p for p in value.split(",") if p] if nvcc else [value]
    other = [value] + [p[1:] for p in (value, *taken) if p.startswith("=")]
    return taken, [p for p in dict.fromkeys(other) if p and p not in taken]


def _parse(options: Sequence[str], nvcc: bool
           ) -> tuple[list[str], dict[str, list[str]], dict[str, list[str]], str | None]:
    """``(other options, {where: [paths taken]}, {where: [other readings]}, problem)`` of
    one option list, an element one option (as nvcc's argv and NVRTC's array take them)."""
    rest: list[str] = []
    found: dict[str, list[str]] = {"dirs": [], "system": [], "forced": []}
    extra: dict[str, list[str]] = {"dirs": [], "system": [], "forced": []}
    problem = None
    it = iter(options)
    for opt in it:
        if opt in _PASS_ON:  # its value is the next element's, whatever it looks like
            kept, why = pass_on(opt, it, _OPAQUE)
            rest += kept
            problem = problem or why
            continue
        for short, long, where in _FLAGS:
            if opt in (short, long):
                value = next(it, None)
            elif opt.startswith(long + "="):
                value = opt[len(long) + 1:]
            elif opt.startswith(short + "="):  # nvcc and NVRTC read -I=dir as -I dir
                value = opt[len(short) + 1:]
            elif opt.startswith(short):
                value = opt[len(short):]
            else:
                continue
            if value is not None:
                taken, other = _values(value, nvcc)
                found[where] += taken
                extra[where] += other
            break
        else:
            head = opt.split("=", 1)[0]
            if head in _OPAQUE:
                problem = problem or (f"the option {opt!r} may change where headers are found "
                                      "(kdb does not read it)")
            elif head in _READS_FILES:
                problem = problem or (f"the option {opt!r} makes the compiler read files kdb "
                                      "would key by name only")
            rest.append(opt)
    return rest, found, extra, problem


def cuda_search(options: Sequence[str], include_dirs: Sequence[str], nvcc: bool,
                variables: Mapping[str, str | None], cwd: str) -> CudaSearch:
    """The include search of a CUDA build: ``options`` (a list, an element one option),
    ``include_dirs`` (kdb's argument), ``nvcc`` (else NVRTC), the :data:`VARIABLES` read."""
    rest, found, extra, problem = _parse(options, nvcc)
    more = {w: _absolute(v, cwd, "an option")[0] for w, v in extra.items()}
    if nvcc:
        problem = problem or _environment(variables, more)
    return assemble(rest, found, more, include_dirs, cwd, problem)


def _environment(variables: Mapping[str, str | None], more: dict[str, list[str]]) -> str | None:
    """Add the include search nvcc takes from its environment to ``more``; a problem when
    kdb cannot name what it finds (a relative path: relative to nvcc's own directory)."""
    problem = None
    for name in _OPTION_VARIABLES:
        value = (variables.get(name) or "").strip()
        if not value:
            continue
        try:
            _, found, extra, why = _parse(shlex.split(value), True)
        except ValueError:
            found, extra, why = {}, {}, f"{name} cannot be split like a shell line"
        problem = problem or why
        for where in found:
            paths, why = _absolute(found[where] + extra[where], "", name)
            more[where] += paths
            problem = problem or why
    for name, where in _PATH_VARIABLES:
        entries = [e for e in (variables.get(name) or "").split(os.pathsep) if e]
        paths, why = _absolute(entries, "", name)
        more[where] += paths
        problem = problem or why
    return problem
