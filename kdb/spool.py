"""Stores handed to a store worker: job files beside the user files, and the worker.

Reading a PoCL program's binaries makes PoCL generate code for every kernel of it: 0.2 s
for a small program, 30-45 s for some of pyopencl's scan programs that build in 0.5 s
(``benchmarks/run.py --only suite``, and DESIGN section 11). Done inside the process that
built the program it competes for PoCL's compiler lock; done after its exit it made the next
run wait. So a process that compiled a program writes down how to build it again (a *job*:
back end, source, options, devices, the entries' attributes and its start-up latency rows)
and goes on at once. One store worker per spool, at low CPU priority (nice 19), builds each
program again (PoCL's own cache answers), reads its binaries and stores them, taking first
the entries another process waits for, then the oldest.

Nobody waits for a store. A job holds no claim once its process has exited; a process that
misses an entry whose job is still queued builds the program itself, which costs no more
than no cache would. Jobs are files, so they survive the process that wrote them, a killed
worker (the next process starts another) and ``kdb log`` can show their compiles before
their binaries are stored.

The worker is a supervisor (this module, no OpenCL) and two children that do the stores. A
job whose store takes far longer than its compile did (pyopencl's scan programs: 30-45 s
against 0.5 s) is stopped and set aside as *slow*; the second child stores slow jobs one by
one while the first goes on with the others, so one costly program never holds up the
entries the next run asks for, and nothing is thrown away once it is set aside.

    python -m kdb.spool DIR            # the worker's supervisor for one spool directory
    python -m kdb.spool --child        # a child: stores the jobs named on stdin (--slow-child)
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable

from . import logs

log = logs.get("kdb")

#: Spool directories live in ``<user dir>/spool/<environment digest>/``.
SPOOL = "spool"
JOB = ".job"
SLOW = ".slow"
TAKEN = ".taken"  # a job a store worker's child (or its own process) is storing now
LOCK = "worker.lock"
#: The worker's log, beside the user files (what it could not store, and why).
LOG_NAME = "store-worker.log"

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

#: Environment variables that change what a store worker's rebuild produces or where its
#: OpenCL runtime looks: a worker only stores jobs written under the same values.
_ENV_PREFIXES = ("POCL_", "OCL_", "OPENCL_", "PYOPENCL_", "CUDA_", "LD_", "KDB_")
_ENV_NAMES = ("PATH", "PYTHONPATH", "HOME", "XDG_CACHE_HOME", "TMPDIR")


ENVIRONMENT = "environment.json"


def _environment() -> dict:
    """What a worker must run with to rebuild this process's programs the same way."""
    return {"executable": sys.executable,
            "variables": sorted([k, v] for k, v in os.environ.items()
                                if k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES)}


def environment_digest(env: dict | None = None) -> str:
    """A digest of what a worker inherits that could change its rebuilds: the Python it runs
    and the variables above. Jobs written under different values go to different spools,
    each with its ``environment.json``, so any process can start the worker of any spool."""
    import hashlib

    text = json.dumps(env or _environment(), separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:16]


# -- writing jobs (the process that compiled) -----------------------------------------------

_counter = 0
_worker_checked: dict[Path, float] = {}
#: Claims kept until their job is stored (another process may still wait for the entry).
_claims: list[tuple[Path, object]] = []
_last_sweep = 0.0


def submit(user_dir: Path, job: dict, claims: list | None = None,
           store_now: Callable[[], None] | None = None) -> Path:
    """Write ``job`` to the spool and make sure a worker runs; returns the job's path.

    ``claims`` (:class:`kdb.claims.Claim`) are marked pending and released once the job is
    stored, or when this process exits. ``store_now`` stores the job in this process; it is
    called (on a watcher thread) when another process waits for one of the claimed keys.
    Raises ``OSError`` when the spool cannot be written.
    """
    global _counter
    from .config import private_dir

    env = _environment()
    spool = private_dir(spool_dir(user_dir))
    if not (spool / ENVIRONMENT).exists():
        _write_file(spool / ENVIRONMENT, env)
    _counter += 1
    name = f"{time.time_ns():020d}-{os.getpid()}-{_counter}"
    path = spool / (name + JOB)
    _write_file(path, job)
    with _claims_lock:
        for claim in claims or ():
            claim.mark_pending(job.get("seconds", 0.0))
            _claims.append((path, claim))
        if claims and store_now is not None:
            _store_now[path] = store_now
    if claims:
        _watch()
    ensure_worker(spool)
    if Path(user_dir) not in _orphans_checked:
        _orphans_checked.add(Path(user_dir))
        for other in {p.parent for p in jobs(user_dir)} - {spool}:
            ensure_worker(other)  # left by processes of another environment, or a dead worker
    return path


