"""The test suite on each CPython kdb supports (``requires-python``), one venv each.

``make test`` runs on the machine's ``python3`` only. This runs the suite (or the pytest
arguments given after ``--``) under every ``python3.X`` the machine has from 3.10 on, each
in a venv of its own with kdb installed from this tree with its test extras (not Triton or
torch: their tests skip), and prints a table: the version, what pytest said, seconds.

A maintainer's tool, not for CI (a suite's time per version). Nothing here is imported by
the library.

    python3 tools/python_versions.py                      # every python3.X found
    python3 tools/python_versions.py --versions 3.10,3.13 -- tests/test_opencl.py
    python3 tools/python_versions.py --python ~/.pyenv/versions/3.13.0/bin/python3
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
OLDEST = (3, 10)
EXTRAS = "opencl,pack,postgres,test"


def interpreters(wanted: list[str] | None, given: list[str]) -> dict[str, str]:
    """``{"3.12": "/path/to/python3.12"}``: the interpreters ``given``, then each
    ``python3.X`` on ``PATH`` that runs (a pyenv shim of a version not selected does not)."""
    found: dict[str, str] = {}
    for path in [*given, *(shutil.which(f"python3.{m}") for m in range(OLDEST[1], 20))]:
        if not path:
            continue
        try:
            out = subprocess.run([path, "-c", "import sys, venv; print('%d.%d' % "
                                  "sys.version_info[:2])"], capture_output=True, text=True,
                                 timeout=60)
        except OSError:
            continue
        version = out.stdout.strip()
        if out.returncode == 0 and version not in found and (wanted is None
                                                             or version in wanted):
            found[version] = path
    return dict(sorted(found.items(), key=lambda kv: tuple(map(int, kv[0].split(".")))))


def run_suite(version: str, python: str, work: Path, pytest_args: list[str]) -> dict:
    """Make the venv, install kdb into it, run pytest there; what it said and how long."""
    venv = work / f"py{version}"
    started = time.monotonic()
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    vpy = str(venv / "bin" / "python")
    install = subprocess.run([vpy, "-m", "pip", "install", "--quiet", "-e",
                              f"{REPO}[{EXTRAS}]"], capture_output=True, text=True)
    if install.returncode != 0:
        return {"python": version, "result": "install failed: "
                + (install.stderr.strip().splitlines() or ["?"])[-1], "seconds": 0}
    began = time.monotonic()
    proc = subprocess.run([vpy, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
                          cwd=REPO, capture_output=True, text=True)
    summary = [ln for ln in proc.stdout.splitlines() if re.search(r"\d+ (passed|failed)", ln)]
    failed = [ln for ln in proc.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    return {"python": version, "exit": proc.returncode,
            "result": (summary[-1].strip("= ") if summary else proc.stdout[-300:].strip()),
            "failed": failed, "seconds": round(time.monotonic() - began),
            "setup_seconds": round(began - started)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    pytest_args = ["-n", "2", "--dist", "loadfile"]
    if "--" in argv:
        at = argv.index("--")
        argv, pytest_args = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", help="comma-separated, e.g. 3.10,3.13 (default: all)")
    parser.add_argument("--python", action="append", default=[],
                        help="an interpreter to use as well (repeat it), e.g. one pyenv holds")
    args = parser.parse_args(argv)
    found = interpreters(args.versions.split(",") if args.versions else None, args.python)
    if not found:
        print("no CPython from 3.10 on was found (PATH, --python)", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="kdb-pythons-") as tmp:
        for version, python in found.items():
            print(f"CPython {version} ({python}) ...", file=sys.stderr, flush=True)
            row = run_suite(version, python, Path(tmp), pytest_args)
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("\n| CPython | pytest | seconds |\n|---|---|---|")
    for row in rows:
        print(f"| {row['python']} | {row['result']} | {row['seconds']} |")
    return 0 if all(row.get("exit") == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
