"""A store queued by a process that has exited, waited for by the next one that misses it.

A run started the moment the previous one exited misses what that run compiled and left to
the store worker (:mod:`kdb.storing.spool`): its jobs are still queued, or a lane at nice 19
is storing them. A process that misses such a key, holding the key's claim (this node's
other processes wait with it), finds the key's job with one ``readlink``
(:func:`kdb.storing.jobfiles.marked`; a run with another ``POCL_CACHE_DIR`` writes to
another spool and finds it all the same) and waits for the store when that costs less
than compiling (:func:`plan`, from the times recorded per device in
:mod:`kdb.storing.storetimes`), getting it stored first:

- a queued job goes at once to a child of this process (``python -m kdb.worker
  --urgent-child``, one per process, started at the first such wait), which stores it at
  this process's priority (the worker's lanes run at nice 19, which cannot be raised
  again), in the environment the job was written in: its spool's ``environment.json`` and
  its build variables, so the rebuild finds the program in that run's PoCL cache;
- a job a worker's lane took first is left to the lane while the lane makes progress
  (``worker.lock`` names each lane's job, :func:`kdb.storing.jobfiles.publish_lanes`); a lane that gets less
  than half the CPU time while it is waited for (starved by busier processes) is overtaken
  by the child, which stores the job too (storing is idempotent);
- the storer is waited for as a claim holder is (:class:`kdb.claims.waiting.Watch`): while
  it makes progress, until it has spent what compiling would cost; then the process
  compiles, and a child of its own is stopped and the job set aside as slow (the worker's
  slow lane stores it when the machine is idle);
- the first job an earlier process queued in a spool also starts the storing of that
  spool's other jobs ahead of this process, in its session (:mod:`kdb.worker.ahead`).

A job that ends without the entry (set aside as bad, a header changed, its storer killed)
ends the wait: the process compiles, as it does for a job already set aside as slow.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .. import claims, lifecycle, logs
from ..claims import progress
from . import jobfiles, storetimes
from .jobfiles import JOB, SLOW, TAKEN

if TYPE_CHECKING:
    from ..keys import HashAttributes

log = logs.get("kdb")

#: Seconds a lane is watched before it may be judged starved; a job taken by a process
#: that is not a lane of the worker (``kdb pack``) is left to it this long and twice its
#: expected store.
LANE_GRACE_S = 0.5
#: A program built from source still generates its work-group code at its first launches,
#: which a stored binary carries: building and launching costs about this many times the
#: build (measured on PoCL: an elementwise program 2.2x, a reduction 3.8x).
COMPILE_AND_LAUNCH = 2.0
#: CPU seconds a store may cost beyond what was expected of it (reading the job, the write).
SLACK_S = 0.25


def plan(user_dir: Path, attrs: HashAttributes) -> QueuedStore | None:
    """The queued store of ``attrs``' key when waiting for it costs less than compiling,
    else None; a job an earlier process queued also starts the storing of the others ahead
    (:mod:`kdb.worker.ahead`). Without a queued job this costs one ``readlink``."""
    claims_dir = Path(user_dir) / "claims"
    job = jobfiles.marked(claims_dir, attrs.key)
    if job is None:
        return None
    data = _read(job)
    if data is None:  # stored or dropped meanwhile, or set aside as slow
        state, writer = jobfiles.state(job), _writer(job)
        if state is None:
            jobfiles.unmark(claims_dir, job, [attrs.key])  # a job dropped left its mark
            _why[attrs.key] = (f"its store, queued by process {writer}, ended without it "
                               "(store-worker.log says why)")
        elif state == SLOW:
            _why[attrs.key] = (f"its store, queued by process {writer}, was set aside: it "
                               "costs more than a compile (stored when the machine is idle)")
        else:
            _why[attrs.key] = (f"its store job, queued by process {writer}, cannot be read "
                               "(the store worker sets it aside)")
        return None
    from .spool import runnable

    if not runnable(job.parent):
        return None  # another Python's spool: rebuilt here, it could store another binary
    if not job.stem.split("-")[1:2] == [str(os.getpid())]:
        _store_ahead(job.parent)  # an earlier process's: the next ones are likely queued too
    return weigh(user_dir, attrs, job, data)


def weigh(user_dir: Path, attrs: HashAttributes, job: Path, data) -> QueuedStore | None:
    """The cost rule: the store of ``attrs``' key by the job ``job`` (its data ``data``, a
    :class:`~kdb.storing.jobs.StoreJob`) when it is expected to cost less than compiling the
    program here, from the times recorded for the device and the program's name; else None."""
    from .spool import spool_dir

    entry = next((e for e in data.entries if e.get("key") == attrs.key), {})
    compile_s = float(entry.get("seconds") or data.seconds or 0.0)
    ratios = storetimes.ratios(user_dir, attrs.arch)
    # In this process's own spool the build finds the program, and its launches their code,
    # in the same PoCL cache the rebuild will use: it costs what a rebuild does.
    same = job.parent == spool_dir(user_dir)
    est_store = ratios.store(str(entry.get("name") or "")) * compile_s
    est_compile = (ratios.build if same else 1.0) * COMPILE_AND_LAUNCH * compile_s
    log.debug("kdb: %s is queued in %s: storing it costs about %.2f s, compiling it %.2f s",
              attrs.key[:16], job.stem, est_store, est_compile)
    if est_store >= est_compile:
        _why[attrs.key] = (f"its store, queued by process {_writer(job)}, costs more than "
                           f"building it here (about {est_store:.2f} s against {est_compile:.2f} s)")
        return None
    _why.pop(attrs.key, None)  # waited for: a reason given earlier no longer holds
    return QueuedStore(attrs.key, job, data, compile_s, est_store,
                       max(est_compile, 2 * est_store) + SLACK_S)


