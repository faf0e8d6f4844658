"""Entry points of installed distributions, read from ``*.dist-info/entry_points.txt`` on
``sys.path``, and the cache of those scans (``<cache root>/entry-points.txt``).

Not through :mod:`importlib.metadata`, whose import alone outweighs a whole warm start.
Even a scan opens a file per installed distribution, so its result is kept per ``sys.path``
directory: in this process, and per machine in the cache file. A directory's record is used
while the directory's mtime is unchanged; pip creates or removes a ``*.dist-info`` directory
on every install, upgrade and uninstall, which changes it. Editing an ``entry_points.txt`` in
place does not: touch its ``site-packages`` directory afterwards.
"""

from __future__ import annotations

import os
import sys
import time
from collections import namedtuple

from .. import config, logs
from ..dirs import make_private_dir

log = logs.get("kdb")


class _EntryPoint(namedtuple("_EntryPoint", "dist version name value")):
    """One entry point: its distribution's name and version, its name and its value."""

    __slots__ = ()


def _dist_name_version(dirname: str) -> tuple[str, str]:
    stem = dirname[: -len(".dist-info")]
    name, _, version = stem.partition("-")
    return name, version


def _parse_group(text: str, group: str) -> list[tuple[str, str]]:
    out, current = [], None
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1].strip()
        elif current == group and "=" in line:
            name, _, value = line.partition("=")
            out.append((name.strip(), value.strip()))
    return out



#: Seconds a directory's mtime must lie in the past before its scan is cached: a file system
#: with coarse timestamps could change it again within the same tick (as in digests.py).
_SETTLED_S = 2.0
_MEMO_NAME = "entry-points.txt"
#: Whether saving the memo may create the cache directory: a program's does (its next
#: start is then cheap, even if it only ever hits the system tier); ``kdb``'s commands do
#: not (``KDB_CACHE_DIR=/tmp/typo kdb ls`` made /tmp/typo).
create_cache_dir = True
_MEMO_HEADER = "kdb entry points 1"

# What this process knows, per (group, absolute directory): (st_mtime_ns, names, items).
# ``names`` holds the normalised name of every distribution there, as "\tname\t...\t" (the
# form the cache file keeps) or, for a directory that cannot be cached, as a set; ``items``
# lists (name, entry points, problem) for the distributions with entry points in the group or
# an unreadable entry_points.txt, in listing order.
_memo: dict[tuple[str, str], tuple] = {}
_read: set[str] = set()  # cache files this process has read (each is read once)



def entry_points(group: str,
                 memo_dir: str | os.PathLike[str] | None = None) -> list[_EntryPoint]:
    """Entry points of ``group`` of every distribution on ``sys.path`` (first one wins).

    Each directory's scan is cached (see the module docstring) in this process and in
    ``memo_dir`` (default: the cache root), so a warm start costs a stat per ``sys.path``
    entry and one read of a small file; a later call in the process, only the stats.
    """
    found: list[_EntryPoint] = []
    earlier: list = []  # ``names`` of the directories before this one: they shadow it
    keep: list[tuple[tuple[str, str], tuple]] = []  # cacheable records, to write if need be
    scanned = False  # whether a cacheable record was made (the cache file is out of date)
    memo_file: str | None = None
    now = 0.0
    for base in sys.path:
        path = os.fspath(base or ".")
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_mode & 0o170000 != 0o040000:  # not a directory (a zip file): nothing to list
            continue
        try:
            key = (group, path if os.path.isabs(path) else os.path.abspath(path))
        except OSError:  # a relative entry under a deleted working directory
            continue
        rec = _memo.get(key)
        if rec is None or rec[0] != st.st_mtime_ns:
            if memo_file is None:
                memo_file = _memo_file(memo_dir)
                if memo_file and memo_file not in _read:
                    _read.add(memo_file)
                    for k, r in _load(memo_file).items():
                        _memo.setdefault(k, r)
                    rec = _memo.get(key)
        if rec is None or rec[0] != st.st_mtime_ns:
            rec = _scan(path, st.st_mtime_ns, group)
            if rec is None:
                continue
            if not now:
                now = time.time()
            if (isinstance(rec[1], str) and now - st.st_mtime > _SETTLED_S
                    and not any(c in s for c in "\t\n" for s in key)):
                _memo[key] = rec
                scanned = True
        if _memo.get(key) is rec:  # cacheable
            keep.append((key, rec))
        for norm, eps, problem in rec[2]:
            tagged = f"\t{norm}\t"
            if any((tagged in n) if isinstance(n, str) else (norm in n) for n in earlier):
                continue  # an earlier directory holds a distribution of that name
            if problem:
                log.warning("kdb: cannot read the entry points of %s (%s); skipped", *problem)
            else:
                found.extend(eps)
        earlier.append(rec[1])
    if scanned and memo_file:
        _save_at_exit(memo_file, keep)
    found.sort(key=lambda ep: (ep.dist.lower(), ep.name))
    return found


