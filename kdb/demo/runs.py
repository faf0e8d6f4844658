"""`kdb demo`: real OpenCL kernels built twice in fresh processes, cold cache then warm.

The demo runs a set of OpenCL programs of several kinds (elementwise, reductions and scans in
local memory, tiled matrix multiply, stencil, atomics, a program that includes a header, float
and complex variants chosen with ``-D`` options) on the default device, checks every result
against numpy, and does it twice, each time in a fresh Python process: first on an empty kdb
cache, then on the cache the first run filled. It prints a table of the two build phases.

Each run gets its own, empty ``POCL_CACHE_DIR``, so PoCL's own cache helps neither run: the
warm run's speed-up is kdb's alone. Launches are timed apart from the build phase: in the
cold run the first launch of each kernel JIT-compiles its work-group function. kdb reads
the binaries back after the start-up burst, when the kernels have run, and PoCL's binaries
then carry the work-group functions it compiled for those launches, so the warm run's first
launches skip the JIT too.

The parent process imports neither pyopencl nor numpy; the worker (``python -m kdb.demo.runs
--worker``, :mod:`kdb.demo.programs`) does the OpenCL work and reports JSON. This module
prints: it is the CLI's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, Sequence

from .. import config
from .programs import KERNEL_DIR, PROGRAMS, DemoProgram, select, worker  # noqa: F401

MISSING_SYSTEM_DB = "no system kernel database"
_TIMEOUT_S = 600


# -- the parent: two fresh processes and a table ------------------------------------------

def _run_child(label: str, cache_dir: Path, pocl_dir: Path, work: Path,
               programs: list[DemoProgram]) -> tuple[dict[str, Any] | None, str, int, float]:
    out = work / f"{label}.json"
    env = dict(os.environ)
    env[config.ENV_CACHE_DIR] = str(cache_dir)
    env["POCL_CACHE_DIR"] = str(pocl_dir)
    # Store before exiting, not through the store worker: the warm run starts right after
    # and should show hits, not compile what the worker has not stored yet.
    env[config.ENV_STORE_AT_EXIT] = "wait"
    cmd = [sys.executable, "-m", "kdb.demo.runs", "--worker", str(out),
           "--kernels", ",".join(p.name for p in programs)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        stderr = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else ""
        return None, stderr + f"\n{label} run killed after {_TIMEOUT_S} s", -1, _TIMEOUT_S
    wall = time.perf_counter() - start
    if proc.stdout.strip():
        print(textwrap.indent(proc.stdout.rstrip(), f"  {label} stdout | "))
    figures = json.loads(out.read_text()) if out.exists() else None
    return figures, proc.stderr, proc.returncode, wall


def _show_stderr(label: str, text: str, already: set[str]) -> None:
    """Print a child's stderr, each line wrapped and indented; skip lines shown before."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    new = [ln for ln in lines if ln not in already]
    if new:
        print(f"{label} run, worker's stderr:")
        for ln in new:
            print(textwrap.fill(ln, width=100, initial_indent="  | ", subsequent_indent="  |     ",
                                break_on_hyphens=False, break_long_words=False))
    repeated = [ln for ln in lines if ln in already]
    if repeated:
        why = ("the missing-system-db warning is given once per process"
               if any(MISSING_SYSTEM_DB in ln for ln in repeated)
               else "each process gives its warnings once")
        print(f"{label} run, worker's stderr: {len(repeated)} line(s) as in the cold run "
              f"({why})")
    already.update(lines)


