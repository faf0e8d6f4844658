"""The ``busy`` scenario (issue 35): the ``suite`` scenario on a machine that is never idle.

kdb's promise is that a second start compiles nothing. Its store worker only gets CPU time
that no other process wants, so on a machine kept busy by other work its stores may not
land before the next run. Here one CPU-bound process per core, at normal priority and in a
session of its own (other users' work), is started before run 1 and stopped after run 3;
the suite (``_suite_workload.py``: 2 processes back to back, unmodified pyopencl code
through ``kdb.opencl.install()``) runs three times back to back, with kdb and without it on
the same busy machine. Before each run the harness reads the store worker's backlog: jobs
still queued, entries in the user file. Every run builds the same programs, so any compile
in run 2 or run 3 is of a program run 1 compiled; the goal is none. After run 3 the
store worker's backlog is read once more and its processes (found by an environment
variable every process of the arm carries) are killed, so that nothing of one arm runs
beside the next. The CPU time of each run's processes is counted as they exit, and the
store worker's over the three runs as it is reaped: the benchmark makes itself the
subreaper of what its children leave behind, so the worker's CPU, lanes included, lands
here instead of with init.
"""

from __future__ import annotations

import os

from _harness import Metric, Outcome, Table, Workspace, at_most
from _load import (JOB_MARKER, adopt_orphans, children_cpu, hogs, kill_job, new_token,
                   reap_orphans, worker_state)
from _script import autogroup

RUNS = (1, 2, 3)
#: The policy that runs the suite on Intel's CPU runtime (where installed), PoCL's cache
#: not in play: there pyopencl keeps its own binary cache, which the no-kdb arm keeps
#: between runs (``XDG_CACHE_HOME``), so the reference is pyopencl's cache, not no cache.
INTEL = "intel"
#: The hogs' own time limit: longer than three runs of the suite on a busy machine.
HOG_LIMIT_S = {True: 600, False: 3600}


def _metrics() -> list[Metric]:
    out = [Metric(f"run{n}", f"run {n}", unit="s") for n in RUNS]
    out += [Metric(f"cpu{n}", f"CPU, run {n}'s processes", unit="s") for n in RUNS]
    out.append(Metric("worker_cpu", "CPU, store worker (runs 1-3)", unit="s", ratio=False))
    out += [Metric(f"c{n}", f"compiles run {n}", unit="n", ratio=False) for n in RUNS]
    out.append(Metric("programs", "programs a run", unit="n", ratio=False))
    for n in RUNS[1:]:
        out += [Metric(f"q{n}", f"queued at run {n}", unit="n", ratio=False),
                Metric(f"e{n}", f"entries at run {n}", unit="n", ratio=False)]
    out += [Metric("q_end", "queued after run 3", unit="n", ratio=False),
            Metric("killed", "worker processes killed", unit="n", ratio=False)]
    return out


def _three_runs(ws: Workspace, t: Table, arm: str, policy: str, reaper: bool) -> None:
    """Runs 1 to 3 of one arm, back to back, the hogs running from before run 1 to after
    run 3; then the store worker's backlog, and its processes killed (waiting for it on a
    shared machine took minutes: a --quick run could not afford it). ``reaper``: this
    process is the subreaper of the arm's store workers (:func:`_load.adopt_orphans`), so
    their CPU time can be counted."""
    from _scenarios import _intel_env  # the suite scenario's (imported late: no cycle)

    cache, pocl = ws.fresh("kdb-busy"), ws.fresh("pocl-busy")
    token = new_token()
    runtime = _intel_env(ws) if policy == INTEL else {}
    env = ws.env(KDB_CACHE_DIR=cache, KDB_STORE_AT_EXIT=None, XDG_CACHE_HOME=ws.fresh("xdg-busy"),
                 KDB_SUITE="1" if arm == "kdb" else None, **{JOB_MARKER: token}, **runtime)
    try:
        with hogs(os.cpu_count() or 1, HOG_LIMIT_S[ws.opts.quick]):
            _runs(ws, t, arm, policy, {"env": env, "cache": cache, "pocl": pocl})
            state = worker_state(cache)
    finally:
        killed = kill_job(JOB_MARKER, token)
        # The hogs are reaped: what is left are the arm's store workers and lanes, ours
        # since busy() made this process their subreaper.
        worker_cpu = reap_orphans()
    t.add(arm, "worker_cpu", worker_cpu if reaper else None)
    if arm == "kdb":
        t.add(arm, "q_end", state["queued"])
        t.add(arm, "killed", len(killed))


