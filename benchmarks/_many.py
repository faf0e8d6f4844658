"""The ``many`` scenario: N processes start together on a cold cache and want the same kernels.

MPI ranks of one job do this. Arms, each run in turn (median of the runs):

- **one process**, kdb on an empty cache: what one rank's cold start costs alone (the
  reference);
- **8 processes, no kdb** (plain pyopencl): every process compiles every kernel;
- **8 and 32 processes, kdb**, one empty ``KDB_CACHE_DIR``: each kernel should be compiled once;
- **4 simulated nodes x 8 ranks, kdb with the shared tier**: each node its own empty
  ``KDB_CACHE_DIR``, one empty PostgreSQL database (the test suite's throw-away server;
  skipped without PostgreSQL's binaries, ``tools/ensure_postgres.sh``).

Every process has its own fresh ``POCL_CACHE_DIR`` and stores through the store worker
(``KDB_STORE_AT_EXIT=detach``, the default). Per arm: compiles (kdb's bookkeeping summed over
the processes; 20 is the goal), the slowest rank's start-up (spawn to exit) and its kernel phase
(build + first launches, from its own clock) against the one process's, and right after the
run, before the store worker has finished, how long ``kdb log`` and ``kdb pack --from-db``
take. All the processes share this machine's CPUs: with 32 of them on a few cores the start-up
ratios measure the machine as much as kdb, the compile counts do not.
"""

from __future__ import annotations

import threading

from _harness import (
    PYTHON,
    Check,
    Metric,
    Outcome,
    Proc,
    Workspace,
    at_most,
    command,
    count_rows,
    kdb_files,
    spawn,
    wait_for_worker,
)

#: The kernel phase of a rank's start-up: its builds and its first launches.
PHASES = ("build", "launch")


def _server(ws: Workspace):
    from _trust import _server as trust_server

    return trust_server(ws)


def _arms(ws: Workspace) -> list[tuple[str, str, int, int, str]]:
    """``(arm, label, processes, nodes, mode)``."""
    few = ws.opts.quick
    n8, n32, per_node = (2, 4, 2) if few else (8, 32, 8)
    return [
        ("single", "1 process, kdb, empty cache", 1, 1, "kdb"),
        ("nocache", f"{n8} processes, no kdb (plain pyopencl)", n8, 1, "pyopencl"),
        ("kdb8", f"{n8} processes, kdb, one empty cache", n8, 1, "kdb"),
        ("kdb32", f"{n32} processes, kdb, one empty cache", n32, 1, "kdb"),
        ("shared", f"4 nodes x {per_node} ranks, kdb + shared tier, empty caches",
         4 * per_node, 4, "kdb"),
    ]


def _start_all(ws: Workspace, n: int, nodes: int, mode: str, url: str | None):
    """Spawn ``n`` processes over ``nodes`` cache directories; returns them and the caches."""
    caches = [ws.fresh("kdb-many") for _ in range(nodes)]
    running = []
    for i in range(n):
        env = ws.env(KDB_CACHE_DIR=caches[i % nodes], POCL_CACHE_DIR=ws.fresh("pocl-many"),
                     KDB_STORE_AT_EXIT="detach", KDB_SHARED_URL=url)
        running.append(spawn("opencl", {"mode": mode, "workload": "kernels",
                                        "kernels": ws.opts.kernels}, env))
    return running, caches


def _wait_all(running) -> list[Proc]:
    """Each process's exit as it happens (waited for in threads: one slow to exit does not
    delay another's time)."""
    procs: list = [None] * len(running)

    def wait(i: int) -> None:
        procs[i] = running[i].wait(900, check=False)

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(len(running))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return procs


def _kernel_phase(p: Proc) -> float | None:
    got = [p.phase(ph) for ph in PHASES]
    return None if None in got else sum(got)


def _right_after(ws: Workspace, cache, url: str | None) -> tuple[float, float]:
    """Seconds ``kdb log`` and ``kdb pack --from-db`` take on ``cache`` right after a run."""
    env = ws.env(KDB_CACHE_DIR=cache, KDB_SHARED_URL=url)
    log = command([PYTHON, "-m", "kdb.cli", "log"], env, timeout=900)
    pack = command([PYTHON, "-m", "kdb.cli", "pack", "--arch", "native", "--from-db",
                    "--out", str(ws.fresh("many-pack"))], env, timeout=900)
    return log.wall, pack.wall


