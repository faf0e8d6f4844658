"""Schema revisions: one alembic chain, pinned to the SQLAlchemy schema; old files upgraded
on open, files from the future left alone."""

from __future__ import annotations

import logging
import os
import select
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kdb import HashAttributes, KernelDB
from kdb.file import codec, migrate
from conftest import sql

BINARY = b"an old kernel binary " * 100


def attrs(source: str = "__kernel void old() {}") -> HashAttributes:
    return HashAttributes(backend="test", source=source, arch="a1", name="old")


def tables(path) -> dict[str, tuple]:
    """Every table's columns (name, type, not null, default, pk) and indexes, from SQLite."""
    conn = sqlite3.connect(path)
    try:
        names = [r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")]
        return {
            t: (sorted(r[1:] for r in conn.execute(f"PRAGMA table_info({t})")),
                sorted((r[1], r[2]) for r in conn.execute(f"PRAGMA index_list({t})")))
            for t in names
        }
    finally:
        conn.close()


def file_at_0001(path: Path, a: HashAttributes, raw: bytes = BINARY,
                 journal: str = "wal") -> Path:
    """A user file as kdb at revision 0001 wrote it, holding one entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sql(path, f"PRAGMA journal_mode={journal}")
    migrate.upgrade_sqlite(path, "0001")
    kind, blob = codec.encode(raw)
    sql(path,
        "INSERT INTO kernels (key, arch, backend, name, attributes, codec, dict_id, blob, "
        "raw_size, stored_size, checksum, compile_seconds, created, last_access, hits) "
        "VALUES (?, ?, ?, ?, ?, ?, NULL, ?, ?, ?, ?, 0.5, 1.0, 1.0, 3)",
        (a.key, a.arch, a.backend, a.name, a.encoded().decode(), kind, blob, len(raw),
         len(blob), codec.checksum(raw)))
    sql(path, "INSERT INTO meta (name, value) VALUES ('stored_bytes', ?)", (str(len(blob)),))
    return path


# -- the revision chain --------------------------------------------------------------------

def test_revisions_match_the_alembic_scripts():
    assert migrate.REVISIONS == tuple(migrate.script_revisions())
    assert migrate.script_heads() == [migrate.HEAD]
    assert migrate.HEAD == migrate.REVISIONS[-1]


def test_migrations_are_found_by_absolute_path():
    d = migrate.migrations_dir()
    assert d.is_absolute() and (d / "env.py").is_file()
    assert migrate.alembic_config().get_main_option("script_location") == str(d)


def test_schema_at_head_equals_the_sqlalchemy_metadata(tmp_path):
    from sqlalchemy import create_engine

    from kdb.file import schema

    migrated = tmp_path / "migrated.kdb"
    migrate.upgrade_sqlite(migrated)
    declared = tmp_path / "declared.kdb"
    engine = create_engine(f"sqlite:///{declared}")
    schema.metadata.create_all(engine)
    engine.dispose()

    got = tables(migrated)
    assert got.pop("alembic_version")[0][0][0] == "version_num"
    assert got == tables(declared)
    assert set(got) == set(schema.metadata.tables)
    for name, table in schema.metadata.tables.items():
        assert sorted(c[0] for c in got[name][0]) == sorted(c.name for c in table.columns)


def test_alembic_sees_no_difference_at_head(tmp_path):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlalchemy import create_engine

    from kdb.file import schema

    path = tmp_path / "head.kdb"
    migrate.upgrade_sqlite(path)
    engine = create_engine(f"sqlite:///{path}")
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), schema.metadata) == []
    engine.dispose()


def test_a_new_file_is_made_as_the_migrations_make_it(tmp_path):
    """The statements a new user file is made from (no alembic) are what the migrations
    leave at the head: after a new revision, ``python -m kdb.file.migrate`` prints them."""
    migrated = tmp_path / "migrated.kdb"
    migrate.upgrade_sqlite(migrated)
    conn = sqlite3.connect(migrated)
    try:
        now = migrate.snapshot(conn)
    finally:
        conn.close()
    head = (migrate.HEAD_SCHEMA_REVISION, migrate.HEAD_SCHEMA, migrate.HEAD_ROWS)
    assert head == (migrate.HEAD, *now), \
        "kdb/file/migrate.py's head schema is stale; it is now:\n" + migrate.render(
            migrate.HEAD, *now)


def test_a_first_write_imports_neither_alembic_nor_sqlalchemy(cache_dir, run_py, tmp_path):
    """A cold cache's first store (a program's exit keeping PoCL's files, a store worker's
    lane) makes the user file without importing the migrations, and makes the file they
    would have made."""
    proc = run_py("""
        import sys
        import kdb
        db = kdb.KernelDB(use_system=False)
        ok = db.put(kdb.HashAttributes(backend="test", source="__kernel void k() {}",
                                       arch="a1", name="k"), b"a binary")
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("alembic", "sqlalchemy"))
        print(ok, heavy)
    """)
    assert proc.stdout.split() == ["True", "[]"], proc.stderr
    made = cache_dir / "v1" / "a1.kdb"
    assert revision(made) == migrate.HEAD
    assert sql(made, "SELECT name FROM kernels") == [("k",)]
    migrated = tmp_path / "migrated.kdb"
    migrate.upgrade_sqlite(migrated)
    assert tables(made) == tables(migrated)
    assert sql(made, "SELECT value FROM meta WHERE name = 'entries'") == [("1",)]
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlalchemy import create_engine

    from kdb.file import schema

    engine = create_engine(f"sqlite:///{made}")
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), schema.metadata) == []
    engine.dispose()


def test_the_hot_path_reads_columns_the_schema_has(tmp_path):
    from kdb.file import schema, kernelfile as store

    selected = store._FETCH.split("SELECT ", 1)[1].split(" FROM", 1)[0].split(", ")
    assert set(selected) - {"NULL"} <= {c.name for c in schema.kernels.columns}
    assert "attributes" not in selected  # a hit never reads the attributes themselves
    # A file before revision 0006 is read with the whole text, as it is.
    old = tmp_path / "old.kdb"
    migrate.upgrade_sqlite(old, "0005")
    whole = store._FETCH_WHOLE.split("SELECT ", 1)[1].split(" FROM", 1)[0].split(", ")
    assert set(whole) <= {r[0] for r in sql(old, "SELECT name FROM pragma_table_info('kernels')")}


def test_every_revision_downgrades_and_upgrades_again(tmp_path):
    from alembic import command
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    path = tmp_path / "round.kdb"
    migrate.upgrade_sqlite(path)
    head = tables(path)
    engine = create_engine(f"sqlite:///{path}", poolclass=NullPool)
    with engine.begin() as conn:
        command.downgrade(migrate.alembic_config(connection=conn), "base")
    engine.dispose()
    assert set(tables(path)) == {"alembic_version"}
    migrate.upgrade_sqlite(path)
    assert tables(path) == head


# -- opening old and new files -------------------------------------------------------------

@pytest.mark.parametrize("journal", ["wal", "delete"])
def test_file_at_0001_is_read_as_it_is_and_upgraded_by_the_first_write(cache_dir, journal):
    a = attrs()
    path = file_at_0001(cache_dir / "v1" / "a1.kdb", a, journal=journal)
    assert revision(path) == "0001"
    before = tables(path)

    db = KernelDB()
    hit = db.lookup(a)
    assert hit is not None and hit.binary == BINARY and hit.tier == "user"
    assert hit.compile_seconds == 0.5
    assert revision(path) == "0001"  # a lookup never migrates
    assert tables(path) == before
    # The first write upgrades it, and the upgraded file takes new entries.
    assert db.get_or_compile(attrs("__kernel void new() {}"), lambda: b"new") == b"new"
    db.flush()
    assert revision(path) == migrate.HEAD
    assert sql(path, "SELECT name, details, hits FROM kernels WHERE key = ?", (a.key,)) == [
        ("old", "{}", 4)]
    assert not list(path.parent.glob("*.corrupt-*"))
    assert sql(path, "SELECT count(*) FROM kernels") == [(2,)]
    assert sql(path, "SELECT count(*) FROM compile_log") == [(1,)]
    assert dict(sql(path, "SELECT name, value FROM counters"))["hits.user"] == 1


def test_a_hit_from_an_older_file_imports_no_migration_code(cache_dir, run_py):
    a = attrs()
    path = file_at_0001(cache_dir / "v1" / "a1.kdb", a)
    (cache_dir / "v1").chmod(0o700)
    path.chmod(0o600)
    proc = run_py(f"""
        import sys
        import kdb
        db = kdb.KernelDB(use_system=False)
        hit = db.lookup(kdb.HashAttributes(backend="test", source={a.source!r}, arch="a1",
                                           name="old"))
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("alembic", "sqlalchemy")
                       or m == "kdb.file.migrate")
        print(hit is not None and hit.binary == {BINARY!r}, heavy)
        sys.stdout.flush()
        import os
        os._exit(0)  # no exit-time flush: only the lookup is observed
    """)
    assert proc.stdout.split() == ["True", "[]"], proc.stderr
    assert revision(path) == "0001"


def revision(path: Path) -> str | None:
    conn = sqlite3.connect(path)
    try:
        return migrate.revision_of(conn)
    finally:
        conn.close()


def test_upgrade_to_0003_computes_the_running_totals(tmp_path):
    path = file_at_0001(tmp_path / "sm_90.kdb", attrs(), raw=BINARY)
    migrate.upgrade_sqlite(path)
    meta = dict(sql(path, "SELECT name, value FROM meta"))
    [(stored,)] = sql(path, "SELECT stored_size FROM kernels")
    assert (meta["entries"], meta["raw_bytes"], meta["stored_bytes"]) == (
        "1", str(len(BINARY)), str(stored))


def test_revision_of_a_fresh_file_is_none(tmp_path):
    conn = sqlite3.connect(tmp_path / "empty.kdb")
    assert migrate.revision_of(conn) is None
    conn.close()


def test_file_from_a_future_revision_is_left_untouched(cache_dir, caplog):
    a = attrs()
    db = KernelDB()
    db.put(a, BINARY)
    db.close()
    path = cache_dir / "v1" / "a1.kdb"
    sql(path, "UPDATE alembic_version SET version_num = '9999'")
    sql(path, "PRAGMA wal_checkpoint(TRUNCATE)")
    before = path.read_bytes()

    calls = []

    def compile_fn():
        calls.append(1)
        return b"compiled by this process"

    db = KernelDB()
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert db.lookup(a) is None
        assert db.get_or_compile(a, compile_fn) == b"compiled by this process"
        db.flush()
        assert db.get_or_compile(a, compile_fn) == b"compiled by this process"
        db.close()
    assert len(calls) == 2
    assert path.read_bytes() == before
    assert sql(path, "SELECT version_num FROM alembic_version") == [("9999",)]
    assert sql(path, "SELECT count(*) FROM compile_log") == [(0,)]
    notes = [r.getMessage() for r in caplog.records if "9999" in r.getMessage()]
    assert len(notes) == 1
    assert str(path) in notes[0] and "newer" in notes[0] and "Upgrade kdb" in notes[0]
    assert not list(path.parent.glob("*.corrupt-*"))


def test_a_system_file_from_a_newer_kdb_is_named_with_the_system_path_not_the_cache(
        tmp_path, cache_dir, monkeypatch, caplog):
    """The advice was the user tier's ("point KDB_CACHE_DIR elsewhere"), which has nothing to
    do with a system file."""
    system = tmp_path / "system"
    system.mkdir(mode=0o755)
    path = system / "a1.kdb"
    migrate.upgrade_sqlite(path)
    sql(path, "UPDATE alembic_version SET version_num = '9999'")
    path.chmod(0o644)
    monkeypatch.setenv("KDB_SYSTEM_DB_PATH", str(system))
    with caplog.at_level(logging.WARNING, logger="kdb"):
        db = KernelDB()
        assert db.lookup(attrs()) is None
        db.close()
    [note] = [r.getMessage() for r in caplog.records if "9999" in r.getMessage()]
    assert "KDB_SYSTEM_DB_PATH" in note and "KDB_CACHE_DIR" not in note, note


def test_a_file_naming_two_revisions_is_found_by_verify_and_set_aside_by_a_write(
        cache_dir, caplog):
    """alembic refuses to upgrade or stamp a file whose alembic_version holds two rows, so
    it was never written again, while `kdb verify` called it sound (the first row's)."""
    from click.testing import CliRunner

    from kdb.cli import cli

    db = KernelDB()
    db.put(attrs(), BINARY)
    db.close()
    path = cache_dir / "v1" / "a1.kdb"
    sql(path, "INSERT INTO alembic_version VALUES ('0005')")
    said = CliRunner().invoke(cli, ["verify"])
    assert said.exit_code == 1 and "more than one schema revision" in said.output, said.output
    db = KernelDB()
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert db.get_or_compile(attrs(source="new"), lambda: b"new") == b"new"
        db.flush()
    db.close()
    assert list(path.parent.glob("a1.kdb.corrupt-*"))  # set aside, a new file in its place
    assert sql(path, "SELECT count(*) FROM alembic_version") == [(1,)]
    assert KernelDB().lookup(attrs(source="new")).binary == b"new"


def test_two_processes_upgrade_an_old_file_at_once(cache_dir, run_py):
    a = attrs()
    path = file_at_0001(cache_dir / "v1" / "a1.kdb", a)
    start = time.time() + 2.0  # both children open the file at the same moment
    code = f"""
        import time
        import kdb
        a = kdb.HashAttributes(backend="test", source={a.source!r}, arch="a1")
        db = kdb.KernelDB()
        time.sleep(max(0.0, {start!r} - time.time()))
        hit = db.lookup(a)
        print(hit.tier if hit else "miss", hit is not None and hit.binary == {BINARY!r})
        db.flush()
    """
    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda _: run_py(code), range(2)))
    for proc in procs:
        assert proc.stdout.split() == ["user", "True"], proc.stderr
        assert "Traceback" not in proc.stderr
    conn = sqlite3.connect(path)
    assert migrate.revision_of(conn) == migrate.HEAD
    conn.close()
    assert dict(sql(path, "SELECT name, value FROM counters"))["hits.user"] == 2


