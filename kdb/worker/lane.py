"""A lane of the store worker: a child process that stores the jobs its supervisor names on
stdin, one at a time, and answers one line per job on a private pipe; and :class:`Lane`, the
supervisor's handle on one (the store worker's, and a process's own, :mod:`.ahead`).

The lane is where a job meets ``KernelDB`` and its back end (found by the name the job
carries, :func:`kdb.storing.jobs.backend_module`); the supervisor (:mod:`kdb.worker`)
only schedules. Everything a lane says goes to ``store-worker.log``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from .. import config
from ..claims import progress
from ..db import KernelDB
from ..file.kernelfile import CompileRecord
from ..keys import HashAttributes
from ..storing import storetimes
from ..storing.jobfiles import (TAKEN, remove, rename, slow_path, take, take_taken,
                                taken_path, unmark)
from ..storing.jobs import BOOKKEEPING, REFRESH, StoreJob, backend_module
from ..storing.spool import ENVIRONMENT, job_environment, read_job
from .floor import Pacer


#: Jobs whose store ended its lane's process once (the OOM killer, a user's kill, a driver
#: that crashes on it): one more try each, then dropped (at most a compile is lost).
_ended_a_lane: set[str] = set()


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


def serve(slow: bool = False, urgent: bool = False, floor: bool = False) -> int:
    """Store each job named on stdin; answer one line per job on the pipe that was fd 1 (fd 1
    is now the log: what a compiler prints never reaches the supervisor).

    ``urgent``: a child of a process that waits for these jobs (:mod:`kdb.storing.queued`),
    at its priority: it says ``ready`` once its back ends are loaded, answers ``busy`` for a
    job a live lane took first, and stores it all the same when the line is ``!path`` (the
    waiter saw that lane starve; storing is idempotent). ``floor``: the worker's floor lane,
    kept at normal priority and paced by its supervisor (:mod:`.floor`); any other lane
    takes the lowest priority (a lane apart had it from its start: :func:`_preexec`). The
    floor lane answers ``left`` for a job whose line is ``?path`` when an early entry
    serves its keys (:func:`_stood_in`), read before the job is taken: a job moving back
    from ``.taken`` to ``.job`` could look, to a process waiting for it, like one that
    ended without its entry."""
    protocol = os.dup(1)
    os.dup2(2, 1)
    if urgent:
        _load_backends()
        os.write(protocol, b"ready\n")
    elif not floor:
        lowest_priority(idle=slow)
    dbs: dict = {}
    for line in sys.stdin.buffer:
        force = urgent and line.startswith(b"!")
        ask = floor and line.startswith(b"?")
        path = Path(os.fsdecode(line[force or ask:].rstrip(b"\n")))
        if ask and _stood_in(path, dbs):  # asked before taking: the job never moves back
            say(f"{about(path)}: an early entry serves it; left to idle CPU")
            os.write(protocol, b"left\n")
            continue
        fd = take(path)  # None: its own process, or another worker, stores it
        if fd is None and urgent:
            fd = take_taken(path)  # its taker died; else (-1) a lane stores it
            if fd == -1 and not force:
                os.write(protocol, b"busy\n")
                continue
        if fd is not None:
            again = False
            try:
                store_job_file(taken_path(path), dbs)
            except StoreLocked as err:
                again = queue_again(path, err)
            except Exception as err:  # noqa: BLE001 - report, drop the job, go on
                say(f"could not store {about(path)}: {type(err).__name__}: {err}")
            if again:
                rename(taken_path(path), path)
            else:
                remove(path)
            if fd >= 0:
                os.close(fd)
            if again:
                time.sleep(LOCKED_PAUSE_S)  # the lock's holder goes on: not again at once
        sys.stdout.flush()
        os.write(protocol, b"done\n")
    for db in dbs.values():
        db.close()
    return 0


def _load_backends() -> None:
    """Import every back end a job may name, before the first job (its wait starts then)."""
    from ..storing.jobs import job_backends

    for name in job_backends():
        try:
            backend_module(name)
        except Exception:  # noqa: BLE001, S112 - a job of this back end fails and says why
            continue


#: How long a job whose store found the user file locked is queued again (from its birth):
#: past it, the lock is no passing one (a session left open) and the job is dropped.
LOCKED_KEEP_S = 600.0
#: The pause before a lane answers for a job queued again on a lock.
LOCKED_PAUSE_S = 1.0


class StoreLocked(Exception):
    """A write of the job failed because another connection held the user file's write lock
    past SQLite's busy timeout: the job was intact, and is stored once the lock is gone."""