def _table(runs: list[tuple[str, dict[str, Any]]], speedup: float | None) -> str:
    head = ("run", "kernels", "compiles", "build s", "launch+check s", "results", "build speed-up")
    rows = [head]
    for label, f in runs:
        ok = sum(r["ok"] for r in f["results"])
        rows.append((label, str(f["kernels"]), str(f["compiles"]), f"{f['build_s']:.3f}",
                     f"{f['launch_check_s']:.3f}", f"{ok}/{f['kernels']} ok",
                     "1.0x" if label == "cold" else
                     (f"{speedup:.1f}x" if speedup is not None else "n/a")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = []
    for n, r in enumerate(rows):
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(kernels: int | Sequence[str] | str | None = None,
         json_out: str | os.PathLike[str] | None = None,
         cache_dir: str | os.PathLike[str] | None = None, keep: bool = False) -> int:
    """Run the demo: a cold and a warm run in fresh processes; print the table; exit code.

    ``kernels`` picks the programs: ``None`` for all, an int for the first ``n``, or names.
    ``json_out`` writes the figures. The kdb cache is ``cache_dir``, else ``KDB_CACHE_DIR``,
    else a new temporary directory, removed at the end unless ``keep``. Returns 0 when every
    result matched numpy and the warm run compiled nothing, else 1.
    """
    programs = select(kernels)
    if cache_dir is None and os.environ.get(config.ENV_CACHE_DIR):
        cache_dir, origin = os.environ[config.ENV_CACHE_DIR], f" (from {config.ENV_CACHE_DIR})"
    else:
        origin = ""
    work = Path(tempfile.mkdtemp(prefix="kdb-demo-"))
    temporary = cache_dir is None
    if temporary:
        cache = work / "kdb-cache"
        origin = " (temporary, kept)" if keep else " (temporary, removed at the end)"
    else:
        cache = Path(cache_dir).expanduser().resolve()
    try:
        return _demo(programs, json_out, cache, origin, work, temporary)
    finally:
        if temporary and keep:  # keep the kdb cache, drop PoCL's caches and the reports
            for entry in work.iterdir():
                if entry != cache:
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        else:
            shutil.rmtree(work, ignore_errors=True)


def _demo(programs: list[DemoProgram], json_out: str | os.PathLike[str] | None, cache: Path,
          origin: str, work: Path, temporary: bool) -> int:
    print(f"kdb demo: {len(programs)} OpenCL programs, built in two fresh processes "
          f"(cold cache, then warm)")
    print(f"kdb cache: {cache}{origin}")
    print("PoCL's own cache: a fresh, empty POCL_CACHE_DIR for each run, so it helps neither "
          "run\n")
    runs, failures, warned_cold = _both_runs(programs, cache, work)
    speedup = _compare(runs, failures, cache)
    if runs:
        _summary(runs, speedup, len(programs), warned_cold)
    if json_out is not None:
        doc = {
            "programs": [{"name": p.name, "file": p.file, "options": list(p.options),
                          "kind": p.kind} for p in programs],
            "cache_dir": str(cache), "cache_temporary": temporary,
            "pocl_cache": "fresh empty POCL_CACHE_DIR per run",
            "runs": {label: f for label, f in runs},
            "build_speedup": speedup,
            "missing_system_db_warning_cold": warned_cold,
            "ok": not failures, "failures": failures,
        }
        Path(json_out).write_text(json.dumps(doc, indent=2))
        print(f"figures written to {json_out}")
    for msg in failures:
        print(f"FAILED: {msg}", file=sys.stderr)
    return 1 if failures else 0


def _both_runs(programs: list[DemoProgram], cache: Path,
               work: Path) -> tuple[list[tuple[str, dict[str, Any]]], list[str], bool]:
    """The cold and the warm run, each a fresh process with a fresh PoCL cache: their
    figures, what went wrong, and whether the cold run warned of no system database."""
    runs: list[tuple[str, dict[str, Any]]] = []
    failures: list[str] = []
    shown: set[str] = set()
    warned_cold = False
    for label in ("cold", "warm"):
        pocl = work / f"pocl-{label}"
        pocl.mkdir(parents=True, exist_ok=True)
        figures, stderr, rc, wall = _run_child(label, cache, pocl, work, programs)
        if label == "cold":
            warned_cold = MISSING_SYSTEM_DB in stderr
        _show_stderr(label, stderr, shown)
        if figures is None:
            failures.append(f"{label} run failed (exit code {rc}) before reporting figures")
            break
        figures["wall_s"] = wall
        figures["missing_system_db_warning"] = MISSING_SYSTEM_DB in stderr
        figures["exit_code"] = rc
        runs.append((label, figures))
        for r in figures["results"]:
            if not r["ok"]:
                failures.append(f"{label} run: {r['name']} is wrong: {r['problem']}")
        if rc != 0 and figures["ok"]:
            failures.append(f"{label} run exited with code {rc}")
    return runs, failures, warned_cold


def _compare(runs: list[tuple[str, dict[str, Any]]], failures: list[str],
             cache: Path) -> float | None:
    """The warm build phase's speed-up over the cold one; a warm run that compiled is a
    failure, a cold run that was not cold a note."""
    if len(runs) != 2:
        return None
    cold, warm = runs[0][1], runs[1][1]
    speedup = cold["build_s"] / warm["build_s"] if warm["build_s"] > 0 else None
    if warm["compiles"]:
        disabled = config.flag(config.ENV_DISABLE_CACHE)
        failures.append(f"the warm run compiled {warm['compiles']} program(s) "
                        f"({', '.join(warm['compiled'])}); expected none"
                        + (" (KDB_DISABLE_CACHE is set)" if disabled else ""))
    if cold["compiles"] != cold["kernels"]:
        print(f"note: the cold run was not cold: {cold['kernels'] - cold['compiles']} of "
              f"{cold['kernels']} programs were already in {cache} or a system database")
    return speedup


def _summary(runs: list[tuple[str, dict[str, Any]]], speedup: float | None, programs: int,
             warned_cold: bool) -> None:
    print()
    print(_table(runs, speedup))
    print()
    f = runs[0][1]
    print(f"device: {f['device']} ({f['platform']}), arch {f['arch']}")
    print(f"user file: {f['user_file']}")
    if speedup is not None and runs[0][1]["compiles"] == programs:
        print(f"warm build phase {speedup:.1f}x faster than cold: "
              f"{runs[0][1]['build_s']:.3f} s -> {runs[1][1]['build_s']:.3f} s for "
              f"{programs} programs")
    pocl = "Portable Computing Language" in f["platform"]
    if len(runs) > 1:  # name the implementation the binaries came from (issue 37)
        print("kdb stores binaries in the background, after the start-up burst: the cold "
              "run then spent\n  "
              f"{runs[0][1]['store_wait_s']:.3f} s at its end reading them back from "
              f"{'PoCL' if pocl else f['platform']} and storing them"
              + ("; read after\n  the launches, they carry the work-group code PoCL "
                 "compiled, so the warm run's launches skip its JIT" if pocl else ""))
    if not warned_cold:
        print("note: the cold run gave no missing-system-db warning "
              "(a system database for this arch was found, or kdb's warnings are silenced)")


def _cli(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kdb.demo.runs", description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", help="how many programs, or comma-separated names "
                        "(default: all)")
    parser.add_argument("--json", dest="json_out", metavar="PATH", help="write the figures here")
    parser.add_argument("--cache-dir", help="kdb cache to use (default: KDB_CACHE_DIR, else a "
                        "temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary cache")
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.kernels)
    from ..errors import KdbError

    try:
        return main(args.kernels, args.json_out, args.cache_dir, args.keep)
    except KdbError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(_cli())
