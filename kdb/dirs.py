"""The directories kdb makes for itself: the home its default cache lives under (or a private
stand-in when there is none) and private directories (a cache holds code the user will run);
and how a file found in one is opened for reading without trusting what it is.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def home() -> str:
    """The home directory the default cache lives under: ``HOME`` (else the password entry's).

    ``HOME`` empty, relative or ``/`` (a service account, a scrubbed environment) would put
    the cache at ``.cache/kdb`` in whatever directory a process runs in, or at
    ``/.cache/kdb``: a private directory under the temporary directory stands in, with one
    warning (:func:`stand_in_home`)."""
    found = os.environ.get("HOME")
    if found is None:
        found = os.path.expanduser("~")  # the password entry (``~`` where there is none)
    if found[:1] == os.sep and str(Path(found)) != os.sep:
        return found
    return stand_in_home(found)


def stand_in_home(found: str | None) -> str:
    """``<tmp>/kdb-<uid>``, created 0700 and checked to be this user's own directory (else a
    new private one, ``mkdtemp``); warns once, naming ``HOME`` and the fix."""
    got = _stand_ins.get(found)
    if got is not None:
        return got
    import tempfile

    from . import logs

    uid = os.getuid() if hasattr(os, "getuid") else 0
    path = os.path.join(tempfile.gettempdir(), f"kdb-{uid}")
    try:
        os.mkdir(path, 0o700)
    except OSError:
        pass
    try:
        st = os.lstat(path)
        ours = stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o022
    except OSError:
        ours = False
    if not ours:  # planted by someone else, or not a directory: never use it
        path = tempfile.mkdtemp(prefix=f"kdb-{uid}-")
    logs.warn_once("home", "kdb: HOME is %s, so there is no home directory for the kernel "
                   "cache; using the private directory %s instead. Set HOME to your home "
                   "directory, or KDB_CACHE_DIR to a directory of your own.",
                   "unset" if found in (None, "~") else repr(found), path)
    _stand_ins[found] = path
    return path


_stand_ins: dict[str | None, str] = {}


def make_private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` and any missing parents with mode 0700; returns it as a Path. (Not
    ``Path.mkdir(parents=True)``: that gives the parents the umask's mode.)"""
    target = Path(path)
    missing = []
    p = target
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
    return target


def open_regular(path: Path) -> int:
    """``path`` opened for reading, without blocking: a FIFO or a device where a job file
    (or any file kdb keeps for itself) should be would hold the reader in ``open()`` for ever. ``OSError`` unless it is a
    regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    return fd


def remove_unheld_lock(path: Path) -> bool:
    """Remove the lock file ``path`` if no process holds its ``flock``; True if removed. It is
    held while unlinked, so a process that opened it meanwhile and locks it next sees that
    the path names another file now, and locks that one (``kdb.file.migrate.file_lock``, a
    claim): one holder at a time, though the file was removed."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if not names_open_file(path, fd):
            return False
        os.unlink(path)
        return True
    except OSError:
        return False  # a live holder, or gone meanwhile
    finally:
        os.close(fd)


def names_open_file(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not removed, nor replaced)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    here = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino)
