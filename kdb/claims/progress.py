"""Whether another process is getting anywhere: its CPU time and run state, read from ``/proc``.

A process that waits for another's compile (:mod:`kdb.claims`) must tell a holder that is slow
from one that is stuck. The wall clock cannot: on a loaded machine a compile takes many times
its usual time, and a waiter that gives up then compiles the same program in the same
crowd. The CPU time the holder (and the compilers it runs as child processes) has used can:
it grows while the holder works, however slowly the machine lets it, and stands still while
the holder is stopped (``SIGSTOP``), dead-locked, or gone. ``man 5 proc`` describes the fields.
"""

from __future__ import annotations

import os

#: How many processes of a holder's tree (it, its children, theirs) are read at most.
MAX_TREE = 32

_start: int | None = None
_hz: float | None = None


class Sample:
    """A process tree at one moment: ``cpu`` (CPU seconds used by the process and its live
    and reaped descendants), ``stopped`` (the process is stopped or traced), ``running``
    (one of them is running or waiting for a CPU) and ``io`` (one of them waits for the
    disk: uninterruptible sleep, ``D``, as a compiler does while its pages are read in from a
    busy disk, using no CPU time meanwhile)."""

    __slots__ = ("cpu", "stopped", "running", "io")

    def __init__(self, cpu: float, stopped: bool = False, running: bool = False,
                 io: bool = False) -> None:
        self.cpu, self.stopped, self.running, self.io = cpu, stopped, running, io


def hz() -> float:
    """Clock ticks a second (``/proc`` counts CPU time in them)."""
    global _hz
    if _hz is None:
        try:
            _hz = float(os.sysconf("SC_CLK_TCK"))
        except (ValueError, OSError, AttributeError):
            _hz = 100.0
    return _hz


def _stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (``state`` first)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


_boot_ns: int | None = None


def boot_ns() -> int:
    """The wall clock at boot (``btime`` in ``/proc/stat``: whole seconds), in ns; 0 unknown."""
    global _boot_ns
    if _boot_ns is None:
        _boot_ns = 0
        try:
            with open("/proc/stat", "rb") as f:
                for line in f:
                    if line.startswith(b"btime "):
                        _boot_ns = int(line.split()[1]) * 1_000_000_000
                        break
        except (OSError, ValueError, IndexError):
            pass
    return _boot_ns


def started_ns(pid: int) -> int:
    """When process ``pid`` started, on the wall clock (``time.time_ns()``), to the second
    (``btime`` is in whole seconds); 0 when no such process; 1 when ``/proc`` gives no boot
    time (it exists, its start unknown)."""
    ticks = start_time(pid)
    if not ticks:
        return 0
    boot = boot_ns()
    return boot + int(ticks / hz() * 1e9) if boot else 1


def ran_at(started: int, wall_ns: int) -> bool:
    """Whether a process whose :func:`started_ns` is ``started`` exists and had started by
    ``wall_ns`` (``time.time_ns()``): a later process that reuses the pid does not count
    (one second of slack)."""
    return 0 < started <= wall_ns + 1_000_000_000


def start_time(pid: int | None = None) -> int:
    """When process ``pid`` (default: this one) started, in clock ticks since boot; 0 when
    unknown. With the pid it names a process: a pid reused by another process, or one of
    another pid namespace, does not match."""
    global _start
    if pid is None:
        if _start is None:
            fields = _stat(os.getpid())
            _start = int(fields[19]) if fields else 0
        return _start
    fields = _stat(pid)
    return int(fields[19]) if fields else 0


def sample(pid: int, start: int) -> Sample | None:
    """The process ``pid`` that started at ``start`` (:func:`start_time`), with its descendants;
    ``None`` when it cannot be seen from here (no ``/proc``, another pid namespace, exited)."""
    fields = _stat(pid)
    if not start or fields is None or int(fields[19]) != start:
        return None
    cpu = sum(int(x) for x in fields[11:15])  # utime, stime, and its reaped children's
    todo, states = _tasks(pid)
    seen = 1
    while todo and seen < MAX_TREE:
        child = todo.pop()
        seen += 1
        got = _stat(child)
        if got is None:
            continue
        cpu += sum(int(x) for x in got[11:15])
        more, child_states = _tasks(child)
        todo += more
        states |= child_states
    return Sample(cpu / hz(), fields[0] in (b"T", b"t"), b"R" in states, b"D" in states)


def _tasks(pid: int) -> tuple[list[int], set[bytes]]:
    """The live child processes of every thread of ``pid`` (a compiler it runs: nvcc, ptxas),
    and the states of its threads (one may run, or wait for the disk, while the first sleeps
    in a join)."""
    out: list[int] = []
    states: set[bytes] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out, states
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                states.add(f.read().rsplit(b")", 1)[1].split(None, 1)[0])
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out += [int(c) for c in f.read().split()]
        except (OSError, ValueError, IndexError):
            continue
    return out, states
