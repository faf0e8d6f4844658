"""Single-flight compiles across processes: one process compiles a key, the others wait.

MPI ranks start together and miss the same kernels at once; without coordination every rank
compiles every kernel (and PoCL fails builds under that load, docs/figures.md). A claim is
an exclusive ``flock`` on ``<user dir>/claims/<key>.lock``, taken without blocking. The
kernel releases it when the holder exits or dies, so a crashed compiler's claim never
outlives it, and taking one costs no database write (no schema needed on a cold machine).

The lock file says what its holder is doing (:func:`holder`): ``compiling``; ``pending``
once the compile is done and only its store is queued (:mod:`kdb.storing.spool`);
``storing`` while it stores the entry; ``waiting`` while another node compiles the key
(the shared tier). A waiter marks its demand with ``<key>.want``; a holder that still has
the program stores that entry at once itself, and the store worker takes wanted entries
first. How long a waiter waits is :mod:`kdb.claims.waiting`'s: as long as the holder makes
progress (:mod:`kdb.claims.progress`). Claims end with their holder; the store a holder left
queued when it exited is waited for, with the key's claim, by the process that misses it,
when that costs less than compiling (:mod:`kdb.storing.queued`, through ``queued``). On a
network file system ``flock`` may not coordinate across nodes; there the shared tier's locks
are the answer.

This wing imports only the base layer (``faults``, ``lifecycle``, ``logs``, ``config``) and
its own modules; the shared tier reaches it, never the other way round.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from .. import lifecycle, logs
from ..config import private_dir
from . import progress

log = logs.get("kdb")

#: What a holder writes into its lock file: state, pid, seconds (a compile's, or what one is
#: expected to take), wall-clock time, and when the process started (:func:`progress.start_time`).
COMPILING = "compiling"
PENDING = "pending"
#: A pending claim's waiter gives the holder this many times the seconds its lock file says,
#: of the holder's CPU time (:func:`kdb.claims.waiting.pending_wait`).
PENDING_FACTOR = 4.0
STORING = "storing"
WAITING = "waiting"

#: The longest compile this process has done: what a compile may take on this machine now.
_longest = 0.0

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
        #: The compile's seconds, once done, and what the lock file says now.
        self.seconds = 0.0
        self.state = COMPILING
        #: Handed to a store that releases it once done (:meth:`kdb.tiers.Tiers.put_later`).
        self.handed = False
        #: The thread that compiles: another thread of this process asking waits for it.
        self.thread = threading.get_ident()

    def __repr__(self) -> str:
        return f"Claim({self.key[:16]})"

    @property
    def wanted(self) -> bool:
        """Whether another process, of this node or (with the shared tier) of another,
        waits for this key."""
        if (self.directory / f"{self.key}.want").exists():
            return True
        return self.cross_node is not None and self.cross_node.wanted(self.key)

    def mark_pending(self, seconds: float, budget: float | None = None) -> None:
        """The compile is done (in ``seconds``) and its store is queued: a waiter now waits
        while storing it costs less than building it (:func:`pending_wait`), or, given a
        ``budget``, while the holder spends less than that of CPU time (an entry that may
        come later or never: AOTAutograd's, put only with a backward the program may never
        run)."""
        global _longest
        _longest = max(_longest, seconds)
        said = seconds if budget is None else budget / PENDING_FACTOR
        self.seconds, self.state = said, PENDING
        _write_state(self._fd, PENDING, said)

    def mark_storing(self) -> None:
        """The holder stores the entry now (for a waiter, or its process went quiet)."""
        self.mark(STORING)

    def mark(self, state: str) -> None:
        """Say what the holder does now (:data:`STORING`, :data:`WAITING`, :data:`COMPILING`)."""
        self.state = state
        _write_state(self._fd, state, self.seconds if state != COMPILING else _longest)

    def release(self) -> None:
        """Give the key up (after the entry was published, or when compiling failed)."""
        cross, self.cross_node = self.cross_node, None
        if cross is not None:
            try:
                cross.unlock(self.key)
            except Exception:  # noqa: BLE001 - the local claim is released whatever happens
                pass
        self.release_local()

    def release_local(self) -> None:
        """Give this node's part of the key up (its processes are served an entry that
        serves this node only), keeping the cross-node lock until the entry is published:
        :meth:`release` then gives that up too."""
        with _lock:
            _held.pop(self.key, None)
            fd, self._fd = self._fd, None
        if fd is None:
            return
        _remove_files(self.directory, self.key)
        os.close(fd)  # after the unlink: a waiter that opened the old file re-checks the inode


class Holder:
    """What another process's lock file says: ``state`` (one of the states above, or ``""``
    when unreadable), its ``pid``, ``seconds`` (the compile's, or what one is expected to
    take while compiling), ``since`` (wall clock) and ``start`` (:func:`progress.start_time`,
    0 when not written)."""

    __slots__ = ("state", "pid", "seconds", "since", "start")

    def __init__(self, state: str, pid: int, seconds: float, since: float,
                 start: int = 0) -> None:
        self.state, self.pid, self.seconds, self.since = state, pid, seconds, since
        self.start = start


def _write_state(fd: int | None, state: str, seconds: float = 0.0) -> None:
    if fd is None:
        return
    text = (f"{state} {os.getpid()} {seconds:.6f} {time.time():.3f} "
            f"{progress.start_time()}\n").encode("ascii")
    try:
        os.pwrite(fd, text.ljust(64), 0)  # one write of a fixed size: never read half-changed
    except OSError:
        pass


def holder(directory: Path, key: str) -> Holder:
    """The state the holder of ``key`` wrote (``state == ""`` if none could be read)."""
    try:
        with open(directory / f"{key}.lock", "rb") as f:
            parts = f.read(64).split()
        return Holder(parts[0].decode("ascii"), int(parts[1]), float(parts[2]), float(parts[3]),
                      int(parts[4]) if len(parts) > 4 else 0)
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
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)  # never a link's
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
            _write_state(fd, COMPILING, _longest)
            claim = Claim(directory, key, fd)
            with _lock:
                _held[key] = claim
            return claim
        os.close(fd)  # the holder released and unlinked it meanwhile: take the new file


def held(key: str) -> Claim | None:
    """This process's claim on ``key``, if it holds one."""
    with _lock:
        return _held.get(key)


