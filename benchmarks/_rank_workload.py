"""One rank of the ``batch`` scenario's job, like an MPI rank of a framework's application:
``python _rank_workload.py PART SCALE BARRIER RANK NRANKS SPIN_S``.

It runs part ``PART`` of the suite (``_suite_workload.py``: unmodified pyopencl code, through
``kdb.opencl.install()`` with ``KDB_SUITE=1``), computes for ``SPIN_S`` seconds (a busy
loop), then waits at a barrier for the other ranks the way MPI ranks do, spinning: so the
job keeps every core busy until its last rank is done, and kdb's store worker (which only
gets CPU time nobody else wants) gets none while the job runs. It prints the suite's one
``BENCH-JSON:`` line (programs built, compiles kdb performed, and the seconds of its part:
its builds and launches, without the spinning).
"""

import time

T_BEGIN = time.perf_counter()

import os  # noqa: E402
import sys  # noqa: E402

import _suite_workload as suite  # noqa: E402 - pyopencl, kdb under KDB_SUITE=1, the counter
from _counting import report  # noqa: E402

BARRIER_TIMEOUT_S = 900


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10000):
            pass


def _barrier(where: str, rank: int, nranks: int) -> None:
    """Arrive (a file of this rank's), then spin until every rank has arrived: a rank that
    waits in MPI polls its network, it does not sleep."""
    open(os.path.join(where, f"rank-{rank}"), "w").close()
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    while len(os.listdir(where)) < nranks and time.monotonic() < deadline:
        _spin(0.01)


def main() -> None:
    part, scale, where = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rank, nranks, spin = int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
    q = suite._queue()
    start = time.perf_counter()
    {"array": suite.part_array, "kernels": suite.part_kernels}[part](q, scale)
    q.finish()
    work = time.perf_counter() - start
    _spin(spin)
    _barrier(where, rank, nranks)
    report(work, T_BEGIN)


if __name__ == "__main__":
    main()
