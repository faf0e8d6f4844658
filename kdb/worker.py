"""The store worker: a supervisor and two lanes that store the jobs of one spool.

Jobs are written by :mod:`kdb.spool`. The supervisor (this module, no OpenCL) runs two
child processes that do the stores. A job whose store takes far longer than its compile
did (pyopencl's scan programs) is stopped and set aside as *slow*; the second child stores
slow jobs one by one while the first goes on with the others, so one costly program never
holds up the entries the next run asks for, and nothing is thrown away once it is set
aside. Each job's back end redoes the build (:func:`kdb.jobs.backend_module`).

    python -m kdb.worker DIR           # the supervisor for one spool directory
    python -m kdb.worker --child       # a child: stores the jobs named on stdin (--slow-child)
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from . import claims
from .db import KernelDB
from .jobs import BOOKKEEPING, StoreJob, backend_module
from .keys import HashAttributes
from .spool import (_ENV_NAMES, _ENV_PREFIXES, ENVIRONMENT, JOB, LOCK, SLOW, _rename, _slow,
                    _taken, _unlink, read_job, worker_running)
from .store import CompileRecord

#: A job waits this long before it is stored (unless another process waits for it), so the
#: program's first launches have put their work-group code in PoCL's cache: the stored
#: binary then carries it and the next start's first launches skip PoCL's JIT.
MIN_AGE_S = 1.0
#: Seconds without a job after which the worker exits.
IDLE_EXIT_S = 3.0
#: A store may take ``SLOW_FACTOR`` times its compile, and at least ``SLOW_MIN_S`` seconds,
#: before it is set aside as slow.
SLOW_FACTOR = 10.0
SLOW_MIN_S = 5.0


def _lowest_priority(idle: bool) -> None:
    """nice 19; with ``idle``, also ``SCHED_IDLE``: run only on a CPU nothing else wants.

    The lane that stores what the next run asks for runs at nice 19 (it yields to any
    normal process, and is not starved by the slow lane); the slow lane at ``SCHED_IDLE``.
    """
    if idle:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):
            pass
    try:
        os.nice(19 - os.nice(0))
    except OSError:
        pass


def _say(text: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} kdb store worker {os.getpid()}: {text}",
          flush=True)


class _Child:
    """The child process that stores jobs, one at a time, named on its stdin."""

    def __init__(self, slow: bool) -> None:
        import subprocess

        self.proc = subprocess.Popen([sys.executable, "-m", "kdb.worker",
                                      "--slow-child" if slow else "--child"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     close_fds=True)

    def start(self, path: Path) -> None:
        self.proc.stdin.write(os.fsencode(path) + b"\n")
        self.proc.stdin.flush()

    def done(self, timeout: float) -> bool | None:
        """True once the current job is finished, None if not within ``timeout``; False if
        the child died."""
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], max(timeout, 0))
        if not ready:
            return None
        line = self.proc.stdout.readline()
        return bool(line)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:  # noqa: BLE001 - it is stopping anyway
            self.proc.kill()


def _keys(path: Path, memo: dict) -> tuple[list[str], float, str]:
    """A job's keys, compile seconds and claims directory (read once per job)."""
    got = memo.get(path.name)
    if got is None:
        job = read_job(path) or {}
        got = memo[path.name] = ([e.get("key", "") for e in job.get("entries", [])],
                                 float(job.get("seconds", 0.0) or 0.0),
                                 job.get("claims_dir", ""))
    return got


class _Lane:
    """One child and the job it is storing: the normal lane bounds each store's time, the
    slow lane stores set-aside jobs one by one, so neither holds up the other."""

    def __init__(self, slow: bool) -> None:
        self.slow = slow
        self.child: _Child | None = None
        self.job: Path | None = None
        self.started = 0.0
        self.limit: float | None = None

    def start(self, path: Path, memo: dict) -> None:
        if self.child is None or self.child.proc.poll() is not None:
            self.child = _Child(self.slow)
        _, seconds, _ = _keys(path, memo)
        self.job, self.started = path, time.monotonic()
        self.limit = None if self.slow else max(SLOW_MIN_S, SLOW_FACTOR * seconds)
        self.child.start(path)

    def poll(self, memo: dict) -> None:
        """Finish, or set aside, the current job if its time has come."""
        if self.job is None or self.child is None:
            return
        done = self.child.done(0)
        path = self.job
        if done is None and (self.limit is None or time.monotonic() - self.started <= self.limit):
            return
        if done is False:  # the child died (killed, or crashed inside the driver)
            _say(f"the store of {path.name} ended its process; the job is dropped")
            _unlink(path)
            self.child = None
        elif done is None:
            _say(f"{path.name}: storing took over {self.limit:.0f} s; set aside, to be stored "
                 "beside the other jobs")
            self.child.kill()
            self.child = None
            _rename(_taken(path), _slow(path))
        self.job = None
        memo.pop(path.name, None)

    def close(self) -> None:
        if self.child is not None:
            self.child.close()


