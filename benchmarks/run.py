#!/usr/bin/env python3
"""kdb side by side with the floor, PoCL's own cache, plain pyopencl and no cache.

    python benchmarks/run.py                  # every scenario (hours on 2 cores)
    python benchmarks/run.py --quick          # 1 run each, 4 kernels: seconds to minutes a
                                              # scenario (hip, suite, script, fresh: minutes)
    python benchmarks/run.py --only hit,scale --runs 7

Scenarios (the figures of docs/design.md; the list: --help): warm, cold, hit, many, scale,
cuda, hip, triton, trust, uncached, adopt, auto; suite, script, fresh (a framework's suite,
a new user's first run); busy, batch, xdist (a machine that is never idle, batch jobs killed
at their end, pytest -n 2). Each prints a
table per measurement, every arm's median and its ratio to the reference arm, then the
figures of docs/design.md it bears on; everything (samples included) goes to a JSON file.
Whatever kdb is installed in this interpreter is what gets measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import REPO, BenchError, Options, Outcome, Workspace, precompile  # noqa: E402
from _scenarios import SCENARIOS  # noqa: E402
from _script import autogroup  # noqa: E402

DEFAULT_JSON = REPO / "benchmarks" / "results" / "latest.json"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="benchmarks/run.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="scenarios: " + ", ".join(SCENARIOS))
    ap.add_argument("--quick", action="store_true",
                    help="fast smoke run: one run per arm, 4 kernels, small sizes")
    ap.add_argument("--runs", type=int, default=None, metavar="N",
                    help="median of N runs for every arm (default: per scenario, 2-20)")
    ap.add_argument("--only", action="append", default=None, metavar="SCENARIO",
                    help="run only these scenarios (repeat, or comma-separate)")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON, metavar="PATH",
                    help=f"where to write the results (default {DEFAULT_JSON.relative_to(REPO)})")
    ap.add_argument("--kernels", type=int, default=None, metavar="N",
                    help="distinct OpenCL kernels per start-up (default 20; --quick 4)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary workspace")
    ap.add_argument("-q", "--silent", action="store_true", help="no progress lines on stderr")
    args = ap.parse_args(argv)
    names = [n.strip() for item in (args.only or []) for n in item.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    if args.only is not None and not names:  # --only "" ran every scenario: hours
        ap.error(f"--only names no scenario; choose from {', '.join(SCENARIOS)}")
    for flag, value in (("--runs", args.runs), ("--kernels", args.kernels)):
        if value is not None and value < 1:
            ap.error(f"{flag} must be at least 1, not {value}")
    # Checked before hours of runs, not after them (the results were lost).
    where = args.json.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    if args.json.is_dir():
        ap.error(f"--json {args.json} is a directory: name the file to write")
    if not where.is_dir() or not os.access(where, os.W_OK):
        ap.error(f"--json {args.json} cannot be written: {where} is not a writable directory")
    args.only = names or list(SCENARIOS)
    if args.runs is not None and args.runs < 1:
        ap.error("--runs must be at least 1")
    if args.kernels is None:
        args.kernels = 4 if args.quick else 20
    return args


def _git() -> dict[str, Any]:
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "kdb", "migrations"],
                               cwd=REPO, capture_output=True, text=True, timeout=10).stdout
        return {"commit": rev or None, "kdb_tree_dirty": bool(dirty.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "kdb_tree_dirty": None}


def _meta(args: argparse.Namespace) -> dict[str, Any]:
    from importlib import metadata

    import kdb

    versions = {}
    for dist in ("pyopencl", "zstandard", "SQLAlchemy", "pocl-binary-distribution"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv[1:],
        "quick": args.quick, "runs": args.runs, "kernels": args.kernels,
        "python": sys.version.split()[0], "executable": sys.executable,
        "platform": platform.platform(), "machine": platform.machine(),
        "cpus": os.cpu_count(), "kdb_version": kdb.__version__, "kdb_file": kdb.__file__,
        "versions": versions, "git": _git(),
        "sched_autogroup_enabled": autogroup(),  # changes what a background process costs
    }


def _run_one(name: str, ws: Workspace) -> tuple[Outcome, float]:
    """Run a scenario; a failure keeps the tables measured so far and says what failed."""
    out = Outcome(name)
    t0 = time.perf_counter()
    try:
        precompile()
        SCENARIOS[name](ws, out)
    except Exception as err:  # noqa: BLE001 - one scenario's failure is reported, not fatal
        detail = str(err) if isinstance(err, BenchError) else traceback.format_exc()
        out.status, out.reason = "error", detail.strip()
    return out, time.perf_counter() - t0


def _print(name: str, out: Outcome, seconds: float) -> None:
    print(f"\n=== {name}: {out.title}  [{seconds:.0f} s]")
    if out.status != "ok":
        print(f"{out.status.upper()}: {out.reason}")
    for t in out.tables:
        print()
        print(t.render())
    for note in out.notes:
        print(f"note: {note}")
    if out.checks:
        print("kdb's figures (docs/design.md):")
        for c in out.checks:
            print(c.render())
    sys.stdout.flush()


def _default_opencl() -> None:
    """Where pip's PoCL builds nothing on this CPU, run on the OpenCL the tests and the demo
    use (tools/default_opencl.py); a caller's own OCL_ICD_VENDORS is kept."""
    if "OCL_ICD_VENDORS" in os.environ:
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import default_opencl

    chosen = default_opencl.choose()
    if chosen:
        os.environ["OCL_ICD_VENDORS"] = chosen


def _stop_on_sigterm() -> None:
    """SIGTERM (``timeout``, a CI job cancelled) ends the run as Ctrl-C does: through the
    ``finally`` blocks that stop the PostgreSQL servers and remove the workspace (they were
    left running, their parent gone)."""
    import signal

    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    _stop_on_sigterm()
    _default_opencl()
    opts = Options(quick=args.quick, runs=args.runs, kernels=args.kernels,
                   verbose=not args.silent)
    ws = Workspace(opts)
    if not args.silent:
        ws.log = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr,
                                   flush=True)
    result: dict[str, Any] = {"meta": _meta(args), "scenarios": {}}
    t_all = time.perf_counter()
    try:
        for name in args.only:
            ws.log(f"scenario {name}")
            out, secs = _run_one(name, ws)
            _print(name, out, secs)
            result["scenarios"][name] = {
                "title": out.title, "status": out.status, "reason": out.reason,
                "seconds": secs, "tables": [t.to_json() for t in out.tables],
                "checks": [c.to_json() for c in out.checks], "notes": out.notes,
                "info": out.info,
            }
    finally:
        if args.keep:
            print(f"\nworkspace kept: {ws.path}", file=sys.stderr)
        else:
            ws.cleanup()
    result["meta"]["seconds"] = time.perf_counter() - t_all
    checks = [c for s in result["scenarios"].values() for c in s["checks"]]
    if checks:
        print("\n=== kdb's figures (docs/design.md), this run")
        for c in checks:
            mark = {True: "MET   ", False: "MISSED", None: "n/a   "}[c["met"]]
            val = "-" if c["value"] is None else f"{c['value']:.3g}"
            print(f"  [{mark}] {c['figure']}: {val}, target {c['target']}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"\nresults: {args.json}  ({result['meta']['seconds']:.0f} s)")
    failed = [n for n, s in result["scenarios"].items() if s["status"] == "error"]
    if failed:
        print(f"scenarios that failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
