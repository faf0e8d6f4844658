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

import subprocess
import sys
from pathlib import Path

import version_matrix as vm

OLDEST = (3, 2)


def run_one(python: str, version: str, work: Path, keep: bool, timeout: int) -> dict:
    """A fresh venv with kdb (editable, its opencl and test extras) and Triton == version;
    then the Triton tests in it, and whether kdb pack keys an AMD launch there."""
    return vm.run_in_venv(python, f"triton-{version}",
                          ["-e", f"{vm.REPO}[opencl,test]", f"triton=={version}"],
                          "test_triton.py", work, keep, timeout,
                          extra=lambda vpy: {"amd_packs": _amd_packs(vpy, work)})


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


def table(rows: list[dict]) -> str:
    lines = ["| Triton | tests/test_triton.py | passed | failed | skipped, and why | "
             "kdb pack keys an AMD launch without torch |", "|---|---|---|---|---|---|"]
    for r in rows:
        why = "; ".join(r.get("skips", []))
        lines.append(f"| {r['triton']} | {r['result']} | {r.get('passed', '')} | "
                     f"{vm.failed_count(r)} | "
                     f"{r.get('skipped', '')}{': ' + why if why else ''} | "
                     f"{r.get('amd_packs', '')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return vm.main(argv, doc=__doc__, package="triton", oldest=OLDEST, default=lambda v: v,
                   run_one=run_one, table=table, timeout=1800)


if __name__ == "__main__":
    sys.exit(main())
