"""A store job's file and its states: queued (``.job``), set aside as slow (``.slow``), being
stored (``.taken``, ``flock``-ed by its taker), unreadable (``.bad``). One job is one name
in one spool directory; its suffix is its state, so a rename is a state change that every
process sees at once and that survives a crash.
"""

from __future__ import annotations

import os
from pathlib import Path

JOB = ".job"
SLOW = ".slow"
TAKEN = ".taken"  # a job a store worker's child (or its own process) is storing now
BAD = ".bad"  # a job the worker could not read: set aside, never stored (kdb log ignores it)
#: Every state a job not stored yet can be in (``.bad`` is never stored).
PENDING = (JOB, SLOW, TAKEN)


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