def _scan(path: str, mtime_ns: int, group: str) -> tuple | None:
    """One directory's record for :data:`_memo`, or None if it cannot be listed.

    ``names`` comes back as a set when the record cannot be cached: an unreadable
    entry_points.txt (its warning must come again) or a tab or newline in a field.
    """
    try:
        names = os.listdir(path)
    except OSError:
        return None
    norms: dict[str, None] = {}  # ordered; the first of a name in the directory wins
    items = []
    clean = True
    tag = group.encode("utf-8")
    for d in names:
        if not d.endswith(".dist-info"):
            continue
        dist, version = _dist_name_version(d)
        norm = dist.lower().replace("-", "_")
        if norm in norms:
            continue
        norms[norm] = None
        if "\t" in d or "\n" in d:
            clean = False
        try:
            data = _read_bytes(os.path.join(path, d, "entry_points.txt"))
            if tag not in data:  # most distributions: not worth decoding and parsing
                continue
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError) as err:  # a broken plugin is never fatal
            if not isinstance(err, FileNotFoundError):
                items.append((norm, (), (d, err)))
                clean = False
            continue
        eps = [_EntryPoint(dist, version, name, value)
               for name, value in _parse_group(text, group)]
        if eps:
            items.append((norm, eps, None))
            if any("\t" in ep.name or "\t" in ep.value for ep in eps):
                clean = False
    if not clean:
        return (mtime_ns, set(norms), items)
    return (mtime_ns, "\t" + "".join(n + "\t" for n in norms), items)


def _read_bytes(path: str) -> bytes:
    """A small file's bytes through the os module: ``open()`` builds a buffered text reader
    per file, a cost a first start paid for every installed distribution."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


def _memo_file(memo_dir: str | os.PathLike[str] | None) -> str:
    """The cache file's path, or "" when there is no cache root (no home directory)."""
    try:
        root = config.cache_root() if memo_dir is None else memo_dir
        return os.path.join(root, _MEMO_NAME)
    except Exception:  # noqa: BLE001 - the cache only saves time; discovery works without
        return ""


