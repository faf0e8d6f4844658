"""The client suite's conftest (``xdist`` scenario): counts the programs each pytest process
asks pyopencl to build, and the compiles kdb performed in it, and writes them to
``$BENCH_COUNTS/<pid>.json`` at the session's end; the harness adds the workers' files up.

The count wraps ``pyopencl.Program.build`` when the session starts, after ``pytest --kdb``
switched kdb on (an xdist worker starts with ``KDB_AUTO=1``: kdb is in place as soon as
pyopencl is imported), so it counts the builds that reach kdb as well as those that do not.
"""

import json
import os
import sys

_builds = [0]


def pytest_sessionstart(session):
    import pyopencl as cl

    build = cl.Program.build

    def counted(self, *args, **kwargs):
        _builds[0] += 1
        return build(self, *args, **kwargs)

    cl.Program.build = counted


def pytest_sessionfinish(session):
    where = os.environ.get("BENCH_COUNTS")
    if not where:
        return
    lat = sys.modules.get("kdb.bookkeeping")  # loaded only where kdb served the builds
    counts = {"programs": _builds[0],
              "compiles": len(lat.records()) if lat else _builds[0],
              "worker": os.environ.get("PYTEST_XDIST_WORKER", "controller")}
    with open(os.path.join(where, f"{os.getpid()}.json"), "w", encoding="utf-8") as f:
        json.dump(counts, f)