def queue_again(path: Path, err: StoreLocked) -> bool:
    """Whether the job ``path`` (locked out, ``err``) is queued again: while it is younger
    than :data:`LOCKED_KEEP_S` (its name starts with its birth in ns). Dropping it, as any
    failed store was, cost the next run every compile of the run before: a 30 s
    ``BEGIN IMMEDIATE`` in a ``sqlite3`` session was enough."""
    try:
        age = time.time() - int(path.stem.split("-", 1)[0]) / 1e9
    except ValueError:
        age = LOCKED_KEEP_S
    if age < LOCKED_KEEP_S:
        say(f"{about(path)}: {err}; queued again")
        return True
    say(f"{about(path)}: {err}, still after {LOCKED_KEEP_S / 60:.0f} minutes; the job is "
        "dropped (its kernels are compiled again where needed)")
    return False


def store_job_file(path: Path, dbs: dict | None = None) -> None:
    """Store one job: its back end builds the program again and reads the binaries (or, for
    a refresh job, adds what the program generated since to the stored binaries). Raises
    :class:`StoreLocked` when a write failed on another connection's lock."""
    from ..file import filewriter

    before = filewriter.locked_failures
    _store_job_file(path, dbs)
    if filewriter.locked_failures > before:
        raise StoreLocked(f"the user file was locked by another connection for over "
                          f"{config.BUSY_TIMEOUT_S:.0f} s")


def _store_job_file(path: Path, dbs: dict | None) -> None:
    data = read_job(path)
    if data is None:
        return
    job = StoreJob.from_dict(data)
    _moved_with_its_cache(job, path)
    dbs = {} if dbs is None else dbs
    if job.cache_dir not in dbs:
        dbs[job.cache_dir] = KernelDB(cache_dir=job.cache_dir)
    db = dbs[job.cache_dir]
    if job.kind == BOOKKEEPING:
        db.tiers.storing.write_bookkeeping(job.archs)
        return
    if job.kind == REFRESH:  # binaries stored before their programs generated more code
        for line in backend_module(job.backend).refresh_job(db, job):
            say(line)
        return
    attrs = _attributes(job)
    if _stored_already(db, attrs):  # the same program compiled again before it was stored
        db.tiers.storing.store([], [CompileRecord(*row) for row in job.logs])
        db.tiers.storing.publish_stored(attrs)  # its store may have ended before its publish
        _stored(job, path)
        return
    start = time.process_time()
    timings = backend_module(job.backend).rebuild_and_store(db, job) or {}
    seconds = time.process_time() - start
    _stored(job, path)
    n = max(len(job.entries), 1)
    build = timings.get("build")
    storetimes.record(db.tiers.user_dir, [
        (HashAttributes.from_canonical(e["attributes"]).arch, str(e.get("name") or ""),
         float(e.get("seconds") or 0.0), seconds / n, build / n if build is not None else None)
        for e in job.entries])


def _stored(job: StoreJob, path: Path) -> None:
    """The job's keys are in the user file: their marks go (:func:`jobfiles.mark`)."""
    if job.claims_dir:
        unmark(Path(job.claims_dir), path, job.keys)


def _attributes(job: StoreJob) -> list[HashAttributes]:
    return [HashAttributes.from_canonical(e["attributes"], name=e.get("name", ""))
            for e in job.entries]


def _stood_in(path: Path, dbs: dict) -> bool:
    """Whether every key of the job ``path`` has an entry in its user file and one of them is
    only an early entry: the next process is served, and the store would only make it a
    binary. A refresh job's entries are binaries already; bookkeeping serves nobody."""
    data = read_job(path)  # None: taken by another meanwhile, or stored
    try:
        job = StoreJob.from_dict(data) if data is not None else None
    except ValueError:
        return False  # malformed: taking it sets it aside and says why
    if job is None:
        return False
    if job.kind == REFRESH:
        return True
    attrs = _attributes(job)
    if job.kind == BOOKKEEPING or not attrs:
        return False
    if job.cache_dir not in dbs:
        dbs[job.cache_dir] = KernelDB(cache_dir=job.cache_dir)
    files = dbs[job.cache_dir].tiers
    found = {}
    for a in attrs:
        found.update(files.user_file(a.arch).details([a.key]))
    return len(found) == len({a.key for a in attrs}) and not _stored_already(
        dbs[job.cache_dir], attrs)


def _stored_already(db: KernelDB, attrs: list[HashAttributes]) -> bool:
    return bool(attrs) and all(a.key in db.tiers.user_file(a.arch).stored([a.key]) for a in attrs)