def _pick(spool: Path, memo: dict, lane: _Lane, busy: set[str]) -> Path | None:
    """The next job for ``lane``. Normal lane: one another process waits for, else the
    oldest that is old enough; a job whose keys a slow job already holds joins the slow ones.
    Slow lane: the oldest slow job."""
    try:
        names = sorted(os.listdir(spool))
    except OSError:
        return None
    if lane.slow:
        slow = [spool / n for n in names if n.endswith(SLOW) and n not in busy]
        return slow[0] if slow else None
    normal = [spool / n for n in names if n.endswith(JOB) and n not in busy]
    slow_keys = {k for n in names if n.endswith(SLOW) or n in busy
                 for k in _keys(spool / n, memo)[0]}
    ready = []
    now_ns = time.time_ns()
    for p in normal:
        keys, _, cdir = _keys(p, memo)
        if keys and set(keys) <= slow_keys:
            _rename(p, _slow(p))  # the same program again: it would be slow again
            continue
        if cdir and any(claims.wanted(Path(cdir), k) for k in keys):
            return p
        try:
            born = int(p.name.split("-", 1)[0])
        except ValueError:
            born = 0
        if (now_ns - born) / 1e9 >= MIN_AGE_S:
            ready.append(p)
    return ready[0] if ready else None


def supervise(spool: Path) -> int:
    """Store every job of ``spool`` until it has been empty ``IDLE_EXIT_S``; one worker at
    a time (an ``flock`` on ``worker.lock``)."""
    import fcntl

    _lowest_priority(idle=False)
    from .spooltrust import trusted

    if not trusted(spool, ENVIRONMENT):  # its variables (LD_*...) would be applied, its jobs run
        _say(f"{spool} is not this user's alone; nothing stored (see the warning above)")
        return 1
    env = read_job(spool / ENVIRONMENT)
    if env is not None:  # the environment the jobs were written in, for the child's rebuilds
        for k in [k for k in os.environ if k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES]:
            del os.environ[k]
        os.environ.update({k: v for k, v in env.get("variables", [])})
    fd = os.open(spool / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return 0  # another worker has it
    lanes = [_Lane(slow=False), _Lane(slow=True)]
    memo: dict = {}
    idle_since = time.monotonic()
    try:
        while True:
            for lane in lanes:
                lane.poll(memo)
            busy = {lane.job.name for lane in lanes if lane.job is not None}
            for lane in lanes:
                if lane.job is None:
                    path = _pick(spool, memo, lane, busy)
                    if path is not None:
                        lane.start(path, memo)
                        busy.add(path.name)
            if busy or _has_jobs(spool):
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since >= IDLE_EXIT_S:
                break
            _wait_any(lanes, 0.1)
    finally:
        for lane in lanes:
            lane.close()
        os.close(fd)
    # A process may have written a job after our last look and seen our lock: go on.
    if _has_jobs(spool) and not worker_running(spool):
        return supervise(spool)
    return 0


def _wait_any(lanes: list[_Lane], timeout: float) -> None:
    import select

    pipes = [lane.child.proc.stdout for lane in lanes
             if lane.job is not None and lane.child is not None]
    if pipes:
        select.select(pipes, [], [], timeout)
    else:
        time.sleep(timeout)


def _has_jobs(spool: Path) -> bool:
    try:
        return any(n.endswith((JOB, SLOW)) for n in os.listdir(spool))
    except OSError:
        return False


# -- the worker: child ------------------------------------------------------------------------

def child_main(slow: bool = False) -> int:
    """Store each job named on stdin; answer one line per job on stdout."""
    _lowest_priority(idle=slow)
    dbs: dict = {}
    for line in sys.stdin.buffer:
        path = Path(os.fsdecode(line.rstrip(b"\n")))
        if _rename(path, _taken(path)):  # else the process that wrote it stores it itself
            try:
                store_job(_taken(path), dbs)
            except Exception as err:  # noqa: BLE001 - report, drop the job, go on
                _say(f"could not store {path.name}: {err}")
            _unlink(path)
        sys.stdout.write("done\n")
        sys.stdout.flush()
    for db in dbs.values():
        db.close()
    return 0


def store_job(path: Path, dbs: dict | None = None) -> None:
    """Store one job: its back end builds the program again and reads the binaries."""
    data = read_job(path)
    if data is None:
        return
    job = StoreJob.from_dict(data)
    dbs = {} if dbs is None else dbs
    db = dbs.get(job.cache_dir)
    if db is None:
        db = dbs[job.cache_dir] = KernelDB(cache_dir=job.cache_dir)
    if job.kind == BOOKKEEPING:
        db.write_bookkeeping(job.archs)
        return
    if _stored_already(db, job):  # the same program compiled again before it was stored
        db.store([], [CompileRecord(*row) for row in job.logs])
        return
    backend_module(job.backend).store_job(db, job.to_dict())


def _stored_already(db: KernelDB, job: StoreJob) -> bool:
    entries = job.entries
    for e in entries:
        attrs = HashAttributes.from_canonical(e["attributes"], name=e.get("name", ""))
        if db.user_file(attrs.arch).fetch(attrs.key) is None:
            return False
    return bool(entries)


def main(argv: list[str]) -> int:
    auto_hook = sys.modules.get("_kdb_auto")  # KDB_AUTO=1 inherited: never adopt in here
    if auto_hook is not None:
        auto_hook.disable()
    if argv in (["--child"], ["--slow-child"]):
        return child_main(slow=argv[0] == "--slow-child")
    return supervise(Path(argv[0]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
