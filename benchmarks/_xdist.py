"""The ``xdist`` scenario (issue 35): a client's test suite under ``pytest -n 2``, run twice.

A small pytest file of pyopencl programs (``xdist_suite/test_client.py``: elementwise
arithmetic and math through ``pyopencl.array``, ``ElementwiseKernel``, reductions, scans)
runs with pytest-xdist's 2 workers, adopted with ``pytest --kdb`` (the kdb pytest plugin:
the workers inherit ``KDB_AUTO=1``), against the same command without ``--kdb``. Run twice
back to back, as a developer reruns a suite: run 2 should compile nothing. The suite's
conftest counts each process's builds and kdb's compiles; kdb's own summary line is kept
beside them. After an arm, its store worker is killed (found by the arm's environment
marker), so that nothing of it runs beside the next arm.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

from _harness import PYTHON, BenchError, Metric, Outcome, Table, Workspace, at_most
from _load import JOB_MARKER, kill_job, new_token, worker_state

SUITE = Path(__file__).resolve().parent / "xdist_suite"
WORKERS = 2
_KDB_LINE = re.compile(r"^kdb: (\d+) programs? requested: (\d+) compiled", re.M)


def _metrics() -> list[Metric]:
    return [Metric("run1", "run 1", unit="s"), Metric("run2", "run 2", unit="s"),
            Metric("c1", "compiles run 1", unit="n", ratio=False),
            Metric("c2", "compiles run 2", unit="n", ratio=False),
            Metric("programs", "programs a run", unit="n", ratio=False),
            Metric("kdb2", "run 2 compiled, kdb's summary", unit="n", ratio=False),
            Metric("q2", "queued at run 2", unit="n", ratio=False),
            Metric("e2", "entries at run 2", unit="n", ratio=False)]


def xdist_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("xdist") is not None


def _pytest(ws: Workspace, env: dict[str, str], cache: Path | None) -> dict:
    """One ``pytest -n 2`` over the client suite (with ``--kdb`` where ``cache`` is given):
    wall time (spawn to exit), the counts its processes wrote, kdb's summary line."""
    suite = ws.memo("xdist_suite", lambda: Path(shutil.copytree(SUITE, ws.path / "xdist-suite",
                                                                ignore=_no_pycache)))
    counts = ws.fresh("xdist-counts")
    argv = [PYTHON, "-m", "pytest", "-n", str(WORKERS), "-q", "-p", "no:cacheprovider", "."]
    if cache is not None:
        argv += ["--kdb", "--kdb-cache-dir", str(cache)]
    t0 = time.perf_counter()
    p = subprocess.run(argv, env={**env, "BENCH_COUNTS": str(counts)}, cwd=suite,
                       capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise BenchError(f"pytest -n {WORKERS} failed (exit {p.returncode}):\n"
                         + "\n".join((p.stdout + p.stderr).strip().splitlines()[-30:]))
    got = [json.loads(f.read_text(encoding="utf-8")) for f in counts.glob("*.json")]
    line = _KDB_LINE.search(p.stdout)
    return {"wall": wall, "programs": sum(c["programs"] for c in got),
            "compiles": sum(c["compiles"] for c in got),
            "kdb_compiled": int(line.group(2)) if line else None}


def _no_pycache(_: str, names: list[str]) -> list[str]:
    return [n for n in names if n == "__pycache__"]


def _arm(ws: Workspace, t: Table, arm: str, policy: str) -> None:
    """Run 1 and run 2 of one arm, back to back; then its store worker killed."""
    cache, token = ws.fresh("kdb-xdist"), new_token()
    env = ws.env(KDB_CACHE_DIR=cache, KDB_STORE_AT_EXIT=None, POCL_CACHE_DIR=ws.fresh("pocl-x"),
                 XDG_CACHE_HOME=ws.fresh("xdg-xdist"), **{JOB_MARKER: token},
                 XDIST_SCALE="0" if ws.opts.quick else "1")
    kdb = cache if arm == "kdb" else None
    try:
        ws.log(f"xdist: PoCL cache {policy}, {arm}, run 1")
        one = _pytest(ws, env, kdb)
        state = worker_state(cache)
        if policy == "fresh":
            env["POCL_CACHE_DIR"] = str(ws.fresh("pocl-x"))
        ws.log(f"xdist: PoCL cache {policy}, {arm}, run 2 (queued {state['queued']})")
        two = _pytest(ws, env, kdb)
    finally:
        kill_job(JOB_MARKER, token)
    for key, value in (("run1", one["wall"]), ("run2", two["wall"]), ("c1", one["compiles"]),
                       ("c2", two["compiles"]), ("programs", one["programs"])):
        t.add(arm, key, value)
    if arm == "kdb":
        t.add(arm, "kdb2", two["kdb_compiled"])
        t.add(arm, "q2", state["queued"])
        t.add(arm, "e2", state["entries"])


def xdist(ws: Workspace, o: Outcome) -> None:
    runs = ws.opts.n(1)
    o.title = (f"pytest -n {WORKERS} (pytest-xdist) over a client's test file of pyopencl "
               "programs (elementwise, ElementwiseKernel, reductions, scans), adopted with "
               "`pytest --kdb`, run twice back to back")
    if not xdist_available():
        o.status, o.reason = "skipped", "pytest-xdist is not installed (pip install pytest-xdist)"
        return
    for policy in ("kept",) if ws.opts.quick else ("kept", "fresh"):
        t = o.table(f"PoCL's cache {policy} between run 1 and run 2"
                    + (" (only kdb's cache survives)" if policy == "fresh" else "")
                    + f"; median of {runs}; wall: pytest's spawn to exit", "nokdb", _metrics())
        t.arm("nokdb", f"pytest -n {WORKERS}, no kdb")
        t.arm("kdb", f"pytest -n {WORKERS} --kdb")
        for _ in range(runs):
            for arm in ("nokdb", "kdb"):
                _arm(ws, t, arm, policy)
        o.checks.append(at_most(f"xdist, PoCL cache {policy}: run 2 compiles, pytest -n "
                                f"{WORKERS} --kdb", t.median("kdb", "c2"), 0, unit=" compiles"))
    o.notes.append("compiles: kdb's compiles in each pytest process (every build without kdb), "
                   "counted by the suite's conftest; 'kdb's summary' is the count on pytest "
                   "--kdb's own summary line. 'programs a run' is run 1's: how xdist shares the "
                   "tests between its workers changes what each builds.")
    if ws.opts.quick:
        o.notes.append("--quick: XDIST_SCALE=0, a few tests of each kind, PoCL's cache kept "
                       "only; the full run adds a fresh PoCL cache for run 2.")
