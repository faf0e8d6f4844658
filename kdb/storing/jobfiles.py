"""A store job's file and its states: queued (``.job``), set aside as slow (``.slow``), being
stored (``.taken``, ``flock``-ed by its taker), unreadable (``.bad``). One job is one name
in one spool directory; its suffix is its state, so a rename is a state change that every
process sees at once and that survives a crash. Each key a job will store is marked beside
the claims (:func:`mark`): a process that misses the key finds the job with one
``readlink``, whatever spool it is in. And the room a job needs: a spool is bounded, and
never what fills a disk (:func:`check_room`).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import time
from pathlib import Path
from typing import Callable

from ..file import fs
from ..dirs import open_regular
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


def _flocked(path: Path) -> int | None:
    """``path`` opened and ``flock``-ed (exclusive, not blocking) through the returned fd; -1
    when another process holds its lock; None when there is no such file, or where it is
    not a regular file (a FIFO, a directory: set aside as ``.bad``, or a worker that read
    the job before it was swapped would hand it to its lanes for ever)."""
    import fcntl

    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return None
    except OSError:
        with contextlib.suppress(OSError):
            if not stat.S_ISREG(os.stat(path).st_mode):
                os.rename(path, path.with_suffix(BAD))
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError:
        os.close(fd)
        return -1


def take(path: Path) -> int | None:
    """Take the job ``path`` names (queued or set aside) to store it: its ``.taken`` file,
    ``flock``-ed through the returned fd until the caller closes it, so that a taker's death
    is seen (the store worker queues it again). None when another process took it first."""
    for src in (path.with_suffix(JOB), slow_path(path)):
        fd = _flocked(src)  # lock, then rename: a .taken file is locked while its taker lives
        if fd is None or fd < 0:
            continue
        try:
            os.rename(src, taken_path(path))
            return fd
        except OSError:
            os.close(fd)
    return None


def first_ready(queued, pending) -> str | None:
    """The oldest of the ``queued`` job stems a lane may take: a refresh job waits while a
    job older than it is still ``pending`` (being stored, or set aside), whose binary the
    refresh would otherwise look at before it is stored. ``queued`` (oldest first) is read
    only as far as that job.

    >>> first_ready(["2-7-1-refresh", "3-8-1"], pending=["1-6-1"])
    '3-8-1'
    >>> first_ready(["2-7-1-refresh", "3-8-1"], pending=[])
    '2-7-1-refresh'
    """
    older = min(pending, default=None)
    return next((s for s in queued if not (s.endswith(REFRESH_MARK) and older is not None
                                           and older < s)), None)


def take_taken(path: Path) -> int | None:
    """For a waiter's child (:mod:`kdb.storing.queued`): the ``.taken`` job ``path`` names,
    ``flock``-ed through the returned fd when its taker died; -1 when a live taker still
    holds it (the child stores it too); None when it is gone."""
    return _flocked(taken_path(path))


def state(path: Path) -> str | None:
    """The state (suffix) of the job ``path`` names, or None once it is stored or dropped:
    in none of its states at two looks, one right after the other. A job moves back as well
    as forth (``.taken`` to ``.job`` when the floor lane takes it over from a starved idle
    lane, ``.taken`` to ``.slow``), each move one ``rename``, so a look a name at a time can
    miss it mid-move; the second look finds it at its new name. Missing it made a shared
    tier's keeper let go of a claim whose entry was still coming (another node compiled it,
    beside a CPU hog), and a process's exit drop a claim that others waited on."""
    for _ in range(2):
        for suffix in PENDING:
            if os.path.exists(path.with_suffix(suffix)):
                return suffix
    return None


def set_aside(path: Path) -> bool:
    """Set the job ``path`` names aside as slow when nobody is storing it (its ``.taken``
    file unlocked: its taker was stopped); False when a live taker holds it."""
    fd = take_taken(path)
    if fd is None or fd < 0:
        return False
    try:
        os.rename(taken_path(path), slow_path(path))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def exists(path: Path) -> bool:
    """Whether the job ``path`` names is not stored yet (queued, set aside, or being stored;
    :func:`state`)."""
    return state(path) is not None


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


