"""The ``uncached`` scenario: PoCL's kernel cache off, as MIRGE-Com's documentation has users
run (``POCL_KERNEL_CACHE=0``), and 8 processes start together on a warm kdb cache.

PoCL 3.0 unpacks a program loaded from a binary into a directory named by the binary's
header and, with its cache off, deletes it when the program is released: processes loading
the same binary shared one directory, and 1-6 of 8 aborted in every run (``Can't get stat()``
from PoCL's ``pocl_rm_rf``). kdb gives each load a directory of its own
(``kdb.backends.opencl.poclbin``). Each run: 8 processes (20 kernels each, the ``many``
workload, held until exit) with one fresh ``POCL_CACHE_DIR`` between them (as
``~/.cache/pocl/uncached`` is shared), against the same 8 without kdb; failed processes
(any exit status but 0) and compiles counted (``--quick``: 1 run, full: 20; the reference
arm, which compiles every kernel from source, the first 2 of them).
"""

from __future__ import annotations

from _harness import Check, Metric, Outcome, Workspace, child, median, spawn

PROCESSES = 8


def uncached(ws: Workspace, o: Outcome) -> None:
    n_k = ws.opts.kernels
    runs = ws.opts.n(20)
    o.title = (f"PoCL's kernel cache off: {PROCESSES} processes start together on a warm kdb "
               f"cache, {n_k} kernels each ({runs} runs)")
    metrics = [Metric("wall", "wall, all done"),
               Metric("failed", "failed procs", unit="n", ratio=False),
               Metric("builds", "source builds", unit="n", ratio=False)]
    t = o.table(f"{PROCESSES} concurrent processes, POCL_KERNEL_CACHE=0, one POCL_CACHE_DIR",
                "pyopencl", metrics, note="kdb: the user tier primed by one process first; "
                "source builds = compiles kdb recorded, summed over the processes")
    t.arm("pyopencl", "no kdb (plain pyopencl)")
    t.arm("kdb", "kdb, warm user tier")
    cache = ws.fresh("kdb-uncached")
    args = {"workload": "kernels", "kernels": n_k}
    child("opencl", {**args, "mode": "kdb"},  # stores all of them before it exits
          ws.env(KDB_CACHE_DIR=cache, POCL_KERNEL_CACHE=0, POCL_CACHE_DIR=ws.fresh("pocl")))
    failures: list[str] = []
    for r in range(runs):
        # The reference compiles all its kernels from source (160 compiles a run): 2 runs.
        arms = ("pyopencl", "kdb") if r < 2 else ("kdb",)
        for arm, mode in ((a, a) for a in arms):
            ws.log(f"uncached: {arm}, run {r + 1}/{runs}")
            env = ws.env(KDB_CACHE_DIR=cache, POCL_KERNEL_CACHE=0,
                         POCL_CACHE_DIR=ws.fresh("pocl-uncached"))
            running = [spawn("opencl", {**args, "mode": mode}, env) for _ in range(PROCESSES)]
            procs = [rp.wait(check=False) for rp in running]
            t.add(arm, "wall", max(p.t_exit for p in procs) - running[0].t_spawn)
            failed = [p for p in procs if p.rc != 0]
            t.add(arm, "failed", len(failed))
            failures += [f"{arm} run {r + 1}: exit {p.rc}: "
                         f"{(p.stderr.strip().splitlines() or [''])[-1][:200]}" for p in failed]
            if arm == "kdb":
                t.add(arm, "builds", sum(p.data.get("compiles") or 0 for p in procs
                                         if p.rc == 0))
    o.notes += failures
    total = sum(t.samples.get("kdb", {}).get("failed", []))
    builds = median(t.samples.get("kdb", {}).get("builds", []))
    o.checks += [
        Check(f"PoCL cache off: failed processes of {PROCESSES} x {runs} runs, kdb", "== 0",
              total, total == 0),
        Check(f"PoCL cache off: source builds per run of {PROCESSES} processes, kdb warm",
              "== 0", builds, None if builds is None else builds == 0),
    ]
