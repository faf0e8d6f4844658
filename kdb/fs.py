"""Facts about the file system under a cache: is it a network file system, is it safe.

SQLite's WAL needs shared memory that network file systems (NFS, Lustre, GPFS, ...) do
not provide across nodes: on those kdb uses a rollback journal and says to use a node-local
cache plus the shared tier. A user database is code the process will load and run, so one
that another user owns, or that group or others can write, is refused.
"""

from __future__ import annotations

import os
import stat

from .strpaths import exists, parent, spelled

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


def network_fs(path: str | os.PathLike[str]) -> str | None:
    """The network file system type under ``path``, or ``None`` if it is local."""
    p = spelled(path)
    while not exists(p) and parent(p) != p:
        p = parent(p)
    kind = fs_type(p)
    return kind if kind in NETWORK_FS else None


def unsafe_reason(path: str | os.PathLike[str]) -> str | None:
    """Why a user database (or its directory) must not be trusted, or ``None`` if it may.

    A path that cannot be there (under a regular file: ``KDB_CACHE_DIR=/dev/null``) is not
    unsafe: nothing is read from it, and whoever tries to create it reports why it failed.

    >>> unsafe_reason("/nonexistent-kdb-file") is None
    True
    >>> unsafe_reason("/dev/null/v1/a.kdb") is None
    True
    """
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"it is owned by another user (uid {st.st_uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "group or others can write it"
    return None
