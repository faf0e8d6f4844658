"""Single-flight compiles across processes: one process compiles a key, the others wait.

MPI ranks start together and miss the same kernels at once; without coordination every rank
compiles every kernel (and PoCL fails builds under that load, docs/figures.md). A claim is
an exclusive ``flock`` on ``<user dir>/claims/<key>.lock``, taken without blocking. The
kernel releases it when the holder exits or dies, so a crashed compiler's claim never
outlives it, and taking one costs no database write (no schema needed on a cold machine).

The lock file says what its holder is doing (:func:`holder`): ``compiling``, or
``pending`` once the compile is done and only its store is queued (:mod:`kdb.storing.spool`). A
waiter waits for a running compile (bounded by ``KDB_WAIT_TIMEOUT``, with back-off), but
for a pending store only :func:`pending_wait`: a few times what the compile took. A waiter
marks its demand with ``<key>.want``; a holder that still has the program stores that entry
at once itself (:mod:`kdb.storing.spool`), and the store worker takes wanted entries first. Claims
end with their holder, so nobody ever waits for the store of a process that has exited. On a network file system
``flock`` may not coordinate across nodes; there the shared tier's locks are the answer.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from . import faults, lifecycle, logs
from .config import private_dir

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable

log = logs.get("kdb")

#: What a holder writes into its lock file: state, pid, compile seconds, wall-clock time.
COMPILING = "compiling"
PENDING = "pending"

_held: dict[str, "Claim"] = {}
_lock = threading.Lock()


class Claim:
    """This process's exclusive right to compile one key; release it once the entry is stored."""

    def __init__(self, directory: Path, key: str, fd: int) -> None:
        self.directory = directory
        self.key = key
        self._fd: int | None = fd
        #: The shared tier's cross-node locks when this claim also holds the key's lock there
        #: (:meth:`kdb.shared.locks.CrossNodeLocks.adopt`): asked about waiters, released with it.
        self.cross_node = None

    def __repr__(self) -> str:
        return f"Claim({self.key[:16]})"

    @property
    def wanted(self) -> bool:
        """Whether another process, of this node or (with the shared tier) of another,
        waits for this key."""
        if (self.directory / f"{self.key}.want").exists():
            return True
        return self.cross_node is not None and self.cross_node.wanted(self.key)

    def mark_pending(self, seconds: float) -> None:
        """The compile is done (in ``seconds``) and its store is queued: waiters now wait at
        most about that long before building the program themselves."""
        _write_state(self._fd, PENDING, seconds)

    def release(self) -> None:
        """Give the key up (after the entry was published, or when compiling failed)."""
        cross, self.cross_node = self.cross_node, None
        if cross is not None:
            try:
                cross.unlock(self.key)
            except Exception:  # noqa: BLE001 - the local claim is released whatever happens
                pass
        with _lock:
            _held.pop(self.key, None)
            fd, self._fd = self._fd, None
        if fd is None:
            return
        _remove_files(self.directory, self.key)
        os.close(fd)  # after the unlink: a waiter that opened the old file re-checks the inode


class Holder:
    """What another process's lock file says: ``state`` (``compiling``, ``pending`` or ``""``
    when unreadable), its ``pid``, the compile's ``seconds`` and ``since`` (wall clock)."""

    __slots__ = ("state", "pid", "seconds", "since")

    def __init__(self, state: str, pid: int, seconds: float, since: float) -> None:
        self.state, self.pid, self.seconds, self.since = state, pid, seconds, since


def _write_state(fd: int | None, state: str, seconds: float = 0.0) -> None:
    if fd is None:
        return
    text = f"{state} {os.getpid()} {seconds:.6f} {time.time():.3f}\n".encode("ascii")
    try:
        os.pwrite(fd, text.ljust(64), 0)  # one write of a fixed size: never read half-changed
    except OSError:
        pass


def holder(directory: Path, key: str) -> Holder:
    """The state the holder of ``key`` wrote (``state == ""`` if none could be read)."""
    try:
        with open(directory / f"{key}.lock", "rb") as f:
            parts = f.read(64).split()
        return Holder(parts[0].decode("ascii"), int(parts[1]), float(parts[2]), float(parts[3]))
    except (OSError, IndexError, ValueError, UnicodeDecodeError):
        return Holder("", 0, 0.0, 0.0)


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
            _write_state(fd, COMPILING)
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


def pending_wait(compile_seconds: float) -> float:
    """How long a waiter waits for an entry whose compile is done and whose store is queued:
    the holder stores a wanted entry at once from the program in hand (reading binaries costs
    about what the compile did), so a few times the compile, and at least 2 s."""
    return max(4.0 * compile_seconds, 2.0)


def wanted(directory: Path, key: str) -> bool:
    """Whether a process waits for ``key`` (the store worker takes such entries first)."""
    return os.path.exists(os.path.join(directory, f"{key}.want"))


