"""Headers by content: the one include model of every back end.

Include paths enter the key as the content of the headers they make the source include, not
as paths: two virtual environments with the same headers in different places get one key.
The scan is textual and conservative: it follows every include line, including those inside
``#if`` blocks the compiler may skip, and every file along the search path that the name
matches (a spurious miss is harmless, a stale hit is not).

:func:`read_headers` reads directives as the preprocessor does after its first translation
phases and refuses, with :class:`UncertainIncludes`, what it cannot be sure of (a macro
include, a FIFO, an unreadable header): that build is not cached. Each back end says where
its compiler looks: :func:`.cloptions.parse_search` (OpenCL C options), :mod:`.cuda.search` (nvcc and
NVRTC). :func:`run_compiler` runs a command-line compiler (nvcc, hipcc) and checks what it
read (its ``-MD`` list) against the headers the key holds.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import stat
from typing import Callable, Sequence

from .digests import file_digest
from .. import logs
from .common import LazyPattern, UnkeyedRead

log = logs.get("kdb")


def _read_text(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


class UncertainIncludes(Exception):
    """kdb cannot be sure which files a build reads, or the build is never the same twice
    (:func:`temporal_macro`): the build runs, nothing is cached.

    ``kind`` names the cause (one warning per kind and process); the message says what.
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class IncludeSearch:
    """Where a build's compiler looks for headers, as its options say: ``-iquote`` dirs,
    ``-I`` dirs, ``-isystem`` dirs and ``-include`` files, each a tuple of the readings a
    compiler may give the written value (all of them are searched: a superset is safe).
    ``problem`` is set when an option changes the search in a way kdb does not model."""

    __slots__ = ("quote", "dirs", "forced", "problem")

    def __init__(self, quote=(), dirs=(), forced=(), problem: str | None = None) -> None:
        self.quote: tuple[tuple[str, ...], ...] = tuple(quote)
        self.dirs: tuple[tuple[str, ...], ...] = tuple(dirs)
        self.forced: tuple[tuple[str, ...], ...] = tuple(forced)
        self.problem = problem


#: A line splice: a backslash, the blanks clang tolerates before the line end, the line end.
_SPLICE_RE = LazyPattern(r"\\[ \t\f\v]*\n")
#: What the preprocessor reads as one token before it strips comments: a comment, a string
#: or character literal (one left open ends with its line, as clang ends it: a ``/*`` after
#: ``don't`` opens no comment), C++'s raw strings and numbers with digit separators, and ``<`` (a header name where a directive or
#: ``__has_include`` stands before it: ``<a//b.h>`` names a file; read as a comment, it
#: named none).
_LEX_RE = LazyPattern(
    r'//[^\n]*|/\*.*?(?:\*/|\Z)'
    # C++ (CUDA, HIP): a raw string, and a number with digit separators (1'000)
    r'|(?<![\w$])(?:u8|[uUL])?R"([^()\\ \t\v\f\n]{0,16})\(.*?\)\1"'
    r"|(?<![\w$])\.?\d(?:[\w.]|[eEpP][+-])*'\w(?:'?[\w.]|[eEpP][+-])*"
    r'|"(?:\\.|[^"\\\n])*"?|\'(?:\\.|[^\'\\\n])*\'?|<', re.DOTALL)
#: What stands before a header name, comments already blanked: a directive, the whole line
#: before it; ``__has_include(``, the end of the line before it.
_DIRECTIVE_BEFORE_RE = LazyPattern(
    r"[ \t\f\v]*(?:#|%:)[ \t\f\v]*(?:include_next|include|import)[ \t\f\v]*")
_HAS_INCLUDE_BEFORE_RE = LazyPattern(r"__has_include(?:_next)?[ \t\f\v]*\([ \t\f\v]*$")
#: The characters of a line kept to look back from a ``<`` (a directive before a header
#: name is shorter): looking back over a whole long line at each ``<`` was quadratic.
_LOOK_BACK = 256
_HEADER_NAME_RE = LazyPattern(r"<[^>\n]*>")
#: A directive: ``#`` or its digraph ``%:`` first on a line, blanks (form feed and vertical
#: tab included) around it.
_DIRECTIVE_RE = LazyPattern(
    r"^[ \t\f\v]*(?:#|%:)[ \t\f\v]*(?:include_next|include|import)\b[ \t\f\v]*(.*)$",
    re.MULTILINE)
