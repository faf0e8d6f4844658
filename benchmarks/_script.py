"""The ``script`` scenario (issue 19, item 7): what a new user's first run costs.

One fresh process runs a plain pyopencl script of about 30 programs (elementwise and math
over two dtypes, reductions, three scans: ``_script_workload.py``) with every cache empty
(kdb's, PoCL's, pyopencl's: fresh directories per run), through ``kdb.opencl.install()``
against the same script without kdb. The two run back to back in pairs, the order
alternating pair by pair; the figure is the ratio of the medians of the process's wall time
(spawn to exit), which is what the user pays.

kdb's store worker goes on after the kdb process exits. Between runs the harness waits for
it to finish (every job stored, no worker left), outside the timed region, so that no run
overlaps the worker of the run before it; how long it went on is reported beside the run.
The machine's scheduler is left as it is: ``/proc/sys/kernel/sched_autogroup_enabled`` (on
by default on many distributions; it gives every session's group an equal share of the CPU
whatever its members' nice values) is read and reported with the figures.
"""

from __future__ import annotations

import resource
from pathlib import Path

from _harness import PYTHON, Metric, Outcome, Workspace, at_most, command, median, \
    wait_for_worker

SCRIPT = Path(__file__).resolve().parent / "_script_workload.py"
AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled")


def autogroup() -> int | None:
    """The machine's ``sched_autogroup_enabled`` (None where the kernel has no such knob)."""
    try:
        return int(AUTOGROUP.read_text().strip())
    except (OSError, ValueError):
        return None


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def script(ws: Workspace, o: Outcome) -> None:
    pairs = ws.opts.n(5)
    ag = autogroup()
    shown = "absent" if ag is None else str(ag)
    o.title = ("Script: a new user's first run, one fresh process building ~30 pyopencl "
               "programs (elementwise and math over two dtypes, reductions, three scans) with "
               f"empty caches, kdb against no kdb, back to back in {pairs} pair(s); "
               f"sched_autogroup_enabled = {shown}")
    t = o.table(f"run 1, empty caches; median of {pairs}, arms alternating in order pair by "
                f"pair; sched_autogroup_enabled = {shown}", "nokdb",
                [Metric("wall", "process wall (run 1)", unit="s"),
                 Metric("cpu", "process CPU (user+sys)", unit="s"),
                 Metric("programs", "programs", unit="n", ratio=False),
                 Metric("compiles", "compiles", unit="n", ratio=False),
                 Metric("after", "store worker after exit (not timed)", unit="s",
                        ratio=False)],
                note="wall: spawn to exit of the script's process, what the user waits for; "
                     "the store worker kdb leaves running is waited for between runs")
    t.arm("nokdb", "no kdb (plain pyopencl)")
    t.arm("kdb", "kdb through kdb.opencl.install(), defaults")
    pair_ratios: list[float] = []
    for r in range(pairs):
        order = ("nokdb", "kdb") if r % 2 == 0 else ("kdb", "nokdb")
        walls: dict[str, float] = {}
        for arm in order:
            ws.log(f"script: pair {r + 1}/{pairs}, {arm}")
            cache = ws.fresh("kdb-script")
            env = ws.env(KDB_CACHE_DIR=cache, KDB_STORE_AT_EXIT=None,
                         POCL_CACHE_DIR=ws.fresh("pocl-script"),
                         XDG_CACHE_HOME=ws.fresh("xdg-script"),
                         KDB_SCRIPT="1" if arm == "kdb" else None)
            cpu = _children_cpu()
            p = command([PYTHON, str(SCRIPT)], env, timeout=1800)
            walls[arm] = p.wall
            t.add(arm, "wall", p.wall)
            t.add(arm, "cpu", _children_cpu() - cpu)  # the worker is not its child: not in it
            t.add(arm, "programs", p.data.get("programs"))
            t.add(arm, "compiles", p.data.get("compiles"))
            if arm == "kdb":  # outside the timed region: the next run must not overlap it
                t.add(arm, "after", wait_for_worker(cache, timeout=3600))
        pair_ratios.append(walls["kdb"] / walls["nokdb"])
    o.info["sched_autogroup_enabled"] = ag
    o.info["pair_ratios"] = pair_ratios
    o.info["pair_ratio_median"] = median(pair_ratios)
    o.checks.append(at_most("script, run 1 (empty caches, one process, ~30 programs with "
                            f"three scans, autogroup {shown}): process wall time, kdb vs no kdb",
                            t.ratio("kdb", "wall"), 1.05,
                            detail="pair ratios " + ", ".join(f"{x:.2f}" for x in pair_ratios)))
    o.notes.append("Each run is one process from spawn to exit with fresh kdb, PoCL and "
                   "pyopencl caches; kdb's store worker goes on after the process and is "
                   "waited for before the next run ('store worker after exit'), so it is not "
                   "in any run's time. 'process CPU' is the script's own CPU time; a wall "
                   "time longer than no kdb's at the same CPU time is time spent waiting for "
                   "a CPU.")