def _runs(ws: Workspace, t: Table, arm: str, policy: str, where: dict) -> None:
    """Runs 1 to 3, back to back, each preceded by a look at the store worker's backlog."""
    from _scenarios import _suite_run  # the suite scenario's runner (imported late: no cycle)

    scale = 0 if ws.opts.quick else 2  # the suite scenario's full scale
    cache, pocl = where["cache"], where["pocl"]
    for n in RUNS:
        if policy == "fresh" and n > 1:
            pocl = ws.fresh("pocl-busy")
        state = worker_state(cache)
        what = "Intel's runtime" if policy == INTEL else f"PoCL cache {policy}"
        ws.log(f"busy: {what}, {arm}, run {n} (queued {state['queued']}, "
               f"entries {state['entries']})")
        cpu = children_cpu()
        got = _suite_run({**where["env"], "POCL_CACHE_DIR": str(pocl)}, scale)
        t.add(arm, f"run{n}", got["wall"])
        t.add(arm, f"cpu{n}", children_cpu() - cpu)  # its processes', not the worker's
        t.add(arm, f"c{n}", got["compiles"])
        if n > 1 and arm == "kdb":
            t.add(arm, f"q{n}", state["queued"])
            t.add(arm, f"e{n}", state["entries"])
        t.add(arm, "programs", got["programs"] if n == 1 else None)


def _checks(o: Outcome, t: Table, policy: str) -> None:
    what = "Intel's CPU runtime" if policy == INTEL else f"PoCL cache {policy}"
    for n in RUNS[1:]:
        o.checks.append(at_most(f"busy, {what}: run {n} compiles, kdb (of what "
                                "run 1 compiled)", t.median("kdb", f"c{n}"), 0,
                                unit=" compiles"))
    o.checks.append(at_most(f"busy, {what}: run 1, kdb vs no kdb",
                            t.ratio("kdb", "run1"), 1.10))
    # Against pyopencl's own cache run 2 is a warm start either way: kdb must not be slower.
    o.checks.append(at_most(f"busy, {what}: run 2, kdb vs no kdb",
                            t.ratio("kdb", "run2"), 1.0 if policy == INTEL else 0.6))


def busy(ws: Workspace, o: Outcome) -> None:
    from _scenarios import _intel_env  # the suite scenario's (imported late: no cycle)

    runs, cores = ws.opts.n(1), os.cpu_count() or 1
    reaper = adopt_orphans()
    ag = autogroup()
    shown = "absent" if ag is None else str(ag)
    # --quick: the suite's smallest scale and PoCL's cache kept only (about a minute),
    # then Intel's runtime where installed.
    policies = ("kept",) if ws.opts.quick else ("kept", "fresh")
    if _intel_env(ws) is not None:
        policies += (INTEL,)
    else:
        o.notes.append("Intel's CPU runtime is not installed (tools/ensure_opencl.sh): no "
                       "Intel arms.")
    o.title = (f"Busy machine: the suite (2 processes back to back) run 3 times in a row while "
               f"{cores} CPU-bound process(es) at normal priority keep every core busy, kdb "
               f"against no kdb on the same busy machine; sched_autogroup_enabled = {shown}")
    o.info.update(sched_autogroup_enabled=ag, hogs=cores, policies=list(policies),
                  subreaper=reaper)
    for policy in policies:
        t = o.table((f"Intel's CPU runtime, pyopencl's own cache kept between runs (the "
                     "no-kdb arm is pyopencl's cache)" if policy == INTEL else
                     f"PoCL's cache {policy} between runs")
                    + (" (only kdb's cache survives)" if policy == "fresh" else "")
                    + f"; median of {runs}; {cores} hog(s) from before run 1 to after run 3; "
                    "queued/entries: the store worker's backlog as the run starts",
                    "nokdb", _metrics())
        t.arm("nokdb", "no kdb (pyopencl's own binary cache)" if policy == INTEL
              else "no kdb (plain pyopencl)")
        t.arm("kdb", "kdb through kdb.opencl.install(), defaults")
        for _ in range(runs):
            for arm in ("nokdb", "kdb"):
                _three_runs(ws, t, arm, policy, reaper)
        _checks(o, t, policy)
    if ws.opts.quick:
        o.notes.append("--quick: the suite's smallest scale (scale 0) and, on PoCL, its cache "
                       "kept only; the full run adds PoCL's cache fresh for each run.")
    o.notes.append("Runs follow each other at once, each process started when the one before "
                   "exited: the store worker gets what CPU the hogs and the suite leave it. "
                   "'queued after run 3': the jobs the store worker had not stored when run 3 ended; "
                   "its processes are then killed ('worker processes killed').")
