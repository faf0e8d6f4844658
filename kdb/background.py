"""One background thread per process that stores binaries off the caller's critical path.

Reading a PoCL program's binaries makes PoCL generate code for every kernel of the program:
it costs as much as the build, and done alongside the caller's builds and first launches it
slowed a cold start by 1.5-3x here (PoCL serialises its compiler work behind one lock).
So stores wait until the process has gone ``QUIET_S`` seconds without submitting one (its
start-up burst is over) or another process waits for one of them (:mod:`kdb.claims`), run
at the lowest CPU priority, and are finished at exit or on :func:`drain`. Jobs not done
when the exit budget (``KDB_STORE_TIMEOUT``) runs out are abandoned: those kernels compile
again next run, and nothing is half-written (SQLite's journal). A job already inside
PoCL's ``clGetProgramInfo`` cannot be interrupted, and PoCL makes the exiting process wait
for it (measured: 27 s for a scan program with a 2 s budget). After ``fork`` the child
starts with an empty queue.
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import time
from typing import Callable

from . import claims, config, logs

log = logs.get("kdb")

#: Seconds without a new submission before stores start (the start-up burst is over).
QUIET_S = 5.0

_q: "queue.Queue[Callable[[], None]]" = queue.Queue()
_thread: threading.Thread | None = None
_pid = 0
_start_lock = threading.Lock()
_errors: list[BaseException] = []
_last_submit = 0.0
_hurry = threading.Event()  # set while someone waits in drain(): no more quiet period


def _lower_priority() -> None:
    # On Linux a thread is a task: PRIO_PROCESS with its native id renices this thread only.
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError):
            pass


def _run() -> None:
    _lower_priority()
    while True:
        job = _q.get()
        while not _hurry.is_set():
            wait = QUIET_S - (time.monotonic() - _last_submit)
            if wait <= 0 or claims.any_wanted():  # another process waits for our entry
                break
            _hurry.wait(min(wait, 0.05))
        try:
            job()
        except BaseException as err:  # noqa: BLE001 - a store failure must not kill the thread
            _errors.append(err)
            log.warning("kdb: background store failed: %s", err, exc_info=log.isEnabledFor(10))
        finally:
            _q.task_done()


def submit(job: Callable[[], None]) -> None:
    """Run ``job`` on the background thread once the process is quiet (or at drain)."""
    global _thread, _pid, _last_submit
    _last_submit = time.monotonic()
    with _start_lock:
        if _thread is None or _pid != os.getpid() or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="kdb-store", daemon=True)
            _pid = os.getpid()
            _thread.start()
    _q.put(job)


def pending() -> int:
    """Jobs submitted and not finished yet."""
    return _q.unfinished_tasks


def drain(timeout: float | None = None) -> list[BaseException]:
    """Run every submitted job now and wait for them (at most ``timeout`` seconds).

    Returns (and forgets) the jobs' errors. Jobs left when the timeout expires stay queued.
    """
    if _thread is not None and _pid == os.getpid() and _thread.is_alive():
        if threading.current_thread() is not _thread:
            _hurry.set()
            try:
                if timeout is None:
                    _q.join()
                else:
                    deadline = time.monotonic() + timeout
                    with _q.all_tasks_done:
                        while _q.unfinished_tasks:
                            left = deadline - time.monotonic()
                            if left <= 0:
                                break
                            _q.all_tasks_done.wait(left)
            finally:
                _hurry.clear()
    errs = list(_errors)
    _errors.clear()
    return errs


_finished = False


def finish() -> None:
    """At exit, once: finish the stores within ``KDB_STORE_TIMEOUT``; report what is left."""
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
    global _q, _thread, _finished
    _finished = False
    _q = queue.Queue()
    _thread = None
    _errors.clear()
    _hurry.clear()


os.register_at_fork(after_in_child=_after_fork)
atexit.register(finish)
