"""One background thread per process that stores binaries off the caller's critical path.

Reading a PoCL program's binaries makes PoCL generate code for every kernel of the program:
it costs as much as the build, and done alongside the caller's builds and first launches it
slowed a cold start by 1.5-3x here (PoCL serialises its compiler work behind one lock).
So stores wait until the process has gone ``QUIET_S`` seconds without submitting one (its
start-up burst is over) or another process waits for one of them (:mod:`kdb.claims`), and
run at the lowest CPU priority.

At exit, stores not started yet that can be redone elsewhere (OpenCL programs: a
description of the build comes with the job) are handed to a detached, low-priority
process (:mod:`kdb.handoff`, ``KDB_STORE_AT_EXIT=detach``, the default), with their claims,
so the process exits at once: reading the binaries of pyopencl's scan kernels kept a
process 35 s past its end. The rest (and everything with ``KDB_STORE_AT_EXIT=wait``) is
finished here within ``KDB_STORE_TIMEOUT``; what is left then is abandoned (it compiles
again next run; SQLite's journal leaves nothing half-written). A job already inside PoCL's
``clGetProgramInfo`` cannot be interrupted, and PoCL makes the exiting process wait for it.
After ``fork`` the child starts with no jobs.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections import deque

from . import claims, config, logs

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable

log = logs.get("kdb")

#: Seconds without a new submission before stores start (the start-up burst is over).
QUIET_S = 5.0

#: A job: the function, and what a detached process needs to redo it (or None).
_jobs: "deque[tuple[Callable[[], None], object]]" = deque()
_cond = threading.Condition()
_unfinished = 0  # submitted and not done (queued, running, or handed over)
_thread: threading.Thread | None = None
_pid = 0
_errors: list[BaseException] = []
_last_submit = 0.0
_hurry = False  # set while someone waits in drain(): no more quiet period


def _lower_priority() -> None:
    # On Linux a thread is a task: PRIO_PROCESS with its native id renices this thread only.
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError):
            pass


def _next_job() -> Callable[[], None]:
    """The next job once it may run: the process is quiet, in a hurry, or someone waits."""
    with _cond:
        while True:
            if _jobs:
                quiet = QUIET_S - (time.monotonic() - _last_submit)
                if _hurry or quiet <= 0:
                    return _jobs.popleft()[0]
            _cond.wait(0.05 if _jobs else None)
            if _jobs and not _hurry and claims.any_wanted():  # another process waits for us
                return _jobs.popleft()[0]


def _run() -> None:
    global _unfinished
    _lower_priority()
    while True:
        job = _next_job()
        try:
            job()
        except BaseException as err:  # noqa: BLE001 - a store failure must not kill the thread
            _errors.append(err)
            log.warning("kdb: background store failed: %s", err, exc_info=log.isEnabledFor(10))
        finally:
            with _cond:
                _unfinished -= 1
                _cond.notify_all()


def submit(job: Callable[[], None], redo: object = None) -> None:
    """Run ``job`` on the background thread once the process is quiet (or at drain).

    ``redo``: what a detached process needs to do the job instead, should this process
    exit first (see :mod:`kdb.handoff`); ``None`` for jobs only this process can do.
    """
    global _thread, _pid, _last_submit, _unfinished
    with _cond:
        _last_submit = time.monotonic()
        if _thread is None or _pid != os.getpid() or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="kdb-store", daemon=True)
            _pid = os.getpid()
            _thread.start()
        _jobs.append((job, redo))
        _unfinished += 1
        _cond.notify_all()


def pending() -> int:
    """Jobs submitted and not finished yet."""
    return _unfinished


def take_redoable() -> list:
    """Remove the queued jobs a detached process can redo; returns their ``redo`` values."""
    global _unfinished
    with _cond:
        taken = [redo for _, redo in _jobs if redo is not None]
        if taken:
            kept = [(job, redo) for job, redo in _jobs if redo is None]
            _jobs.clear()
            _jobs.extend(kept)
            _unfinished -= len(taken)
            _cond.notify_all()
    return taken


def drain(timeout: float | None = None) -> list[BaseException]:
    """Run every submitted job now and wait for them (at most ``timeout`` seconds).

    Returns (and forgets) the jobs' errors. Jobs left when the timeout expires stay queued.
    """
    global _hurry
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
                    _cond.wait(left)
            finally:
                _hurry = False
    errs = list(_errors)
    _errors.clear()
    return errs


_finished = False


def finish() -> None:
    """At exit, once: hand redoable stores to a detached process (``KDB_STORE_AT_EXIT=detach``),
    finish the others within ``KDB_STORE_TIMEOUT``, and report what is left."""
    global _finished
    if _finished:
        return
    _finished = True
    try:
        detach = config.store_at_exit() == "detach"
    except Exception as err:  # noqa: BLE001 - a bad setting must not fail an exiting program
        log.warning("kdb: %s; storing before exit", err)
        detach = False
    if detach and os.name == "posix" and _pid == os.getpid():  # pass_fds, new sessions
        from . import handoff

        redo = take_redoable() if handoff.can_detach() else []
        if redo:
            handoff.start(redo)
    budget = config.store_timeout()
    for err in drain(budget):
        log.debug("kdb: background store error: %s", err)
    left = pending()
    if left:
        log.warning("kdb: %d kernel(s) not stored: storing them took longer than "
                    "KDB_STORE_TIMEOUT=%gs at exit; they compile again next run", left, budget)


def _after_fork() -> None:
    global _cond, _thread, _finished, _unfinished, _hurry
    _finished = False
    _cond = threading.Condition()
    _jobs.clear()
    _unfinished = 0
    _thread = None
    _hurry = False
    _errors.clear()


os.register_at_fork(after_in_child=_after_fork)
atexit.register(finish)
