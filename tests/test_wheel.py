"""The wheel, built and installed into a new virtual environment, works from its installed copy.

This is what a user gets from ``pip install kdb``: the alembic migrations must ship inside
the package and run without the source tree.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import run_checked

pytestmark = pytest.mark.slow


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    return run_checked(cmd, cwd, env).stdout


@pytest.fixture
def installed_venv(kdb_venv) -> Path:
    """The session's new virtual environment with the kdb wheel installed (conftest)."""
    return kdb_venv


def test_installed_kdb_info_runs(installed_venv, tmp_path):
    out = _run([str(installed_venv / "bin" / "kdb"), "info"], cwd=tmp_path,
               env={"KDB_CACHE_DIR": str(tmp_path / "c")})
    assert "user tier" in out.lower()


def test_installed_copy_migrates_from_its_own_package(installed_venv, tmp_path):
    code = """
import json, kdb, kdb.file.migrate
db = kdb.KernelDB(cache_dir=%r)
attrs = kdb.HashAttributes(backend="test", source="k", arch="sm_90")
assert db.get_or_compile(attrs, lambda: b"cubin") == b"cubin"
db.flush()
print(json.dumps({"migrations": str(kdb.file.migrate.migrations_dir()), "kdb": kdb.__file__,
                  "hit": db.lookup(attrs).tier}))
""" % str(tmp_path / "c")
    out = _run([str(installed_venv / "bin" / "python"), "-c", code], cwd=tmp_path)
    info = json.loads(out.strip().splitlines()[-1])
    site = str(installed_venv)
    assert info["kdb"].startswith(site) and info["migrations"].startswith(site)
    assert info["migrations"].endswith(os.path.join("kdb", "migrations"))
    assert info["hit"] == "user"
    assert (tmp_path / "c" / "v1" / "sm_90.kdb").is_file()
