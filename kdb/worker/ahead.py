"""Stores that earlier processes queued, done ahead for a process that needs them, with its CPU.

The store worker gives its lanes only the CPU time no other session wants (nice 19 in an
autogroup of the lowest weight): right for the process that compiled, which must not pay for
its stores, and wrong for the next run, started the moment it exited, which misses what is
still queued (on a busy machine, 191 of a suite's 304 programs). So a process that meets a
job an earlier process queued starts this (:func:`kdb.storing.queued.plan`): a supervisor
and one lane, both in the process's own session, the lane at nice 19. Autogroup scheduling
shares the CPU between sessions: the lane takes the share of the process that needs the
stores, on a CPU that process leaves idle, and yields to it on its own. It stores the jobs
of one spool that other processes wrote before it started, newest first (the process itself meets them oldest
first: the two meet halfway), only those whose store is expected to cost less than
compiling them (:mod:`kdb.storing.storetimes`, by program name), each within what compiling
would cost (else set aside as slow, for the worker's slow lane, and recorded as costly). It
stops when no such job is left, or when its process has exited (its stdin ends). One at a
time per spool (an ``flock`` on ``ahead.lock``): ranks that started together share one.

    python -m kdb.worker --ahead SPOOL BEFORE_NS
"""

from __future__ import annotations

import os
import select
import sys
from pathlib import Path

from .. import claims
from ..claims import progress
from ..storing import storetimes
from ..storing.jobfiles import AHEAD_LOCK, JOB, slow_path
from ..storing.jobs import StoreJob
from ..storing.queued import COMPILE_AND_LAUNCH, SLACK_S
from .lane import Lane, inherit, lowest_priority

#: CPU seconds a lane's start (Python, the back end, the device) adds to its first store.
LANE_START_S = 1.0


def run(spool: Path, before: int) -> int:
    """Store ``spool``'s jobs written before ``before`` (``time.time_ns()``), newest first,
    while they are worth it and the process that started this runs."""
    import fcntl

    lowest_priority(idle=False)
    if not inherit(spool):
        return 1
    fd = os.open(spool / AHEAD_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return 0  # another process's stores them ahead (ranks that started together)
    lane, seen = Lane(slow=False), {}
    try:
        while not _ended():
            pick = _next(spool, before, seen)
            if pick is None:
                break
            path, info = pick
            fresh = lane.proc is None or lane.proc.poll() is not None
            lane.start(path, info["build"], info["limit"] + (LANE_START_S if fresh else 0.0))
            while not lane.poll():
                select.select([lane.proc.stdout], [], [], 0.1)
            if slow_path(path).exists():  # stopped at its limit: remember what it cost
                storetimes.record(spool.parent.parent, [
                    (info["arch"], info["name"], info["compile"], info["limit"], None)])
    finally:
        lane.close()
        os.close(fd)
    return 0


def _ended() -> bool:
    """Whether the process that started this has exited (the end of its pipe on stdin)."""
    if not select.select([sys.stdin], [], [], 0)[0]:
        return False
    return os.read(sys.stdin.fileno(), 4096) == b""


def _next(spool: Path, before: int, seen: dict) -> tuple[Path, dict] | None:
    """The newest queued job written before ``before`` that is worth storing now, with what
    :func:`_weigh` says of it; ``seen``: stem -> that, or None (not worth it, or tried)."""
    try:
        stems = sorted((n[:-len(JOB)] for n in os.listdir(spool) if n.endswith(JOB)),
                       reverse=True)
    except OSError:
        return None
    for stem in stems:
        try:
            born, pid = (int(x) for x in stem.split("-")[:2])
        except ValueError:
            continue
        if born >= before or pid == os.getppid():  # its own process's: the worker's
            continue
        if stem not in seen:
            seen[stem] = _weigh(spool, spool / (stem + JOB))
        info, seen[stem] = seen[stem], None  # each job is tried once
        if info is not None:
            return spool / (stem + JOB), info
    return None


def _weigh(spool: Path, path: Path) -> dict | None:
    """What storing the job ``path`` is expected to cost, and its bound; None when that is
    more than compiling it, or a live process holds one of its keys (it compiles it now)."""
    from ..storing.spool import read_job

    data = read_job(path)
    try:
        job = StoreJob.from_dict(data) if data is not None else None
    except ValueError:
        job = None
    if job is None or not job.entries or not job.claims_dir:
        return None
    for key in job.keys:
        held = claims.holder(Path(job.claims_dir), key)
        if held.state and held.pid and progress.sample(held.pid, held.start):
            return None
    from ..keys import HashAttributes

    first = job.entries[0]
    try:
        arch = HashAttributes.from_canonical(first["attributes"]).arch
    except (KeyError, TypeError, ValueError):
        return None
    name, compile_s = str(first.get("name") or ""), float(first.get("seconds") or 0.0)
    expected = storetimes.ratios(spool.parent.parent, arch).store(name) * compile_s
    if expected >= COMPILE_AND_LAUNCH * compile_s:
        return None
    per_job = max(job.seconds, compile_s * len(job.entries))
    return {"build": tuple(sorted(job.environment.items())), "arch": arch, "name": name,
            "compile": compile_s, "limit": max(COMPILE_AND_LAUNCH * per_job,
                                               2 * expected * len(job.entries)) + SLACK_S}
