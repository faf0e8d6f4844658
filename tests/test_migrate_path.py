"""Migrations run from an install path alembic's configparser would misread (a ``%``)."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import kdb
from kdb.file import migrate


def test_migrations_run_from_a_path_with_a_percent_sign(tmp_path):
    root = tmp_path / "site 100%done"
    src = Path(kdb.__file__).parent
    shutil.copytree(src, root / "kdb", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(migrate.migrations_dir(), root / "kdb" / "migrations",
                    ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    target = tmp_path / "a1.kdb"
    code = ("import sys, kdb.file.migrate as m; assert m.__file__.startswith(sys.argv[2]), m.__file__; "
            "print(m.migrations_dir()); m.upgrade_sqlite(__import__('pathlib').Path(sys.argv[1]))")
    proc = subprocess.run([sys.executable, "-c", code, str(target), str(root)], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "%" in proc.stdout
    conn = sqlite3.connect(target)
    try:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [
            (migrate.HEAD,)]
    finally:
        conn.close()


def test_the_config_escapes_the_percent_sign(monkeypatch, tmp_path):
    where = tmp_path / "50%"
    monkeypatch.setattr(migrate, "migrations_dir", lambda: where)
    assert migrate.alembic_config().get_main_option("script_location") == str(where)