def blocked_file_at_0001(path: Path, a: HashAttributes) -> Path:
    """A 0001 file whose upgrade to 0002 fails (an index of that name already exists)."""
    file_at_0001(path, a)
    sql(path, "CREATE INDEX ix_kernels_name ON meta (name)")
    return path


def test_a_failed_upgrade_changes_nothing(tmp_path):
    path = blocked_file_at_0001(tmp_path / "a1.kdb", attrs())
    before = tables(path)
    with pytest.raises(Exception, match="ix_kernels_name"):
        migrate.upgrade_sqlite(path)
    assert tables(path) == before  # one transaction: no half-migrated file
    assert sql(path, "SELECT version_num FROM alembic_version") == [("0001",)]


def test_a_failed_upgrade_on_write_is_a_warning_not_a_crash(cache_dir, caplog):
    a = attrs()
    path = blocked_file_at_0001(cache_dir / "v1" / "a1.kdb", a)
    before = tables(path)
    db = KernelDB()
    new = attrs("__kernel void new() {}")
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert db.get(a) == BINARY  # read as it is
        assert db.get_or_compile(new, lambda: b"compiled") == b"compiled"
        assert db.put(new, b"compiled") is False
        db.flush()
    assert "could not be upgraded" in caplog.text and str(path) in caplog.text
    assert tables(path) == before
    assert not list(path.parent.glob("*.corrupt-*"))