# -- single flight: claim, or wait for the holder ----------------------------------------------

#: Pids of claim holders this process waited for in vain (stopped, or stuck in a driver).
_given_up: set[int] = set()


def claim_or_wait(directory: Path, key: str, label: str, find: Callable[[], Any],
                  timeout: float, shared=None):
    """After a miss: claim ``key`` for compiling, or wait while another process compiles it.

    Polls with bounded back-off: this node's claim first, then (with ``shared``, the shared
    tier) the cross-node lock; ``find()`` looks for the entry another process may have
    published meanwhile. Returns what ``find()`` found, a :class:`Claim` (this process
    compiles; with ``shared`` it also holds the cross-node lock), or ``None`` (compile
    without coordination: the directory is unusable, or the wait is over).

    A waiter waits for a compile that is running, up to ``timeout`` seconds; for an entry
    whose compile is done and whose store is only queued (:mod:`kdb.storing.spool`), at most
    :func:`pending_wait`, since building the program itself costs about that. A holder that
    made no progress within the bound is given up on for the rest of the process. A process
    that holds this node's claim while another node compiles the key waits for the shared
    entry, and past the bound compiles it with that claim.
    """
    deadline = time.monotonic() + timeout
    try:
        return _wait(directory, key, label, find, timeout, deadline, shared)
    finally:
        if shared is not None:
            shared.unwant(key)


def _wait(directory, key, label, find, timeout, deadline, shared):
    delay = 0.002
    claim = None
    while True:
        try:
            claim = claim or try_claim(directory, key)
        except OSError as err:
            # Same once-key as the user file's write faults: a read-only cache warns once.
            user_dir = directory.parent
            faults.fault(f"cannot write to the kernel cache {user_dir} ({err}): kernels "
                         "are compiled but may not be stored, and processes may compile the "
                         "same kernel. Make it writable or set KDB_CACHE_DIR to a writable "
                         "directory.", once=str(user_dir))
            return None
        # Shared tier: with the local claim, take the cross-node lock too (None: no server).
        locked = shared.try_lock(key) if shared and claim else None
        # Even with the claim: the holder may have published just before releasing it.
        hit = find()
        if hit is not None:
            if locked:
                shared.unlock(key)
            if claim is not None:
                claim.release()
            return hit
        if claim is not None and locked is not False:
            return shared.adopt(claim) if locked else claim
        if claim is None:
            held_by = holder(directory, key)
            if held_by.pid in _given_up:
                return None  # it made no progress before: do not wait for it again
            want(directory, key)
            if (held_by.state == PENDING
                    and time.time() - held_by.since >= pending_wait(held_by.seconds)):
                return None  # its store did not come: building it costs no more
        else:  # this node's claim is ours, another node compiles it: ask it to hurry
            shared.want(key)
        if time.monotonic() >= deadline:
            if claim is None and held_by.pid:
                _given_up.add(held_by.pid)
            log.warning("kdb: waited %.0f s for another process (pid %s) to compile %s; "
                        "compiling it here, and not waiting for that process again "
                        "(KDB_WAIT_TIMEOUT)", timeout,
                        held_by.pid if claim is None and held_by.pid else "unknown", label)
            return claim  # ours if this node's claim is: its other processes wait for us
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


# -- leftovers ----------------------------------------------------------------------------------

def _at_exit() -> None:
    """A claim ends with its process (the kernel drops the ``flock``); so does its lock file,
    or it would stay behind for every store still queued at exit. Runs after the STORES
    phase has handed cross-node locks to a keeper, so only the local files go here."""
    with _lock:
        held = [(claim, claim._fd) for claim in _held.values()]
        for claim, _ in held:
            claim._fd = None
        _held.clear()
    for claim, fd in held:
        if fd is None:
            continue
        _remove_files(claim.directory, claim.key)
        os.close(fd)


def _remove_files(directory: Path, key: str) -> None:
    """A claim's files, removed while its lock is still held (so no waiter takes a new one
    that is then unlinked under it)."""
    for name in (f"{key}.want", f"{key}.lock"):
        try:
            os.unlink(directory / name)
        except OSError:
            pass


def remove_if_stale(path: Path) -> bool:
    """Remove the claim file ``path`` (``<key>.lock``) if no process holds its ``flock``
    (its holder is gone), with its ``.want``; True if removed. Held while unlinking, so a
    process that opens it meanwhile finds the inode changed and takes a new file."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False  # a live holder
    try:
        if os.fstat(fd).st_ino != os.stat(path).st_ino:
            return False
        os.unlink(path)
        try:
            os.unlink(path.with_suffix(".want"))
        except OSError:
            pass
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _after_fork() -> None:
    global _lock
    _held.clear()  # the child holds no claims: flock is shared, but the parent owns them
    _lock = threading.Lock()


lifecycle.on_fork(_after_fork)
lifecycle.on_exit(lifecycle.SUMMARY, _at_exit)
