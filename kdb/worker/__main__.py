"""``python -m kdb.worker``: the store worker's processes, by their arguments.

    python -m kdb.worker DIR              # the supervisor for one spool directory
    python -m kdb.worker --child          # a lane: stores the jobs named on stdin (--slow-child)
    python -m kdb.worker --floor-child    # the lane its supervisor paces at normal priority
    python -m kdb.worker --hurry DIR      # store every job of DIR now (kdb pack waits)
    python -m kdb.worker --urgent-child   # a lane of a process that waits for its jobs
    python -m kdb.worker --ahead DIR NS   # store DIR's jobs older than NS, for a process

Each process imports only its own part: a lane never loads the supervisor, nor it a back end.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# A lane loads binaries through pyopencl, which imports numpy: OpenBLAS then starts a thread a
# core that spins a while for work it never gets (0.1 CPU-s of a lane's start on 2 cores, the
# floor lane's whole budget for a second; more threads on a bigger node). No store does
# linear algebra; a value the user set is kept.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def main(argv: list[str]) -> int:
    auto_hook = sys.modules.get("_kdb_auto")  # KDB_AUTO=1 inherited: never adopt in here
    if auto_hook is not None:
        auto_hook.disable()
    if argv in (["--child"], ["--slow-child"], ["--urgent-child"], ["--floor-child"]):
        from .lane import serve

        return serve(slow=argv[0] == "--slow-child", urgent=argv[0] == "--urgent-child",
                     floor=argv[0] == "--floor-child")
    if argv[:1] == ["--ahead"] and len(argv) == 3:
        from .ahead import run

        return run(Path(argv[1]), int(argv[2]))
    from . import supervisor

    if argv[:1] == ["--hurry"] and len(argv) == 2:
        return supervisor.hurry(Path(argv[1]))
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    return supervisor.supervise(Path(argv[0]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
