"""What the benchmark workloads share: a count of the programs a client asks pyopencl to build,
taken around ``pyopencl.Program.build`` (the build itself, kdb's or pyopencl's, untouched).
Imported after ``kdb.opencl.install()``, so it counts the calls that reach kdb too; and the
one line a workload process ends with (:func:`report`)."""

import json
import sys
import time

import pyopencl as cl

builds = [0]
_build = cl.Program.build


def _counted(self, *args, **kwargs):
    builds[0] += 1
    return _build(self, *args, **kwargs)


cl.Program.build = _counted


def report(seconds: float, t_begin: float) -> None:
    """Print the workload's ``BENCH-JSON:`` line: programs the client built, compiles kdb
    performed (every build without kdb), its seconds, and when it began and ended."""
    lat = sys.modules.get("kdb.bookkeeping")
    print("BENCH-JSON:" + json.dumps({
        "programs": builds[0], "compiles": len(lat.records()) if lat else builds[0],
        "seconds": seconds, "t_begin": t_begin, "t_end": time.perf_counter()}), flush=True)
