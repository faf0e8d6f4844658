"""What tools/triton_versions.py and tools/torch_versions.py share: the versions the package
registry offers, one virtual environment per version with kdb installed beside that version,
a test file run in it, one JSON line per version as it goes, and the command line.

A maintainer's tool, not for CI: each version is a venv of one to several GB and minutes of
tests on 2 cores. Nothing here is imported by the library.
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
from typing import Callable

REPO = Path(__file__).resolve().parent.parent


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def offered(python: str, package: str, oldest: tuple[int, ...]) -> list[str]:
    """The plain releases of ``package`` the registry offers this interpreter, oldest
    first, from ``oldest`` on (local builds such as ``2.13.0+cpu`` left out)."""
    out = subprocess.run([python, "-m", "pip", "index", "versions", package],
                         capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("Available versions:"))
    versions = [v.strip() for v in line.split(":", 1)[1].split(",")]
    keep = [v for v in versions if re.fullmatch(r"\d+\.\d+\.\d+", v)
            and version_tuple(v) >= oldest]
    return sorted(keep, key=version_tuple)


def newest_patches(versions: list[str]) -> list[str]:
    """The newest patch release of each minor version."""
    by_minor: dict[tuple[int, ...], str] = {}
    for v in sorted(versions, key=version_tuple):
        by_minor[version_tuple(v)[:2]] = v
    return list(by_minor.values())


def summary(stdout: str) -> dict:
    """pytest's closing counts: passed, failed, skipped, errors."""
    last = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", last)}
    return {k: counts.get(k, 0) for k in ("passed", "failed", "skipped", "error")}


def run_in_venv(python: str, name: str, requirements: list[str], test_file: str, work: Path,
                keep: bool, timeout: int, extra: Callable[[str], dict] | None = None) -> dict:
    """A fresh venv ``work/name`` with ``requirements`` installed, then ``test_file`` run
    in it; the row: install and test seconds, pytest's counts, the skips' reasons, the
    failures, and what ``extra(venv python)`` adds."""
    venv = work / name
    shutil.rmtree(venv, ignore_errors=True)
    row: dict = {"python": sys.version.split()[0]}
    start = time.monotonic()
    try:
        subprocess.run([python, "-m", "venv", str(venv)], check=True, capture_output=True)
        vpy = str(venv / "bin" / "python")
        install = subprocess.run(
            [vpy, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             *requirements], capture_output=True, text=True)
        row["install_s"] = round(time.monotonic() - start, 1)
        if install.returncode != 0:
            said = [ln for ln in (install.stdout + install.stderr).splitlines()
                    if ln.strip() and not ln.startswith("WARNING: Location")]
            why = [ln.strip() for ln in said if "requested" in ln or "conflict" in ln.lower()]
            row.update(result="install failed", detail="; ".join(why or said)[-800:])
            return row
        tests = time.monotonic()
        proc = subprocess.run(
            [vpy, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "--tb=short",
             str(REPO / "tests" / test_file)], capture_output=True, text=True, cwd=REPO,
            timeout=timeout)
        row["tests_s"] = round(time.monotonic() - tests, 1)
        log = work / f"{name}.log"
        log.write_text(proc.stdout + proc.stderr, encoding="utf-8")
        row["log"] = str(log)
        row.update(summary(proc.stdout), result="pass" if proc.returncode == 0 else "fail",
                   skips=sorted({ln.split(": ", 1)[-1].strip() for ln in proc.stdout.splitlines()
                                 if ln.startswith("SKIPPED")}))
        if proc.returncode != 0:
            row["detail"] = "\n".join(ln for ln in proc.stdout.splitlines()
                                      if ln.startswith(("FAILED", "ERROR")))[-2000:] \
                or proc.stdout[-2000:]
        if extra is not None:
            row.update(extra(vpy))
    except subprocess.TimeoutExpired:
        row.update(result=f"timed out after {timeout} s")
    except (OSError, subprocess.CalledProcessError) as err:
        row.update(result="error", detail=str(err)[-800:])
    finally:
        if not keep:
            shutil.rmtree(venv, ignore_errors=True)
    return row


def failed_count(row: dict) -> int | str:
    return row.get("failed", 0) + row.get("error", 0) if "passed" in row else ""


def main(argv: list[str] | None, *, doc: str, package: str, oldest: tuple[int, ...],
         default: Callable[[list[str]], list[str]], run_one: Callable[..., dict],
         table: Callable[[list[dict]], str], timeout: int) -> int:
    """The command line both scripts share: ``--versions``, ``--list``, ``--keep``,
    ``--work``, ``--timeout``, ``--out``; runs ``run_one(python, version, work, keep,
    timeout)`` per version and prints ``table(rows)``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--versions", help="comma-separated versions (default: see above)")
    ap.add_argument("--all", action="store_true", help="every release offered, not only the "
                    "default choice")
    ap.add_argument("--list", action="store_true", help="print the versions offered and stop")
    ap.add_argument("--keep", action="store_true", help="keep each version's venv")
    ap.add_argument("--work", type=Path, help="where the venvs go (default: a temporary dir)")
    ap.add_argument("--timeout", type=int, default=timeout,
                    help="seconds for one version's tests")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results"
                    / f"{package}-versions.jsonl")
    args = ap.parse_args(argv)
    python = sys.executable
    everything = offered(python, package, oldest)
    versions = (args.versions.split(",") if args.versions
                else everything if args.all else default(everything))
    if args.list:
        print(" ".join(versions))
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix=f"kdb-{package}-versions-"))
    work.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for version in versions:
        print(f"{package} {version}: installing and testing in {work} ...", file=sys.stderr,
              flush=True)
        row = {package: version, **run_one(python, version, work, args.keep, args.timeout)}
        rows.append(row)
        with args.out.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{package} {version}: {row['result']} {row.get('detail', '')[:600]}",
              file=sys.stderr, flush=True)
    print(table(rows))
    return 0 if all(r["result"] == "pass" for r in rows) else 1
