"""Early stores: a compiled program's directory in PoCL's own cache, kept by kdb at exit and
put back for the next process's build.

A full store reads a program's binaries back from PoCL, which generates every kernel's
generic work-group function first (:mod:`.refresh` says why that cannot be skipped): about
a compile's cost, a hundred times more for scans, and on a machine that is never idle the
store worker gets no CPU for it. What the next process needs is already on disk: PoCL keeps
each program built from source in ``<POCL_CACHE_DIR>/<build hash>/`` (``program.bc``, and the
work-group functions its launches generated, ``<kernel>/<variant>/<kernel>.so``), and a build
from source whose build hash names a directory holding ``program.bc`` reads it instead of
compiling (``pocl_llvm_build_program`` in PoCL's ``lib/CL/pocl_llvm_build.cc``). So:

- a process notes each program it compiled, with the wall-clock window of its build
  (:func:`compiled`: a clock read and an append);
- at exit it lists PoCL's cache once, finds the directory each build used (its
  ``last_accessed``, which PoCL touches at the end of every build, or its ``program.bc``
  written within the build's window), and writes those files as a *provisional* entry
  under each key not stored yet, in one transaction: no OpenCL call, no rebuild, a few
  milliseconds a program;
- a process whose lookup finds such an entry (:func:`is_early`) writes the files back where
  PoCL looks for them, where they are missing, and builds from source: PoCL's cache answers
  (preprocessing, no compile). That PoCL used them is checked, not assumed: the build must
  have touched the directory's ``last_accessed`` (:func:`used`);
- the store worker still stores the full binary when it gets the CPU, and replaces the
  provisional entry (a provisional entry never replaces a stored one).

Safe because PoCL checks them itself: the build hash is a SHA-1 of PoCL's version and build
time stamp, LLVM's version, the preprocessed source, the options, the work-group method and
the device's own build hash (``build_program_compute_hash`` in ``lib/CL/pocl_cache.c``), so
files put back under the hash they came from are found only by a build of the same program
by the same PoCL for the same device; a build of anything else computes another hash and
compiles. A wrong match at exit costs a compile, never a wrong kernel. The entry is keyed,
checksummed, signed and trusted as any other; headers are checked against the key right
after the build, as for every store (not at exit: a suite may delete its headers before it
ends); files are read only from directories this user alone can write, and only of
PoCL's own names.
"""

from __future__ import annotations

import os
import struct
import time
from typing import Callable, NamedTuple

from ... import config, lifecycle, logs
from .poclbin import _HASH_CHARS, MAX_BINARY, build_hash_of, kernel_cache_off
from .poclbin import EARLY_MAGIC as MAGIC, is_early  # noqa: F401 - this format's

log = logs.get("kdb")

#: File modification times come from the kernel's coarse clock, up to a tick behind the
#: clock a build's window is read from: a directory counts for a build whose window,
#: widened by this much at its start, holds its time.
CLOCK_SLACK_NS = 15_000_000
#: A build's own directory has its ``last_accessed`` touched this close to the build's end
#: (kernel metadata set up after it, and the coarse clock's lag): what tells it from another
#: process's build that overlapped it.
END_NS = 25_000_000
#: PoCL's cache directory is listed at most this deep: a cache of more programs than this
#: is not searched (the full stores still come).
MAX_DIRS = 50_000

PROGRAM_BC = "program.bc"


class Build(NamedTuple):
    """A program this process compiled: its keys, when its build ran (``time.time_ns``),
    and its kernels' names."""

    tiers: object
    attrs: tuple
    start_ns: int
    end_ns: int
    names: tuple[str, ...]


_builds: list[Build] = []


def compiled(tiers, attrs, start_ns: int, end_ns: int, names, recheck) -> Build | None:
    """Note a PoCL program this process compiled from source (the miss path: an append, and
    the headers' digests taken again, as every store does after the compile: a header saved
    between the key's digest and the compiler's read left a ``program.bc`` the key does not
    describe, which is then not kept); the note, for :func:`keep_now`."""
    from ...storing.stores import headers_changed

    attrs = tuple(a for a in attrs if a.arch.startswith("pocl-"))
    if not attrs or len({a.arch for a in attrs}) != 1:  # one device class: one directory
        return None
    if not _on():  # stored by this process (``wait``, kdb pack): nothing to keep at exit
        return None
    if recheck is not None and headers_changed(list(attrs), recheck) is not None:
        return None
    build = Build(tiers, attrs, start_ns, end_ns, tuple(names))
    _builds.append(build)
    return build


