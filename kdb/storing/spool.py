"""Stores handed to a store worker: job files beside the user files, written and read.

Reading a PoCL program's binaries makes PoCL generate code for every kernel of it, which
can cost far more than the build (docs/figures.md). Done inside the process that built
the program it competes for PoCL's compiler lock; done after its exit it made the next run
wait. So a process that compiled a program writes down how to build it again (a
:class:`~kdb.storing.jobs.StoreJob`: back end, source, options, devices, the entries' attributes
and its start-up latency rows) and goes on at once. One store worker per spool
(:mod:`kdb.worker`, at low CPU priority) builds each program again (PoCL's own cache
answers), reads its binaries and stores them, taking first the entries another process
waits for, then the oldest.

Each job marks its keys beside the claims (:func:`kdb.storing.jobfiles.mark`): a process
that misses an entry whose job is still queued, or being stored, finds it with one
``readlink`` and waits for the store when that costs less than compiling
(:mod:`kdb.storing.queued`). Jobs are files, so they survive the process that wrote them, a
killed worker (the next process starts another) and ``kdb log`` can show their compiles
before their binaries are stored.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .. import lifecycle
from .jobfiles import (  # noqa: F401 - the job states and bounds, named here too
    BAD,
    JOB,
    LOCK,
    MAX_JOBS,
    MIN_FREE,
    PENDING,
    REFRESH_MARK,
    SLOW,
    TAKEN,
    SpoolFull,
    check_room,
    exists,
    low_space,
    mark,
    worker_running,
    marked,
    remove,
    rename,
    slow_path,
    take,
    taken_path,
)
from . import jobfiles
from .jobs import REFRESH
from .trust import ENVIRONMENT, UntrustedSpool, accepted, runnable, trusted

if TYPE_CHECKING:
    from typing import Callable

    from .jobs import StoreJob


#: Spool directories live in ``<user dir>/spool/<environment digest>/``.
SPOOL = "spool"
#: The worker's log, beside the user files (what it could not store, and why).
LOG_NAME = "store-worker.log"

#: Environment variables that change what a store worker's rebuild produces or where its
#: OpenCL runtime looks: a worker only stores jobs written under the same values.
_ENV_PREFIXES = ("POCL_", "OCL_", "OPENCL_", "PYOPENCL_", "CUDA_", "LD_", "KDB_")
_ENV_NAMES = ("PATH", "PYTHONPATH", "HOME", "XDG_CACHE_HOME", "TMPDIR")


#: Variables of the kinds above that change nothing a rebuild makes and differ from run to
#: run, or between a ``kdb run`` and a plain program: one spool per environment, not per run.
_ENV_PER_RUN = frozenset({"KDB_RUN_REPORT", "KDB_AUTO", "KDB_TRACE", "KDB_WAIT_TIMEOUT",
                          "KDB_DISABLE_REFRESH", "KDB_DISABLE_EARLY_STORE",
                          "KDB_STORE_SHARE"})


#: Variables naming files: made absolute, since the worker runs in ``/``.
_ENV_PATHS = frozenset({"KDB_SIGNING_KEY", "KDB_TRUSTED_KEYS"})


def _variables(environ) -> list[list[str]]:
    """The ``[name, value]`` pairs a worker inherits from ``environ``, sorted."""
    return sorted([k, os.pathsep.join(os.path.abspath(p) if p else p
                                      for p in v.split(os.pathsep)) if k in _ENV_PATHS else v]
                  for k, v in environ.items() if inherited(k) and k not in _ENV_PER_RUN)


def inherited(name: str) -> bool:
    """Whether the variable ``name`` is one a store worker takes from its spool's
    ``environment.json`` (and so one that tells spools apart)."""
    return name.startswith(_ENV_PREFIXES) or name in _ENV_NAMES


def _environment() -> dict:
    """What a worker must run with to rebuild this process's programs the same way.

    The settings the worker will read are checked here, in the program that set them: a bad
    one warns once now, not only in the worker's log."""
    from .. import config

    config.check_settings()
    return {"executable": sys.executable, "variables": _variables(os.environ)}


def job_environment(spool: Path | None, build=(), base=None) -> dict[str, str] | None:
    """The environment a store of ``spool``'s jobs runs in: ``base`` (default this process's)
    with the variables of the spool's ``environment.json`` in place of those a worker
    inherits (none there: ``base``'s stay), and a job's ``build`` variables (``(name, value)``
    pairs, unset where the value is None). None when ``environment.json`` is malformed."""
    env = dict(os.environ if base is None else base)
    data = read_job(spool / ENVIRONMENT) if spool is not None else None
    if data is not None:
        try:
            variables = {str(k): str(v) for k, v in data.get("variables", [])}
        except (AttributeError, TypeError, ValueError):
            return None
        env = {k: v for k, v in env.items() if not inherited(k)}
        env.update(variables)
    for name, value in build:
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


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
_last_sweep = 0.0


