"""The store worker: a supervisor and two lanes that store the jobs of one spool.

Jobs are written by :mod:`kdb.storing.spool`. The supervisor (no OpenCL) runs two child processes
(lanes) that store them, each in the environment of the job it stores: the spool's, with the
build variables the job's keys hold set and those they leave unset unset (a lane is started
again for a job of other values: runtimes read some of them once per process). A job whose
store takes far longer than its compile did (pyopencl's
scans) is set aside as *slow*; the second lane stores slow jobs one by one while the first
goes on, so one costly program never holds up what the next run asks for. Each job's back
end redoes the build (:func:`kdb.storing.jobs.backend_module`). A lane answers each job with one
line on a pipe of its own (its fd 1 is the log, with the compiler's output); every failure
reaches ``store-worker.log`` with the job and why. A job that cannot be read is set aside
(``.bad``); a ``.taken`` job whose taker died (no ``flock`` on it) is queued again.
Started as ``python -m kdb.worker DIR`` (:mod:`kdb.worker.__main__`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .. import config
from ..claims import progress
from ..dirs import open_regular
from ..file.fileformat import identity
from ..storing.jobfiles import (BAD, JOB, REFRESH_MARK, SLOW, TAKEN, first_ready,
                                publish_lanes, remove, rename, sweep_partial, take, taken_path)
from ..storing.jobs import StoreJob
from ..storing.spool import LOCK, worker_running
from .lane import Lane, inherit
from .lane import about as _about
from .lane import background_group as _background_group
from .lane import lowest_priority as _lowest_priority
from .lane import say as _say

#: A job waits this long before it is stored (unless another process waits for it), so the
#: program's first launches have put their work-group code in PoCL's cache: the stored
#: binary then carries it and the next start's first launches skip PoCL's JIT.
MIN_AGE_S = 1.0
#: Seconds the floor lane's look at whether a job's process still runs holds, per pid.
STARTED_S = 1.0
#: Seconds without a job after which the worker exits.
IDLE_EXIT_S = 3.0
#: A store may take ``SLOW_FACTOR`` times its compile, and at least ``SLOW_MIN_S`` seconds
#: (of the lane's CPU time), before it is set aside as slow.
SLOW_FACTOR = 10.0
SLOW_MIN_S = 5.0
#: The spool and claims directories are listed when their mtime changed, at most every
#: ``SCAN_S`` (else every ``RESCAN_S``): a long queue costs the supervisor little per job.
SCAN_S = 0.25
#: Queued jobs read to find those put ahead of the oldest (:meth:`_Queue._ahead`).
MAX_READ = 2000
RESCAN_S = 2.0
#: The window over which the idle lanes' CPU time tells whether the machine has idle CPU:
#: the floor lane stores only once an idle lane got less than its share over one (and no
#: other got more), and then, with nothing queued, takes the job of such a lane over.
TAKE_OVER_S = 2.0


class _Queue:
    """The spool as the supervisor knows it: stems of queued (``normal``), set-aside (``slow``)
    and foreign ``.taken`` jobs; ``jobs``, each read once: stem -> (keys, compile seconds,
    claims dir, build environment), None when gone or malformed; ``wanted``: keys other
    processes wait for."""

    def __init__(self, spool: Path) -> None:
        self.spool = spool
        self.normal: dict[str, None] = {}  # oldest first
        self.slow: list[str] = []
        self.foreign: list[str] = []
        self.jobs: dict[str, tuple | None] = {}
        self.wanted: set[str] = set()
        self.stood_in: set[str] = set()  # stems the floor lane found an early entry serving
        self.refused = 0  # jobs :meth:`floor_may` refused since the floor lane last looked
        self._started: dict[int, tuple[float, int]] = {}  # pid -> (looked at, started_ns)
        self._wants: dict[str, set[str]] = {}
        self._seen: dict[str, tuple[int, float]] = {}  # directory -> (mtime, listed at)
        self.listings = 0

    def _changed(self, directory: str, force: bool) -> bool:
        try:
            mtime = os.stat(directory).st_mtime_ns
        except OSError:
            return False
        old, when = self._seen.get(directory, (None, -1e9))
        now = time.monotonic()
        if not force and (now - when < SCAN_S or (old == mtime and now - when < RESCAN_S)):
            return False
        self._seen[directory] = (mtime, now)
        self.listings += 1
        return True

    def scan(self, busy: set[str], force: bool = False) -> None:
        """Look again at the spool and its claims where they changed (``busy``: the stems
        our lanes are storing)."""
        if self._changed(str(self.spool), force):
            try:
                names = os.listdir(self.spool)
            except OSError:
                names = []
            stem = {n: n.rsplit(".", 1)[0] for n in names}
            taken = [n for n in names if n.endswith(TAKEN) and stem[n] not in busy]
            back = {stem[n] for n in taken if self._orphan(n)}
            normal = {stem[n] for n in names if n.endswith(JOB)} - busy | back
            self.normal = dict.fromkeys(sorted(normal))
            self.slow = sorted({stem[n] for n in names if n.endswith(SLOW)} - busy)
            self.foreign = [stem[n] for n in taken if stem[n] not in back]
            self.jobs = {s: j for s, j in self.jobs.items() if s in normal or s in busy
                         or s in self.slow}
            self.stood_in.intersection_update(self.jobs)
            self._started = {p: v for p, v in self._started.items()
                             if time.monotonic() - v[0] <= STARTED_S}
        for cdir in self._wants:  # the claims directories of the jobs read so far
            if self._changed(cdir, False):
                try:
                    self._wants[cdir] = {n[:-5] for n in os.listdir(cdir) if n.endswith(".want")}
                except OSError:
                    self._wants[cdir] = set()
        self.wanted = set().union(*self._wants.values())

    def job(self, stem: str, suffix: str) -> tuple | None:
        """The job ``stem`` names, read once; a malformed one is set aside (None)."""
        if stem not in self.jobs:
            path, got = self.spool / (stem + suffix), None
            try:
                with os.fdopen(open_regular(path), "rb") as f:  # a FIFO: set aside
                    job = StoreJob.from_json(f.read().decode("utf-8"))
                got = ([k for k in job.keys if k], job.seconds, job.claims_dir,
                       tuple(sorted(job.environment.items())), job.first)
                if job.claims_dir:
                    self._wants.setdefault(job.claims_dir, set())
            except FileNotFoundError:  # stored by its own process, or taken for a moment:
                return None  # looked at again once a listing names it (never kept as gone:
                # a job its process took and put back was then passed over for good, and
                # its worker never left)
            except (OSError, ValueError, TypeError) as err:
                _say(f"{path.name} is not a store job ({err}); set aside as {stem + BAD}")
                rename(path, path.with_suffix(BAD))
            self.jobs[stem] = got
        return self.jobs[stem]

    def _orphan(self, name: str) -> bool:
        """Queue again the ``.taken`` job ``name`` if its taker died mid-store (no ``flock``
        on it: :func:`kdb.storing.spool.take`)."""
        import fcntl

        try:
            fd = os.open(self.spool / name, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(self.spool / name, (self.spool / name).with_suffix(JOB))
        except OSError:
            return False  # its taker is storing it
        finally:
            os.close(fd)
        _say(f"{name}: the process storing it stopped; queued again")
        return True

    def keys(self, stem: str, suffix: str = JOB) -> list[str]:
        return (self.job(stem, suffix) or ((),))[0]

    def pick(self, slow: bool, busy: set[str], floor: bool = False) -> Path | None:
        """The next job for a lane. Normal lane: one another process waits for, else one
        nothing stands in for (``first``), else the oldest, each old enough; a job whose
        keys a slow job already holds joins the slow ones. Slow lane: the oldest slow job.
        ``floor``: only jobs :meth:`floor_may` store."""
        for stem in list(self.slow) if slow else ():
            if floor and not self.floor_may(stem, SLOW):
                continue
            self.slow.remove(stem)
            if self.job(stem, SLOW) is not None:
                return self.spool / (stem + SLOW)
        if slow:
            return None
        ahead, young = self._ahead(), set()
        slow_keys = {k for s in self.slow + list(busy) for k in self.keys(s, SLOW)}
        while self.normal:
            put_ahead = bool(ahead)
            # Lazily: a pick looks as far as the first job it may take, not at every
            # queued job (the floor lane's looks made a long queue cost n**2 / 2 of them).
            stem = ahead.pop(0) if ahead else first_ready(
                (s for s in self.normal if s not in young and (not floor or self.floor_may(s))),
                [*self.slow, *busy, *self.foreign])
            if stem is None:
                return None
            job = self.job(stem, JOB)
            if job is not None and job[0] and set(job[0]) <= slow_keys:
                rename(self.spool / (stem + JOB), self.spool / (stem + SLOW))
                self.slow.append(stem)  # the same program again: it would be slow again
                job = None
            if job is None:
                self.normal.pop(stem, None)
                continue
            try:
                born = int(stem.split("-", 1)[0])
            except ValueError:
                born = 0
            if self.wanted.isdisjoint(job[0]) and (time.time_ns() - born) / 1e9 < MIN_AGE_S:
                if put_ahead:
                    young.add(stem)  # too young, put ahead: an older one may be ready
                    continue
                return None  # the oldest is too young, and so are the others
            self.normal.pop(stem, None)
            return self.spool / (stem + JOB)
        return None

    def may_stand_in(self, stem: str, suffix: str = JOB) -> bool:
        """Whether an entry the job's process kept at its exit (an early entry) may serve
        its keys: no other process waits for them, the job is not marked ``first``, and no
        shared tier waits for its publish. An early entry serves this node only: other
        nodes waited up to ``KDB_WAIT_TIMEOUT`` for the cross-node locks a keeper holds
        until the job is stored, each ahead of a compile of a second."""
        if os.environ.get(config.ENV_SHARED_URL):  # the job's environment: the worker's
            return False
        job = self.job(stem, suffix) or ((), 0, None, (), False)
        return self.wanted.isdisjoint(job[0]) and not job[4]

    def floor_may(self, stem: str, suffix: str = JOB) -> bool:
        """Whether the floor lane may take the job: the floor is there so that the next
        process compiles nothing, and an early entry already sees to that at no cost. So
        it leaves to idle CPU a job an early entry was found serving, and one whose process
        still runs (it keeps its early entries at its exit); it takes those nothing can
        stand in for (``first``), those another process waits for, and those of a process
        that ended without keeping one (killed, say). The lane asks the user file when
        :meth:`may_stand_in`."""
        if not self.may_stand_in(stem, suffix):
            return True
        if stem in self.stood_in or stem.endswith(REFRESH_MARK):
            # A refresh job's entries are binaries already: its lane leaves it to idle CPU
            # (a take-over of one ended an idle lane's store for a job it then left).
            self.refused += 1
            return False
        try:
            born, pid = (int(x) for x in stem.split("-", 2)[:2])
        except ValueError:
            return True
        now = time.monotonic()
        looked, started = self._started.get(pid, (-1.0, 0))
        if now - looked > STARTED_S:  # one look a pid, however many jobs it queued
            started = progress.started_ns(pid)
            self._started[pid] = (now, started)
        may = not progress.ran_at(started, born)
        self.refused += not may
        return may

    def _ahead(self) -> list[str]:
        """The queued stems taken before the oldest: those with a key another process waits
        for, then those marked ``first`` (nothing stands in for them: the next process
        would compile them), oldest first in each. Every queued job is read once for it
        (``MAX_READ`` at most, oldest first)."""
        stems = list(self.normal)[:MAX_READ]
        waited = [s for s in stems if self.wanted and not self.wanted.isdisjoint(self.keys(s))]
        first = [s for s in stems if s not in waited and (self.job(s, JOB) or (0,) * 5)[4]]
        return waited + first

    def has_jobs(self) -> bool:  # a foreign .taken too: its taker may die before storing it
        return bool(self.normal or self.slow or self.foreign)


def supervise(spool: Path, share: float | None = None) -> int:
    """Store every job of ``spool`` until it has been empty ``IDLE_EXIT_S``; one worker at
    a time (an ``flock`` on ``worker.lock``). ``share`` (default ``KDB_STORE_SHARE``, read
    from the process that started the worker, before the spool's environment replaces it):
    the floor lane's share of one core; 0: idle lanes only, this process and its session
    at the lowest priority too. With a floor, this process keeps its session's normal
    weight and nice 0, to pace the floor lane on time (:mod:`.floor`), and the idle lanes
    take sessions of their own."""
    import fcntl

    share = config.store_share() if share is None else share
    if not share:
        _lowest_priority(idle=False)
    if not inherit(spool):
        return 1
    fd = os.open(spool / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return 0  # another worker has it
    if not share:
        _background_group()
    sweep_partial(spool, _say)
    lanes = [Lane(slow=False, share=share)] if share else []
    lanes += [Lane(slow=False, apart=bool(share)), Lane(slow=True, apart=bool(share))]
    queue = _Queue(spool)
    try:
        _serve(queue, lanes, fd, share)
    finally:
        for lane in lanes:
            lane.close()
        os.close(fd)
    queue.scan(set(), force=True)  # a job written after our last look, by one who saw our lock
    return supervise(spool, share) if queue.has_jobs() and not worker_running(spool) else 0


def _serve(queue: _Queue, lanes: list[Lane], fd: int, share: float) -> None:
    """Give the lanes the queue's jobs until it has been empty ``IDLE_EXIT_S``; pace the
    floor lane (``lanes[0]`` when ``share``) between looks."""
    import select

    idle_since = time.monotonic()
    no_idle_cpu = False  # until an idle lane starves: where CPU is idle, the floor waits
    floor_looks = 0.0  # when the floor lane, having found nothing it may take, looks again
    while True:
        ended = [lane.poll() for lane in lanes]
        ours = _still_locked_here(fd, queue.spool)
        if not ours and all(lane.job is None for lane in lanes):
            return
        for lane in lanes:
            if lane.left is not None:  # an early entry serves it: idle CPU stores it
                queue.stood_in.add(lane.left)
                lane.left = None
        busy = {lane.job.stem for lane in lanes if lane.job is not None}
        queue.scan(busy)
        before = len(busy)
        if share:
            no_idle_cpu = _no_idle_cpu(lanes, share, no_idle_cpu)
        for lane in lanes:
            path = None
            if ours and lane.job is None and (lane.pacer is None or (
                    no_idle_cpu and time.monotonic() >= floor_looks)):
                path = _pick(queue, lane, busy)
                if path is None and lane.pacer is not None:
                    path = _take_over(queue, lanes, share)
                    # Jobs it may not take: not again before a second (a long queue of
                    # jobs early entries serve would cost the supervisor CPU each loop).
                    # Jobs only too young: at once (an idle lane would drain them first).
                    floor_looks = time.monotonic() + (
                        STARTED_S if path is None and queue.refused else 0.0)
            if path is not None:
                _, seconds, _, build, _ = queue.jobs[path.stem]
                lane.start(path, build, None if path.suffix == SLOW
                           else max(SLOW_MIN_S, SLOW_FACTOR * seconds),
                           ask=lane.pacer is not None and queue.may_stand_in(path.stem,
                                                                             path.suffix))
                busy.add(path.stem)
        if len(busy) != before or any(ended):  # a waiter judges the lane storing its job
            publish_lanes(fd, [(lane.proc.pid, lane.pstart, lane.started, lane.job.stem)
                               for lane in lanes if lane.job and lane.proc])
        if busy or any(ended) or queue.has_jobs():
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since >= IDLE_EXIT_S:
            queue.scan(busy, force=True)
            if not queue.has_jobs():
                return
        due = min(lane.pace() for lane in lanes)
        select.select([lane.proc.stdout for lane in lanes  # until a lane is done
                       if lane.job is not None and lane.proc is not None], [], [], due)


def _still_locked_here(fd: int, spool: Path) -> bool:
    """Whether ``spool``'s ``worker.lock`` is still the file this worker locked. A cache
    directory removed and made again (``rm -rf``) has a new one, which the next process
    finds unlocked and starts a worker for; this one would serve the new spool beside it
    (two floor lanes, and lanes no waiter sees), so it takes no more jobs and leaves."""
    mine = os.fstat(fd)
    return identity(str(spool / LOCK)) == (mine.st_dev, mine.st_ino)


def _pick(queue: _Queue, lane: Lane, busy: set[str]) -> Path | None:
    """The next job for ``lane``: the floor lane takes queued jobs first, then set-aside
    (slow) ones, of those it may (:meth:`_Queue.floor_may`); an idle lane its own kind."""
    if lane.pacer is None:
        return queue.pick(lane.slow, busy)
    queue.refused = 0
    return queue.pick(False, busy, floor=True) or queue.pick(True, busy, floor=True)


def _no_idle_cpu(lanes: list[Lane], share: float, before: bool) -> bool:
    """Whether the machine has no idle CPU for the stores, as the idle lanes storing jobs
    found it over their last :data:`TAKE_OVER_S`: one that got the floor's share says there
    is idle CPU, else one that got less says there is none; else as ``before``."""
    judged = [lane.judge(share, TAKE_OVER_S) for lane in lanes if lane.pacer is None]
    if True in judged:
        return False
    return True if False in judged else before


def _take_over(queue: _Queue, lanes: list[Lane], share: float) -> Path | None:
    """For the floor lane, with nothing queued (and no idle CPU): the job of an idle lane
    that got less than the floor's share over its last :data:`TAKE_OVER_S` and that the floor
    may take (:meth:`_Queue.floor_may`), queued again and handed over."""
    for lane in lanes:
        if (lane.pacer is None and lane.starved(share, TAKE_OVER_S)
                and queue.floor_may(lane.job.stem, lane.job.suffix)):
            path = lane.hand_over()
            if path is not None:
                _say(f"{_about(path)}: its lane got no idle CPU for {TAKE_OVER_S:.0f} s; "
                     "handed to the floor lane")
                return path
    return None


#: Seconds a job another process took (``.taken``) is left to it before a hurry stores it too.
TAKEN_GRACE_S = 2.0


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def hurry(spool: Path) -> int:
    """Store every job of ``spool`` now, at the priority of the process that asks (``kdb pack``
    waits for them; the worker gives its lanes only the CPU nothing else wants, and cannot
    raise their priority again). Jobs are taken one by one beside the worker's lanes; one a
    lane still holds after :data:`TAKEN_GRACE_S` is stored here as well (storing is
    idempotent) and removed, so a starved lane never holds the caller up."""
    from .lane import StoreLocked, queue_again, store_job_file

    if not inherit(spool):
        return 1
    dbs: dict = {}
    first_seen: dict[str, float] = {}
    while True:
        try:
            names = sorted(n for n in os.listdir(spool) if n.endswith((JOB, SLOW, TAKEN)))
        except OSError:
            names = []
        if not names:
            break
        now = time.monotonic()
        for name in names:
            path = spool / name
            fd = take(path) if not name.endswith(TAKEN) else None
            if fd is None and (not name.endswith(TAKEN)
                               or now - first_seen.setdefault(name, now) < TAKEN_GRACE_S):
                continue
            locked = False
            try:
                store_job_file(taken_path(path) if fd is not None else path, dbs)
            except StoreLocked as err:  # stored once the lock is gone, not dropped
                locked = fd is None or queue_again(path, err)
            except Exception as err:  # noqa: BLE001 - report, drop the job, go on
                _say(f"could not store {_about(path)}: {type(err).__name__}: {err}")
            if fd is not None:
                if locked:
                    rename(taken_path(path), path)
                else:
                    remove(path)
                os.close(fd)
            elif not locked:
                _unlink(path)  # a lane's .taken only: one it queued again meanwhile stays
        time.sleep(0.05)
    for db in dbs.values():
        db.close()
    return 0
