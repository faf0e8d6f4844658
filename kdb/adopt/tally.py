"""The per-process reports ``kdb run`` and ``pytest --kdb`` add up.

:class:`kdb.KernelDB` counts hits per tier, misses, compiles and seconds as it counts them for
the user file (:mod:`kdb.bookkeeping`, which keeps this process's totals off the import of a
hit). When ``KDB_RUN_REPORT`` names a directory, a process that counted anything leaves
``<pid>-<ns>.json`` there at exit (one small file, written to a temporary name and
renamed). One file per process is exact under concurrency (MPI ranks, pytest-xdist workers)
with no lock, and independent of when the stores and counters reach the user files: a process
that exits may leave those to the store worker, which writes them after ``kdb run`` has
returned, so a before/after diff of ``kdb stats`` would miss them, and would count every
other process that shares the cache meanwhile.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..bookkeeping import add, process_counts as counts, process_warnings as warnings
from ..bookkeeping import write_run_report as write_report

__all__ = ["COUNTERS", "TIERS", "add", "counts", "warnings", "write_report", "read_reports",
           "summarize", "describe"]

#: The counters a report carries (as :mod:`kdb.db` names them), and the tiers that serve.
COUNTERS = ("hits.memory", "hits.system", "hits.user", "hits.shared", "misses", "compiles",
            "compile_seconds", "saved_seconds")
#: Where a served program came from: this process's memory (built or loaded earlier in the
#: same process), or a tier.
TIERS = ("memory", "system", "user", "shared")
#: What ``saved_seconds`` is: not wall time saved, but an estimate from what was recorded.
SAVED_BASIS = "compile seconds recorded when each served program was first built"


def read_reports(directory: str | os.PathLike[str],
                 skip: frozenset[str] | set[str] = frozenset(),
                 plus: dict[str, float] | None = None,
                 plus_warnings: list[str] = ()) -> dict[str, Any]:
    """The reports in ``directory`` (but the file names in ``skip``) added up, with the
    counts ``plus`` and warnings ``plus_warnings`` (this live process's own, which replace
    any report it left so far): :func:`summarize` of them, ``processes``, the reports read,
    ``pids``, the processes they came from, and ``warnings``: ``[(text, processes)]``."""
    import json

    total: dict[str, float] = dict(plus or {})
    said: dict[str, int] = dict.fromkeys(plus_warnings, 1)
    pids = []
    for path in sorted(Path(directory).glob("*.json")):
        if path.name in skip:
            continue
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
            data = report["counts"]
            pid = report.get("pid")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # a report cut short by a killed process: its counts are lost, not ours
        if plus is not None and pid == os.getpid():
            continue
        pids.append(pid)
        for k, v in data.items():
            if isinstance(v, (int, float)):
                total[k] = total.get(k, 0) + v
        for text in report.get("warnings") or ():
            if isinstance(text, str):
                said[text] = said.get(text, 0) + 1
    return {**summarize(total), "processes": len(pids), "pids": pids,
            "warnings": sorted(said.items(), key=lambda w: -w[1])}


def pending_stores(user_dir: Path, pids, since: float) -> int:
    """How many compiles of the processes ``pids`` since ``since`` (epoch seconds) are still
    queued for the store worker in ``user_dir``'s spools: counted (a compile counts when it
    happens, :mod:`kdb.bookkeeping`) but not stored yet. Read from the jobs' latency rows,
    one per compiled entry, which name the process that compiled."""
    from ..storing import spool

    wanted = set(pids)
    return sum(1 for rec in spool.pending_log_rows(user_dir)
               if rec.pid in wanted and isinstance(rec.at, (int, float)) and rec.at >= since)


def summarize(c: dict[str, float]) -> dict[str, Any]:
    """Programs requested, compiled and served (per tier and from memory), and seconds,
    from raw counters.

    A request is one build call that reached kdb: it is served (from memory or a tier) or
    compiled; a miss that waited for another process's compile and was then served counts
    once, as served. ``saved_seconds`` is an estimate (:data:`SAVED_BASIS`), never wall time.

    >>> s = summarize({"hits.user": 3, "hits.memory": 2, "compiles": 1,
    ...                "compile_seconds": 0.5, "misses": 1})
    >>> s["requested"], s["served"], s["compiled"], s["hits"]["user"], s["hits"]["memory"]
    (6, 5, 1, 3, 2)
    """
    hits = {t: int(c.get(f"hits.{t}", 0)) for t in TIERS}
    served = sum(hits.values())
    compiled = int(c.get("compiles", 0))
    return {"requested": served + compiled, "served": served, "compiled": compiled,
            "hits": hits, "misses": int(c.get("misses", 0)),
            "compile_seconds": round(float(c.get("compile_seconds", 0.0)), 3),
            "saved_seconds": round(float(c.get("saved_seconds", 0.0)), 3),
            "saved_basis": SAVED_BASIS}


def describe(s: dict[str, Any]) -> str:
    """One line for people: what :func:`summarize` (or :func:`read_reports`) returned.

    >>> describe(summarize({"hits.user": 3, "hits.memory": 1, "compiles": 1,
    ...                     "compile_seconds": 0.5, "saved_seconds": 1.25}))
    '5 programs requested: 1 compiled (0.50 s compiling), 4 served (memory 1, user 3); the served programs took 1.25 s to compile when first built'
    """
    tiers = ", ".join(f"{t} {n}" for t, n in s["hits"].items() if n)
    n = s["requested"]
    pending = s.get("pending_stores")  # kdb run's: its compiles still queued to store
    line = (f"{n} program{'' if n == 1 else 's'} requested: {s['compiled']} compiled "
            f"({s['compile_seconds']:.2f} s compiling"
            + (f", {pending} of them pending store" if pending is not None and s["compiled"]
               else "")
            + f"), {s['served']} served" + (f" ({tiers})" if tiers else ""))
    if s["saved_seconds"]:
        line += (f"; the served programs took {s['saved_seconds']:.2f} s to compile when "
                 "first built")
    return line