def submit(user_dir: Path, job: StoreJob, claims: list | None = None,
           store_now: Callable[[bool], str | None] | None = None) -> Path:
    """Write ``job`` to the spool and make sure a worker runs; returns the job's path.

    ``claims`` (:class:`kdb.claims.Claim`) are marked pending and held until the job is
    stored, or this process exits (:mod:`kdb.storing.holding`). ``store_now`` stores the
    job in this process, when another process waits for one of the claimed keys.
    Raises ``OSError`` when the spool cannot be written, :class:`UntrustedSpool` (after its
    warning) when a directory on its way is not this user's alone.
    """
    global _counter
    from ..config import private_dir

    env = _environment()
    spool = spool_dir(user_dir)
    if not trusted(spool):  # checked before anything is created in it, and after
        raise UntrustedSpool(spool)
    private_dir(spool)
    if not trusted(spool, ENVIRONMENT):
        raise UntrustedSpool(spool)
    check_room(Path(user_dir), spool)
    if not (spool / ENVIRONMENT).exists():
        write_json(spool / ENVIRONMENT, env)
    _counter += 1
    name = f"{time.time_ns():020d}-{os.getpid()}-{_counter}"
    if job.kind == REFRESH:
        name += REFRESH_MARK
    path = spool / (name + JOB)
    write_json(path, job.to_dict())
    if job.claims_dir and job.entries:  # a process that misses one of its keys finds it
        mark(Path(job.claims_dir), path, [k for k in job.keys if k])
    if claims:
        from . import holding

        holding.hold(path, claims, job.seconds, store_now)
    ensure_worker(spool)
    if Path(user_dir) not in _orphans_checked:
        _orphans_checked.add(Path(user_dir))
        for other in {p.parent for p in jobs(user_dir)} - {spool}:
            ensure_worker(other)  # left by processes of another environment, or a dead worker
    return path


_orphans_checked: set[Path] = set()


def write_json(path: Path, data: dict) -> None:
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


#: Bytes ``store-worker.log`` grows to before it is moved to ``store-worker.log.1`` (the one
#: older log kept), when a worker starts.
LOG_MAX = 1 << 20


def _open_log(path: Path) -> int:
    """``store-worker.log`` opened for appending, the one before moved aside first where it
    outgrew :data:`LOG_MAX` (it was only ever appended to)."""
    try:
        if os.stat(path).st_size > LOG_MAX:
            os.replace(path, f"{path}.1")
    except OSError:
        pass
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)


def ensure_worker(spool: Path) -> None:
    """Start a worker for ``spool`` unless one runs (checked at most every 0.25 s).

    Only in a spool this user alone can write (:func:`trusted`), and always this process's
    own Python: never an executable named by a file, which whoever wrote it chose."""
    now = time.monotonic()
    if now - _worker_checked.get(spool, -1e9) < 0.25:
        return
    _worker_checked[spool] = now
    if not runnable(spool) or worker_running(spool):
        return
    import subprocess

    exe = sys.executable
    out_fd = _open_log(spool.parent.parent / LOG_NAME)
    with os.fdopen(out_fd, "ab") as out:
        subprocess.Popen([exe, "-m", "kdb.worker", str(spool)],
                         stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                         start_new_session=True, close_fds=True, cwd="/")


def resume(user_dir: Path, keys) -> None:
    """Start the worker of each spool whose job still stores one of ``keys``: a provisional
    entry was served, so its store is pending, perhaps left by a worker killed with its job
    (a batch system's end of job), which nothing else would start again until this user's
    next compile. One ``readlink`` a key."""
    claims_dir = Path(user_dir) / "claims"
    for spool in {job.parent for job in (marked(claims_dir, k) for k in keys) if job}:
        if exists_any(spool):
            ensure_worker(spool)


def exists_any(spool: Path) -> bool:
    """Whether ``spool`` holds a job in any state (one ``scandir``)."""
    try:
        with os.scandir(spool) as entries:
            return any(e.name.endswith((JOB, TAKEN, SLOW)) for e in entries)
    except OSError:
        return False


def spool_dir(user_dir: Path, environ=None) -> Path:
    """The spool a process with ``environ`` (default: this one's) writes its jobs to."""
    env = _environment()
    if environ is not None:
        env["variables"] = _variables(environ)
    return Path(user_dir) / SPOOL / environment_digest(env)


def _after_fork() -> None:
    _worker_checked.clear()
    _orphans_checked.clear()


lifecycle.on_fork(_after_fork)


def can_spool() -> bool:
    """Whether ``sys.executable -m kdb.worker`` would start Python: not in an application that
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
            found += [p for p in d.iterdir() if p.suffix in PENDING]
        except OSError:
            pass
    return sorted(found, key=lambda p: p.name)


def read_job(path: Path) -> dict | None:
    """A job's (or ``environment.json``'s) data; ``None`` when it is gone, not JSON, or not
    this user's alone (refused with a warning: its contents are run as this user)."""
    try:
        fd = jobfiles.open_regular(path)
    except OSError:
        return None  # stored (and removed) meanwhile, or not a file (a FIFO never answers)
    try:
        with open(fd, encoding="utf-8", closefd=False) as f:
            if not accepted(path, fd):
                return None
            return json.load(f)
    except (OSError, ValueError):
        return None  # not a job
    finally:
        os.close(fd)