def stands_in(search) -> bool:
    """Whether an early entry of a build with the include search ``search`` can serve the
    next process. Not when an include path lies in a temporary directory (one
    :mod:`.tempincludes` could not copy): the next process's build names another one, and
    PoCL's build hash holds the option text and the headers' paths, so it compiles; the
    full store is then all that serves it, and the store worker takes it first.

    >>> from kdb.backends.cloptions import parse_search
    >>> stands_in(parse_search("-I /opt/x/include")), stands_in(parse_search("-I/tmp/t1"))
    (True, False)
    """
    from .tempincludes import temporary_dirs

    return not temporary_dirs(search, forced=True)


# -- the entry's format ---------------------------------------------------------------------

def pack(build_hash: str, files: list[tuple[str, bytes]]) -> bytes:
    """An early entry's bytes: :data:`MAGIC`, the build hash (40 characters), the number of
    files, then each file as a ``uint32`` length and its path, a ``uint32`` length and its
    content.

    >>> unpack(pack("AB/CDEFGHIJKLMNOPABCDEFGHIJKLMNOPABCDEFG", [("program.bc", b"BC")]))
    ('AB/CDEFGHIJKLMNOPABCDEFGHIJKLMNOPABCDEFG', [('program.bc', b'BC')])
    """
    out = [MAGIC, build_hash.encode("ascii"), struct.pack("<I", len(files))]
    for path, content in files:
        name = path.encode("ascii")
        out += [struct.pack("<I", len(name)), name, struct.pack("<I", len(content)), content]
    return b"".join(out)


def unpack(binary: bytes) -> tuple[str, list[tuple[str, bytes]]] | None:
    """The build hash and files of an early entry; None for anything else, or for one whose
    hash or paths are not PoCL's (never a path outside the program's directory)."""
    start = len(MAGIC)
    if not is_early(binary) or len(binary) < start + 44:
        return None
    build_hash = build_hash_of(binary[start:start + 40] + b"\0")
    if build_hash is None:
        return None
    try:
        (count,) = struct.unpack_from("<I", binary, start + 40)
        files, at = [], start + 44
        for _ in range(count):
            (n,) = struct.unpack_from("<I", binary, at)
            path = binary[at + 4:at + 4 + n].decode("ascii")
            (size,) = struct.unpack_from("<I", binary, at + 4 + n)
            content = binary[at + 8 + n:at + 8 + n + size]
            if len(content) != size or not _pocl_path(path):
                return None
            files.append((path, content))
            at += 8 + n + size
    except (struct.error, UnicodeDecodeError):
        return None
    if at != len(binary) or not files or files[0][0] != PROGRAM_BC:
        return None
    return build_hash, files


def _pocl_path(path: str) -> bool:
    """``program.bc``, or ``<kernel>/<variant>/<kernel>.so`` as PoCL 3.0 names a work-group
    function (:func:`.refresh.variant`).

    >>> [_pocl_path(p) for p in ("program.bc", "k/16-1-1/k.so", "../x", "k/16-1-1/j.so")]
    [True, True, False, False]
    """
    from .refresh import variant

    if path == PROGRAM_BC:
        return True
    parts = path.split("/")
    return (len(parts) == 3 and parts[0].isascii() and parts[0].isidentifier()
            and variant(parts[1]) and parts[2] == parts[0] + ".so")


# -- at exit: find each build's directory and keep it ------------------------------------------

def scan(top: str, since_ns: int) -> dict[str, tuple[int, int]]:
    """PoCL's program directories under ``top`` used at or after ``since_ns``: build hash ->
    (``last_accessed``'s and ``program.bc``'s modification times). One ``scandir`` per
    first-level directory and two ``stat`` calls per program."""
    found: dict[str, tuple[int, int]] = {}
    seen = 0
    for first in _dirs(top):
        if not (len(first) == 2 and _HASH_CHARS.issuperset(first)):
            continue
        for rest in _dirs(os.path.join(top, first)):
            seen += 1
            if seen > MAX_DIRS:
                return found
            name = f"{first}/{rest}"
            if build_hash_of(name.encode("ascii", "replace") + b"\0") is None:
                continue
            times = (_mtime(os.path.join(top, name, "last_accessed")),
                     _mtime(os.path.join(top, name, PROGRAM_BC)))
            if max(times) >= since_ns:
                found[name] = times
    return found