_HAS_INCLUDE_RE = LazyPattern(r"__has_include(?:_next)?\s*\(\s*(.?)")
_NAME_RE = LazyPattern(r'(?:<([^>\n]+)>|"([^"\n]+)")')
#: The nine trigraphs (clang replaces them with ``-trigraphs`` or in strict C modes).
_TRIGRAPHS = {"=": "#", "/": "\\", "'": "^", "(": "[", ")": "]", "!": "|", "<": "{", ">": "}",
              "-": "~"}
_TRIGRAPH_RE = LazyPattern(r"\?\?([=/'()!<>-])")


def _lines(text: str) -> str:
    """``text`` after the first translation phases: a byte-order mark dropped, every line
    end (CR LF, CR alone) one newline, line splices joined."""
    if "\ufeff" in text:
        text = text.replace("\ufeff", "")
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if "\\" in text:
        text = _SPLICE_RE.sub("", text)
    return text


def _comment_free(text: str) -> str:
    """``text`` after line splicing, with comments replaced by a space, as the
    preprocessor sees it before it reads a directive: a header name after ``#include`` or
    in ``__has_include(`` (comments before it, on its line, blanked first) is one token,
    whatever ``//`` or ``/*`` it holds."""
    text = _lines(text)
    if "/*" not in text and "//" not in text:
        return text
    out: list[str] = []
    line, length = "", 0  # the end of the current line as written, and its whole length
    pos = 0
    lex, name = _LEX_RE.search, _HEADER_NAME_RE.match
    while (m := lex(text, pos)) is not None:
        piece = text[pos:m.start()]
        token = m.group()
        if token[0] == "/":
            token = " "
        elif token == "<":
            line, length = _line_end(line, length, piece)
            header = name(text, m.start()) if _before_name(line, length) else None
            token = header.group() if header is not None else "<"
            out += (piece, token)
            line, length = _line_end(line, length, token)
            pos = m.start() + len(token)
            continue
        out += (piece, token)
        line, length = _line_end(line, length, piece + token)
        pos = m.end()
    out.append(text[pos:])
    return "".join(out)


def _line_end(line: str, length: int, piece: str) -> tuple[str, int]:
    """The last :data:`_LOOK_BACK` characters of the current line and its length, after
    ``piece`` is written."""
    if "\n" in piece:
        tail = piece.rpartition("\n")[2]
        return tail[-_LOOK_BACK:], len(tail)
    return (line + piece)[-_LOOK_BACK:], length + len(piece)


def _before_name(line: str, length: int) -> bool:
    """Whether a ``<`` after ``line`` (the current line's end, ``length`` long in all)
    starts a header name: the line so far is a directive, or ends in ``__has_include(``."""
    if length <= _LOOK_BACK and _DIRECTIVE_BEFORE_RE.fullmatch(line):
        return True
    return line.rstrip(" \t\f\v").endswith("(") and _HAS_INCLUDE_BEFORE_RE.search(line) is not None


def may_include(text: str) -> bool:
    """Whether ``text`` may hold a directive that reads a file: the words, or a splice (or
    the trigraph of a backslash) that may join them. A substring search for most sources.

    >>> may_include("kernel void k() {}"), may_include('#inc\\\\\\nlude "a.h"')
    (False, True)
    """
    if "include" in text or "import" in text:
        return True
    if "\\" not in text and "??/" not in text:
        return False
    joined = _lines(text.replace("??/", "\\"))
    return "include" in joined or "import" in joined


def readings(text: str) -> tuple[str, ...]:
    """Every way a preprocessor may read ``text`` before it looks for directives: as it is,
    and with trigraphs replaced when it holds one (clang does with ``-trigraphs`` or a strict
    ``-std``; kdb follows both readings, a superset is safe).

    >>> readings("??=include <a.h>")
    ('??=include <a.h>', '#include <a.h>')
    """
    if "??" not in text or _TRIGRAPH_RE.search(text) is None:
        return (text,)
    return text, _TRIGRAPH_RE.sub(lambda m: _TRIGRAPHS[m.group(1)], text)