def test_a_failed_upgrade_raises_in_strict_mode(cache_dir, monkeypatch):
    from kdb import CacheFaultError

    a = attrs()
    blocked_file_at_0001(cache_dir / "v1" / "a1.kdb", a)
    monkeypatch.setenv("KDB_STRICT", "1")
    assert KernelDB().get(a) == BINARY  # read as it is: a lookup does not upgrade
    with pytest.raises(CacheFaultError, match="could not be upgraded"):
        KernelDB().put(attrs("__kernel void new() {}"), b"new")


def test_the_upgrade_lock_is_never_removed_from_under_its_holder(tmp_path):
    """``kdb clear`` removes ``<file>.lock`` only while no upgrader holds it; a waiter that
    opened a lock file removed meanwhile (by hand) locks the file at the path instead, so
    two processes never migrate one new file at once ("table alembic_version already
    exists" beside a ``kdb clear`` loop)."""
    import fcntl
    import os
    import threading

    from kdb.admin.maintenance import clear
    from kdb.file.migrate import file_lock

    db, lock = tmp_path / "a.kdb", tmp_path / "a.kdb.lock"
    with file_lock(db):
        assert clear([lock]) == ([], [])  # held: left alone
        assert lock.exists()
    assert clear([lock]) == ([str(lock)], [])  # not held: removed

    held, release, inside, done = (threading.Event() for _ in range(4))

    def holder():
        with file_lock(db):
            held.set()
            release.wait(10)

    def waiter():
        with file_lock(db, timeout=10):
            inside.set()
            done.wait(10)

    first = threading.Thread(target=holder)
    first.start()
    held.wait(10)
    second = threading.Thread(target=waiter)
    second.start()  # opens the lock file the holder holds, and waits
    time.sleep(0.2)
    lock.unlink()  # removed by hand while held
    release.set()
    first.join(10)
    assert inside.wait(10)
    fd = os.open(lock, os.O_RDWR)  # the file at the path now: the waiter holds it
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
        done.set()
        second.join(10)


