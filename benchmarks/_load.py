"""What the scenarios of issue 35 share: a machine kept busy, a batch system's kill, and the
store worker's state as a run starts.

kdb's store worker runs at nice 19 (its slow lane ``SCHED_IDLE``): it gets only the CPU no
other process wants. A machine that is never idle (other users' jobs, the ranks of an MPI
job spinning while they wait) gives it nothing, and a batch system kills whatever a job
left running shortly after the job ends. These helpers make both happen on purpose, bounded
so that a benchmark that fails or is killed cannot leave a core spinning.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from _harness import PYTHON, count_rows, kdb_files

#: One CPU-bound process: spins until its time limit or until its parent is gone (checked
#: every few milliseconds), whichever is first; so it ends even if the benchmark is killed.
_HOG = """\
import os, sys, time
end, parent = time.monotonic() + float(sys.argv[1]), int(sys.argv[2])
while time.monotonic() < end and os.getppid() == parent:
    for _ in range(20000):
        pass
"""

#: The environment variable that marks every process of a job (a batch job in ``batch``, an
#: arm's runs in ``busy``): the store worker ``setsid``s out of the job's session but keeps
#: this variable (and passes it to its lanes), as SLURM's cgroup keeps it in the job. Not a ``KDB_`` name: those tell the store
#: worker's spools apart, and a token per job would give each job a spool of its own.
JOB_MARKER = "BENCH_JOB"


@contextmanager
def hogs(count: int, limit_s: float) -> Iterator[list[subprocess.Popen]]:
    """``count`` CPU-bound processes at normal priority, each in a session of its own (other
    users' work: not in the benchmark's autogroup), for at most ``limit_s`` seconds; always
    stopped on leaving the block."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            procs.append(subprocess.Popen([PYTHON, "-c", _HOG, str(limit_s), str(os.getpid())],
                                          stdin=subprocess.DEVNULL, start_new_session=True))
        yield procs
    finally:
        _stop(procs)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def adopt_orphans() -> bool:
    """Make this process the subreaper of its descendants (Linux ``PR_SET_CHILD_SUBREAPER``):
    a store worker its children leave behind is reparented here, not to init, so that
    :func:`reap_orphans` can count the CPU time it used. False where that is not possible."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def children_cpu() -> float:
    """CPU seconds of every child reaped so far (``RUSAGE_CHILDREN``), with theirs."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def reap_orphans(timeout: float = 30.0) -> float:
    """Reap every child left (call it when this process has no child of its own running:
    the orphaned store workers and lanes, killed or exited); returns the CPU seconds they
    used, their own children's included."""
    before, deadline = children_cpu(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.05)
    return children_cpu() - before


def new_token() -> str:
    """A job's marker value: unique on this machine."""
    import uuid

    return uuid.uuid4().hex


def job_processes(marker: str, token: str) -> list[int]:
    """The pids of every live process whose environment holds ``marker=token`` (as a batch
    system finds a job's processes, whatever session they moved to); this one aside."""
    want = f"{marker}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue  # gone, or not ours
        if want in env.split(b"\0"):
            found.append(int(entry.name))
    return found


def kill_job(marker: str, token: str, rounds: int = 20) -> dict[int, str]:
    """SIGKILL every process of the job, again until none is left (a worker may start a lane
    between a scan and the kill). Returns each pid killed with its command line."""
    killed: dict[int, str] = {}
    for _ in range(rounds):
        pids = job_processes(marker, token)
        if not pids:
            break
        for pid in pids:
            killed.setdefault(pid, _cmdline(pid))
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)
    return killed


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return " ".join(a.decode(errors="replace") for a in raw.split(b"\0") if a)


def worker_kind(cmdline: str) -> str:
    """What a killed process was: one of the job's own, the store worker, a lane, or the
    process that stores ahead of a run (by the arguments kdb starts each with)."""
    if "kdb.worker" not in cmdline:
        return "job"
    for flag, kind in (("--slow-child", "lane"), ("--child", "lane"), ("--ahead", "ahead")):
        if flag in cmdline:
            return kind
    return "worker"


def worker_state(cache_dir: Path) -> dict[str, int]:
    """The store worker's backlog under a ``KDB_CACHE_DIR`` right now: jobs still queued (not
    stored), and entries in the user files (what a next process can be served)."""
    from kdb.storing import spool

    queued = sum(len(spool.jobs(v)) for v in cache_dir.glob("v*") if v.is_dir())
    entries = sum(count_rows(f, "kernels") for f in kdb_files(cache_dir))
    return {"queued": queued, "entries": entries}
