"""The ``adopt`` scenario: what adopting kdb costs a program that uses pyopencl.

A fresh process, kdb installed from its wheel into a virtual environment of its own, imports
pyopencl, makes a context and builds N programs. Without kdb, PoCL's own cache is warm;
with kdb, ``kdb.opencl.install()`` is called first and every program is a kdb hit (the user
tier filled by a run before, its store worker finished). N = 1 and N = 20, the two arms in
pairs, the order alternating pair by pair; the figure is the ratio of the medians of the
process's wall time (spawn to exit). ``import kdb.opencl`` after ``import pyopencl`` is timed
inside the kdb arm's processes.

The venv holds only kdb's wheel (``--no-deps``); the dependencies (pyopencl, numpy,
zstandard, SQLAlchemy, ...) come from the benchmark's own environment through a path file,
so no package is downloaded and the editable install of the source tree is not seen.
"""

from __future__ import annotations

import subprocess
import sysconfig
import venv
from pathlib import Path

from _harness import PYTHON, REPO, Metric, Outcome, Workspace, at_most, command, median, \
    wait_for_worker

PROGRAM = """\
import json, os, sys, time
t0 = time.perf_counter()
import pyopencl as cl
t1 = time.perf_counter()
if os.environ.get("ADOPT_KDB") == "1":
    import kdb.opencl
    kdb.opencl.install()
    assert "site-packages" in kdb.opencl.__file__, kdb.opencl.__file__  # the wheel's copy
t2 = time.perf_counter()
ctx = cl.Context(cl.get_platforms()[0].get_devices())
for i in range(int(sys.argv[1])):
    cl.Program(ctx, "__kernel void k%d(__global float *a) { a[get_global_id(0)] *= %d.0f; }"
               % (i, i + 2)).build()
t3 = time.perf_counter()
print("BENCH-JSON:" + json.dumps({"import_kdb_ms": (t2 - t1) * 1e3, "build_s": t3 - t2}))
"""


def _wheel_venv(ws: Workspace) -> Path:
    """A venv with kdb's wheel in its own site-packages and this environment's packages
    behind it; returns its python."""

    def build() -> Path:
        d = ws.path / "adopt-venv"
        ws.log("adopt: building kdb's wheel and a venv for it")
        subprocess.run([PYTHON, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "--quiet", "-w", str(d / "dist"), str(REPO)], check=True,
                       capture_output=True, timeout=600)
        venv.EnvBuilder(with_pip=False).create(d / "venv")
        python = d / "venv" / "bin" / "python"
        wheel = sorted((d / "dist").glob("kdb-*.whl"))[-1]
        subprocess.run([PYTHON, "-m", "pip", "--python", str(python), "install", "--no-deps",
                        "--quiet", str(wheel)], check=True, capture_output=True, timeout=600)
        site = subprocess.run([str(python), "-c", "import sysconfig; "
                               "print(sysconfig.get_paths()['purelib'])"], check=True,
                              capture_output=True, text=True).stdout.strip()
        ours = sysconfig.get_paths()["purelib"]  # a plain directory line: its .pth files
        Path(site, "zz-benchmark-deps.pth").write_text(ours + "\n")  # (the editable kdb) stay off
        (d / "program.py").write_text(PROGRAM)
        return python

    return ws.memo("adopt_venv", build)


def adopt(ws: Workspace, o: Outcome) -> None:
    pairs = ws.opts.n(7)
    python = _wheel_venv(ws)
    program = str(python.parent.parent.parent / "program.py")
    o.title = ("Adopt: a fresh process of a wheel install imports pyopencl, makes a context "
               f"and builds N programs; PoCL's warm cache against kdb hits; {pairs} pairs")
    t = o.table(f"warm start; median of {pairs}, arms alternating pair by pair", "pocl",
                [Metric("n1", "N = 1, process wall", unit="ms"),
                 Metric("n20", "N = 20, process wall", unit="ms"),
                 Metric("imp", "import kdb.opencl after pyopencl", unit="ms", ratio=False)],
                note="process wall: spawn to exit; the kdb arm calls kdb.opencl.install() and "
                     "every program is a hit from the user tier")
    t.arm("pocl", "no kdb, PoCL's cache warm")
    t.arm("kdb", "kdb.opencl.install(), every program a kdb hit")
    pocl_cache, kdb_cache = ws.fresh("pocl-adopt"), ws.fresh("kdb-adopt")
    envs = {"pocl": ws.env(POCL_CACHE_DIR=pocl_cache, PYTHONDONTWRITEBYTECODE=None),
            "kdb": ws.env(POCL_CACHE_DIR=ws.fresh("pocl-adopt-kdb"), KDB_CACHE_DIR=kdb_cache,
                          ADOPT_KDB="1", PYTHONDONTWRITEBYTECODE=None)}
    for arm, env in envs.items():  # fill the caches (and write the .pyc files) first
        command([str(python), program, "20"], env, timeout=900)
    wait_for_worker(kdb_cache, timeout=900)
    ratios: dict[str, list[float]] = {"n1": [], "n20": []}
    for r in range(pairs):
        for metric, n in (("n1", "1"), ("n20", "20")):
            walls = {}
            for arm in (("pocl", "kdb") if r % 2 == 0 else ("kdb", "pocl")):
                ws.log(f"adopt: pair {r + 1}/{pairs}, N = {n}, {arm}")
                p = command([str(python), program, n], envs[arm], timeout=600)
                walls[arm] = p.wall
                t.add(arm, metric, p.wall)
                if arm == "kdb":
                    t.add(arm, "imp", p.data.get("import_kdb_ms", 0.0) / 1e3)
            ratios[metric].append(walls["kdb"] / walls["pocl"])
    o.info["pair_ratios"] = ratios
    o.checks.append(at_most("adopt, N = 1: a warm start with kdb hits vs PoCL's warm cache",
                            t.ratio("kdb", "n1"), 1.0,
                            detail=f"median pair ratio {median(ratios['n1']):.3f}"))
    o.checks.append(at_most("adopt, N = 20: a warm start with kdb hits vs PoCL's warm cache",
                            t.ratio("kdb", "n20"), 0.5,
                            detail=f"median pair ratio {median(ratios['n20']):.3f}"))
    o.checks.append(at_most("adopt: import kdb.opencl after import pyopencl, ms",
                            (t.median("kdb", "imp") or 0.0) * 1e3, 10.0, unit=" ms"))
