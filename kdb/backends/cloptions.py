"""OpenCL C option strings as a driver reads them: split, the include search they give
(:class:`kdb.backends.includes.IncludeSearch`), and the options that enter a key.

pyopencl joins a list of options into one string and PoCL splits it for clang, so an element
``"-I inc -DN=8"`` is two options. Kept apart from :mod:`.includes` (the model every back end
shares) and from the OpenCL back end's package (which imports pyopencl).
"""

from __future__ import annotations

from typing import Iterable

from .includes import IncludeSearch

_SPACES = " \t\n\r\v\f"


def compiler_tokens(options: str) -> list[tuple[str, str | None]]:
    """``(token, as PoCL 3 reads it)``: the option string split as PoCL splits it for clang,
    spaces inside double quotes kept and the quotes removed; PoCL 3 turned the quotes into
    spaces instead (the second item; None for a token without quotes).

    >>> compiler_tokens('-DX=1 -I"/a b"  -Ic')
    [('-DX=1', None), ('-I/a b', '-I /a b '), ('-Ic', None)]
    """
    if '"' not in options:
        return [(t, None) for t in options.split()]
    out: list[tuple[str, str | None]] = []
    cur: list[str] = []
    alt: list[str] = []
    quoted = inside = started = False
    for ch in options:
        if ch == '"':
            inside = not inside
            quoted = started = True
            alt.append(" ")
        elif ch in _SPACES and not inside:
            if started:
                out.append(("".join(cur), "".join(alt) if quoted else None))
            cur, alt, quoted, started = [], [], False, False
        else:
            cur.append(ch)
            alt.append(ch)
            started = True
    if started:
        out.append(("".join(cur), "".join(alt) if quoted else None))
    return out


def _readings(value: str, alt: str | None) -> tuple[str, ...]:
    """The directories or files a compiler may make of an option's value: the value, less
    the spaces newer PoCL drops after ``-I``, as PoCL 3 reads a quoted one (``alt``), and
    clang's reading of ``=dir`` (relative to the sysroot, or literal when there is none)."""
    got = [value, value.strip(_SPACES), alt]
    if value.startswith("="):
        got.append(value[1:])
    return tuple(dict.fromkeys(g for g in got if g))


#: The options that name include search dirs or files, and where their value goes.
_INCLUDE_FLAGS = (("--include-directory", "dirs"), ("-isystem", "system"),
                  ("-iquote", "quote"), ("-include", "forced"), ("-I", "dirs"))


def parse_search(options: str | bytes) -> IncludeSearch:
    """The include search of a build from its option string, as the compiler reads it
    (``options`` exactly as handed to ``clBuildProgram``).

    >>> s = parse_search(b"-DX=1 -I/a -iquote q -isystem s --include-directory=b -include f.h")
    >>> [d[0] for d in s.dirs], [d[0] for d in s.quote], [f[0] for f in s.forced]
    (['/a', 'b', 's'], ['q'], ['f.h'])
    """
    if isinstance(options, (bytes, bytearray)):
        options = bytes(options).decode("utf-8", "surrogateescape")
    tokens = compiler_tokens(options)
    found: dict[str, list[tuple[str, ...]]] = {"dirs": [], "system": [], "quote": [],
                                               "forced": []}
    problem = None
    i = 0
    while i < len(tokens):
        tok = tokens[i][0]
        i += 1
        if tok in ("-D", "-U", "-x"):  # the next token is this option's value
            i += 1
            continue
        if not tok.startswith(("-i", "-I", "--i", "-nostdinc", "--sysroot")):
            continue
        for flag, where in _INCLUDE_FLAGS:
            long = flag == "--include-directory"
            if tok == flag:
                if i >= len(tokens):
                    break  # a dangling flag: the compiler refuses or ignores it
                value, alt = tokens[i]
                i += 1
            elif tok.startswith(flag) and (not long or tok[len(flag)] == "="):
                value, alt = tok[len(flag) + long:], tokens[i - 1][1]
                alt = alt[len(flag) + long:] if alt is not None else None
            else:
                continue
            if value.startswith("-") and tok != flag:  # -include-pch, -isystem-after, -I-
                problem = problem or f"the build option {tok!r} changes where headers are found"
                break
            found[where].append(_readings(value, alt))
            break
        else:
            problem = problem or f"the build option {tok!r} changes where headers are found"
    return IncludeSearch(found["quote"], found["dirs"] + found["system"], found["forced"],
                         problem)


def key_options(options: Iterable[str]) -> list[str]:
    """The options of a joined option string that enter a key: ``-I`` dirs left out (the
    headers they find enter by content), everything else kept. The driver receives the
    elements joined into one string (pyopencl, PoCL), so an element ``"-I inc -DN=8"`` is two
    options and only ``-I inc`` leaves. An element with quotes that holds more than include
    options is kept whole: a path in a key costs a miss elsewhere, never a stale hit.

    >>> key_options(["-I inc -DN=8", "-I", "d -DM=2", "-Ix", "-D", "-Iy", "-cl-fast"])
    ['-DN=8', '-DM=2', '-D', '-Iy', '-cl-fast']
    """
    elements = list(options)
    flat: list[tuple[int, str]] = []
    for n, opt in enumerate(elements):
        if any(c in opt for c in _SPACES) or '"' in opt:
            flat.extend((n, tok) for tok, _ in compiler_tokens(opt))
        else:
            flat.append((n, opt))
    dropped: set[int] = set()
    i = 0
    while i < len(flat):
        tok = flat[i][1]
        if tok in ("-D", "-U", "-x"):  # the next token is this option's value
            i += 2
            continue
        if tok == "-I":
            dropped.update((i, i + 1))
        elif tok.startswith("-I"):
            dropped.add(i)
        i += 1
    kept: dict[int, list[str]] = {}
    for k, (n, tok) in enumerate(flat):
        kept.setdefault(n, [])
        if k not in dropped:
            kept[n].append(tok)
    out = []
    for n, opt in enumerate(elements):
        toks = kept.get(n, [])
        if toks:
            whole = len(toks) == sum(1 for m, _ in flat if m == n) or '"' in opt
            out.append(opt if whole else " ".join(toks))
    return out