class Lane:
    """A supervisor's handle on a lane (:func:`serve` in a child process) and its job now: a
    normal lane's store is bounded in CPU time (set aside as slow past it), the slow lane's
    is not. The child runs in one job environment (``build``); a job of another is stored by
    a new child (a job that names none, such as bookkeeping, by the child there is)."""

    def __init__(self, slow: bool, share: float = 0.0, apart: bool = False) -> None:
        """``share``: a floor lane, at normal priority, paced to that share of one core
        (:mod:`.floor`); ``apart``: an idle lane in a session of its own (its supervisor
        keeps a session of normal weight for the floor lane). Either dies with its
        supervisor: a stopped lane would not see its stdin end."""
        self.slow, self.proc, self.job = slow, None, None  # job: the Path it is storing
        self.started, self.limit = 0.0, None  # its lane's CPU clock then, and the bound
        self.taken_at = 0.0  # the wall clock (time.monotonic()) then
        self.build: tuple = ()  # the build variables the child runs with
        self.pstart = 0  # the child's start time (kdb.claims.progress.start_time)
        self.pacer = Pacer(share) if share else None
        self.apart = apart
        self.window = (0.0, 0.0)  # the wall clock and its CPU seconds as a window began
        self.fed: bool | None = None  # its last full window: it got the share (idle CPU)
        self.left: str | None = None  # the stem of a job a floor lane left to idle CPU

    def start(self, path: Path, build: tuple = (), limit: float | None = None,
              ask: bool = False) -> None:
        """Have the child store ``path``, in ``limit`` CPU seconds at most (None: no bound);
        ``ask``: a floor lane first asks whether an early entry serves it (:func:`serve`)."""
        import subprocess

        if self.proc is not None and build and self.build != build:
            self.close()  # idle: it exits at the end of its stdin
            self.proc = None
        if self.proc is None or self.proc.poll() is not None:
            kind = "--floor-child" if self.pacer else "--slow-child" if self.slow else "--child"
            tied = self.apart or self.pacer is not None
            self.proc = subprocess.Popen([sys.executable, "-m", "kdb.worker", kind],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         close_fds=True, env=job_environment(None, build),
                                         start_new_session=self.apart, preexec_fn=_preexec(
                                             os.getpid(), self.apart, self.slow) if tied else None)
            self.build = build
            self.pstart = progress.start_time(self.proc.pid)
            if self.pacer:
                self.pacer.reset(self.proc.pid, self.clock())
        self.job, self.started, self.taken_at = path, self.clock(), time.monotonic()
        self.limit = limit
        self.window, self.fed = (self.taken_at, self.started), None
        self.proc.stdin.write((b"?" if ask else b"") + os.fsencode(path) + b"\n")
        self.proc.stdin.flush()

    def clock(self) -> float:
        """The CPU seconds the child used (a lane starved by busier processes is not a slow
        store), or without ``/proc`` the wall clock."""
        seen = progress.sample(self.proc.pid, self.pstart)
        return seen.cpu if seen is not None else time.monotonic()

    def poll(self) -> bool:
        """Finish, or set aside, the current job if its time has come; True if it ended."""
        import select

        if self.job is None or self.proc is None:
            return False
        path, done = self.job, None
        if select.select([self.proc.stdout], [], [], 0)[0]:  # b"": the child died
            answer = self.proc.stdout.readline()
            if answer == b"left\n":
                self.job, self.left = None, path.stem
                return True
            done = answer == b"done\n"
        if done is None and (self.limit is None or self.clock() - self.started <= self.limit):
            return False
        if done is False:  # the child died (killed, or crashed inside the driver)
            self.proc.wait()
            self.proc = None
            if path.stem in _ended_a_lane:  # again: the job itself ends it (a driver's crash)
                say(f"the store of {about(path)} ended its process again; the job is dropped")
                remove(path)
            else:
                _ended_a_lane.add(path.stem)
                say(f"the store of {about(path)} ended its process (killed, or the driver "
                    "crashed); it is tried once more")
                rename(taken_path(path), path)  # queued again (unless it was never taken)
        elif done is None:
            say(f"{about(path)}: storing took over {self.limit:.0f} s of CPU time; set "
                 "aside, to be stored beside the other jobs")
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            if not rename(taken_path(path), slow_path(path)):  # killed before its take
                rename(path, slow_path(path))
        self.job = None
        return True

    def pace(self) -> float:
        """Hold a floor lane with a job to its share (:meth:`.floor.Pacer.look`); the seconds
        until it is due again (an idle lane: never sooner than the supervisor's loop)."""
        if self.pacer is None or self.job is None or self.proc is None:
            return 0.1
        return self.pacer.look(self.clock())

    def judge(self, share: float, window: float) -> bool | None:
        """For an idle lane storing a job: whether it got at least ``share`` of one core over
        its last full ``window`` seconds (True: the machine has idle CPU for it; False: it
        has none); None until it has stored one job that long."""
        if self.job is None or self.proc is None:
            return None
        now = time.monotonic()
        began, cpu = self.window
        if now - began >= window:
            self.window = (now, self.clock())
            self.fed = self.window[1] - cpu >= share * (now - began)
        return self.fed

    def starved(self, share: float, window: float) -> bool:
        """Whether an idle lane's store got less than ``share`` of one core over its last
        full ``window`` seconds (:meth:`judge`)."""
        return self.judge(share, window) is False

    def hand_over(self) -> Path | None:
        """Stop storing the job now (the lane is ended) and queue it again, as it was before
        it was taken; returns its path, None when it was stored or dropped meanwhile."""
        path, self.job = self.job, None
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
        if path is None or not (rename(taken_path(path), path) or path.exists()):
            return None  # (a lane starved before its take leaves the job as it was)
        return path

    def close(self) -> None:
        if self.pacer is not None:
            self.pacer.release()  # a stopped lane would never read the end of its stdin
        if self.proc is not None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001 - it is stopping anyway
                self.proc.kill()