def _writer(job: Path) -> str:
    """The pid of the process that queued ``job`` (its name: ``<ns>-<pid>-<n>``)."""
    parts = job.stem.split("-")
    return parts[1] if len(parts) > 2 else "?"


#: Key -> why this process compiles a key whose store was queued (:func:`why_compiled`).
_why: dict[str, str] = {}


def why_compiled(key: str) -> str | None:
    """Why this process compiled ``key`` although its store was queued, once (the start-up
    latency log's reason says so); None when no queued store was met."""
    return _why.pop(key, None)


def _read(job: Path):
    """The job's data, in whichever state it is (None: gone, unreadable, or slow)."""
    from .jobs import StoreJob
    from .spool import read_job

    for suffix in (JOB, TAKEN):
        data = read_job(job.with_suffix(suffix))
        if data is not None:
            try:
                return StoreJob.from_dict(data)
            except ValueError:
                return None  # malformed: the worker sets it aside
    return None


class QueuedStore:
    """One queued store this process waits for (:func:`kdb.claims.waiting.claim_or_wait`'s
    ``queued``): ``look()`` says how it goes, ``budget`` is the CPU time it may cost."""

    def __init__(self, key: str, job: Path, data, compile_s: float, est_store: float,
                 budget: float) -> None:
        self.key, self.job, self.compile_s, self.est_store = key, job, compile_s, est_store
        self.total = self.budget = budget
        self.build = tuple(sorted(data.environment.items()))
        self.began = time.monotonic()
        self.taken_at = 0.0  # when it was first seen taken by another process
        self.lane_cpu: dict[int, tuple[float, float]] = {}  # lane pid -> (CPU, when) first seen
        self.child: _Child | None = None  # ours, once it was sent there
        self.sent_at = 0.0  # when it was sent to the child (time.time())
        self.force = False  # sent to be stored even though a lane holds it

    def look(self) -> tuple | None:
        """None: go on waiting; ``()``: the job ended (stored, or dropped); else who stores
        it (a lane, or this process's child), as :meth:`kdb.claims.waiting.Watch.verdict`
        judges a holder."""
        with _lock:  # threads of this process share its child
            return self._look()

    def _look(self) -> tuple | None:
        if self.child is not None:
            view = self.child.view(self)
            if view is not _BUSY:
                return view
            self.child, self.sent_at = None, 0.0  # a lane took it first: watch the lane
        state = jobfiles.state(self.job)
        if state is None or state == SLOW:
            return ()  # stored, dropped, or set aside as slow meanwhile: look, else compile
        if state == TAKEN:
            now = time.monotonic()
            self.taken_at = self.taken_at or now
            view = self._lane()
            if view is not _STARVED and (view is not None or now - self.taken_at
                                         < LANE_GRACE_S + 2 * self.est_store):
                return view
        self.child = _child_for(self.job.parent, self.build)
        if self.child is None:
            return ()
        self.budget, self.force = self.total, state == TAKEN
        return self.child.view(self)

    def _lane(self):
        """The worker's lane storing the job, as a holder to watch (its CPU time on the job
        counts against :attr:`budget`); :data:`_STARVED` when, :data:`LANE_GRACE_S` after
        the first look, it has used less than half the time since (overtaken); None when
        no lane of the worker has it (another process's child, ``kdb pack``)."""
        lane = jobfiles.lane_of(self.job)
        seen = progress.sample(lane[0], lane[1]) if lane is not None else None
        if seen is None:
            return None
        pid, start, cpu0 = lane
        now = time.monotonic()
        first_cpu, first_at = self.lane_cpu.setdefault(pid, (seen.cpu, now))
        if now - first_at >= LANE_GRACE_S and seen.cpu - first_cpu < 0.5 * (now - first_at):
            log.debug("kdb: the lane storing %s is starved; storing it here", self.job.stem)
            return _STARVED
        self.budget = max(self.total - (first_cpu - cpu0), 0.0)  # spent before we looked
        return ((pid, start, self.job.stem), claims.STORING, self.compile_s, time.time(), seen)

    def close(self, gave_up: bool, why: str | None = None) -> None:
        """The wait is over: the entry came, or this process compiles (``why``, for the
        latency log). A child still storing the job when it gave up is stopped, and the job
        set aside as slow."""
        if why is not None:
            _why[self.key] = (f"waited {time.monotonic() - self.began:.1f} s for its store, "
                              f"queued by process {_writer(self.job)}, and {why}")
        with _lock:
            stop = gave_up and self.child is not None and self.job in self.child.pending
            if stop:
                self.child.stop()
        if stop and jobfiles.set_aside(self.job):
            log.debug("kdb: the store of %s was set aside as slow", self.job.stem)