def want(directory: Path, key: str) -> None:
    """Tell the holder of ``key`` that this process waits for it."""
    try:
        fd = os.open(directory / f"{key}.want", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        os.close(fd)
    except OSError:
        pass


def any_wanted() -> bool:
    """Whether another process waits for a key this process holds (checked by the writer)."""
    with _lock:
        held = list(_held.values())
    return any(c.wanted for c in held)


def longest() -> float:
    """The longest compile this process has done (0 before the first)."""
    return _longest


def wanted(directory: Path, key: str) -> bool:
    """Whether a process waits for ``key`` (the store worker takes such entries first)."""
    return os.path.exists(os.path.join(directory, f"{key}.want"))


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
    (its holder is gone), with its ``.want``; True if removed
    (:func:`kdb.dirs.remove_unheld_lock`)."""
    from ..dirs import remove_unheld_lock

    if not remove_unheld_lock(path):
        return False
    try:
        os.unlink(path.with_suffix(".want"))
    except OSError:
        pass
    return True


def _after_fork() -> None:
    """The child holds no claims: the parent does. Its copies of their fds are closed (a
    child living on after its parent died kept the ``flock``, and others waited for a dead
    holder), and its claims forget them and their cross-node locks, whose release would
    undo the parent's."""
    global _lock
    for claim in _held.values():
        fd, claim._fd, claim.cross_node = claim._fd, None, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    _held.clear()
    _lock = threading.Lock()


lifecycle.on_fork(_after_fork)
lifecycle.on_exit(lifecycle.SUMMARY, _at_exit)
