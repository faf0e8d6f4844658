"""A store job's file and its states: queued (``.job``), set aside as slow (``.slow``), being
stored (``.taken``, ``flock``-ed by its taker), unreadable (``.bad``). One job is one name
in one spool directory; its suffix is its state, so a rename is a state change that every
process sees at once and that survives a crash. And the room a job needs: a spool is
bounded, and never what fills a disk (:func:`check_room`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

from ..file import fs
from ..lifecycle import alive

JOB = ".job"
SLOW = ".slow"
TAKEN = ".taken"  # a job a store worker's child (or its own process) is storing now
BAD = ".bad"  # a job the worker could not read: set aside, never stored (kdb log ignores it)
#: Every state a job not stored yet can be in (``.bad`` is never stored).
PENDING = (JOB, SLOW, TAKEN)
#: The end of a refresh job's name (:data:`kdb.storing.jobs.REFRESH`): the worker holds it
#: back while an older job is still being stored, whose binary it may be about to refresh.
REFRESH_MARK = "-refresh"


def slow_path(path: Path) -> Path:
    return path.with_suffix(SLOW)


def taken_path(path: Path) -> Path:
    return path.with_suffix(TAKEN)


def take(path: Path) -> int | None:
    """Take the job ``path`` names (queued or set aside) to store it: its ``.taken`` file,
    ``flock``-ed through the returned fd until the caller closes it, so that a taker's death
    is seen (the store worker queues it again). None when another process took it first."""
    import fcntl

    for src in (path.with_suffix(JOB), slow_path(path)):
        try:
            fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:  # lock, then rename: a .taken file is never unlocked while its taker lives
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(src, taken_path(path))
            return fd
        except OSError:
            os.close(fd)
    return None


def first_ready(queued, pending) -> str | None:
    """The oldest of the ``queued`` job stems a lane may take: a refresh job waits while a
    job older than it is still ``pending`` (being stored, or set aside), whose binary the
    refresh would otherwise look at before it is stored.

    >>> first_ready(["2-7-1-refresh", "3-8-1"], pending=["1-6-1"])
    '3-8-1'
    >>> first_ready(["2-7-1-refresh", "3-8-1"], pending=[])
    '2-7-1-refresh'
    """
    older = min(pending, default=None)
    return next((s for s in queued if not (s.endswith(REFRESH_MARK) and older is not None
                                           and older < s)), None)


def exists(path: Path) -> bool:
    """Whether the job ``path`` names is not stored yet (queued, set aside, or being stored)."""
    return any(os.path.exists(path.with_suffix(s)) for s in PENDING)


def rename(src: Path, dst: Path) -> bool:
    """Move a job to another state; False when another process moved or stored it first."""
    try:
        os.rename(src, dst)
        return True
    except OSError:
        return False


def remove(path: Path) -> None:
    """Remove the job ``path`` names, whichever state it is in."""
    for p in (path.with_suffix(JOB), slow_path(path), taken_path(path)):
        try:
            os.unlink(p)
        except OSError:
            pass


# -- room -------------------------------------------------------------------------------------

#: A job is queued only while the file system under the spool keeps this much free: the
#: store that follows needs room for the binaries, SQLite's WAL and the worker's log, and a
#: cache must never be what fills a disk.
MIN_FREE = 32 << 20
#: ... and while its spool holds fewer jobs than this: a worker that cannot keep up, or
#: cannot run, never lets them pile up without end (the process stores them itself).
MAX_JOBS = 5000


class SpoolFull(OSError):
    """The spool, or the disk under it, is full: the job was not queued."""


def low_space(user_dir: Path) -> str | None:
    """Why nothing should be stored under ``user_dir`` now (its disk is nearly full), else
    None: one ``statvfs``."""
    free = fs.free_bytes(user_dir)
    if free is None or free >= MIN_FREE:
        return None
    return (f"the file system of {user_dir} has {free / 2**20:.1f} MiB free "
            f"(kdb leaves {MIN_FREE >> 20} MiB)")


#: Jobs each spool held when this process last counted, plus those it queued since.
_queued: dict[Path, int] = {}


def check_room(user_dir: Path, spool: Path) -> None:
    """Raise :class:`SpoolFull` when the disk is nearly full or the spool holds
    ``MAX_JOBS``; the spool is listed once, and again only when the count nears the bound."""
    import errno

    why = low_space(user_dir)
    if why is not None:
        raise SpoolFull(errno.ENOSPC, why)
    n = _queued.get(spool)
    if n is None or n >= MAX_JOBS:
        try:
            n = sum(1 for e in os.scandir(spool) if e.name.endswith(PENDING))
        except OSError:
            n = 0
    if n >= MAX_JOBS:
        raise SpoolFull(f"{spool} holds {n} jobs not stored yet (is its store worker "
                        "running? see store-worker.log)")
    _queued[spool] = n + 1


#: A job file still being written after this long was left by a writer that is stuck.
PARTIAL_AGE_S = 600.0


def sweep_partial(spool: Path, say: Callable[[str], None]) -> None:
    """Remove the job files writers left half-written (``.<job>.<pid>.tmp``: killed before
    the rename that queues them) once their writer is gone: a spool recovers from them."""
    try:
        names = [n for n in os.listdir(spool) if n.startswith(".") and n.endswith(".tmp")]
    except OSError:
        return
    for name in names:
        try:
            pid = int(name.rsplit(".", 2)[-2])
            age = time.time() - os.stat(spool / name).st_mtime
        except (ValueError, OSError):
            pid, age = 0, PARTIAL_AGE_S
        if 0 < pid != os.getpid() and age < PARTIAL_AGE_S and alive(pid):
            continue
        try:
            os.unlink(spool / name)
        except OSError:
            continue
        say(f"removed {name}, a job file its writer (process {pid}) left half-written")
