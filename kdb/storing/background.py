"""One background thread per process that stores binaries off the caller's critical path.

Stores a back end can hand to the store worker (:mod:`kdb.storing.spool`) go there; this thread
writes the rest: binaries a caller passed as bytes, shared-tier copies, drops, and, with
``KDB_STORE_AT_EXIT=wait`` (or where no worker can be started), the OpenCL stores too.
A store starts once the process has gone ``QUIET_S`` seconds without submitting one (its
start-up burst is over), or at once when another process waits for one of them
(:mod:`kdb.claims`). A *costly* one (reading a PoCL program's binaries, which competes with
the caller's builds for PoCL's compiler lock and costs about a compile) also waits for the
machine to have a CPU's idle time for it; the others (binaries already in hand: a compress
and an insert) do not, or on a machine that is never idle they would wait for the exit, and
a batch system that kills the job at its time limit would take them with it. The thread
keeps the process's priority: a thread cannot raise its priority again once lowered, and a
nice-19 store started in a quiet moment did not finish within ``KDB_STORE_TIMEOUT`` at exit
once CPU-bound work came back; the idle-CPU test before a costly store keeps it off a busy
machine instead. At exit
the stores are finished within ``KDB_STORE_TIMEOUT``; what is left then is abandoned (it
compiles again next run; SQLite's journal leaves nothing half-written). After ``fork`` the
child starts with no jobs.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from .. import claims, config, lifecycle, logs

if TYPE_CHECKING:
    from typing import Callable

log = logs.get("kdb")

#: Seconds without a new submission before stores start (the start-up burst is over).
QUIET_S = 5.0
#: Stores of bytes in hand queued past which the thread stores without waiting for a quiet
#: moment: a process that compiles without pause (an autotuner) holds at most this many
#: binaries in memory, not every one it made until its exit.
BACKLOG = 64

_jobs: "deque[tuple[Callable[[], None], bool]]" = deque()  # (job, costly)
_cond = threading.Condition()
_unfinished = 0  # submitted and not done (queued, running, or handed over)
_thread: threading.Thread | None = None
_pid = 0
_errors: list[BaseException] = []
_last_submit = 0.0
_hurry = False  # set while someone waits in drain(): no more quiet period
_busy = False  # a job is running (on the background thread or a draining one)


#: Seconds over which the machine's idle CPU time is judged before a store starts.
IDLE_WINDOW_S = 0.5
#: CPUs' worth of idle time over that window that let a store start.
IDLE_CPUS = 0.5

_sample: tuple[float, float] | None = None  # (when, the machine's idle CPU seconds then)


def _idle_seconds() -> float | None:
    """The machine's idle CPU seconds so far (``/proc/stat``: idle and iowait, all CPUs);
    None where there is no such file."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
        return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _machine_idle() -> bool | None:
    """Whether the machine had ``IDLE_CPUS`` idle over the last ``IDLE_WINDOW_S`` (True where
    it cannot be told); None until a window has passed since the last look."""
    global _sample
    now, idle = time.monotonic(), _idle_seconds()
    if idle is None:
        return True
    spent = None if _sample is None else now - _sample[0]
    if spent is None or spent > 4 * IDLE_WINDOW_S:  # none, or too old to tell the machine now
        _sample = (now, idle)
        return None
    if spent < IDLE_WINDOW_S:
        return None
    got = (idle - _sample[1]) / spent
    _sample = (now, idle)
    return got >= IDLE_CPUS


def _next_job() -> Callable[[], None]:
    """The next job once it may run: the process is quiet (and, for a costly job, the
    machine idle; for another, or more than ``BACKLOG`` queued), or another process waits. A job is never taken here while a drain runs:
    the draining thread runs it (at exit, a flush), and the order of jobs is kept."""
    global _busy
    with _cond:
        while True:
            if _jobs and not _busy and not _hurry:
                if claims.any_wanted():  # another process waits
                    _busy = True
                    return _jobs.popleft()[0]
                quiet = time.monotonic() - _last_submit >= QUIET_S
                costly = _jobs[0][1]
                if (quiet and _machine_idle()) if costly else (quiet or len(_jobs) > BACKLOG):
                    _busy = True
                    return _jobs.popleft()[0]
            _cond.wait(0.05 if _jobs else None)