def _one_run(ws: Workspace, t, arm: str, n: int, nodes: int, mode: str, url: str | None,
             errors: list[str]) -> None:
    running, caches = _start_all(ws, n, nodes, mode, url)
    t0 = min(r.t_spawn for r in running)
    procs = _wait_all(running)
    ok = [p for p in procs if p.rc == 0]
    t.add(arm, "wall", max(p.t_exit for p in procs) - t0)
    errors += [f"{arm}: exit {p.rc}: {p.stderr.strip().splitlines()[-1:]}"
               for p in procs if p.rc != 0]
    t.add(arm, "failed", len(procs) - len(ok))
    per_node = [[p for i, p in enumerate(procs) if i % nodes == nd and p.rc == 0]
                for nd in range(nodes)]
    t.add(arm, "rank", max((max(p.wall for p in ps) for ps in per_node if ps), default=None))
    phases = [_kernel_phase(p) for ps in per_node for p in ps]
    t.add(arm, "kernels", max((x for x in phases if x is not None), default=None))
    if mode == "pyopencl":
        t.add(arm, "compiles", ws.opts.kernels * len(ok))
        return
    t.add(arm, "compiles", sum(p.data.get("compiles") or 0 for p in ok))
    if arm != "single":
        log_s, pack_s = _right_after(ws, caches[0], url)
        t.add(arm, "log", log_s)
        t.add(arm, "pack", pack_s)
    for cache in caches:
        wait_for_worker(cache)  # the last stores run after the processes exited
    t.add(arm, "stored", sum(count_rows(f, "kernels") for c in caches for f in kdb_files(c)))


def many(ws: Workspace, o: Outcome) -> None:
    n_k = ws.opts.kernels
    runs = ws.opts.n(2)
    o.title = (f"Many processes start together on a cold cache, the same {n_k} kernels each "
               f"(median of {runs} runs)")
    metrics = [Metric("compiles", "compiles", unit="n", ratio=False),
               Metric("rank", "slowest rank, spawn to exit"),
               Metric("kernels", "slowest rank, build+launch"),
               Metric("wall", "all done"),
               Metric("log", "kdb log after", unit="s", ratio=False),
               Metric("pack", "kdb pack --from-db after", unit="s", ratio=False),
               Metric("stored", "stored", unit="n", ratio=False),
               Metric("failed", "failed", unit="n", ratio=False)]
    t = o.table("each process its own fresh POCL_CACHE_DIR; the shared arm's nodes each "
                "their own KDB_CACHE_DIR", "single", metrics,
                note="compiles: kdb's bookkeeping summed over the processes; slowest rank: "
                     "of every node; 'after': run on the first node's cache as the last "
                     "process exits, the store worker still working")
    arms = _arms(ws)
    server, why = _server(ws)
    if server is None:
        arms = [a for a in arms if a[0] != "shared"]
        o.notes.append(f"the shared-tier arm is skipped: {why}")
    for arm, label, *_ in arms:
        t.arm(arm, label)
    errors: list[str] = []
    try:
        for r in range(runs):
            for arm, _, n, nodes, mode in arms:
                ws.log(f"many: {arm}, run {r + 1}/{runs}")
                url = None
                if arm == "shared":
                    server.sql(f'CREATE DATABASE "many_{r}"')
                    url = server.url(f"many_{r}")
                _one_run(ws, t, arm, n, nodes, mode, url, errors)
    finally:
        if server is not None:
            server.close()
    o.notes += errors
    o.checks += _checks(t, arms, n_k)


def _checks(t, arms, n_k: int) -> list[Check]:
    out = []
    for arm, label, n, nodes, mode in arms:
        if mode != "kdb" or arm == "single":
            continue
        builds = t.median(arm, "compiles")
        out.append(Check(f"many processes: compiles, {label}", f"== {n_k}", builds,
                         None if builds is None else builds == n_k))
        out.append(at_most(f"many processes: slowest rank's build+launch vs one process's, "
                           f"{label}", t.ratio(arm, "kernels"), 1.2))
        out.append(at_most(f"many processes: kdb pack --from-db right after, {label}",
                           t.median(arm, "pack"), 30, unit=" s"))
        out.append(at_most(f"many processes: kdb log right after, {label}",
                           t.median(arm, "log"), 10, unit=" s"))
    failed = sum(t.median(arm, "failed") or 0 for arm, *_ in arms)
    out.append(Check("many processes: failed processes", "== 0", failed, failed == 0))
    return out