def _dirs(path: str) -> list[str]:
    try:
        with os.scandir(path) as entries:
            return [e.name for e in entries if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _mtime(path: str) -> int:
    try:
        return os.lstat(path).st_mtime_ns
    except OSError:
        return -1


def match(builds: list[Build], dirs: dict[str, tuple[int, int]],
          holds: Callable[[str, Build], bool] = lambda name, build: True) -> dict[int, str]:
    """Build index -> the one directory it used. Its candidates are the directories whose
    ``last_accessed`` or ``program.bc`` time falls in its window; of several (another
    process's build overlapped it, or a store worker's rebuild touched an older program),
    the one whose ``program.bc`` was written in the window (a compile; a rebuild that PoCL's
    cache answers writes none), else those that ``holds`` the build's kernels, else the one
    touched as the build ended. A directory that two builds of other keys would take is
    neither's, and a build left with two is left out: its full store comes."""
    found: dict[int, str] = {}
    for i, b in enumerate(builds):
        lo, hi = b.start_ns - CLOCK_SLACK_NS, b.end_ns
        inside = [n for n, times in dirs.items()
                  if any(lo <= t <= hi for t in times if t >= 0)]  # -1: no such file
        if len(inside) > 1:
            compiled_here = [n for n in inside if lo <= dirs[n][1] <= hi]
            inside = compiled_here if len(compiled_here) == 1 else inside
        if len(inside) > 1:
            inside = [n for n in inside if holds(n, b)]
        if len(inside) > 1:
            inside = _at_the_end(inside, dirs, b.end_ns)
        if len(inside) == 1:
            found[i] = inside[0]
    owners: dict[str, set[tuple]] = {}
    for i, name in found.items():
        owners.setdefault(name, set()).add(tuple(sorted(a.key for a in builds[i].attrs)))
    return {i: name for i, name in found.items() if len(owners[name]) == 1}


def _at_the_end(names: list[str], dirs: dict[str, tuple[int, int]], end_ns: int) -> list[str]:
    """Of several directories in a build's window, the one PoCL touched as the build ended
    (``last_accessed`` is touched at the very end of a build), when only it was touched
    within :data:`END_NS` of the end; else all of them.

    >>> ms = 1_000_000
    >>> _at_the_end(["a", "b"], {"a": (995 * ms, -1), "b": (700 * ms, -1)}, 1000 * ms)
    ['a']
    >>> _at_the_end(["a", "b"], {"a": (995 * ms, -1), "b": (990 * ms, -1)}, 1000 * ms)
    ['a', 'b']
    """
    near = [n for n in names if 0 <= end_ns - dirs[n][0] <= END_NS]
    return near if len(near) == 1 else names


def _holds(top: str) -> Callable[[str, Build], bool]:
    """Whether a program directory's ``program.bc`` names every kernel of a build (LLVM
    bitcode keeps function names as plain bytes)."""
    def holds(name: str, build: Build) -> bool:
        try:
            with open(os.path.join(top, name, PROGRAM_BC), "rb") as f:
                bc = f.read(MAX_BINARY)
        except OSError:
            return False
        return all(n.encode() in bc for n in build.names)
    return holds


def program_files(top: str, build_hash: str, names: tuple[str, ...]) -> list[tuple[str, bytes]] | None:
    """``program.bc`` and the work-group functions of the program's directory, read as
    :mod:`.refresh` reads them (files and directories this user alone can write); None
    when there is no ``program.bc``, or it lacks a name of the program's kernels (another
    program's directory)."""
    from pathlib import Path

    from .refresh import read_owned, variant

    me = os.getuid()
    program_dir = Path(top, build_hash)
    bc = read_owned(program_dir, PROGRAM_BC, me)
    if not bc or not all(n.encode() in bc for n in names):
        return None
    files, total = [(PROGRAM_BC, bc)], len(bc)
    for kernel in sorted(set(names)):
        if not (kernel.isascii() and kernel.isidentifier()):
            continue
        try:
            variants = sorted(os.listdir(program_dir / kernel))
        except OSError:
            continue
        for v in filter(variant, variants):
            content = read_owned(program_dir / kernel / v, f"{kernel}.so", me)
            if content and total + len(content) <= MAX_BINARY:
                files.append((f"{kernel}/{v}/{kernel}.so", content))
                total += len(content)
    return files


def _unstored(tiers, builds: list[Build]) -> list[Build]:
    """The builds of which some key has no binary in its user file yet (none, or an early
    entry: one this process compiled anyway is one PoCL did not take, and is replaced)."""
    out = []
    for b in builds:
        if not tiers.storing.can_store(b.attrs[0].arch):  # refused, or the disk is full
            continue
        keys = [a.key for a in b.attrs]
        if set(keys) - tiers.user_file(b.attrs[0].arch).stored(keys):
            out.append(b)
    return out


def keep(top: str, builds: list[Build]) -> int:
    """Write an early entry for each of ``builds`` whose directory is found, per tiers in
    one transaction per arch; how many builds were kept (0 when a write failed)."""
    dirs = scan(top, min(b.start_ns for b in builds) - CLOCK_SLACK_NS)
    found = match(builds, dirs, _holds(top))
    by_tiers: dict[int, tuple[object, list]] = {}
    kept = 0
    for i, build_hash in sorted(found.items()):
        b = builds[i]
        files = program_files(top, build_hash, b.names)
        if files is None:
            continue
        kept += 1
        binary = pack(build_hash, files)
        seconds = (b.end_ns - b.start_ns) / 1e9 / len(b.attrs)
        items = by_tiers.setdefault(id(b.tiers), (b.tiers, []))[1]
        items += [(a, binary, seconds, {"early": "pocl-cache"}) for a in b.attrs]
    written = True
    for tiers, items in by_tiers.values():
        written = tiers.storing.store_provisional(items) and written
    return kept if written else 0


def _on() -> bool:
    """Whether early stores are on: PoCL's kernel cache on, stores handed to the store
    worker, and ``KDB_DISABLE_EARLY_STORE`` unset. A build noted while they were off (``kdb
    pack`` stores its builds itself) was kept at exit all the same, once they were on again,
    into the pack's removed work directory."""
    return not (kernel_cache_off() or config.store_at_exit() != "detach"
                or config.flag(config.ENV_DISABLE_EARLY_STORE))


def _top() -> str | None:
    """PoCL's cache directory when early stores are on and it can be read from, else None."""
    if not _on():
        return None
    from .refresh import pocl_cache_dir, trusted_top

    top = os.path.abspath(pocl_cache_dir())
    return top if trusted_top(top) else None


def keep_now(build: Build) -> bool:
    """Keep ``build``'s files now, for a process that waits for its entry (ranks building
    the same programs): what it needs, at a scan's cost, instead of reading the binaries
    back. True when its entries are in the user file, kept now or stored before."""
    top = _top()
    if top is None or not build.tiers.storing.can_store(build.attrs[0].arch):
        return False
    return not _unstored(build.tiers, [build]) or keep(top, [build]) > 0


def at_exit() -> None:
    """Keep, for the next process, what PoCL's cache holds of the programs compiled here
    and not stored yet. First of the exit phase ``STORES`` (:mod:`kdb.backends.opencl`
    registers it when imported): the other hooks of that phase (a store-ahead child's close,
    claims handed over) may take seconds, meanwhile the store worker rebuilds these programs
    in the same cache and touches the directories this keep matches by time."""
    builds = list(_builds)
    top = _top() if builds else None
    if top is None:
        return
    start = time.perf_counter()
    by_tiers: dict[int, list[Build]] = {}
    for b in builds:
        by_tiers.setdefault(id(b.tiers), []).append(b)
    pending = [b for group in by_tiers.values() for b in _unstored(group[0].tiers, group)]
    if pending:
        kept = keep(top, pending)
        log.debug("kdb: kept PoCL's files of %d of %d program(s) not stored yet, in %.3f s",
                  kept, len(pending), time.perf_counter() - start)


def _forget() -> None:
    _builds.clear()


lifecycle.on_fork(_forget)


# -- a hit: the files put back -----------------------------------------------------------------

def can_put_back() -> str | None:
    """PoCL's cache directory where early entries can be put back, or None (its kernel cache
    is off, or the directory is not this user's alone)."""
    if kernel_cache_off():
        return None
    from .refresh import pocl_cache_dir, trusted_top

    top = os.path.abspath(pocl_cache_dir())
    return top if trusted_top(top) else None


def put_back(top: str, build_hash: str, files: list[tuple[str, bytes]]) -> None:
    """Write each file under ``<top>/<build hash>/`` where none is: whole or not at all (a
    temporary name, synced, then linked into place, as PoCL renames its own), so a build
    never reads a half-written ``program.bc``. Work-group functions go first: PoCL takes
    the directory as a hit once ``program.bc`` is there."""
    program_dir = os.path.join(top, build_hash)
    for path, content in sorted(files, key=lambda f: f[0] == PROGRAM_BC):
        target = os.path.join(program_dir, path)
        if os.path.lexists(target):
            continue
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        temp = f"{target}.kdb-{os.getpid()}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(content)
                fh.flush()
                os.fdatasync(fh.fileno())
            try:
                os.link(temp, target)
            except FileExistsError:
                pass  # another process put it back first: the same bytes
        finally:
            try:
                os.unlink(temp)
            except OSError:
                pass


def used(top: str, build_hash: str, since_ns: int) -> bool:
    """Whether a build that started at ``since_ns`` used the program's directory: PoCL
    touches its ``last_accessed`` at the end of every build from it (``pocl_build.c``).
    PoCL before 3.0 (1.2, 1.3) writes none: there the build used it when it compiled
    nothing meanwhile, a compile writing ``program.bc`` in its own hash's directory (every
    waiting process had counted a compile of every program, "its build hash differs")."""
    since = since_ns - CLOCK_SLACK_NS
    st_ns = _mtime(os.path.join(top, build_hash, "last_accessed"))
    if st_ns >= 0:
        return st_ns >= since
    return not any(name != build_hash and bc >= since
                   for name, (_, bc) in scan(top, since).items())