def _run() -> None:
    global _sample
    while True:
        _run_one(_next_job())
        _sample = None  # the next look starts after this job: its own CPU time is not idle


def _run_one(job: Callable[[], None]) -> None:
    """Run ``job`` (taken with ``_busy`` set: one job at a time, in order, whichever thread
    runs it: a drop and a store of one key must not swap)."""
    global _unfinished, _busy
    try:
        job()
    except BaseException as err:  # noqa: BLE001 - a store failure must not kill the thread
        if not isinstance(err, Exception) and threading.current_thread() is not _thread:
            raise  # the caller's Ctrl-C (a flush, the exit): its job is dropped, not failed
        _errors.append(err)
        log.warning("kdb: background store failed: %s", err, exc_info=log.isEnabledFor(10))
    finally:
        with _cond:
            _unfinished -= 1
            _busy = False
            _cond.notify_all()


def submit(job: Callable[[], None], *, costly: bool = False) -> None:
    """Run ``job`` on the background thread once the process is quiet, and a ``costly`` one
    once the machine has idle CPU too (or either at drain)."""
    global _thread, _pid, _last_submit, _unfinished
    with _cond:
        _last_submit = time.monotonic()
        if _thread is None or _pid != os.getpid() or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="kdb-store", daemon=True)
            _pid = os.getpid()
            _thread.start()
        _jobs.append((job, costly))
        _unfinished += 1
        _cond.notify_all()


def pending() -> int:
    """Jobs submitted and not finished yet."""
    return _unfinished


def drain(timeout: float | None = None) -> list[BaseException]:
    """Run every submitted job now and wait for them (at most ``timeout`` seconds).

    A job the background thread has not started is run by the calling thread, without
    waiting for a quiet process or idle CPU (the caller waits for it: at exit, or a flush);
    one already started is waited for. Returns (and forgets) the jobs' errors. Jobs
    left when the timeout expires stay queued.
    """
    global _hurry, _busy
    if (_thread is not None and _pid == os.getpid() and _thread.is_alive()
            and threading.current_thread() is not _thread):
        deadline = None if timeout is None else time.monotonic() + timeout
        with _cond:
            _hurry = True
            _cond.notify_all()
            try:
                while _unfinished:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    if _jobs and not _busy:
                        _busy = True
                        job = _jobs.popleft()[0]
                        _cond.release()
                        try:
                            _run_one(job)
                        finally:
                            _cond.acquire()
                        continue
                    _cond.wait(left)
            finally:
                _hurry = False
    errs = list(_errors)
    _errors.clear()
    return errs


_finished = False


def finish() -> None:
    """At exit, once: finish the stores within ``KDB_STORE_TIMEOUT`` and report what is left."""
    global _finished
    if _finished:
        return
    _finished = True
    budget = config.store_timeout()
    for err in drain(budget):
        log.debug("kdb: background store error: %s", err)
    left = pending()
    if left:
        log.warning("kdb: %d kernel(s) not stored: storing them took longer than "
                    "KDB_STORE_TIMEOUT=%gs at exit; they compile again next run", left, budget)


def _after_fork() -> None:
    global _cond, _thread, _finished, _unfinished, _hurry, _busy, _sample
    _finished = False
    _sample = None
    _busy = False
    _cond = threading.Condition()
    _jobs.clear()
    _unfinished = 0
    _thread = None
    _hurry = False
    _errors.clear()


lifecycle.on_fork(_after_fork)
lifecycle.on_exit(lifecycle.STORES, finish)
