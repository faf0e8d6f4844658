"""Single-flight compiles across processes: one process compiles a key, the others wait.

MPI ranks start together and miss the same kernels at once; without coordination every rank
compiles every kernel (and PoCL fails builds under that load, DESIGN section 11). A claim is
an exclusive ``flock`` on ``<user dir>/claims/<key>.lock``, taken without blocking. The
kernel releases it when the holder exits or dies, so a crashed compiler's claim never
outlives it, and taking one costs no database write (no schema needed on a cold machine).

A waiter marks its demand with ``<key>.want``; the holder's background writer sees it and
publishes that entry at once instead of waiting for the process to go quiet. Waiting is
bounded (``KDB_WAIT_TIMEOUT``) with exponential back-off; past the bound the waiter
compiles the kernel itself. On a network file system ``flock`` may not coordinate across
nodes; there the shared tier's locks are the answer (see the shared-tier issue).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from .config import private_dir

_held: dict[str, "Claim"] = {}
_lock = threading.Lock()


class Claim:
    """This process's exclusive right to compile one key; release it once the entry is stored."""

    def __init__(self, directory: Path, key: str, fd: int) -> None:
        self.directory = directory
        self.key = key
        self._fd: int | None = fd

    def __repr__(self) -> str:
        return f"Claim({self.key[:16]})"

    @property
    def wanted(self) -> bool:
        """Whether another process waits for this key."""
        return (self.directory / f"{self.key}.want").exists()

    def release(self) -> None:
        """Give the key up (after the entry was published, or when compiling failed)."""
        with _lock:
            _held.pop(self.key, None)
            fd, self._fd = self._fd, None
        if fd is None:
            return
        for name in (f"{self.key}.want", f"{self.key}.lock"):
            try:
                os.unlink(self.directory / name)
            except OSError:
                pass
        os.close(fd)  # after the unlink: a waiter that opened the old file re-checks the inode


    def hand_over(self) -> int | None:
        """The claim's descriptor, for a process this one starts to inherit (``pass_fds``):
        the ``flock`` lives as long as any descriptor of it is open, so the claim outlives
        this process. This process forgets it; the heir releases it with :func:`adopt`."""
        with _lock:
            _held.pop(self.key, None)
            fd, self._fd = self._fd, None
        return fd


def adopt(directory: Path, key: str, fd: int) -> Claim:
    """A claim handed over by the process that started this one (see :meth:`Claim.hand_over`)."""
    claim = Claim(directory, key, fd)
    with _lock:
        _held[key] = claim
    return claim


def try_claim(directory: Path, key: str) -> Claim | None:
    """Claim ``key`` if no other process holds it; ``None`` if one does.

    Raises ``OSError`` when the directory cannot be used (read-only cache): the caller then
    compiles without coordination.
    """
    import fcntl

    with _lock:
        if key in _held:  # another thread of this process compiles it
            return None
    private_dir(directory)
    path = directory / f"{key}.lock"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError:
            os.close(fd)
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            claim = Claim(directory, key, fd)
            with _lock:
                _held[key] = claim
            return claim
        os.close(fd)  # the holder released and unlinked it meanwhile: take the new file


def held_here(key: str) -> bool:
    """Whether this process holds the claim on ``key`` (its store is still pending)."""
    with _lock:
        return key in _held


def want(directory: Path, key: str) -> None:
    """Tell the holder of ``key`` that this process waits for it."""
    try:
        fd = os.open(directory / f"{key}.want", os.O_WRONLY | os.O_CREAT, 0o600)
        os.close(fd)
    except OSError:
        pass


def any_wanted() -> bool:
    """Whether another process waits for a key this process holds (checked by the writer)."""
    with _lock:
        held = list(_held.values())
    return any(c.wanted for c in held)


def _after_fork() -> None:
    _held.clear()  # the child holds no claims: flock is shared, but the parent owns them


os.register_at_fork(after_in_child=_after_fork)