#: The macros a compiler replaces with the time of the build (``__TIMESTAMP__``: the time
#: the file was last written; kdb writes the program to a new file for nvcc and hipcc).
_TEMPORAL_RE = LazyPattern(
    r"(?<![A-Za-z0-9_$])__(?:DATE|TIME|TIMESTAMP)__(?![A-Za-z0-9_$])")


def temporal_macro(text: str) -> str | None:
    """``__DATE__``, ``__TIME__`` or ``__TIMESTAMP__`` where ``text`` uses one outside its
    comments (in any reading, :func:`readings`), else None: a build that uses one differs
    from the last, so serving a stored one would change what the program sees. A substring
    search for most sources.

    >>> temporal_macro('char s[] = __DATE__; // __TIME__'), temporal_macro("x__TIME__y")
    ('__DATE__', None)
    """
    if "__DATE__" not in text and "__TIME" not in text and "\\" not in text \
            and "??/" not in text:
        return None
    return _temporal_macro(text)


_FILE_RE = LazyPattern(r"(?<![A-Za-z0-9_$])__FILE__(?![A-Za-z0-9_$])")


def names_its_path(text: str) -> bool:
    """Whether ``text`` (a header) uses ``__FILE__`` outside its comments: the path the
    compiler found it at, which a kernel may print or size (``sizeof(__FILE__)``), so two
    builds that find the same bytes at two paths differ.

    >>> names_its_path('printf("%s", __FILE__);'), names_its_path("// __FILE__")
    (True, False)
    """
    if "__FILE" not in text and "\\" not in text and "??/" not in text:
        return False
    return any(_FILE_RE.search(_comment_free(r)) is not None for r in readings(text))


@functools.lru_cache(maxsize=512)
def _temporal_macro(text: str) -> str | None:
    for reading in readings(text):
        m = _TEMPORAL_RE.search(_comment_free(reading))
        if m is not None:
            return m.group()
    return None


@functools.lru_cache(maxsize=512)
def directives(text: str) -> tuple[tuple[tuple[bool, str], ...], str | None]:
    """``((quoted, name) ...)`` for every ``#include``, ``#include_next``, ``#import`` and
    ``__has_include`` in ``text``, and a problem when one names its header by a macro.
    Directives are read after the translation phases a compiler applies first (byte-order
    mark, line ends, trigraphs, splices, comments) and in every spelling it accepts
    (``%:`` for ``#``, form feeds and vertical tabs around it).

    >>> directives('#\\\\\\ninclude "a.h"\\n/* #include "b.h" */ #include <c.h> // "d.h"\\n')
    (((True, 'a.h'), (False, 'c.h')), None)
    """
    if not may_include(text):
        return (), None
    out: list[tuple[bool, str]] = []
    problem = None
    for reading in readings(text):
        got, why = _directives_of(_comment_free(reading))
        out.extend(g for g in got if g not in out)
        problem = problem or why
    return tuple(out), problem


def _directives_of(text: str) -> tuple[list[tuple[bool, str]], str | None]:
    if "include" not in text and "import" not in text:
        return [], None
    out: list[tuple[bool, str]] = []
    problem = None
    found = [(m.group(1), "#include") for m in _DIRECTIVE_RE.finditer(text)]
    if "__has_include" in text:
        found += [(text[m.start(1):m.start(1) + 4096], "__has_include")
                  for m in _HAS_INCLUDE_RE.finditer(text)]
    for arg, what in found:
        m = _NAME_RE.match(arg.strip(" \t\f\v"))
        if m is None:
            problem = problem or f"{what} {arg.strip()[:60]!r} names its header by a macro"
            continue
        angle, quoted = m.groups()
        out.append((quoted is not None, (quoted or angle).strip()))
    return out, problem


#: ``(directives, temporal macro)`` of header contents by digest: a warm build reads no
#: header again.
_parsed: dict[str, tuple] = {}


