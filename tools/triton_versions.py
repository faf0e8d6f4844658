#!/usr/bin/env python3
"""Runs kdb's Triton tests (tests/test_triton.py) against every Triton the package registry
offers from 3.2 on, each in a virtual environment of its own, and prints the table that
docs/triton.md holds.

Not for CI: each Triton is about 1 GB installed and its tests take minutes on 2 cores. Each
venv is removed after its run unless --keep is given.

    python3 tools/triton_versions.py                      # every version from 3.2 to the newest
    python3 tools/triton_versions.py --versions 3.2.0,3.6.0
    python3 tools/triton_versions.py --list               # what the registry offers, nothing run

Writes the results, one JSON line per version, to --out (default
benchmarks/results/triton-versions.jsonl, ignored by git) as it goes, so a run that is
stopped keeps what it finished.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OLDEST = (3, 2)


def offered(python: str) -> list[str]:
    """The Triton versions the registry offers for this interpreter, oldest first, from 3.2."""
    out = subprocess.run([python, "-m", "pip", "index", "versions", "triton"],
                         capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("Available versions:"))
    versions = [v.strip() for v in line.split(":", 1)[1].split(",")]
    keep = [v for v in versions if re.fullmatch(r"\d+\.\d+\.\d+", v) and _tuple(v) >= OLDEST]
    return sorted(keep, key=_tuple)


def _tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".")[:3])


def run_one(python: str, version: str, work: Path, keep: bool, timeout: int) -> dict:
    """A fresh venv with kdb (editable, its opencl and test extras) and Triton == version;
    then the Triton tests in it."""
    venv = work / f"triton-{version}"
    shutil.rmtree(venv, ignore_errors=True)
    row: dict = {"triton": version, "python": sys.version.split()[0]}
    start = time.monotonic()
    try:
        subprocess.run([python, "-m", "venv", str(venv)], check=True, capture_output=True)
        vpy = str(venv / "bin" / "python")
        install = subprocess.run(
            [vpy, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-e",
             f"{REPO}[opencl,test]", f"triton=={version}"], capture_output=True, text=True)
        row["install_s"] = round(time.monotonic() - start, 1)
        if install.returncode != 0:
            row.update(result="install failed", detail=install.stderr.strip()[-800:])
            return row
        tests = time.monotonic()
        proc = subprocess.run(
            [vpy, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "--tb=short",
             str(REPO / "tests" / "test_triton.py")], capture_output=True, text=True,
            cwd=REPO, timeout=timeout)
        row["tests_s"] = round(time.monotonic() - tests, 1)
        log = work / f"triton-{version}.log"
        log.write_text(proc.stdout + proc.stderr, encoding="utf-8")
        row["log"] = str(log)
        summary = _summary(proc.stdout)
        row.update(summary, result="pass" if proc.returncode == 0 else "fail",
                   skips=sorted({ln.split(": ", 1)[-1].strip() for ln in proc.stdout.splitlines()
                                 if ln.startswith("SKIPPED")}))
        if proc.returncode != 0:
            row["detail"] = "\n".join(ln for ln in proc.stdout.splitlines()
                                      if ln.startswith(("FAILED", "ERROR")))[-2000:] \
                or proc.stdout[-2000:]
        row["amd_packs"] = _amd_packs(vpy, work)
    except subprocess.TimeoutExpired:
        row.update(result=f"timed out after {timeout} s")
    except (OSError, subprocess.CalledProcessError) as err:
        row.update(result="error", detail=str(err)[-800:])
    finally:
        if not keep:
            shutil.rmtree(venv, ignore_errors=True)
    return row


AMD_PROBE = """
import sys, warnings
warnings.simplefilter("ignore")
from kdb.backends.triton import packing
from kdb.errors import BackendUnavailableError
try:
    packing.launch_source(packing.kernel_of(sys.argv[1], "add"),
                          {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32",
                           "BLOCK": "constexpr"}, {"BLOCK": 64}, {}, packing.gpu_target("gfx942"))
    print("yes")
except BackendUnavailableError as err:
    print("no: " + str(err).split(":")[0])
"""

KERNEL = """
import triton
import triton.language as tl


@triton.jit
def add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) + tl.load(y_ptr + offs), mask=offs < n)
"""


def _amd_packs(vpy: str, work: Path) -> str:
    """Whether kdb pack keys an AMD launch with this Triton here (no torch installed)."""
    kernel = work / "amd_probe_kernel.py"
    kernel.write_text(KERNEL, encoding="utf-8")
    proc = subprocess.run([vpy, "-c", AMD_PROBE, str(kernel)], capture_output=True, text=True,
                          timeout=300)
    return (proc.stdout.strip() or proc.stderr.strip().splitlines()[-1])[:200]


def _summary(stdout: str) -> dict:
    """pytest's closing counts: passed, failed, skipped, errors."""
    last = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", last)}
    return {k: counts.get(k, 0) for k in ("passed", "failed", "skipped", "error")}


def table(rows: list[dict]) -> str:
    lines = ["| Triton | tests/test_triton.py | passed | failed | skipped, and why | "
             "kdb pack keys an AMD launch without torch |", "|---|---|---|---|---|---|"]
    for r in rows:
        why = "; ".join(r.get("skips", []))
        lines.append(f"| {r['triton']} | {r['result']} | {r.get('passed', '')} | "
                     f"{r.get('failed', 0) + r.get('error', 0) if 'passed' in r else ''} | "
                     f"{r.get('skipped', '')}{': ' + why if why else ''} | "
                     f"{r.get('amd_packs', '')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", help="comma-separated versions (default: all from 3.2)")
    ap.add_argument("--list", action="store_true", help="print the versions offered and stop")
    ap.add_argument("--keep", action="store_true", help="keep each version's venv")
    ap.add_argument("--work", type=Path, help="where the venvs go (default: a temporary dir)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds for one version's tests")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results"
                    / "triton-versions.jsonl")
    args = ap.parse_args(argv)
    python = sys.executable
    versions = args.versions.split(",") if args.versions else offered(python)
    if args.list:
        print(" ".join(versions))
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="kdb-triton-versions-"))
    work.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for version in versions:
        print(f"triton {version}: installing and testing in {work} ...", file=sys.stderr,
              flush=True)
        row = run_one(python, version, work, args.keep, args.timeout)
        rows.append(row)
        with args.out.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        print(f"triton {version}: {row['result']} {row.get('detail', '')[:600]}",
              file=sys.stderr, flush=True)
    print(table(rows))
    return 0 if all(r["result"] == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
