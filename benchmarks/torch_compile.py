"""torch.compile's first training step in a fresh process (CPU, Inductor's C++ backend):
Inductor's own caches warm (the reference) against kdb warm with Inductor's caches empty,
and a cold start with and without kdb. Prints a table, writes JSON; asserts no timing.

    python benchmarks/torch_compile.py [--runs 3] [--json out.json]

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
from pathlib import Path

STEP = Path(__file__).resolve().parent / "_torch_step.py"


def step(where: Path, kdb_dir: Path | None, inductor: Path | None = None) -> dict:
    """One first step; ``inductor``: an Inductor cache to reuse (else a new, empty one)."""
    where.mkdir(parents=True, exist_ok=True)
    tmp = where / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KDB_", "TORCHINDUCTOR_"))}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(inductor or where / "inductor"),
               TMPDIR=str(inductor.parent / "tmp" if inductor else tmp))
    if kdb_dir is not None:
        env.update(KDB_AUTO="1", KDB_CACHE_DIR=str(kdb_dir))
    proc = subprocess.run([sys.executable, str(STEP)], env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(next(x for x in proc.stdout.splitlines()
                           if x.startswith("STEP-JSON:")).partition(":")[2])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    arms: dict[str, list[dict]] = {"inductor warm (reference)": [], "kdb warm, Inductor empty": [],
                                   "cold, no kdb": [], "cold, kdb": []}
    with tempfile.TemporaryDirectory(prefix="kdb-bench-torch-") as d:
        root = Path(d)
        for run in range(args.runs):
            r = root / f"run{run}"
            arms["cold, no kdb"].append(step(r / "plain", None))
            arms["inductor warm (reference)"].append(
                step(r / "plain-again", None, inductor=r / "plain" / "inductor"))
            arms["cold, kdb"].append(step(r / "kdb-cold", r / "kdb"))
            arms["kdb warm, Inductor empty"].append(step(r / "kdb-warm", r / "kdb"))
    reference = statistics.median(x["first_step"] for x in arms["inductor warm (reference)"])
    cold = statistics.median(x["first_step"] for x in arms["cold, no kdb"])
    rows = []
    print(f"{'arm':30} {'first step s':>12} {'x ref':>7} {'fx miss':>7} {'C++ builds':>10}  bits")
    digest = arms["cold, no kdb"][0]["digest"]
    for name, xs in arms.items():
        t = statistics.median(x["first_step"] for x in xs)
        base = cold if name.startswith("cold") else reference
        row = {"arm": name, "first_step_s": t, "ratio": t / base,
               "ratio_to": "cold, no kdb" if name.startswith("cold") else "reference",
               "fx_miss": max(x["fx_miss"] for x in xs),
               "cpp_builds": max(x["cpp_builds"] for x in xs),
               "bits_equal": all(x["digest"] == digest for x in xs), "runs": xs}
        rows.append(row)
        print(f"{name:30} {t:12.2f} {row['ratio']:7.2f} {row['fx_miss']:7d} "
              f"{row['cpp_builds']:10d}  {'equal' if row['bits_equal'] else 'DIFFER'}")
    print(f"torch {arms['cold, no kdb'][0]['torch']}; ratios: warm arms to the reference, "
          "cold arms to cold without kdb; medians of", args.runs, "runs")
    if args.json:
        args.json.write_text(json.dumps({"scenario": "torch_compile", "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