def _header_directives(path: str, digest: str, name: str) -> tuple:
    got = _parsed.get(digest)
    if got is None:
        try:
            text = _read_text(path)
        except OSError as err:
            raise UncertainIncludes("unreadable", f"header {name!r} cannot be read "
                                    f"({err.strerror or err})") from None
        got = (directives(text), temporal_macro(text), names_its_path(text))
        if len(_parsed) > 4096:
            _parsed.clear()
        _parsed[digest] = got
    return got


def _temporal(where: str, macro: str) -> UncertainIncludes:
    return UncertainIncludes("time", f"{where} uses {macro}, which the compiler fills in "
                             "at each build")


def temporal_options(texts) -> UncertainIncludes | None:
    """Why a build is never the same twice where one of its options, or a variable its
    compiler reads options from, uses a temporal macro (``-DSTAMP=__TIME__`` expands to the
    time); None where none does. Raise it: the build is not cached."""
    for text in texts:
        if text and (macro := temporal_macro(text)) is not None:
            return _temporal(f"the option {text[:60]!r}", macro)
    return None


def _find(name: str, dirs: list[str]) -> list[tuple[str, tuple[int, int]]]:
    """Every regular file ``name`` names in ``dirs``, once each, in search order."""
    out: list[tuple[str, tuple[int, int]]] = []
    for d in dirs:
        p = os.path.join(d, name)
        try:
            st = os.stat(p)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as err:
            raise UncertainIncludes("unreadable", f"header {name!r} cannot be looked up in "
                                    f"{d} ({err.strerror or err})") from None
        if stat.S_ISDIR(st.st_mode):
            continue  # the compiler goes on to the next directory
        if not stat.S_ISREG(st.st_mode):
            raise UncertainIncludes("not a file", f"header {name!r} is not a regular file "
                                    f"({p}: a FIFO, socket or device)")
        ident = (st.st_dev, st.st_ino)
        if all(ident != seen for _, seen in out):
            out.append((p, ident))
    return out


def read_headers(source: str, search: IncludeSearch, cwd: str | None = None, *,
                 main_in_cwd: bool = True, cwd_in_path: bool = True,
                 files: set[tuple[int, int]] | None = None,
                 main_dirs: Sequence[str] = ()) -> tuple[tuple[str, str], ...]:
    """``(include name, content digest)`` for every file a build of ``source`` with this
    include search may read, the way an OpenCL C compiler looks: quoted includes in the
    including file's directory first (the working directory ``cwd`` for the program
    itself and ``-include``), then ``-iquote``, the working directory (PoCL's ``-I.``),
    ``-I`` and ``-isystem``. Every match along the path enters, not only the first, so the
    key holds whatever file the compiler picks. nvcc compiles a copy of the program in a
    directory of its own (``main_in_cwd=False``) and neither it nor NVRTC puts the working
    directory on the path (``cwd_in_path=False``). ``files`` collects the identities
    ``(st_dev, st_ino)`` of the files found, for a check against what the compiler read.
    ``main_dirs``: where the compiler writes the program before it reads it (PoCL: its
    cache directory), searched first for the program's quoted includes. Names are as written, prefixed by the
    chain of including headers (``a.h>b.h``; ``h.h|2`` for a second match, ``+f.h`` for
    ``-include``): no path enters.

    Raises :class:`UncertainIncludes` where kdb cannot be sure what the build reads.
    """
    if search.problem:
        raise UncertainIncludes("option", search.problem)
    if (macro := temporal_macro(source)) is not None:
        raise _temporal("the program", macro)
    if not search.forced and not may_include(source):
        return ()
    found, problem = directives(source)
    if problem:
        raise UncertainIncludes("macro", problem)
    if cwd is None:
        try:
            cwd = os.getcwd()
        except OSError:  # a deleted working directory: "." is what the compiler searches
            cwd = "."
    quote = [os.path.join(cwd, d) for r in search.quote for d in r]
    tail = [*([cwd] if cwd_in_path else []),
            *(os.path.join(cwd, d) for r in search.dirs for d in r)]
    out: dict[str, str] = {}
    # A header is followed once per directory it is reached in: its quoted includes are
    # looked up beside the path it was reached by (a link in another directory, a hard
    # link), and followed once per inode, a second directory's headers never entered the
    # key (NVRTC was served a binary built with their old content).
    followed: dict[tuple[int, int], list[str]] = {}
    forced = tuple((True, name) for r in search.forced for name in r)
    main = (*main_dirs, *([cwd] if main_in_cwd else []))
    stack: list[tuple[tuple, tuple[str, ...], str]] = [(found, main, ""), (forced, (cwd,), "+")]
    while stack:
        items, here, prefix = stack.pop()
        for quoted, name in items:
            label = prefix + name
            dirs = [*here, *quote, *tail] if quoted else tail
            matches = _find(name, dirs)
            if not matches:
                out.setdefault(label, "missing")
                continue
            for k, (path, ident) in enumerate(matches):
                lab = label if k == 0 else f"{label}|{k + 1}"
                try:
                    digest = file_digest(path)
                except OSError as err:
                    raise UncertainIncludes("unreadable", f"header {name!r} cannot be read "
                                            f"({err.strerror or err})") from None
                (nested, problem), macro, named = _header_directives(path, digest, name)
                # a header that uses __FILE__ is keyed with the path it is found at
                out[lab] = f"{digest} at {path}" if named else digest
                if files is not None:
                    files.add(ident)
                if not _first_time_here(followed.setdefault(ident, []), path):
                    continue
                if problem:
                    raise UncertainIncludes("macro", f"in {name!r}: {problem}")
                if macro is not None:
                    raise _temporal(f"header {name!r}", macro)
                stack.append((nested, (os.path.dirname(path),), lab + ">"))
    return tuple(sorted(out.items()))


