"""Where hipcc and HIPRTC find headers: clang's include options and variables, one model.

kdb runs hipcc on a copy of the program in a temporary directory, so the include options a
caller gives are made absolute against the caller's working directory and handed to the
compiler in one normal form (``-I``, ``-isystem``, ``-iquote``, ``-include``), each once.
The key keeps the other options; the headers enter it by content
(:func:`kdb.backends.includes.read_headers`). What the model cannot be sure of (an options
file, ``-Xclang``, ``--sysroot``, a relative directory in a variable) makes the build
uncertain: it is built and not cached, as is one whose options name other files the compiler
reads (bitcode libraries, profiles, plugins), which the key would hold only by name.

clang reads ``-I``/``--include-directory``, ``-isystem``, ``-iquote``, ``-idirafter`` and
``-include``, and ``CPATH``, ``C_INCLUDE_PATH``, ``CPLUS_INCLUDE_PATH``; HIPRTC is clang in
the calling process and reads them too, and searches ``$HIP_PATH/include`` and
``$ROCM_PATH/include``; hipcc adds the options in ``HIPCC_COMPILE_FLAGS_APPEND``.
"""

from __future__ import annotations

import os
import shlex
from typing import Mapping, Sequence

from ..optsearch import OptionSearch, assemble, pass_on
from ..optsearch import absolute as _absolute

#: Include options: (spellings, where).
_FLAGS = ((("--include-directory", "-I"), "dirs"),
          (("-isystem",), "system"), (("-idirafter", "--include-directory-after"), "after"),
          (("-iquote",), "quote"), (("-include", "--include"), "forced"))
#: Options whose value may change the include search in ways kdb does not model (with its
#: value attached or not: ``-F/dir``, ``-iwithsysroot/dir``).
_OPAQUE = ("-Xclang", "-Xpreprocessor", "--sysroot", "-isysroot", "-nostdinc", "-nostdinc++",
           "-iprefix", "-iwithprefix", "-iwithprefixbefore", "--config", "-cxx-isystem",
           "-iwithsysroot", "-iframework", "-iframeworkwithsysroot", "-F", "-isystem-after",
           "--include-prefix", "--include-with-prefix", "--include-with-prefix-after",
           "--include-with-prefix-before", "-imacros", "-include-pch", "--imacros")
_OPAQUE_PREFIXES = ("-iwithsysroot", "-iframework", "-F", "-iprefix", "-iwithprefix",
                    "-cxx-isystem", "-isysroot", "--sysroot", "-imacros", "--imacros=")
#: Options whose value is the next element, never read as an option of clang's own:
#: ``-Xclang -include -Xclang f.h`` is cc1's ``-include``.
_PASS_ON = ("-Xclang", "-Xpreprocessor", "-mllvm", "-Xlinker", "-Xassembler", "-Xarch_host",
            "-Xarch_device", "-Xoffload-linker", "-Xcuda-ptxas", "-Xcuda-fatbinary",
            "-Xopenmp-target", "-imacros", "--imacros", "-include-pch")
#: Options that make the compiler read files other than headers, named by the option only:
#: an edited bitcode library was served the code object built with the one before.
_READS_FILES = ("--hip-device-lib", "--hip-device-lib-path", "--rocm-device-lib-path",
                "--rocm-path", "--hip-path", "-resource-dir", "--gcc-toolchain",
                "-fprofile-instr-use", "-fprofile-use", "-fprofile-sample-use",
                "-fpass-plugin", "-fplugin", "-fsanitize-ignorelist", "-fprofile-list",
                "-mlink-bitcode-file", "-mlink-builtin-bitcode", "-Xlinker")
_READS_FILES_PREFIXES = ("-Wl,", "-B")
_PATH_VARIABLES = (("CPATH", "dirs"), ("C_INCLUDE_PATH", "system"),
                   ("CPLUS_INCLUDE_PATH", "system"))
#: Every variable the model reads, for :func:`kdb.config.read_variables`.
#: HIPRTC's comgr adds ``<it>/include`` of each of these where set (a header there was
#: served the code object built before its edit, and a process without the variable, whose
#: build fails, was served one built with it).
HIPRTC_ROOTS = ("HIP_PATH", "ROCM_PATH")
VARIABLES = ("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "HIPCC_COMPILE_FLAGS_APPEND",
             *HIPRTC_ROOTS)


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
    found: dict[str, list[str]] = {"dirs": [], "system": [], "quote": [], "after": [], "forced": []}
    problem = None
    it = iter(options)
    for opt in it:
        if opt in _PASS_ON:  # its value is the next element's, whatever it looks like
            kept, why = pass_on(opt, it, _OPAQUE)
            rest += kept
            problem = problem or why
            continue
        got = _match(opt, it)
        if got is not None:
            if got[1] is not None:
                found[got[0]].append(got[1])
            continue
        head = opt.split("=", 1)[0]
        if opt.startswith(("@", *_OPAQUE_PREFIXES)) or head in _OPAQUE:
            problem = problem or (f"the option {opt!r} may change where headers are found "
                                  "(kdb does not read it)")
        elif head in _READS_FILES or opt.startswith(_READS_FILES_PREFIXES):
            problem = problem or (f"the option {opt!r} makes the compiler read files kdb "
                                  "would key by name only")
        rest.append(opt)
    return rest, found, problem


def hip_search(options: Sequence[str], include_dirs: Sequence[str], hipcc: bool,
               variables: Mapping[str, str | None], cwd: str) -> HipSearch:
    """The include search of a HIP build: ``options`` (an element one option),
    ``include_dirs`` (kdb's argument), ``hipcc`` (else HIPRTC), the :data:`VARIABLES` read."""
    rest, found, problem = _parse(options)
    more: dict[str, list[str]] = {"dirs": [], "system": [], "quote": [], "after": [], "forced": []}
    problem = problem or _environment(variables, more, hipcc)
    return assemble(rest, found, more, include_dirs, cwd, problem)


def _environment(variables: Mapping[str, str | None], more: dict[str, list[str]],
                 hipcc: bool) -> str | None:
    """Add the include search the compiler takes from its environment to ``more``; a
    problem when kdb cannot name what it finds (a relative path: relative to hipcc's own
    directory, or to whatever directory HIPRTC's caller is in when it compiles)."""
    problem = None
    value = (variables.get("HIPCC_COMPILE_FLAGS_APPEND") or "").strip() if hipcc else ""
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
    for name in () if hipcc else HIPRTC_ROOTS:
        if root := (variables.get(name) or "").strip():
            paths, why = _absolute([os.path.join(root, "include")], "", name)
            more["system"] += paths
            problem = problem or why
    return problem
