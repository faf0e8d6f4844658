"""kdb on the oldest pyopencl its ``opencl`` extra allows that differs where kdb calls it:
pyopencl before 2026.1 takes a program's source as ``str`` only. The pyopencl wheel comes
from the package index (a skip, with the reason, where it cannot be fetched); PoCL, numpy
and kdb are this environment's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, once_per_run, purelib, venv_over

cl = pytest.importorskip("pyopencl")

#: The last pyopencl that takes a source as ``str`` only.
OLD = "2025.2.7"

APP = textwrap.dedent("""
    import json
    import numpy as np
    import pyopencl as cl
    import pyopencl.array as cla
    import kdb.opencl
    from kdb import bookkeeping
    kdb.opencl.install()
    plat = [p for p in cl.get_platforms() if "Portable Computing Language" in p.name][0]
    ctx = cl.Context(plat.get_devices()[:1])
    q = cl.CommandQueue(ctx)
    a = cla.to_device(q, np.arange(64, dtype=np.float32))
    ok = bool(((a + a).get() == 2 * np.arange(64)).all()) and float(cla.sum(a).get()) == 2016.0
    print(json.dumps({"version": cl.VERSION, "ok": ok,
                      "compiles": len(bookkeeping.records())}))
""")


@pytest.fixture(scope="module")
def old_pyopencl(tmp_path_factory) -> Path:
    """A venv holding pyopencl OLD, over this environment's packages."""
    def make(root: Path) -> None:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                               "--quiet", "--only-binary=:all:", f"pyopencl=={OLD}", "-d",
                               str(root / "wheels")], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode == 0:
            venv_over(root / "venv", purelib(Path(sys.executable)),
                      *(root / "wheels").glob("pyopencl-*.whl"))

    root = once_per_run(tmp_path_factory, f"pyopencl-{OLD}", make)
    if not (root / "venv").is_dir():
        pytest.skip(f"pyopencl=={OLD} could not be fetched from the package index")
    return root / "venv" / "bin" / "python"


def _env(cache: Path, pocl: Path) -> dict[str, str]:
    """The child's environment: this one's OpenCL; where that is the PoCL bundled in this
    environment's pyopencl wheel, its ICD file named (the old wheel bundles none)."""
    env = dict(os.environ, KDB_CACHE_DIR=str(cache), POCL_CACHE_DIR=str(pocl),
               KDB_STORE_AT_EXIT="detach", PYTHONPATH=str(REPO))
    vendors = Path(env.get("OCL_ICD_VENDORS", "/nonexistent"))
    if not (vendors.is_file() or (vendors.is_dir() and any(vendors.glob("*.icd")))):
        libs = Path(cl.__file__).parent / ".libs"
        if not (libs / "pocl.icd").is_file():
            pytest.skip("no PoCL the old pyopencl can load")
        env.update(OCL_ICD_VENDORS=str(libs / "pocl.icd"),
                   LD_LIBRARY_PATH=f"{libs}:{env.get('LD_LIBRARY_PATH', '')}")
    return env


def test_an_older_pyopencl_is_stored_and_served(old_pyopencl, tmp_path):
    """Under pyopencl 2025.2.7 every store of the store worker failed (a TypeError: kdb gave
    the source as bytes) and the next start crashed on the first program it was served (its
    early entry's build). Each start now builds, stores, and the next is served."""
    from kdb.storing import spool

    cache = tmp_path / "cache"
    runs = []
    for i in range(2):
        proc = subprocess.run([str(old_pyopencl), "-c", APP], capture_output=True, text=True,
                              timeout=300, env=_env(cache, tmp_path / f"pocl-{i}"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        assert spool.wait(cache / "v1", 300) == 0
    assert runs[0]["version"][:2] == [2025, 2] and all(r["ok"] for r in runs), runs
    assert runs[0]["compiles"] > 0 and runs[1]["compiles"] == 0, runs
    log = cache / "v1" / "store-worker.log"
    assert "could not store" not in (log.read_text() if log.exists() else ""), log.read_text()