#: What :meth:`_Child.view` says when a lane had the job first; what :meth:`QueuedStore._lane`
#: says of a lane that makes too little progress.
_BUSY = ("busy",)
_STARVED = ("starved",)


class _Child:
    """A child of this process storing jobs for it (``python -m kdb.worker
    --urgent-child``, :func:`kdb.worker.lane.serve`), in one job environment: each job
    path written to its stdin (``!path``: also when a lane holds it) is answered in order,
    ``done`` once stored or dropped, ``busy`` when a lane of the worker had it first."""

    def __init__(self, spool: Path, build: tuple, env: dict[str, str]) -> None:
        import subprocess

        from .spool import LOG_NAME

        self.spool, self.build = spool, build
        fd = os.open(spool.parent.parent / LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                     0o600)
        with os.fdopen(fd, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kdb.worker", "--urgent-child"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=out, env=env,
                close_fds=True, cwd="/")
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.start = 0  # its start time (progress.start_time), once read
        self.ready = False
        self.pending: list[Path] = []  # jobs sent, not answered yet
        self.busy: set[Path] = set()  # jobs it answered busy (a lane had them)
        self._buf = b""

    def _read(self) -> bool:
        """Take in what it said; False once it has exited."""
        while True:
            try:
                chunk = os.read(self.proc.stdout.fileno(), 4096)
            except BlockingIOError:
                return True
            except OSError:
                chunk = b""
            if not chunk:
                return False
            *lines, self._buf = (self._buf + chunk).split(b"\n")
            for line in lines:
                if line == b"ready":
                    self.ready = True
                elif line in (b"done", b"busy") and self.pending:
                    job = self.pending.pop(0)
                    if line == b"busy":
                        self.busy.add(job)

    def view(self, store: QueuedStore) -> tuple:
        """How the store of ``store``'s job goes: ``()`` once done (or the child died),
        :data:`_BUSY` when a lane had it first, else ``(ident, state, seconds, since,
        sample)`` for the waiter's ``Watch``."""
        if not self.start:
            self.start = progress.start_time(self.proc.pid)
        if not self._read():
            _forget(self)
            return ()
        if self.ready and not store.sent_at:
            store.sent_at = time.time()
            self.pending.append(store.job)
            line = ("!" if store.force else "") + str(store.job)
            try:
                self.proc.stdin.write(os.fsencode(line) + b"\n")
                self.proc.stdin.flush()
            except OSError:
                _forget(self)
                return ()
        if store.sent_at and store.job not in self.pending:
            if store.job in self.busy:
                self.busy.discard(store.job)
                return _BUSY
            return ()
        sample = progress.sample(self.proc.pid, self.start)
        if not self.ready:  # importing: judged as a compile is (progress, not a budget)
            return ((self.proc.pid, self.start, "starting"), claims.COMPILING, 0.0,
                    time.time(), sample)
        return ((self.proc.pid, self.start, str(store.job)), claims.STORING, store.compile_s,
                store.sent_at, sample)

    def stop(self) -> None:
        _forget(self)
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        """No more jobs: it exits once those it was given are stored."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass


_lock = threading.Lock()
#: This process's child: one at a time (a job of another environment gets a new one).
_child: _Child | None = None


def _live_child(spool: Path, build: tuple) -> bool:
    return _child is not None and (_child.spool, _child.build) == (spool, build)


def _child_for(spool: Path, build: tuple) -> _Child | None:
    """This process's child for jobs of ``spool`` with ``build`` variables, started if need
    be (the one there was, of another environment, finishes its job and exits); None when
    none can be started."""
    global _child
    if _live_child(spool, build):
        return _child
    from .spool import job_environment

    env = job_environment(spool, build)
    if env is None:
        return None
    if _child is not None:
        _child.close()
    try:
        _child = _Child(spool, build, env)
    except OSError as err:
        log.debug("kdb: could not start a process to store %s's jobs: %s", spool, err)
        _child = None
        return None
    if not _exit_registered:
        _register()
    return _child


#: Spool -> the process storing its jobs ahead for this one (:mod:`kdb.worker.ahead`), or
#: when to try again to start one (another process's ran).
_ahead: dict[Path, object] = {}
AHEAD_RETRY_S = 1.0


def _store_ahead(spool: Path) -> None:
    """Start, once per spool, the process that stores what earlier processes queued there
    ahead of this one, in its session (its CPU share), at nice 19 (yielding to it)."""
    import subprocess

    from .spool import LOG_NAME

    with _lock:  # threads of this process start one between them
        got = _ahead.get(spool)
        if got is not None and (not isinstance(got, float) or time.monotonic() < got):
            return
        _ahead[spool] = time.monotonic() + AHEAD_RETRY_S
    if jobfiles.locked(spool / jobfiles.AHEAD_LOCK):
        return  # another process's runs (one a spool): looked at again later
    try:
        fd = os.open(spool.parent.parent / LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                     0o600)
        with os.fdopen(fd, "ab") as out:
            _ahead[spool] = subprocess.Popen(
                [sys.executable, "-m", "kdb.worker", "--ahead", str(spool),
                 str(time.time_ns())], stdin=subprocess.PIPE, stdout=out, stderr=out,
                close_fds=True, cwd="/")
    except OSError as err:
        log.debug("kdb: could not start a process to store %s's jobs ahead: %s", spool, err)
    if not _exit_registered:
        _register()


def _forget(child: _Child) -> None:
    global _child
    if _child is child:
        _child = None


_exit_registered = False


def _register() -> None:
    global _exit_registered
    _exit_registered = True
    lifecycle.on_exit(lifecycle.STORES, _at_exit)


def _at_exit() -> None:
    """The children end with this process: once what they were given is stored."""
    if _child is not None:
        _child.close()
    for proc in _ahead.values():
        if not isinstance(proc, float):
            try:
                proc.stdin.close()
            except OSError:
                pass


def _after_fork() -> None:
    global _child, _lock
    _child = None  # the parent's: it feeds and closes it
    _ahead.clear()
    _lock = threading.Lock()


lifecycle.on_fork(_after_fork)