# -- which job stores a key ----------------------------------------------------------------------

#: ``<claims dir>/<key>.queued``: a symlink to the job that will store ``key``
#: (``../spool/<environment>/<name>``, without its state's suffix).
QUEUED = ".queued"
_TARGET = re.compile(r"\.\./spool/[0-9a-f]{16}/[0-9]{20}-[0-9]+-[0-9]+")


def _target(job: Path) -> str:
    return f"../spool/{job.parent.name}/{job.stem}"


def mark(claims_dir: Path, job: Path, keys) -> None:
    """Mark each of ``keys`` as stored by ``job`` (a newer job's mark replaces an older one's).
    One ``symlink`` a key; nothing when the claims directory cannot be written."""
    target = _target(job)
    for key in keys:
        link = os.path.join(claims_dir, key + QUEUED)
        try:
            os.symlink(target, link)
        except FileExistsError:
            tmp = f"{link}.{os.getpid()}.tmp"
            try:
                os.symlink(target, tmp)
                os.replace(tmp, link)
            except OSError:
                return
        except OSError:
            return


def unmark(claims_dir: Path, job: Path, keys) -> None:
    """Remove the marks of ``keys`` that still name ``job`` (it is stored or dropped)."""
    target = _target(job)
    for key in keys:
        link = os.path.join(claims_dir, key + QUEUED)
        try:
            if os.readlink(link) == target:
                os.unlink(link)
        except OSError:
            continue


def marked(claims_dir: Path, key: str) -> Path | None:
    """The job marked as storing ``key`` (its path in the ``.job`` state, whatever its state
    is now), or None: one ``readlink``. A mark that names nothing a spool can hold is
    ignored."""
    try:
        target = os.readlink(os.path.join(claims_dir, key + QUEUED))
    except OSError:
        return None
    if not _TARGET.fullmatch(target):
        return None
    return Path(claims_dir).parent.joinpath(*target.split("/")[1:]).with_suffix(JOB)


# -- which lane of the store worker stores a job ----------------------------------------------

#: Held by the one process that stores a spool's jobs ahead for others (:mod:`kdb.worker.ahead`).
AHEAD_LOCK = "ahead.lock"


def locked(path: Path) -> bool:
    """Whether a process holds an ``flock`` on ``path`` (False when there is no such file)."""
    fd = _flocked(path)
    if fd is not None and fd >= 0:
        os.close(fd)  # closing drops the lock we took
    return fd == -1


#: The store worker's lock file in its spool (held by the worker; it says what its lanes
#: store, in its first :data:`LANES_SIZE` bytes).
LOCK = "worker.lock"
LANES_SIZE = 256


def publish_lanes(fd: int, lanes: list[tuple[int, int, float, str]]) -> None:
    """Say in ``worker.lock`` (open as ``fd`` by its worker) which job each lane stores:
    ``(pid, start time, CPU seconds when it took the job, the job's name)``. A process that
    waits for one of those jobs judges the lane by its progress (:mod:`kdb.storing.queued`)."""
    text = "".join(f"{pid} {start} {cpu:.3f} {stem}\n" for pid, start, cpu, stem in lanes)
    try:
        os.pwrite(fd, text.encode("ascii")[:LANES_SIZE].ljust(LANES_SIZE), 0)
    except OSError:
        pass


def lane_of(job: Path) -> tuple[int, int, float] | None:
    """``(pid, start time, CPU time when it took the job)`` of the worker's lane storing
    ``job``, from the spool's ``worker.lock`` (:func:`publish_lanes`)."""
    try:
        with open(job.parent / LOCK, "rb") as f:
            lines = f.read(LANES_SIZE).split(b"\n")
    except OSError:
        return None
    stem = job.stem.encode("ascii")
    for line in lines:
        parts = line.split()
        if len(parts) == 4 and parts[3] == stem:
            try:
                return int(parts[0]), int(parts[1]), float(parts[2])
            except ValueError:
                return None
    return None


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


def worker_running(spool: Path) -> bool:
    """Whether a worker holds ``spool``'s lock."""
    import fcntl

    try:
        fd = os.open(spool / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops a lock we took
    return False
