"""Headers by content: resolve a source's ``#include`` lines and digest what they name.

Include paths enter the key as the content of the headers they make the source include, not
as paths: two virtual environments with the same headers in different places get one key.
The scan is textual and conservative: it follows every include line, including those inside
``#if`` blocks the compiler may skip (a spurious miss is harmless, a stale hit is not). An
include whose name is a macro cannot be resolved without the preprocessor; then every header
file directly inside the include directories is digested instead.
"""

from __future__ import annotations

import os
import re
from typing import Iterable

from .digests import file_digest

_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"\n]+)[>"]', re.MULTILINE)
_MACRO_INCLUDE_RE = re.compile(r"^[ \t]*#[ \t]*include[ \t]+[A-Za-z_]", re.MULTILINE)
_HEADER_SUFFIXES = (".h", ".hpp", ".hh", ".cl", ".clh", ".cuh", ".inc", ".inl")


def _read_text(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def _resolve(name: str, here: str | None, include_dirs: Iterable[str]) -> str | None:
    candidates = [here] if here else []
    candidates.extend(include_dirs)
    for d in candidates:
        p = os.path.join(d, name)
        if os.path.isfile(p):
            return p
    return None


def header_digests(
    source: str, include_dirs: Iterable[str | os.PathLike[str]], source_dir: str | None = None
) -> tuple[tuple[str, str], ...]:
    """``(include name, content digest)`` for every header the source transitively includes.

    A name that resolves to no file is kept with digest ``"missing"`` (the compiler's own
    headers, or an error the compiler will report). Names are as written in the source,
    prefixed by the chain of including headers when nested, so the result holds no path.
    """
    if "include" not in source:  # most kernels: a substring search, not two regex scans
        return ()
    dirs = [os.fspath(d) for d in include_dirs]
    out: dict[str, str] = {}
    macro_seen = False
    seen_files: set[str] = set()
    stack: list[tuple[str, str | None, str]] = [(source, source_dir, "")]
    while stack:
        text, here, prefix = stack.pop()
        if not macro_seen and _MACRO_INCLUDE_RE.search(text):
            macro_seen = True
        for quote, name in _INCLUDE_RE.findall(text):
            name = name.strip()
            label = prefix + name
            path = _resolve(name, here if quote == '"' else None, dirs)
            if path is None:
                out.setdefault(label, "missing")
                continue
            out[label] = file_digest(path)
            real = os.path.realpath(path)
            if real in seen_files:
                continue
            seen_files.add(real)
            stack.append((_read_text(path), os.path.dirname(path), label + ">"))
    if macro_seen:
        for d in dirs:
            try:
                entries = sorted(os.listdir(d))
            except OSError:
                continue
            for entry in entries:
                p = os.path.join(d, entry)
                if entry.endswith(_HEADER_SUFFIXES) and os.path.isfile(p):
                    out.setdefault("*/" + entry, file_digest(p))
    return tuple(sorted(out.items()))


def split_include_options(options: Iterable[str]) -> tuple[list[str], list[str]]:
    """Separate ``-I dir`` / ``-Idir`` options from the rest: ``(other options, include dirs)``.

    >>> split_include_options(["-DN=4", "-I", "/a", "-I/b", "-I\\"/c d\\""])
    (['-DN=4'], ['/a', '/b', '/c d'])
    """
    rest: list[str] = []
    dirs: list[str] = []
    it = iter(options)
    for opt in it:
        if opt == "-I":
            nxt = next(it, None)
            if nxt is not None:
                dirs.append(nxt.strip('"'))
        elif opt.startswith("-I"):
            dirs.append(opt[2:].strip('"'))
        else:
            rest.append(opt)
    return rest, dirs


def source_dir_of(path: str | os.PathLike[str] | None) -> str | None:
    """The directory searched first for ``#include "x"`` of a source read from ``path``."""
    return os.path.dirname(os.path.abspath(path)) if path else None