def test_clear_leaves_the_wal_and_shm_of_a_file_made_again_since(tmp_path):
    """``kdb clear`` removes the database, then its ``-wal`` and ``-shm``, by name: a process
    that made a new file in between owns those names now; removing them from under its open
    connection gave it "disk I/O error" (beside a clear loop)."""
    from kdb.admin.maintenance import clear

    db = tmp_path / "a.kdb"
    side = [tmp_path / "a.kdb-wal", tmp_path / "a.kdb-shm"]
    migrate.upgrade_sqlite(db)  # made again before the clear came to its side files
    for p in side:
        p.write_bytes(b"x")  # its own (what they hold does not matter here)
    assert clear(side) == ([], []) and all(p.exists() for p in side)
    db.unlink()  # no database there: they are leftovers
    assert clear(side) == ([str(p) for p in side], [])


def _a_writer_comes(db: Path) -> tuple[subprocess.Popen, bool]:
    """Another process's writer of ``db``, started now, and whether it made the file ready
    within 2 s (it prints ``True`` then, and holds it until its stdin ends)."""
    code = ("import sys; from kdb.file.filewriter import ensure; "
            "from kdb.file.kernelfile import KernelFile; "
            f"f = KernelFile({str(db)!r}, tier='user', readonly=False); "
            "print(ensure(f) is not None, flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code], text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    ready, _, _ = select.select([proc.stdout], [], [], 2)
    return proc, bool(ready)


def test_no_file_is_made_while_clear_removes_the_old_ones_side_files(tmp_path, monkeypatch):
    """``kdb clear`` removes a file, its ``-wal``, then its ``-shm``, by name. A writer that
    made a new file in WAL mode between the last two took the old ``-shm``: where a third
    process held the new file open, the writer's SQLite kept it, clear left it for the new
    file, and two files shared one WAL index ("disk I/O error" in CI, beside a clear loop).
    A writer makes a new file a WAL file only under the file's lock, which clear holds
    while it removes all three: the writer waits for it, then makes its own side files."""
    from kdb.admin.maintenance import clear, clearable
    from kdb.file.filewriter import ensure
    from kdb.file.kernelfile import KernelFile

    db = tmp_path / "a.kdb"
    old = KernelFile(db, tier="user", readonly=False)
    assert ensure(old) is not None  # a live file in WAL mode, held open as a program does
    writers = []
    unlink = Path.unlink

    def unlink_then_a_writer_comes(self, *args, **kwargs):
        unlink(self, *args, **kwargs)
        if self.name.endswith("-wal") and not writers:  # between the -wal and the -shm
            writers.append(_a_writer_comes(db))

    monkeypatch.setattr(Path, "unlink", unlink_then_a_writer_comes)
    try:
        removed, failed = clear(clearable(tmp_path))
    finally:
        monkeypatch.setattr(Path, "unlink", unlink)
    writer, early = writers[0]
    try:
        assert not early, "a writer made a new file while clear was removing the old one's"
        assert not failed and str(db) in removed
        assert writer.stdout.readline().strip() == "True"  # then it makes its own
        assert db.exists() and (tmp_path / "a.kdb-shm").exists()
    finally:
        writer.communicate("", timeout=30)
        old.close()


def test_no_file_is_made_while_a_bad_one_and_its_side_files_are_moved_aside(tmp_path,
                                                                            monkeypatch):
    """A process that finds its user file damaged moves it, its ``-wal`` and its ``-shm``
    aside, by name, as ``kdb clear`` removes them: under the file's lock, so that a writer
    never makes a new file that takes the old ``-shm`` between the moves."""
    from kdb.file.filewriter import ensure
    from kdb.file.kernelfile import KernelFile

    db = tmp_path / "a.kdb"
    bad = KernelFile(db, tier="user", readonly=False)
    assert ensure(bad) is not None  # in WAL mode, held open
    writers = []
    rename = os.rename

    def rename_then_a_writer_comes(src, dst, *args, **kwargs):
        rename(src, dst, *args, **kwargs)
        if str(src) == str(db) and not writers:  # before the -wal and the -shm
            writers.append(_a_writer_comes(db))

    monkeypatch.setattr(os, "rename", rename_then_a_writer_comes)
    try:
        assert bad._quarantine()
    finally:
        monkeypatch.setattr(os, "rename", rename)
    writer, early = writers[0]
    try:
        assert not early, "a writer made a new file while the bad one's were moved aside"
        assert writer.stdout.readline().strip() == "True"  # then it makes its own
        moved = sorted(p.name.split(".corrupt-")[1][15:] for p in tmp_path.glob("a.kdb.corrupt-*"))
        assert moved == ["", "-shm", "-wal"], moved
    finally:
        writer.communicate("", timeout=30)
        bad.close()


def test_a_file_replaced_while_a_reader_opens_it_is_read_as_it_is_now(cache_dir, monkeypatch):
    """A reader that opened a file just before ``kdb clear`` removed it (and a writer made a
    new one) read the old, unlinked file, and its first read made a ``-wal`` and ``-shm`` at
    the path for it, which the new file could then take over. It closes that connection at
    once and reads the file at the path."""
    from kdb.file.kernelfile import KernelFile

    a = attrs()
    path = cache_dir / "v1" / "a1.kdb"
    for binary in (b"the old file's", b"the new file's"):
        if path.exists():
            path.rename(cache_dir / "old.kdb")
        db = KernelDB()
        db.put(a, binary)
        db.close()
    path.rename(cache_dir / "new.kdb")
    (cache_dir / "old.kdb").rename(path)  # the old file is at the path as the open begins
    opened = KernelFile.open_connection
    swapped: list[int] = []

    def open_then_the_file_is_replaced(self):
        conn = opened(self)
        if not swapped:  # kdb clear and a writer, between the open and the first read
            swapped.append(1)
            os.replace(cache_dir / "new.kdb", path)
        return conn

    monkeypatch.setattr(KernelFile, "open_connection", open_then_the_file_is_replaced)
    reader = KernelFile(path, tier="user", readonly=False)
    row = reader.fetch(a.key)
    assert swapped and row is not None
    assert codec.decode(row.codec, row.blob, row.raw_size, row.checksum) == b"the new file's"


def test_an_upgrade_failing_for_room_is_said_to_be_a_full_disk_whatever_error_hid_it(tmp_path):
    """alembic's cleanup after SQLite's 'database or disk is full' raised its own error (no
    such table: _alembic_tmp_kernels), and the warning said to delete the file. The error
    the full disk caused is found where it is chained."""
    from kdb.file.filewriter import _upgrade_failed

    path = tmp_path / "a1.kdb"
    migrate.upgrade_sqlite(path)
    try:
        try:
            raise sqlite3.OperationalError("database or disk is full")
        except sqlite3.OperationalError:
            raise sqlite3.OperationalError("no such table: _alembic_tmp_kernels")
    except sqlite3.OperationalError as err:
        said = _upgrade_failed(path, err)
    assert "file system is full" in said and "Delete it to start afresh" not in said, said
    other = _upgrade_failed(path, sqlite3.OperationalError("no such table: x"))
    assert "file system is full" not in other  # a disk with room: another failure
