"""torch.compile's first training step in a fresh process (CPU, Inductor's C++ backend):
Inductor's own caches warm (the reference) against kdb warm with Inductor's caches empty and
against a pack (``kdb pack --from-db``) pip-installed in another venv at another path with
every cache empty; a cold start with and without kdb; 8 processes at once on a cold kdb
cache (is each graph compiled once?). Prints a table, writes JSON; asserts no timing.

    python benchmarks/torch_compile.py [--runs 3] [--procs 8] [--json out.json]

Each arm is a fresh process running benchmarks/_torch_step.py; "empty" means a new
TORCHINDUCTOR_CACHE_DIR and a new TMPDIR (Inductor's precompiled headers default there).
Arms are interleaved per run; the figure is the median of the runs. Needs torch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEP = Path(__file__).resolve().parent / "_torch_step.py"


def _env(where: Path, kdb_dir: Path | None, inductor: Path | None) -> dict:
    """A fresh process's environment: its own empty Inductor cache and TMPDIR unless
    ``inductor`` names one to reuse; kdb on (``KDB_AUTO``) with ``kdb_dir`` as its cache."""
    where.mkdir(parents=True, exist_ok=True)
    tmp = where / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KDB_", "TORCHINDUCTOR_")) and k != "PYTHONPATH"}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(inductor or where / "inductor"),
               TMPDIR=str(inductor.parent / "tmp" if inductor else tmp))
    if kdb_dir is not None:
        env.update(KDB_AUTO="1", KDB_CACHE_DIR=str(kdb_dir))
    return env


def _figures(stdout: str) -> dict:
    return json.loads(next(x for x in stdout.splitlines()
                           if x.startswith("STEP-JSON:")).partition(":")[2])


def step(where: Path, kdb_dir: Path | None, inductor: Path | None = None,
         python: str = sys.executable) -> dict:
    """One first step; ``inductor``: an Inductor cache to reuse (else a new, empty one)."""
    proc = subprocess.run([python, str(STEP)], env=_env(where, kdb_dir, inductor),
                          capture_output=True, text=True, check=True, cwd=where)
    return _figures(proc.stdout)


def at_once(where: Path, kdb_dir: Path, n: int) -> dict:
    """``n`` fresh processes started together on one cold kdb cache, each with its own empty
    Inductor cache: the graphs and C++ modules each compiled, per process and in total."""
    procs = [subprocess.Popen([sys.executable, str(STEP)], cwd=where,
                              env=_env(where / f"p{i}", kdb_dir, None),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for i in range(n)]
    start = time.perf_counter()
    each = [_figures(p.communicate()[0]) for p in procs]
    wall = time.perf_counter() - start
    total = {k: sum(x[k] for x in each) for k in ("fx_miss", "aot_miss", "cpp_builds")}
    return {**total, "first_step": max(x["first_step"] for x in each), "wall": wall,
            "digest": each[0]["digest"] if len({x["digest"] for x in each}) == 1 else "differ",
            "per_process": [{k: x[k] for k in ("fx_miss", "aot_miss", "cpp_builds",
                                               "first_step")} for x in each]}


def other_venv(root: Path, kdb_dir: Path) -> str:
    """A pack of ``kdb_dir``'s entries, pip-installed into a new venv at another path; its
    Python (benchmarks/_torch_pack.py)."""
    import _torch_pack
    from kdb.backends.torch.targets import host_arch

    wheel = _torch_pack.build_pack(kdb_dir, host_arch(), root / "dist")
    return str(_torch_pack.other_venv(root / "elsewhere" / "venv",
                                      [_torch_pack.kdb_wheel(root / "kdb-dist"), wheel]))


ARMS = ("inductor warm (reference)", "kdb warm, Inductor empty", "pack in another venv, "
        "all empty", "cold, no kdb", "cold, kdb", "8 at once, cold kdb")


def collect(root: Path, runs: int, procs: int) -> dict[str, list[dict]]:
    """Every arm ``runs`` times, interleaved."""
    arms: dict[str, list[dict]] = {name: [] for name in ARMS}
    python = None
    for run in range(runs):
        r = root / f"run{run}"
        arms["cold, no kdb"].append(step(r / "plain", None))
        arms["inductor warm (reference)"].append(
            step(r / "plain-again", None, inductor=r / "plain" / "inductor"))
        arms["cold, kdb"].append(step(r / "kdb-cold", r / "kdb"))
        arms["kdb warm, Inductor empty"].append(step(r / "kdb-warm", r / "kdb"))
        python = python or other_venv(root, r / "kdb")
        arms[ARMS[2]].append(step(r / "packed", r / "packed-kdb", python=python))
        arms["8 at once, cold kdb"].append(at_once(r / "many", r / "many-kdb", procs))
    return arms


def report(arms: dict[str, list[dict]], runs: int, procs: int) -> list[dict]:
    """The table (printed) and its rows."""
    reference = statistics.median(x["first_step"] for x in arms["inductor warm (reference)"])
    cold = statistics.median(x["first_step"] for x in arms["cold, no kdb"])
    digest = arms["cold, no kdb"][0]["digest"]
    rows = []
    print(f"{'arm':34} {'first step s':>12} {'x ref':>7} {'fx miss':>7} {'C++ builds':>10}  bits")
    for name, xs in arms.items():
        t = statistics.median(x["first_step"] for x in xs)
        base = cold if name.startswith("cold") else reference
        row = {"arm": name, "first_step_s": t, "ratio": t / base,
               "ratio_to": "cold, no kdb" if name.startswith("cold") else "reference",
               "fx_miss": max(x["fx_miss"] for x in xs),
               "cpp_builds": max(x["cpp_builds"] for x in xs),
               "bits_equal": all(x["digest"] == digest for x in xs), "runs": xs}
        ratio = f"{row['ratio']:7.2f}"
        if name.startswith("8 at once"):  # totals over the processes; no ratio
            row.update(ratio=None, ratio_to=None, wall_s=statistics.median(x["wall"] for x in xs))
            ratio = f"{'-':>7}"
        rows.append(row)
        print(f"{name:34} {t:12.2f} {ratio} {row['fx_miss']:7d} "
              f"{row['cpp_builds']:10d}  {'equal' if row['bits_equal'] else 'DIFFER'}")
    for x in arms["8 at once, cold kdb"]:
        each = x["per_process"]
        print(f"8 at once: graphs compiled per process {[p['fx_miss'] for p in each]}"
              f" (total {x['fx_miss']}), AOTAutograd entries traced {[p['aot_miss'] for p in each]}"
              f" (total {x['aot_miss']}), C++ builds {[p['cpp_builds'] for p in each]}"
              f" (total {x['cpp_builds']}), all {procs} done in {x['wall']:.1f} s")
    print(f"torch {arms['cold, no kdb'][0]['torch']}; ratios: warm arms to the reference, "
          f"cold arms to cold without kdb; medians of {runs} runs; '8 at once': the last "
          "process's first step, graphs and C++ builds summed over the processes")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--procs", type=int, default=8, help="processes of the 'at once' arm")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _harness import precompile

    precompile()  # kdb's arms import kdb from its .pyc, as an installed kdb does
    with tempfile.TemporaryDirectory(prefix="kdb-bench-torch-") as d:
        arms = collect(Path(d), args.runs, args.procs)
    rows = report(arms, args.runs, args.procs)
    if args.json:
        args.json.write_text(json.dumps({"scenario": "torch_compile", "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
