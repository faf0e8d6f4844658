"""One background thread per process that stores binaries off the caller's critical path.

Reading a PoCL program's binaries can take seconds, compressing and inserting takes
milliseconds: neither belongs between a framework and its first kernel launch. Jobs run in
order on a daemon thread; at exit (and on :func:`drain`) the queue is finished, so what was
compiled is stored before the process ends. After ``fork`` the child starts a fresh thread.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from typing import Callable

log = logging.getLogger("kdb")

_q: "queue.Queue[Callable[[], None] | None]" = queue.Queue()
_thread: threading.Thread | None = None
_pid = 0
_start_lock = threading.Lock()
_errors: list[BaseException] = []


def _run() -> None:
    while True:
        job = _q.get()
        try:
            if job is not None:
                job()
        except BaseException as err:  # noqa: BLE001 - a store failure must not kill the thread
            _errors.append(err)
            log.warning("kdb: background store failed: %s", err, exc_info=log.isEnabledFor(10))
        finally:
            _q.task_done()


def submit(job: Callable[[], None]) -> None:
    """Run ``job`` on the background thread, after the jobs submitted before it."""
    global _thread, _pid
    with _start_lock:
        if _thread is None or _pid != os.getpid() or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="kdb-store", daemon=True)
            _pid = os.getpid()
            _thread.start()
    _q.put(job)


def drain() -> list[BaseException]:
    """Wait until every submitted job has run; returns (and forgets) the jobs' errors."""
    if _thread is not None and _pid == os.getpid() and _thread.is_alive():
        if threading.current_thread() is not _thread:
            _q.join()
    errs = list(_errors)
    _errors.clear()
    return errs


def _after_fork() -> None:
    global _q, _thread
    _q = queue.Queue()
    _thread = None
    _errors.clear()


os.register_at_fork(after_in_child=_after_fork)
atexit.register(drain)
