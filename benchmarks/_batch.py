"""The ``batch`` scenario (issue 35): a batch job that kills what it leaves behind.

A job of 4 processes (``_rank_workload.py``: a part of the suite each, then computing and
spinning at a barrier as MPI ranks do) keeps both cores busy until its last rank exits.
2 s later the harness does what a batch system does at a job's end: SIGKILL to every
process of the job. kdb's store worker ``setsid``s out of the job's session, so the job's
processes are found as SLURM's cgroup would hold them: by an environment variable set for
the job (``_load.JOB_MARKER``), which the worker and its lanes inherit, read from
``/proc/*/environ``. Then the same job again, with the same kdb cache: the second job
should compile none of what the first compiled (every job builds the same programs, so any
compile of job 2 is one). With kdb and without it; compiles and wall time per job (the
first rank's spawn to the last rank's exit), and what was killed.
"""

from __future__ import annotations

import time
from pathlib import Path

from _harness import PYTHON, Metric, Outcome, Running, Table, Workspace, at_most
from _load import JOB_MARKER, kill_job, new_token, worker_kind, worker_state

RANK = Path(__file__).resolve().parent / "_rank_workload.py"
PARTS = ("array", "kernels", "array", "kernels")  # one a rank
GRACE_S = 2.0  # from the job's last process's exit to the kill


def _metrics() -> list[Metric]:
    return [Metric("wall1", "job 1", unit="s"), Metric("wall2", "job 2", unit="s"),
            Metric("c1", "compiles job 1", unit="n", ratio=False),
            Metric("c2", "compiles job 2", unit="n", ratio=False),
            Metric("work1", "slowest rank's part, job 1", unit="s"),
            Metric("work2", "slowest rank's part, job 2", unit="s"),
            Metric("programs", "programs a job", unit="n", ratio=False),
            Metric("q2", "queued at job 2", unit="n", ratio=False),
            Metric("e2", "entries at job 2", unit="n", ratio=False),
            Metric("killed1", "kdb processes killed after job 1", unit="n", ratio=False)]


def _job(ws: Workspace, env: dict[str, str], scale: int) -> dict:
    """One job: its ranks started together, waited for, then (after the grace) everything
    that carries the job's marker killed; whatever happens, the kill is done."""
    token, barrier = new_token(), ws.fresh("batch-barrier")
    env = {**env, JOB_MARKER: token}
    spin = 0.5 if ws.opts.quick else 5.0
    t0, ranks = time.perf_counter(), []
    try:
        for i, part in enumerate(PARTS):
            ranks.append(Running([PYTHON, str(RANK), part, str(scale), str(barrier), str(i),
                                  str(len(PARTS)), str(spin)], env, None))
        procs = [r.wait(timeout=1800) for r in ranks]
        last = max(p.t_exit for p in procs)
        time.sleep(max(0.0, last + GRACE_S - time.perf_counter()))
    finally:
        killed = kill_job(JOB_MARKER, token)
    kinds = [worker_kind(c) for c in killed.values()]
    return {"wall": last - t0, "compiles": sum(p.data.get("compiles", 0) for p in procs),
            "programs": sum(p.data.get("programs", 0) for p in procs),
            "work": max(p.data.get("seconds", 0.0) for p in procs),
            "killed": sum(k != "job" for k in kinds), "kinds": kinds}


def _arm(ws: Workspace, t: Table, arm: str, policy: str) -> dict:
    """Job 1 and job 2 of one arm, the same kdb cache; PoCL's cache as ``policy`` says."""
    scale = 0 if ws.opts.quick else 1
    cache, pocl = ws.fresh("kdb-batch"), ws.fresh("pocl-batch")
    env = ws.env(KDB_CACHE_DIR=cache, KDB_STORE_AT_EXIT=None,
                 XDG_CACHE_HOME=ws.fresh("xdg-batch"), KDB_SUITE="1" if arm == "kdb" else None)
    ws.log(f"batch: PoCL cache {policy}, {arm}, job 1")
    one = _job(ws, {**env, "POCL_CACHE_DIR": str(pocl)}, scale)
    state = worker_state(cache)
    if policy == "fresh":
        pocl = ws.fresh("pocl-batch")
    ws.log(f"batch: PoCL cache {policy}, {arm}, job 2 (queued {state['queued']}, entries "
           f"{state['entries']})")
    two = _job(ws, {**env, "POCL_CACHE_DIR": str(pocl)}, scale)
    for key, value in (("wall1", one["wall"]), ("wall2", two["wall"]), ("c1", one["compiles"]),
                       ("c2", two["compiles"]), ("programs", one["programs"]),
                       ("work1", one["work"]), ("work2", two["work"])):
        t.add(arm, key, value)
    if arm == "kdb":
        t.add(arm, "q2", state["queued"])
        t.add(arm, "e2", state["entries"])
        t.add(arm, "killed1", one["killed"])
    return {"job1_killed": one["kinds"], "job2_killed": two["kinds"]}


def batch(ws: Workspace, o: Outcome) -> None:
    runs = ws.opts.n(1)
    policies = ("kept",) if ws.opts.quick else ("kept", "fresh")
    o.title = (f"Batch jobs: a job of {len(PARTS)} processes (a part of the suite each, then "
               "computing and spinning at a barrier like MPI ranks) keeps both cores busy; "
               f"{GRACE_S:g} s after its last process exits, every process of the job is "
               "SIGKILLed (the store worker and its lanes included); then the same job again")
    for policy in policies:
        t = o.table(f"PoCL's cache {policy} between jobs"
                    + (" (a node-local cache: only kdb's survives)" if policy == "fresh" else "")
                    + f"; median of {runs}; job wall: first rank's spawn to last rank's exit",
                    "nokdb", _metrics())
        t.arm("nokdb", "no kdb (plain pyopencl)")
        t.arm("kdb", "kdb through kdb.opencl.install(), defaults")
        for _ in range(runs):
            for arm in ("nokdb", "kdb"):
                o.info.setdefault(f"killed_{policy}_{arm}", []).append(_arm(ws, t, arm, policy))
        o.checks.append(at_most(f"batch, PoCL cache {policy}: job 2 compiles, kdb (of what job 1 "
                                "compiled)", t.median("kdb", "c2"), 0, unit=" compiles"))
    if ws.opts.quick:
        o.notes.append("--quick: the suite's smallest scale (scale 0), PoCL's cache kept only; "
                       "the full run (scale 1) adds a fresh PoCL cache for job 2.")
    o.notes.append("'slowest rank's part': the longest of the ranks' own builds and launches "
                   "(before computing and the barrier); ranks 0 and 2 build the same programs, "
                   "as do 1 and 3, as MPI ranks do.")
    o.notes.append("'kdb processes killed': the store worker, its lanes and any process "
                   "storing ahead, found by the job's environment variable after the job's "
                   "ranks were gone; what each was is in the JSON (info).")
