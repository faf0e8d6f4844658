"""Shared fixtures: every test gets its own kdb cache directory; PoCL is the real device."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

# Nothing a test does may touch the real home cache, in this process or its children.
_SESSION_TMP = Path(tempfile.mkdtemp(prefix="kdb-tests-"))
os.environ["KDB_CACHE_DIR"] = str(_SESSION_TMP / "kdb-cache")
os.environ.setdefault("POCL_CACHE_DIR", str(_SESSION_TMP / "pocl-cache"))
for _var in ("KDB_SYSTEM_DB_PATH", "KDB_DISABLE_CACHE", "KDB_STRICT", "KDB_TRACE"):
    os.environ.pop(_var, None)

TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parent


@pytest.fixture(autouse=True)
def _fresh_process_state():
    """Forget once-per-process warnings and this process's compile log between tests."""
    from kdb import background, faults, latency

    faults.reset()
    latency.reset()
    yield
    background.drain()
    faults.reset()
    latency.reset()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    """A private KDB_CACHE_DIR for this test (the user tier lives in ``<it>/v1``)."""
    d = tmp_path / "cache"
    monkeypatch.setenv("KDB_CACHE_DIR", str(d))
    return d


@pytest.fixture(scope="session")
def cl_ctx():
    """A context on the PoCL CPU device (skips if pyopencl/PoCL are absent)."""
    cl = pytest.importorskip("pyopencl")
    for plat in cl.get_platforms():
        if "Portable Computing Language" in plat.name:
            return cl.Context(plat.get_devices())
    pytest.skip("no PoCL platform")


@pytest.fixture
def run_py(tmp_path):
    """Run Python code in a fresh interpreter; returns the CompletedProcess (text mode).

    Each call gets its own POCL_CACHE_DIR unless ``env`` sets one, so concurrent children
    never share PoCL's cache (see DESIGN section 11).
    """
    counter = iter(range(10**6))

    def run(code: str, env: dict[str, str] | None = None, check: bool = True,
            timeout: float = 300) -> subprocess.CompletedProcess:
        full = dict(os.environ)
        full["POCL_CACHE_DIR"] = str(tmp_path / f"pocl-{next(counter)}")
        full.update(env or {})
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full,
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"child failed ({proc.returncode})\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
        return proc

    return run
