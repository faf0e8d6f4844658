#!/usr/bin/env python3
"""Runs kdb's torch.compile tests (tests/test_torch.py) against the torch releases the package
registry offers from 2.7 on (the first with ``torch.compiler.save_cache_artifacts``), each in
a virtual environment of its own, and prints the table that docs/torch.md holds.

Not for CI: the registry's torch is the CUDA build, which pulls NVIDIA's libraries (about
4 GB a venv; the tests run Inductor's CPU backend all the same) and takes minutes to install
and test on 2 cores. Each venv is removed after its run unless --keep is given.

    python3 tools/torch_versions.py                     # the newest patch of each minor, 2.7 on
    python3 tools/torch_versions.py --all               # every release from 2.7 on
    python3 tools/torch_versions.py --versions 2.7.1,2.15.0
    python3 tools/torch_versions.py --list              # what would run, nothing run

kdb is installed with its opencl and test extras and ``torch==<version>`` (not its torch
extra, whose floor is the newest torch tested: this is how an older one gets tested).
Writes the results, one JSON line per version, to --out (default
benchmarks/results/torch-versions.jsonl, ignored by git) as it goes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import version_matrix as vm

#: The first torch with the public interface the issue names (torch.compiler's mega-cache).
OLDEST = (2, 7)


def run_one(python: str, version: str, work: Path, keep: bool, timeout: int) -> dict:
    return vm.run_in_venv(python, f"torch-{version}",
                          ["-e", f"{vm.REPO}[opencl,test]", f"torch=={version}"],
                          "test_torch.py", work, keep, timeout)


def table(rows: list[dict]) -> str:
    lines = ["| torch | tests/test_torch.py | passed | failed | skipped, and why |",
             "|---|---|---|---|---|"]
    for r in rows:
        why = "; ".join(r.get("skips", []))
        lines.append(f"| {r['torch']} | {r['result']} | {r.get('passed', '')} | "
                     f"{vm.failed_count(r)} | {r.get('skipped', '')}{': ' + why if why else ''} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return vm.main(argv, doc=__doc__, package="torch", oldest=OLDEST,
                   default=vm.newest_patches, run_one=run_one, table=table, timeout=2400)


if __name__ == "__main__":
    sys.exit(main())
