"""Facts about the file system under a cache: is it a network file system, is it safe.

SQLite's WAL needs shared memory that network file systems (NFS, Lustre, GPFS, ...) do
not provide across nodes: on those kdb uses a rollback journal and says to use a node-local
cache plus the shared tier. A user database, a store worker's spool and a system database
are code the process will load and run, so one that another user owns (root may own a system
database), or that group or others can write, is refused; so is one below a directory someone
else could change (:func:`unsafe_above`): whoever can rename entries of a directory above a
cache can swap the whole cache for their own between two opens.
"""

from __future__ import annotations

import os
from pathlib import Path
import stat


#: File system types (as /proc/mounts names them) on which SQLite's WAL cannot be trusted.
NETWORK_FS = frozenset({
    "nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "ceph", "beegfs", "glusterfs",
    "fuse.sshfs", "fuse.glusterfs", "fuse.beegfs", "9p", "afs", "panfs", "pvfs2", "orangefs",
})


def fs_type(path: str | os.PathLike[str], mounts: str = "/proc/mounts") -> str | None:
    """The type of the file system holding ``path`` (Linux), or ``None`` when unknown."""
    target = os.path.realpath(path)
    best, kind = "", None
    try:
        with open(mounts, encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                point = parts[1].replace("\\040", " ")
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, parts[2]
    except OSError:
        return None
    return kind


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes a writer that is not root may still use on the file system of ``path``
    (``statvfs``'s ``f_bavail``), or ``None`` when it cannot be asked."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def network_fs(path: str | os.PathLike[str]) -> str | None:
    """The network file system type under ``path``, or ``None`` if it is local."""
    p = str(Path(path))
    while not Path(p).exists() and str(Path(p).parent) != p:
        p = str(Path(p).parent)
    kind = fs_type(p)
    return kind if kind in NETWORK_FS else None


def unsafe_reason(path: str | os.PathLike[str]) -> str | None:
    """Why a user database (or its directory, or a spool's file) must not be trusted, or
    ``None`` if it may: it must be this user's and written by nobody else. A symbolic link
    counts as what it points to, unless another user owns the link (they could re-point it).

    A path that cannot be there (under a regular file: ``KDB_CACHE_DIR=/dev/null``) is not
    unsafe: nothing is read from it, and whoever tries to create it reports why it failed.

    >>> unsafe_reason("/nonexistent-kdb-file") is None
    True
    >>> unsafe_reason("/dev/null/v1/a.kdb") is None
    True
    """
    return _owner_problem(path, system=False)


def system_unsafe_reason(path: str | os.PathLike[str]) -> str | None:
    """Why a system database (or its directory) must not be loaded, or ``None`` if it may:
    it must be owned by this user or root and written by nobody else. A sticky directory
    that others can write (``/tmp``) is refused too: one rule, however the bits are set.

    >>> system_unsafe_reason("/") is None
    True
    >>> system_unsafe_reason("/tmp")
    'group or others can write it'
    """
    return _owner_problem(path, system=True)


def unsafe_chain(paths, system: bool = False) -> tuple[str, str] | None:
    """The first of ``paths`` (a cache root, its user dir, a spool, a file...) that must not
    be trusted, with why, then the first directory above the topmost of them, or above where
    one that is a link leads, that someone else could change (:func:`unsafe_above`); ``None``
    when every one may be trusted."""
    paths, links = [os.fspath(p) for p in paths], []
    for p in paths:
        why, linked = _checked(p, system)
        if why is not None:
            return str(Path(p)), why
        if linked:
            links.append(os.path.realpath(p))
    if not paths:
        return None
    top = paths[0] if len(paths) == 1 else min(
        paths, key=lambda p: os.path.abspath(p).count(os.sep))
    for p in (top, *links):
        bad = unsafe_above(p)
        if bad is not None:
            return bad
    return None


def unsafe_above(path: str | os.PathLike[str]) -> tuple[str, str] | None:
    """The first directory above ``path`` (as written, and with its links resolved) whose
    entries someone other than this user or root could rename, with why (:func:`above_problem`);
    ``None`` when nobody else can swap what ``path`` resolves to. Checked at every open (an
    ``lstat`` per directory): a cache under such a directory can be replaced between two
    opens of the same path.

    >>> unsafe_above("/tmp/kdb-cache") is None   # /tmp is sticky: only its owner renames an entry
    True
    """
    if not hasattr(os, "getuid"):
        return None
    me, linked = os.getuid(), []
    bad = _above(os.path.dirname(os.path.abspath(path)), me, linked, set())
    if bad is None and linked:  # the directories a link's target resolves through, too
        bad = _above(os.path.dirname(os.path.realpath(path)), me, [], set())
    return bad


def _above(d: str, me: int, linked: list, seen: set) -> tuple[str, str] | None:
    while d not in seen:
        seen.add(d)
        try:
            st = os.lstat(d)
            if stat.S_ISLNK(st.st_mode):
                if st.st_uid not in (me, 0):
                    return d, f"it is a symbolic link owned by another user (uid {st.st_uid})"
                linked.append(d)
                st = os.stat(d)
        except OSError:
            st = None  # not there (yet): nothing resolves through it
        if st is not None and stat.S_ISDIR(st.st_mode):  # /dev/null/v1: nothing below
            why = above_problem(st, me)
            if why is not None:
                return d, why
        d = os.path.dirname(d)
    return None


def above_problem(st: os.stat_result, me: int | None = None) -> str | None:
    """Why a directory above a trusted one must not be trusted: it is not this user's or
    root's (its owner can rename what is in it), or group or others can write it and it is
    not sticky (a sticky directory, ``/tmp``, lets only an entry's owner rename it)."""
    me = os.getuid() if me is None else me
    if st.st_uid not in (me, 0):
        return f"it is owned by another user (uid {st.st_uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        return "group or others can write it, and it is not sticky"
    return None


def _owner_problem(path: str | os.PathLike[str], system: bool) -> str | None:
    return _checked(path, system)[0]


def _checked(path: str | os.PathLike[str], system: bool) -> tuple[str | None, bool]:
    """(why ``path`` must not be trusted or None, whether it is a symbolic link)."""
    try:
        link = os.lstat(path)
        st = os.stat(path) if stat.S_ISLNK(link.st_mode) else link
    except (FileNotFoundError, NotADirectoryError):
        return None, False
    except OSError as err:  # a name too long, EACCES above it, an I/O error: not trusted
        return f"it cannot be examined ({err.strerror or err})", False
    linked = stat.S_ISLNK(link.st_mode)
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        return None, linked  # /dev/null and the like: nothing is read from it, and making
        # a cache below it fails with its own clear error ("Not a directory")
    me = os.getuid() if hasattr(os, "getuid") else None
    allowed = (me, 0) if system else (me,)
    if me is not None and linked and link.st_uid not in (me, 0):
        return f"it is a symbolic link owned by another user (uid {link.st_uid})", linked
    return stat_problem(st, allowed), linked


def stat_problem(st: os.stat_result, allowed: tuple | None = None) -> str | None:
    """Why a file with this ``stat`` must not be trusted: an owner not in ``allowed`` (default:
    this user), or group or others can write it."""
    if hasattr(os, "getuid"):
        if st.st_uid not in (allowed or (os.getuid(),)):
            return f"it is owned by another user (uid {st.st_uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "group or others can write it"
    return None


def refused(paths, why_not: tuple[str, str], system: bool = False) -> bool:
    """True, after one warning (:func:`refuse`), when one of ``paths`` must not be trusted."""
    bad = unsafe_chain(paths, system)
    if bad is None:
        return False
    refuse(*bad, why_not, once=bad[0])
    return True


def refuse(path: str, why: str, why_not: tuple[str, str], once: str) -> None:
    """One warning (a fault) naming ``path``, what is wrong with it, the fix and what kdb
    does instead. ``why_not``: (what trusting it would risk, what happens meanwhile)."""
    from .. import faults

    risk, meanwhile = why_not
    faults.fault(f"{path} is refused: {why}, and {risk}. chown/chmod it (make it yours; chmod "
                 "700 a directory, 600 a file) or set KDB_CACHE_DIR to a directory of your own; "
                 f"{meanwhile}.", once="unsafe:" + once)