def _root_of_spool(spool: Path) -> Path | None:
    """The cache directory a spool is in (``<cache>/v1/spool/<id>``), else None."""
    from ..storing.spool import SPOOL

    return spool.parent.parent.parent if spool.parent.name == SPOOL else None


def _moved(recorded: str | None, root: Path | None) -> bool:
    if not recorded or root is None:
        return False
    try:
        return os.path.realpath(recorded) != os.path.realpath(root)
    except (OSError, ValueError):
        return False


def _moved_with_its_cache(job: StoreJob, path: Path) -> None:
    """A job whose cache was moved with its spool (a CI runner restores the cache at another
    workspace) is stored where it is now: the worker stored it at the old path (made again
    for it), or dropped it where that could not be made, and the moved cache kept early
    entries for good."""
    root = _root_of_spool(path.parent)
    if _moved(job.cache_dir, root):
        job.cache_dir = str(root)
        job.claims_dir = str(path.parent.parent.parent / "claims")


def inherit(spool: Path) -> bool:
    """Take the environment the spool's jobs were written in (``environment.json``), for the
    rebuilds; False (said in the log) when the spool is not this user's alone or malformed."""
    from ..storing.trust import trusted

    if not trusted(spool, ENVIRONMENT):  # its variables (LD_*...) would be applied, its jobs run
        say(f"{spool} is not this user's alone; nothing stored (see the warning above)")
        return False
    env = job_environment(spool)
    if env is None:
        say(f"{spool / ENVIRONMENT} is malformed; remove {spool} to start afresh")
        return False
    root = _root_of_spool(spool)
    if _moved(env.get(config.ENV_CACHE_DIR), root):  # the cache moved: not the old path's
        env[config.ENV_CACHE_DIR] = str(root)
        if not os.path.isdir(env.get("POCL_CACHE_DIR") or "/"):  # nor its PoCL cache made
            env.pop("POCL_CACHE_DIR", None)                       # again at the old path
    os.environ.clear()
    os.environ.update(env)
    return True


def background_group() -> None:
    """The lowest weight for the autogroup of the worker's own session (autogroup scheduling
    shares the CPU between sessions whatever their nice); never for a session it joined."""
    if os.getsid(0) != os.getpid():
        return
    import errno

    for _ in range(20):  # an unprivileged write is refused (EAGAIN) soon after anyone's last
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write("19")
            return
        except FileNotFoundError:
            return  # a kernel without autogroup scheduling
        except OSError as err:
            if err.errno != errno.EAGAIN:
                say(f"could not give the worker's session the lowest autogroup weight: {err}")
                return
            time.sleep(0.1)
    say("could not give the worker's session the lowest autogroup weight: the kernel kept "
        "refusing (EAGAIN); its stores compete with this session's programs")


def _preexec(parent: int, apart: bool, slow: bool):
    """For ``preexec_fn``: the child is killed when ``parent`` ends (Linux's
    ``PR_SET_PDEATHSIG``; elsewhere not), or ends at once if it has already; a lane
    ``apart`` (an idle lane in a session of its own) takes the lowest priority and autogroup
    weight before Python starts, so that even its start costs no other session anything."""
    import ctypes
    import signal

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (AttributeError, OSError):
        prctl = None

    def tie() -> None:
        if prctl is not None:
            prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)
        if apart:
            lowest_priority(idle=slow)
            background_group()

    return tie
