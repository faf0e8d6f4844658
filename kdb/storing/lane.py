"""A lane of the store worker: a child process that stores the jobs its supervisor names on
stdin, one at a time, and answers one line per job on a private pipe.

The lane is where a job meets ``KernelDB`` and its back end (found by the name the job
carries, :func:`kdb.storing.jobs.backend_module`); the supervisor (:mod:`kdb.storing.worker`)
only schedules. Everything a lane says goes to ``store-worker.log``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ..db import KernelDB
from ..file.kernelfile import CompileRecord
from ..keys import HashAttributes
from . import storetimes
from .jobfiles import TAKEN, remove, take, take_taken, taken_path, unmark
from .jobs import BOOKKEEPING, StoreJob, backend_module
from .spool import read_job


def lowest_priority(idle: bool) -> None:
    """nice 19 (yields to any normal process); with ``idle`` (the slow lane), also
    ``SCHED_IDLE``: run only on a CPU nothing else wants."""
    if idle:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):
            pass
    try:
        os.nice(19 - os.nice(0))
    except OSError:
        pass


def say(text: str) -> None:
    """One line for ``store-worker.log`` (on stderr: a lane's stdout is its protocol). A full
    disk loses the line, never the worker: it goes on storing, or dropping, its jobs."""
    try:
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} kdb store worker {os.getpid()}: {text}",
              file=sys.stderr, flush=True)
    except OSError:
        pass  # kept in stderr's buffer: written with the next line that finds room


def about(path: Path) -> str:
    """``job (name key, ...)``: what a log line about the job ``path`` is about."""
    try:
        got = [f"{e.get('name') or 'kernel'} {str(e.get('key', ''))[:16]}" for e in
               (read_job(path.with_suffix(TAKEN)) or read_job(path) or {})["entries"]]
    except (TypeError, KeyError, AttributeError):
        got = []
    return f"{path.stem} ({', '.join(got)})" if got else path.stem


def serve(slow: bool = False, urgent: bool = False) -> int:
    """Store each job named on stdin; answer one line per job on the pipe that was fd 1 (fd 1
    is now the log: what a compiler prints never reaches the supervisor).

    ``urgent``: a child of a process that waits for these jobs (:mod:`kdb.storing.queued`),
    at its priority: it says ``ready`` once its back ends are loaded, answers ``busy`` for a
    job a live lane took first, and stores it all the same when the line is ``!path`` (the
    waiter saw that lane starve; storing is idempotent)."""
    protocol = os.dup(1)
    os.dup2(2, 1)
    if urgent:
        _load_backends()
        os.write(protocol, b"ready\n")
    else:
        lowest_priority(idle=slow)
    dbs: dict = {}
    for line in sys.stdin.buffer:
        force = urgent and line.startswith(b"!")
        path = Path(os.fsdecode(line[force:].rstrip(b"\n")))
        fd = take(path)  # None: its own process, or another worker, stores it
        if fd is None and urgent:
            fd = take_taken(path)  # its taker died; else (-1) a lane stores it
            if fd == -1 and not force:
                os.write(protocol, b"busy\n")
                continue
        if fd is not None:
            try:
                store_job(taken_path(path), dbs)
            except Exception as err:  # noqa: BLE001 - report, drop the job, go on
                say(f"could not store {about(path)}: {type(err).__name__}: {err}")
            remove(path)
            if fd >= 0:
                os.close(fd)
        sys.stdout.flush()
        os.write(protocol, b"done\n")
    for db in dbs.values():
        db.close()
    return 0


def _load_backends() -> None:
    """Import every back end a job may name, before the first job (its wait starts then)."""
    from .jobs import BACKENDS

    for name in BACKENDS:
        try:
            backend_module(name)
        except Exception:  # noqa: BLE001, S112 - a job of this back end fails and says why
            continue


def store_job(path: Path, dbs: dict | None = None) -> None:
    """Store one job: its back end builds the program again and reads the binaries."""
    data = read_job(path)
    if data is None:
        return
    job = StoreJob.from_dict(data)
    dbs = {} if dbs is None else dbs
    if job.cache_dir not in dbs:
        dbs[job.cache_dir] = KernelDB(cache_dir=job.cache_dir)
    db = dbs[job.cache_dir]
    if job.kind == BOOKKEEPING:
        db.tiers.write_bookkeeping(job.archs)
        return
    if _stored_already(db, job):  # the same program compiled again before it was stored
        db.tiers.store([], [CompileRecord(*row) for row in job.logs])
        _stored(job, path)
        return
    start = time.process_time()
    timings = backend_module(job.backend).store_job(db, job) or {}
    seconds = time.process_time() - start
    _stored(job, path)
    n = max(len(job.entries), 1)
    build = timings.get("build")
    storetimes.record(db.tiers.user_dir, [
        (HashAttributes.from_canonical(e["attributes"]).arch, float(e.get("seconds") or 0.0),
         seconds / n, build / n if build is not None else None) for e in job.entries])


def _stored(job: StoreJob, path: Path) -> None:
    """The job's keys are in the user file: their marks go (:func:`jobfiles.mark`)."""
    if job.claims_dir:
        unmark(Path(job.claims_dir), path, job.keys)


def _stored_already(db: KernelDB, job: StoreJob) -> bool:
    attrs = [HashAttributes.from_canonical(e["attributes"], name=e.get("name", ""))
             for e in job.entries]
    return bool(attrs) and all(db.tiers.user_file(a.arch).fetch(a.key) is not None for a in attrs)


def background_group() -> None:
    """The lowest weight for the autogroup of the worker's own session (autogroup scheduling
    shares the CPU between sessions whatever their nice); never for a session it joined."""
    if os.getsid(0) != os.getpid():
        return
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("19")
    except FileNotFoundError:
        pass  # a kernel without autogroup scheduling
    except OSError as err:
        say(f"could not give the worker's session the lowest autogroup weight: {err}")
