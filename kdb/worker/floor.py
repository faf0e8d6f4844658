"""The floor under the store worker's stores: a lane at normal priority held to a share of
one core (``KDB_STORE_SHARE``) by its supervisor, so that stores land on a machine that is
never idle, and cost the programs there no more than that share.

The idle lanes (nice 19, ``SCHED_IDLE``, in sessions of the lowest autogroup weight) get
nothing while MPI ranks or ``pytest -n auto`` keep every core busy. Priority cannot be the
floor: an unprivileged process may raise its nice value and enter ``SCHED_IDLE``, never undo
either, and autogroup weight counts for a whole session. So the floor lane keeps nice 0, in
the supervisor's session of normal weight, and its supervisor stops and continues it
(``SIGSTOP``, ``SIGCONT``): over each :data:`PERIOD_S` it may use ``share * PERIOD_S`` CPU
seconds while it competes for its CPU. CPU time it gets without competing (its thread waited
for a CPU less than :data:`CONTENDED` of the time it ran: ``/proc/<pid>/schedstat``) is CPU
no one else wanted and is not counted, so on a quiet machine the floor lane stores at full
speed. Where the scheduler gives a normal process less than the share (more runnable
processes than cores times one over the share), the floor lane gets what any of them gets.
"""

from __future__ import annotations

import os
import signal
import time

#: Seconds over which the floor lane's CPU time is held to its share: short, since a
#: stopped lane may hold a user file's write lock, which other writers wait for.
PERIOD_S = 0.5
#: Waiting for a CPU this fraction of the time it ran makes a look's CPU time count.
CONTENDED = 0.1
#: Seconds between looks while the floor lane runs: the most it overruns its share by.
LOOK_S = 0.05


def waited(pid: int) -> tuple[float, float]:
    """``(seconds run, seconds waited for a CPU)`` by the main thread of ``pid``, from
    ``/proc/<pid>/schedstat``; ``(0, inf)`` where it cannot be read (everything counts)."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            ran, wait = (int(x) / 1e9 for x in f.read().split()[:2])
    except (OSError, ValueError):
        return 0.0, float("inf")
    return ran, wait


class Pacer:
    """Holds one lane process to ``share`` of one core of contended CPU time per period.
    :meth:`look` is called with the lane's CPU seconds whenever the lane has a job; it says
    when to look again."""

    def __init__(self, share: float, period: float = PERIOD_S) -> None:
        self.share, self.period = share, period
        self.pid = 0
        self.stopped = False
        self.began = 0.0  # the period's start (time.monotonic())
        self.charged = 0.0  # contended CPU seconds used in the period
        self.seen = (0.0, 0.0, 0.0)  # CPU, run and wait seconds at the last look

    def reset(self, pid: int, cpu: float) -> None:
        """A new lane process, running: a period starts."""
        self.pid, self.stopped, self.charged = pid, False, 0.0
        self.began = time.monotonic()
        self.seen = (cpu, *waited(pid))

    def look(self, cpu: float) -> float:
        """Count the CPU time the lane used since the last look (only where it competed),
        stop it past its share, continue it when a new period starts; returns the seconds
        until the next look is due."""
        now = time.monotonic()
        ran, wait = waited(self.pid)
        used, d_ran, d_wait = cpu - self.seen[0], ran - self.seen[1], wait - self.seen[2]
        self.seen = (cpu, ran, wait)
        if not d_wait <= CONTENDED * d_ran:  # unknown (NaN) counts too
            self.charged += max(used, 0.0)
        if now - self.began >= self.period:
            self.began, self.charged = now, 0.0
            self._signal(signal.SIGCONT, False)
        budget = self.share * self.period - self.charged
        if budget <= 0 and not self.stopped:
            self._signal(signal.SIGSTOP, True)
        if self.stopped:
            return max(self.began + self.period - now, 0.001)
        return min(max(budget, 0.005), LOOK_S)

    def release(self) -> None:
        """Continue the lane (it is closing, or has no job left to pace)."""
        self._signal(signal.SIGCONT, False)

    def _signal(self, sig: int, stopped: bool) -> None:
        if self.pid and self.stopped != stopped:
            try:
                os.kill(self.pid, sig)
            except OSError:
                pass  # gone: its supervisor sees it at the next poll
            self.stopped = stopped
