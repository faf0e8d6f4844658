"""The file format in one module: revision classes, WAL detection, meta rows, the transaction."""

from __future__ import annotations

import ast
import sqlite3
from pathlib import Path

import pytest

from kdb.file import fileformat, migrate
from conftest import sql

KDB = Path(fileformat.__file__).parent.parent  # the kdb package


def connect(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def classify(path: Path) -> fileformat.Status:
    conn = connect(path)
    try:
        return fileformat.classify(conn)
    finally:
        conn.close()


def test_every_kind_of_file_is_classified_with_its_remedy(tmp_path):
    head = tmp_path / "head.kdb"
    migrate.upgrade_sqlite(head)
    assert classify(head) == ("current", fileformat.HEAD, "", "")

    old = tmp_path / "old.kdb"
    migrate.upgrade_sqlite(old, fileformat.REVISIONS[0])
    status = classify(old)
    assert status.kind == "older" and status.readable
    assert "kdb migrate" in status.remedy

    future = tmp_path / "future.kdb"
    migrate.upgrade_sqlite(future)
    sql(future, "UPDATE alembic_version SET version_num = '9999'")
    status = classify(future)
    assert status.kind == "newer" and not status.readable
    assert "newer than this kdb" in status.what and status.remedy == "upgrade kdb"

    foreign = tmp_path / "foreign.kdb"
    sql(foreign, "CREATE TABLE t (x)")
    assert classify(foreign).kind == "foreign"

    # A revision no kdb writes is no kdb file: upgrading kdb, the advice, would never help.
    unknown = tmp_path / "unknown.kdb"
    migrate.upgrade_sqlite(unknown)
    sql(unknown, "UPDATE alembic_version SET version_num = 'abc1'")
    status = classify(unknown)
    assert status.kind == "foreign" and "'abc1' is none kdb writes" in status.what
    assert "upgrade" not in status.remedy

    # Two revisions: alembic refuses to upgrade it, so it is damage, not the first row's.
    two = tmp_path / "two.kdb"
    migrate.upgrade_sqlite(two, fileformat.REVISIONS[-2])
    sql(two, f"INSERT INTO alembic_version VALUES ('{fileformat.HEAD}')")
    with pytest.raises(fileformat.DAMAGE, match="more than one schema revision"):
        classify(two)

    empty = tmp_path / "empty.kdb"
    empty.touch()
    assert classify(empty).kind == "empty"


def test_a_revision_missing_its_tables_is_damage_not_age(tmp_path):
    path = tmp_path / "half.kdb"
    migrate.upgrade_sqlite(path)
    sql(path, "DROP TABLE counters")
    with pytest.raises(fileformat.DAMAGE, match="no table counters"):
        classify(path)


def test_a_revision_older_than_readers_take_is_stale(monkeypatch):
    monkeypatch.setattr(fileformat, "READABLE_FROM", fileformat.REVISIONS[1])
    status = fileformat.status_of(fileformat.REVISIONS[0])
    assert status.kind == "stale" and not status.readable


def test_journal_mode_is_read_from_the_header(tmp_path):
    wal = tmp_path / "wal.kdb"
    sql(wal, "PRAGMA journal_mode=WAL")
    sql(wal, "CREATE TABLE t (x)")
    rollback = tmp_path / "rollback.kdb"
    sql(rollback, "CREATE TABLE t (x)")
    assert fileformat.journal_of(wal) == "wal"
    assert fileformat.journal_of(rollback) == "rollback"
    assert fileformat.journal_of(tmp_path / "missing.kdb") is None
    assert fileformat.wal_size(rollback) == 0
    (tmp_path / "rollback.kdb-wal").write_bytes(b"x" * 7)
    assert fileformat.wal_size(rollback) == 7


def test_meta_rows_are_bumped_and_set(tmp_path):
    path = tmp_path / "m.kdb"
    migrate.upgrade_sqlite(path)
    conn = connect(path)
    try:
        assert fileformat.meta_int(conn, "nothing") == 0
        fileformat.bump_meta(conn, "n", 5)
        fileformat.bump_meta(conn, "n", -2)
        assert fileformat.meta_int(conn, "n") == 3
        fileformat.set_meta(conn, [("arch", "a1"), *fileformat.file_facts(created=7)])
        meta = dict(conn.execute("SELECT name, value FROM meta"))
    finally:
        conn.close()
    assert meta["arch"] == "a1" and meta["created"] == "7" and "kdb_version" in meta


def test_the_transaction_commits_or_rolls_back(tmp_path):
    conn = connect(tmp_path / "t.kdb")
    try:
        conn.execute("CREATE TABLE t (x)")
        with fileformat.transaction(conn):
            conn.execute("INSERT INTO t VALUES (1)")
        with pytest.raises(ZeroDivisionError):
            with fileformat.transaction(conn):
                conn.execute("INSERT INTO t VALUES (2)")
                1 / 0
        assert not conn.in_transaction
        assert conn.execute("SELECT x FROM t").fetchall() == [(1,)]
    finally:
        conn.close()


def test_a_bad_file_is_moved_aside_with_its_wal(tmp_path):
    path = tmp_path / "bad.kdb"
    path.write_bytes(b"junk")
    Path(str(path) + "-wal").write_bytes(b"wal")
    assert fileformat.move_aside(path)
    assert not path.exists()
    assert len(list(tmp_path.glob("bad.kdb.corrupt-*"))) == 2


def _private_uses(tree: ast.AST) -> list[str]:
    """Names starting with ``_`` taken from :mod:`kdb.file.kernelfile` (imported or as attributes)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("kernelfile"):
            out += [a.name for a in node.names if a.name.startswith("_")]
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and isinstance(node.value, ast.Name) and node.value.id == "kernelfile"):
            out.append(node.attr)
    return out


def test_no_module_reaches_into_the_store_or_migrates_with_private_helpers():
    for path in sorted(KDB.rglob("*.py")):
        if path.name == "kernelfile.py":
            continue
        assert _private_uses(ast.parse(path.read_text())) == [], path.name