def _first_time_here(dirs: list[str], path: str) -> bool:
    """Whether ``path``'s directory is none of ``dirs`` (where its file was followed before,
    compared as real paths: a link to ``.`` names the same directory forever); if so, it
    joins them."""
    here = os.path.dirname(path)
    if dirs:
        real = os.path.realpath(here)
        if here in dirs or any(os.path.realpath(d) == real for d in dirs):
            return False
    dirs.append(here)
    return True


def search_list(said: str) -> list[str]:
    r"""The ``#include <...>`` directories a ``-v`` preprocessor run lists, real paths.

    >>> search_list("#include <...> search starts here:\n /usr/include\nEnd of search list.\n")
    ['/usr/include']
    """
    dirs, inside = [], False
    for line in said.splitlines():
        if line.startswith("#include <...> search starts here"):
            inside = True
        elif line.startswith("End of search list"):
            inside = False
        elif inside and line.startswith(" "):
            dirs.append(os.path.realpath(line.strip()))
    return sorted(set(dirs))


def dependency_paths(text: str) -> list[str]:
    r"""The prerequisites of a make rule as ``-MD`` writes it (a backslash ends a continued
    line; ``\ `` is a space in a name).

    >>> dependency_paths("k.o : k.cu \\\n  a\\ b.h /x/c.h\n")
    ['k.cu', 'a b.h', '/x/c.h']
    """
    body = text.replace("\\\n", " ").replace("\\\r\n", " ")
    _, _, deps = body.partition(": ")
    out, cur, i = [], [], 0
    while i < len(deps):
        ch = deps[i]
        if ch == "\\" and i + 1 < len(deps) and deps[i + 1] in " #":
            cur.append(deps[i + 1])
            i += 2
            continue
        if ch.isspace():
            if cur:
                out.append("".join(cur))
                cur = []
        else:
            cur.append(ch)
        i += 1
    if cur:
        out.append("".join(cur))
    return out


def unkeyed_read(dep_file: str, system_dirs, header_files, compiler: str) -> str | None:
    """The first file in a compiler's ``-MD`` list at ``dep_file`` (relative names are of
    its directory) that is neither the program (listed first), nor under ``system_dirs``,
    nor one of ``header_files`` (the ``(st_dev, st_ino)`` of the headers the key holds);
    None when there is none."""
    try:
        with open(dep_file, encoding="utf-8", errors="surrogateescape") as f:
            text = f.read()
    except OSError:
        return f"its dependency list ({compiler} wrote none)"
    here = os.path.dirname(dep_file)
    system = tuple(os.path.join(d, "") for d in system_dirs)
    for dep in dependency_paths(text)[1:]:
        path = os.path.realpath(os.path.join(here, dep))
        if path.startswith(system):
            continue
        try:
            st = os.stat(path)
        except OSError:
            return dep
        if (st.st_dev, st.st_ino) not in header_files:
            return dep
    return None