def _load(memo_file: str) -> dict[tuple[str, str], tuple]:
    """The records of a cache file; {} if it is missing or malformed (it is then rewritten).

    The format, one record per directory, fields separated by tabs::

        kdb entry points 1
        D <st_mtime_ns> <group> <directory>
        S <name> <name> ... <empty>       every distribution's normalised name
        P <dist> <version> <name> <value> one line per entry point in the group
        end
    """
    if _unsafe(memo_file):
        return {}
    try:
        with open(memo_file, "rb") as f:
            lines = f.read().decode("utf-8", "surrogateescape").split("\n")
    except OSError:
        return {}
    if lines[0] != _MEMO_HEADER or lines[-2:] != ["end", ""]:
        return {}
    out: dict[tuple[str, str], tuple] = {}
    cur: list | None = None  # [mtime_ns, names, items] of the record being read
    for line in lines[1:-2]:
        fields = line.split("\t")
        tag = fields[0]
        if tag == "D" and len(fields) == 4:
            try:
                mtime_ns = int(fields[1])
            except ValueError:
                return {}
            if cur is not None and cur[1] is None:
                return {}
            cur = [mtime_ns, None, []]
            out[(fields[2], fields[3])] = cur  # type: ignore[assignment]
        elif tag == "S" and cur is not None and cur[1] is None and line.endswith("\t"):
            cur[1] = line[1:]
        elif tag == "P" and len(fields) == 5 and cur is not None and cur[1] is not None:
            ep = _EntryPoint(*fields[1:])
            norm = ep.dist.lower().replace("-", "_")
            items = cur[2]
            if items and items[-1][0] == norm:
                items[-1][1].append(ep)
            else:
                items.append((norm, [ep], None))
        else:
            return {}
    if cur is not None and cur[1] is None:
        return {}
    return {key: tuple(rec) for key, rec in out.items()}


#: Records to write, per cache file: written at exit (or by :func:`flush`), off the start-up
#: path of the process whose first start it is.
_unsaved: dict[str, dict[tuple[str, str], tuple]] = {}


def _save_at_exit(memo_file: str, records: list[tuple[tuple[str, str], tuple]]) -> None:
    if not _unsaved:
        from .. import lifecycle

        lifecycle.on_exit(lifecycle.REPORT, flush)
    _unsaved.setdefault(memo_file, {}).update(records)


def flush() -> None:
    """Write the scans this process made to the cache file (at exit, or when called)."""
    while _unsaved:
        memo_file, records = _unsaved.popitem()
        _save(memo_file, list(records.items()))


def _save(memo_file: str, records: list[tuple[tuple[str, str], tuple]]) -> None:
    """Write ``records`` and the file's still valid records of other directories (other
    venvs share the cache root), atomically; a read-only cache only costs a rescan."""
    if _unsafe(memo_file):
        return
    mine = dict(records)
    for key, rec in _load(memo_file).items():
        if key in mine:
            continue
        try:
            if os.stat(key[1]).st_mtime_ns == rec[0]:  # else gone or stale: drop it
                mine[key] = rec
        except (OSError, ValueError):
            pass
    lines = [_MEMO_HEADER]
    for (group, path), (mtime_ns, norms, items) in mine.items():
        lines.append(f"D\t{mtime_ns}\t{group}\t{path}")
        lines.append("S" + norms)
        lines.extend(f"P\t{ep.dist}\t{ep.version}\t{ep.name}\t{ep.value}"
                     for _, eps, _ in items for ep in eps)
    lines.append("end\n")
    try:
        data = "\n".join(lines).encode("utf-8", "surrogateescape")
    except UnicodeError:  # a path that no encoding can write (a lone surrogate)
        return
    import threading  # not tempfile: heavier to import than a name of our own

    directory = os.path.dirname(memo_file)
    tmp = os.path.join(directory, f".entry-points-{os.getpid()}-{threading.get_ident()}.tmp")
    created = False
    try:
        try:
            fd = _create(tmp)
        except FileNotFoundError:  # no cache directory yet
            if not create_cache_dir:
                return
            make_private_dir(directory)
            fd = _create(tmp)
        created = True
        with open(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, memo_file)
    except OSError:
        if created:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _unsafe(memo_file: str) -> bool:
    """Whether the cache file or its directory is not this user's alone: another user could
    point a system database's entry point at a package of their choosing. It is then neither
    read nor written (the cache root's own refusal is reported where the tiers use it)."""
    from .fs import unsafe_chain

    bad = unsafe_chain([memo_file, os.path.dirname(memo_file)])
    if bad is not None:
        log.debug("kdb: entry point cache %s not used: %s", *bad)
    return bad is not None


def _create(path: str) -> int:
    """A new private file open for writing; one left by a dead process of the same id goes."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        os.unlink(path)
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)

