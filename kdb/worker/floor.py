"""The floor under the store worker's stores: a lane at normal priority held to a share of
one core (``KDB_STORE_SHARE``) by its supervisor, so that stores land on a machine that is
never idle, and cost the programs there no more than that share.

The idle lanes (nice 19, ``SCHED_IDLE``, in sessions of the lowest autogroup weight) get
nothing while MPI ranks or ``pytest -n auto`` keep every core busy. Priority cannot be the
floor: an unprivileged process may raise its nice value and enter ``SCHED_IDLE``, never undo
either, and autogroup weight counts for a whole session. So the floor lane keeps nice 0, in
the supervisor's session of normal weight, and its supervisor stops and continues it
(``SIGSTOP``, ``SIGCONT``): over each :data:`PERIOD_S` it may use ``share * PERIOD_S`` CPU
seconds, every CPU second it runs counted. It runs only while the idle lanes starve
(:func:`kdb.worker.supervisor.supervise`): where CPU is idle they store at no cost to
anyone, and a lane at nice 0 would not. (Counting only the CPU time the floor lane waited
for, as it once did, let it run unpaced beside a program on a quiet machine: what the
program's threads waited for it is not in the floor lane's own numbers.) Where the scheduler
gives a normal process less than the share (more runnable processes than cores times one
over the share), the floor lane gets what any of them gets.
"""

from __future__ import annotations

import os
import signal
import time

#: Seconds over which the floor lane's CPU time is held to its share: short, since a
#: stopped lane may hold a user file's write lock, which other writers wait for.
PERIOD_S = 0.5
#: Seconds between looks while the floor lane runs: the most it overruns its share by.
LOOK_S = 0.05


class Pacer:
    """Holds one lane process to ``share`` of one core of CPU time per period. :meth:`look`
    is called with the lane's CPU seconds whenever the lane has a job; it says when to look
    again."""

    def __init__(self, share: float, period: float = PERIOD_S) -> None:
        self.share, self.period = share, period
        self.pid = 0
        self.stopped = False
        self.began = 0.0  # the period's start (time.monotonic())
        self.charged = 0.0  # CPU seconds used in the period
        self.seen = 0.0  # CPU seconds at the last look

    def reset(self, pid: int, cpu: float) -> None:
        """A new lane process, running: a period starts."""
        self.pid, self.stopped, self.charged = pid, False, 0.0
        self.began = time.monotonic()
        self.seen = cpu

    def look(self, cpu: float) -> float:
        """Count the CPU time the lane used since the last look, stop it past its share,
        continue it once a new period has budget (what it overran by is carried over, so
        over time it gets the share and no more); returns the seconds until the next look."""
        now = time.monotonic()
        self.charged += max(cpu - self.seen, 0.0)
        self.seen = cpu
        if now - self.began >= self.period:
            self.began = now
            self.charged = max(self.charged - self.share * self.period, 0.0)
        budget = self.share * self.period - self.charged
        self._signal(signal.SIGSTOP if budget <= 0 else signal.SIGCONT, budget <= 0)
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