_orphans_checked: set[Path] = set()


def _at_exit() -> None:
    """Claims whose jobs are still queued end with this process; with the shared tier their
    cross-node locks go to a keeper (:mod:`kdb.keeper`) so other nodes still wait for them."""
    pending = [(p, c) for p, c in _claims if _exists(p)]
    tiers: dict[int, tuple[object, list]] = {}
    for path, claim in pending:
        tier = getattr(claim, "_tier", None)
        if tier is not None:
            tiers.setdefault(id(tier), (tier, []))[1].append((claim.key, str(path)))
    if tiers:
        from . import keeper

        for tier, items in tiers.values():
            keeper.hand_over(tier, items)


_exit_registered = False


def _register_exit() -> None:
    global _exit_registered
    import atexit

    _exit_registered = True
    atexit.register(_at_exit)


def _write_file(path: Path, data: dict) -> None:
    """Write JSON to ``path`` atomically (0600): a reader never sees half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, separators=(",", ":"))
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


_claims_lock = threading.Lock()
_store_now: dict[Path, Callable[[], None]] = {}
_watcher: threading.Thread | None = None


def _watch() -> None:
    """Start the thread that releases the claims of stored jobs and stores wanted ones."""
    global _watcher
    if not _exit_registered:
        _register_exit()
    if _watcher is None or not _watcher.is_alive():
        _watcher = threading.Thread(target=_watch_claims, name="kdb-claims", daemon=True)
        _watcher.start()


def _watch_claims() -> None:
    while True:
        time.sleep(0.05)
        with _claims_lock:
            held = list(_claims)
        if not held:
            return
        for path, claim in held:
            if not _exists(path):
                _drop_claim(path, claim)
            elif claim.wanted:
                with _claims_lock:
                    store = _store_now.pop(path, None)
                if store is None or not (_rename(path, _taken(path))
                                         or _rename(_slow(path), _taken(path))):
                    continue  # the worker has it (it takes wanted jobs first)
                try:
                    store()
                    _unlink(path)
                except Exception as err:  # noqa: BLE001 - the worker will store it instead
                    log.debug("kdb: storing a wanted entry in this process failed: %s", err)
                    _rename(_taken(path), path)
                for other_path, other in [h for h in held if h[0] == path]:
                    _drop_claim(other_path, other)


def _drop_claim(path: Path, claim) -> None:
    with _claims_lock:
        try:
            _claims.remove((path, claim))
        except ValueError:
            return
        if not any(p == path for p, _ in _claims):
            _store_now.pop(path, None)
    claim.release()


def _slow(path: Path) -> Path:
    return path.with_suffix(SLOW)


def _taken(path: Path) -> Path:
    return path.with_suffix(TAKEN)


def _exists(path: Path) -> bool:
    """Whether the job ``path`` names is not stored yet (queued, set aside, or being stored)."""
    return any(os.path.exists(path.with_suffix(s)) for s in (JOB, SLOW, TAKEN))


def worker_running(spool: Path) -> bool:
    """Whether a worker holds ``spool``'s lock."""
    import fcntl

    try:
        fd = os.open(spool / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops a lock we took
    return False


def ensure_worker(spool: Path) -> None:
    """Start a worker for ``spool`` unless one runs (checked at most every 0.25 s)."""
    now = time.monotonic()
    if now - _worker_checked.get(spool, -1e9) < 0.25:
        return
    _worker_checked[spool] = now
    if worker_running(spool):
        return
    import subprocess

    env = read_job(spool / ENVIRONMENT) or {}
    exe = env.get("executable") or sys.executable
    if not os.access(exe, os.X_OK):
        exe = sys.executable
    out_fd = os.open(spool.parent.parent / LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                     0o600)
    with os.fdopen(out_fd, "ab") as out:
        subprocess.Popen([exe, "-m", "kdb.spool", str(spool)],
                         stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                         start_new_session=True, close_fds=True, cwd="/")


def spool_dir(user_dir: Path, environ=None) -> Path:
    """The spool a process with ``environ`` (default: this one's) writes its jobs to."""
    env = _environment()
    if environ is not None:
        env["variables"] = sorted([k, v] for k, v in environ.items()
                                  if k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES)
    return Path(user_dir) / SPOOL / environment_digest(env)


def _after_fork() -> None:
    global _watcher, _claims_lock
    _claims.clear()  # the parent's: it releases them
    _store_now.clear()
    _watcher = None
    _claims_lock = threading.Lock()
    _worker_checked.clear()
    _orphans_checked.clear()


os.register_at_fork(after_in_child=_after_fork)


def can_spool() -> bool:
    """Whether ``sys.executable -m kdb.spool`` would start Python: not in an application that
    embeds Python or is frozen (its executable is the application itself), and POSIX."""
    exe = sys.executable
    if os.name != "posix" or not exe or getattr(sys, "frozen", False):
        return False
    return os.path.basename(exe).lower().startswith(("python", "pypy"))


# -- reading the spool (kdb log, kdb pack, tests) ---------------------------------------------

def jobs(user_dir: Path) -> list[Path]:
    """Every job not stored yet under ``user_dir``, oldest first, slow ones included."""
    root = Path(user_dir) / SPOOL
    try:
        dirs = [d for d in root.iterdir() if d.is_dir()]
    except OSError:
        return []
    found = []
    for d in dirs:
        try:
            found += [p for p in d.iterdir() if p.suffix in (JOB, SLOW, TAKEN)]
        except OSError:
            pass
    return sorted(found, key=lambda p: p.name)


def read_job(path: Path) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None  # stored (and removed) meanwhile, or not a job


def pending_log_rows(user_dir: Path) -> list[list]:
    """The start-up latency rows of jobs not stored yet (``kdb log`` shows them at once)."""
    rows = []
    for path in jobs(user_dir):
        job = read_job(path)
        if job:
            rows += job.get("logs", [])
    return rows


def wait(user_dir: Path, timeout: float, progress=None) -> int:
    """Wait until the spool under ``user_dir`` is empty or ``timeout`` passed (starting a
    worker where none runs); returns how many jobs are left. ``progress(left)`` is called
    when the count changes."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        left = jobs(user_dir)
        if len(left) != last and progress is not None:
            progress(len(left))
        last = len(left)
        if not left or time.monotonic() >= deadline:
            return len(left)
        for spool in {p.parent for p in left}:
            _worker_checked.pop(spool, None)
            ensure_worker(spool)
        time.sleep(0.1)


def _rename(src: Path, dst: Path) -> bool:
    try:
        os.rename(src, dst)
        return True
    except OSError:
        return False


# -- the worker: supervisor ------------------------------------------------------------------

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

        self.proc = subprocess.Popen([sys.executable, "-m", "kdb.spool",
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
    from . import claims

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


def _unlink(path: Path) -> None:
    for p in (path.with_suffix(JOB), _slow(path), _taken(path)):
        try:
            os.unlink(p)
        except OSError:
            pass


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
    import importlib

    job = read_job(path)
    if job is None:
        return
    from .db import KernelDB

    dbs = {} if dbs is None else dbs
    db = dbs.get(job["cache_dir"])
    if db is None:
        db = dbs[job["cache_dir"]] = KernelDB(cache_dir=job["cache_dir"])
    if job.get("kind") == "bookkeeping":
        db.write_bookkeeping(job["archs"])
        return
    if _stored_already(db, job):  # the same program compiled again before it was stored
        from .store import CompileRecord

        db.store([], [CompileRecord(*row) for row in job.get("logs", [])])
        return
    backend = importlib.import_module(f"kdb.backends.{job['backend']}")
    backend.store_job(db, job)


def _stored_already(db, job: dict) -> bool:
    from .keys import HashAttributes

    entries = job.get("entries", [])
    for e in entries:
        attrs = HashAttributes.from_canonical(e["attributes"], name=e.get("name", ""))
        if db.user_file(attrs.arch).fetch(attrs.key) is None:
            return False
    return bool(entries)


if __name__ == "__main__":
    if sys.argv[1:] in (["--child"], ["--slow-child"]):
        sys.exit(child_main(slow=sys.argv[1] == "--slow-child"))
    sys.exit(supervise(Path(sys.argv[1])))