#: The modification time of the program file a compiler reads (1980-01-01, as zip's).
_SOURCE_TIME = 315532800


@contextlib.contextmanager
def _build_dir(tool: str, command: str, text: str):
    """The directory a compiler runs in, named by what it builds
    (``<tmp>/kdb-<tool>-<uid>/<digest>``): debug and line information holds it (nvcc's
    ``-G``/``-lineinfo``, hipcc's ``-g``), and a random name made two packs of such kernels
    differ. A temporary directory where that cannot be had: a root that is not this user's
    alone, or one build of the same thing already running (or killed) there."""
    import hashlib
    import shutil
    import tempfile

    root = os.path.join(tempfile.gettempdir(), f"kdb-{tool}-{os.getuid()}")
    digest = hashlib.sha256(f"{command}\0{text}".encode("utf-8", "surrogateescape"))
    path = os.path.join(root, digest.hexdigest()[:24])
    try:
        try:
            os.mkdir(root, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(root)
        if not (stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
                and not st.st_mode & 0o077):
            raise PermissionError(f"{root} is not this user's alone")
        os.mkdir(path, 0o700)
    except OSError:
        with tempfile.TemporaryDirectory(prefix=f"kdb-{tool}-") as tmp:
            yield tmp
        return
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        try:
            os.rmdir(root)  # nothing left behind; another build's directory keeps it
        except OSError:
            pass


def run_compiler(tool: str, command: Callable[[str, str], list[str]], text: str,
                 source_name: str, out_name: str, *, building: str, options,
                 system_dirs, header_files, unavailable: Callable[[str, OSError], Exception],
                 env: Callable[[str], dict] | None = None,
                 where: str = "run in a temporary directory") -> bytes:
    """What a command-line compiler (nvcc, hipcc) makes of ``text`` in a temporary directory.

    ``command(source, output)`` is its command line, to which ``-MD -MF kernel.d`` is added;
    ``env(tmp)`` its environment. A failure is a :class:`kdb.CompileError` naming
    ``building`` and the command; a compiler that cannot run, ``unavailable(path, error)``.
    A file it read (its ``-MD`` list) that is neither the program, nor under
    ``system_dirs``, nor one of ``header_files`` raises :class:`UnkeyedRead` with the
    output, which is then served and not stored."""
    import shlex
    import subprocess

    from ..errors import CompileError

    cmd = command(source_name, out_name)
    with _build_dir(tool, shlex.join(cmd), text) as tmp:
        with open(os.path.join(tmp, source_name), "w", encoding="utf-8") as f:
            f.write(text)
        # Line information may hold the program file's time too: one of its own, always.
        os.utime(os.path.join(tmp, source_name), (_SOURCE_TIME, _SOURCE_TIME))
        try:
            proc = subprocess.run([*cmd, "-MD", "-MF", "kernel.d"], cwd=tmp,
                                  env=None if env is None else env(tmp), capture_output=True)
        except OSError as err:
            raise unavailable(cmd[0], err) from err
        said = (proc.stderr + proc.stdout).decode("utf-8", "replace")
        out_path = os.path.join(tmp, out_name)
        if proc.returncode != 0 or not os.path.isfile(out_path):
            why = f"exit status {proc.returncode}" if proc.returncode else "no output file"
            failed = CompileError(f"{tool} failed ({why}) building {building}; fix the source "
                                  f"or options. Command ({where}): {shlex.join(cmd)}",
                                  log=said, options=options)
            failed.command = cmd  # type: ignore[attr-defined]
            raise failed
        with open(out_path, "rb") as f:
            data = f.read()
        unkeyed = unkeyed_read(os.path.join(tmp, "kernel.d"), system_dirs, header_files, tool)
    if said.strip():
        log.debug("kdb: %s said, building %s: %s", tool, building, said.strip())
    if unkeyed:
        raise UnkeyedRead(data, f"{tool} read {unkeyed!r}, a file kdb's include model did not "
                                "find, so the key would not see its edits")
    return data
