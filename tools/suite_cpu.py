"""Where the test suite's CPU goes: a pytest plugin that records each test's CPU time (its
process's and that of the children it waited for: the compilers and Python processes it
runs), and a report of it per test file.

Beside a CPU hog the suite gets about one of CI's two cores, so its CPU seconds, not its
wall time on a quiet machine, decide how long it takes under load.

    PYTHONPATH=tools SUITE_CPU_DIR=/tmp/cpu .venv/bin/python -m pytest -n 2 -p suite_cpu
    python3 tools/suite_cpu.py /tmp/cpu [--json out.json] [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import sys
import time
from pathlib import Path

_rows: list[tuple[str, float, float, float]] = []


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


try:
    import pytest
except ImportError:  # the report needs no pytest
    pytest = None

if pytest is not None:
    def pytest_sessionstart(session):
        """A new run: the rows of an earlier one in the same directory are not this run's
        (they were added in: a file's tests counted twice). The controller, or a run
        without xdist, clears them; xdist's workers start after it."""
        where = os.environ.get("SUITE_CPU_DIR")
        if where and not os.environ.get("PYTEST_XDIST_WORKER"):
            for old in Path(where).glob("rows-*.json"):
                old.unlink()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        before, start = _cpu(), time.perf_counter()
        yield
        after = _cpu()
        _rows.append((item.nodeid, after[0] - before[0], after[1] - before[1],
                      time.perf_counter() - start))

    def pytest_sessionfinish(session):
        where = os.environ.get("SUITE_CPU_DIR")
        if where and _rows:
            Path(where).mkdir(parents=True, exist_ok=True)
            worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
            (Path(where) / f"rows-{worker}.json").write_text(json.dumps(_rows))


def report(where: Path, top: int) -> dict:
    """Per test file: CPU seconds (own, children), wall seconds, tests; largest CPU first."""
    rows = [r for f in sorted(where.glob("rows-*.json")) for r in json.loads(f.read_text())]
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for nodeid, own, kids, wall in rows:
        f = files[nodeid.split("::", 1)[0]]
        f[0] += own
        f[1] += kids
        f[2] += wall
        f[3] += 1
    order = sorted(files.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))
    total = [sum(v[i] for v in files.values()) for i in range(3)]
    print(f"{'cpu s':>8} {'own':>7} {'wall s':>8} {'tests':>6}  file")
    for name, (own, kids, wall, n) in order[:top]:
        print(f"{own + kids:8.1f} {own:7.1f} {wall:8.1f} {n:6d}  {name}")
    print(f"{total[0] + total[1]:8.1f} {total[0]:7.1f} {total[2]:8.1f} {len(rows):6d}  "
          "(all)")
    return {"files": {k: {"cpu_s": v[0] + v[1], "own_cpu_s": v[0], "wall_s": v[2],
                          "tests": v[3]} for k, v in order},
            "cpu_s": total[0] + total[1], "wall_s": total[2], "tests": len(rows)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="the SUITE_CPU_DIR of a run")
    ap.add_argument("--json", type=Path, help="write the table as JSON here too")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    if not list(args.dir.glob("rows-*.json")):
        print(f"no rows-*.json in {args.dir}: run pytest with -p suite_cpu and "
              "SUITE_CPU_DIR set (PYTHONPATH=tools)", file=sys.stderr)
        return 2
    data = report(args.dir, args.top)
    if args.json:
        args.json.write_text(json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