def _pending_jobs(user_dir: Path):
    """Each job not stored yet, as ``(path, StoreJob)``, read without taking it (the one
    reading of the spool that ``kdb log``, ``kdb stats`` and ``kdb run`` share)."""
    from .jobs import StoreJob

    for path in jobs(user_dir):
        data = read_job(path)
        if data is None:
            continue
        try:
            yield path, StoreJob.from_dict(data)
        except ValueError:
            continue  # a malformed job: the store worker sets it aside and says so


def pending_log_rows(user_dir: Path) -> list:
    """The start-up latency rows of jobs not stored yet, as ``CompileRecord``s (``kdb log``
    shows them at once, ``kdb run`` counts its own); a row that is not one is skipped."""
    from ..file.kernelfile import CompileRecord

    out = []
    for _, job in _pending_jobs(user_dir):
        for row in job.logs:
            try:
                out.append(CompileRecord(*row))
            except TypeError:
                continue
    return out


class Queued:
    """What a spool still holds, for ``kdb stats``: the store jobs (``programs``, their
    ``entries``, ``oldest``: when the oldest was queued, epoch seconds, or None) and the
    counters of bookkeeping jobs per arch (``counters``).

    The counters are compiles and hits a process counted and handed to the store worker at
    exit because no user file existed yet (:meth:`kdb.bookkeeping.Book.at_exit`); until
    the worker writes them they are only here, so a report that reads the user files alone
    says 0 compiles after runs that compiled (issue 35). They are in the spool or in the
    file, never both, but for the moment between the worker's commit and its removal of the
    job, when a reader may count them twice."""

    def __init__(self) -> None:
        self.programs = 0
        self.entries = 0
        self.oldest: float | None = None
        self.counters: dict[str, dict[str, float]] = {}

    def add(self, path: Path, job, arch: str | None) -> None:
        """Count one pending job (a store job of another arch than ``arch`` is not)."""
        from .jobs import BOOKKEEPING, STORE

        if job.kind == BOOKKEEPING:
            for a, data in job.archs.items():
                counters = data.get("counters") if isinstance(data, dict) else None
                if isinstance(counters, dict) and arch in (None, a):
                    mine = self.counters.setdefault(a, {})
                    for name, n in counters.items():
                        if isinstance(n, (int, float)) and not isinstance(n, bool):
                            mine[name] = mine.get(name, 0) + n
            return
        if job.kind != STORE or (arch is not None and not any(
                isinstance(r, list) and r[2:3] == [arch] for r in job.logs)):
            return
        self.programs += 1
        self.entries += len(job.entries)
        at = queued_at(path)
        self.oldest = at if self.oldest is None else min(self.oldest, at)


def queued(user_dir: Path, arch: str | None = None) -> Queued:
    """What the spools under ``user_dir`` hold (for ``arch`` only, if given): :class:`Queued`."""
    out = Queued()
    for path, job in _pending_jobs(user_dir):
        out.add(path, job, arch)
    return out


def queued_at(path: Path) -> float:
    """When the job ``path`` was queued: its name starts with the time in nanoseconds
    (:func:`submit`); its file's modification time for a name that does not."""
    head = path.name.split("-", 1)[0]
    if head.isdigit():
        return int(head) / 1e9
    try:
        return path.stat().st_mtime
    except OSError:
        return time.time()


def wait(user_dir: Path, timeout: float, progress=None, hurry: bool = False) -> int:
    """Wait until the spools under ``user_dir`` this process can store (:func:`runnable`)
    are empty or ``timeout`` passed (starting a worker where none runs); returns how many
    of their jobs are left. ``progress(left)`` is called when the count changes. With
    ``hurry``, the jobs are stored by a child of this process at its priority
    (``python -m kdb.worker --hurry``), not left to the worker's idle-priority lanes."""
    deadline = time.monotonic() + timeout
    last = None
    ours: dict[Path, bool] = {}  # spools this process can store (not refused, its Python)
    helpers: dict[Path, object] = {}
    try:
        while True:
            left = [p for p in jobs(user_dir) if _memo(ours, p.parent)]
            if len(left) != last and progress is not None:
                progress(len(left))
            last = len(left)
            if not left or time.monotonic() >= deadline:
                return len(left)
            for spool in {p.parent for p in left}:
                _worker_checked.pop(spool, None)
                ensure_worker(spool)
                if hurry and (spool not in helpers or helpers[spool].poll() is not None):
                    helpers[spool] = _hurry(spool)
            time.sleep(0.1)
    finally:
        for proc in helpers.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _hurry(spool: Path):
    """Start a child that stores every job of ``spool`` now (its output goes to the log)."""
    import subprocess

    out_fd = _open_log(spool.parent.parent / LOG_NAME)
    with os.fdopen(out_fd, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "kdb.worker", "--hurry", str(spool)],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=out, close_fds=True,
                                cwd="/")


def _memo(ours: dict[Path, bool], spool: Path) -> bool:
    if spool not in ours:
        ours[spool] = runnable(spool)
    return ours[spool]
