"""Alembic upgrades of a kdb file, a new file made at the head without them, and the lock
that lets one process do one at a time.

Only writers import this module (a new or older user file, ``kdb pack``, ``kdb migrate``,
the shared tier); what a revision means is :mod:`kdb.file.fileformat`'s, re-exported here.
SQLAlchemy and alembic are imported inside the functions that run them; a new user file
needs neither (:func:`create_at_head`). One process upgrades
a file at a time (an ``flock`` on ``<file>.lock``); the others wait, then find it current.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from .fileformat import COMPACT_FROM, HEAD, REVISIONS, at_least, revision_of

if TYPE_CHECKING:
    from typing import Iterator

__all__ = ["HEAD", "HEAD_ROWS", "HEAD_SCHEMA", "HEAD_SCHEMA_REVISION", "REVISIONS",
           "alembic_config", "create_at_head", "file_lock", "migrations_dir", "revision_of",
           "script_heads", "script_revisions", "snapshot", "upgrade_sqlite"]


def migrations_dir() -> Path:
    """Where the alembic environment is: inside the installed package, else the source tree."""
    here = Path(__file__).resolve().parent.parent  # kdb/
    installed = here / "migrations"
    if (installed / "env.py").is_file():
        return installed
    return here.parent / "migrations"


def alembic_config(connection=None):
    """An alembic ``Config`` built in code, pointing at the installed migrations.

    Alembic reads its options through :mod:`configparser` interpolation, so a ``%`` in the
    install path is written ``%%`` (alembic.sqlalchemy.org/en/latest/api/config.html).
    """
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()).replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


_local = threading.local()


def _held_here() -> set[str]:
    """The lock files this thread holds through :func:`file_lock`."""
    held = getattr(_local, "held", None)
    if held is None:
        held = _local.held = set()
    return held


@contextlib.contextmanager
def file_lock(path: Path, timeout: float | None = None, *,
              remove: bool = False) -> Iterator[None]:
    """An exclusive advisory lock on ``<path>.lock``, for one upgrader at a time (and for
    ``kdb clear``, which removes a file and its ``-wal`` and ``-shm`` under it).

    Waits at most ``timeout`` seconds (default ``KDB_LOCK_TIMEOUT``) with back-off, then
    raises :class:`TimeoutError` (an ``OSError``): a holder stopped or stuck inside an
    upgrade must not stop every other process with it. With ``remove`` the lock file is
    removed before it is let go; a waiter then locks the file at the path (see below).
    """
    import fcntl
    import time

    from .. import config
    from ..dirs import names_open_file

    limit = config.lock_timeout() if timeout is None else timeout
    lock_path = path.with_name(path.name + ".lock")
    held = _held_here()
    if str(lock_path) in held:  # this thread holds it already (a writer's check moves a
        yield                   # bad file aside under it): an flock would wait for itself
        return
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + limit
        delay = 0.005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if names_open_file(lock_path, fd):
                    break
                # Removed (kdb clear) or replaced while we waited: a lock on it excludes
                # nobody who opens the path now. Lock the file that is there.
                os.close(fd)
                fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
                continue
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"another process has held {lock_path} for more than {limit:g} s "
                        f"({config.ENV_LOCK_TIMEOUT})") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.1)
        held.add(str(lock_path))
        try:
            yield
        finally:
            held.discard(str(lock_path))
            if remove and names_open_file(lock_path, fd):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock_path)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def upgrade_sqlite(path: Path, revision: str = "head", *, create: bool = True) -> None:
    """Create or upgrade the SQLite file at ``path`` to ``revision`` with alembic.

    ``create=False``: the file must exist (a user file kdb created ``0600`` and set to WAL);
    one moved aside meanwhile (``kdb verify --repair``, ``kdb clear``) must not come back as
    a ``0644`` file in rollback-journal mode.
    """
    from alembic import command
    from sqlalchemy import create_engine, event
    from sqlalchemy.pool import NullPool

    from .fileformat import sqlite_uri

    uri = sqlite_uri(path, "mode=rwc" if create else "mode=rw")
    before = _revision_at(uri)
    engine = create_engine("sqlite://", poolclass=NullPool,
                           creator=lambda: sqlite3.connect(uri, uri=True,
                                                           check_same_thread=False))
    # pysqlite commits before every DDL statement, so a failed or killed upgrade would leave
    # a half-migrated file that never upgrades again. Let SQLAlchemy emit BEGIN itself, which
    # makes the whole upgrade one transaction: SQLAlchemy's documented pysqlite recipe,
    # docs.sqlalchemy.org/en/20/dialects/sqlite.html (serializable isolation, transactional DDL).
    event.listen(engine, "connect", _no_pysqlite_transactions)
    event.listen(engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN IMMEDIATE"))
    try:
        with engine.begin() as conn:
            command.upgrade(alembic_config(connection=conn), revision)
    finally:
        engine.dispose()
    if before is not None and not at_least(before, COMPACT_FROM) and revision == "head":
        _vacuum(uri)


def _revision_at(uri: str) -> str | None:
    """The file's revision before an upgrade; None where it cannot tell (the upgrade's own
    connection then reports what is wrong)."""
    try:
        conn = sqlite3.connect(uri, uri=True)
    except sqlite3.Error:
        return None
    try:
        return revision_of(conn)
    except sqlite3.Error:
        return None
    finally:
        conn.close()


def _vacuum(uri: str) -> None:
    """Give back the pages the whole-text attributes held (revision 0006 rewrote every
    entry): the file shrinks to what it stores. Once per file, by its writer, after the
    upgrade's own transaction; a failure leaves a sound, larger file. In WAL mode a VACUUM
    writes the whole file through the ``-wal``, which keeps that size until truncated: the
    checkpoint truncates it (a reader still in it keeps it for now; the next one does)."""
    conn = sqlite3.connect(uri, uri=True, isolation_level=None)
    try:
        conn.execute("VACUUM")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    except sqlite3.Error:
        pass
    finally:
        conn.close()


def _no_pysqlite_transactions(dbapi_conn, _record) -> None:
    dbapi_conn.isolation_level = None


def script_heads() -> list[str]:
    """Heads of the shipped alembic scripts (one, asserted by the tests)."""
    from alembic.script import ScriptDirectory

    return list(ScriptDirectory.from_config(alembic_config()).get_heads())


def script_revisions() -> list[str]:
    """All shipped revision ids, oldest first."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(alembic_config())
    return [r.revision for r in reversed(list(script.walk_revisions()))]


# -- a new file, without alembic ------------------------------------------------------------
#
# The migrations are the schema's one definition. Running them on a new file costs about half
# a second, nearly all of it importing alembic and SQLAlchemy, which the first store of a cold
# cache paid on the program's exit (early stores) or in the store worker's floor lane. So the
# writer makes a new file from what the migrations leave at the head: the ``CREATE``
# statements of ``sqlite_master`` in their order and the rows they insert, taken from a
# migrated file by :func:`snapshot`; a test holds them equal to what the migrations make
# (alembic's cookbook does the same with ``create_all`` and ``stamp``:
# alembic.sqlalchemy.org/en/latest/cookbook.html#building-an-up-to-date-database-from-scratch).
# After a new revision, ``python -m kdb.file.migrate`` prints them anew.

#: The revision :data:`HEAD_SCHEMA` and :data:`HEAD_ROWS` make.
HEAD_SCHEMA_REVISION = "0006"

#: ``sqlite_master``'s statements at the head, in the order the migrations leave them.
HEAD_SCHEMA: tuple[str, ...] = (
    ('CREATE TABLE alembic_version (\n'
     '\tversion_num VARCHAR(32) NOT NULL, \n'
     '\tCONSTRAINT alembic_version_pkc PRIMARY KEY (version_num)\n'
     ')'),
    ('CREATE TABLE meta (\n'
     '\tname TEXT NOT NULL, \n'
     '\tvalue TEXT NOT NULL, \n'
     '\tPRIMARY KEY (name)\n'
     ')'),
    ('CREATE TABLE compile_log (\n'
     '\tid INTEGER NOT NULL, \n'
     '\tat FLOAT NOT NULL, \n'
     '\t"key" TEXT NOT NULL, \n'
     "\tname TEXT DEFAULT '' NOT NULL, \n"
     '\tarch TEXT NOT NULL, \n'
     "\tbackend TEXT DEFAULT '' NOT NULL, \n"
     '\tseconds FLOAT NOT NULL, \n'
     "\tmissed TEXT DEFAULT '' NOT NULL, \n"
     "\treason TEXT DEFAULT '' NOT NULL, \n"
     "\tpid INTEGER DEFAULT '0' NOT NULL, \n"
     '\tPRIMARY KEY (id)\n'
     ')'),
    'CREATE INDEX ix_compile_log_at ON compile_log (at)',
    ('CREATE TABLE counters (\n'
     '\tname TEXT NOT NULL, \n'
     "\tvalue FLOAT DEFAULT '0' NOT NULL, \n"
     '\tPRIMARY KEY (name)\n'
     ')'),
    ('CREATE TABLE sources (\n'
     '\tdigest TEXT NOT NULL, \n'
     '\tbody BLOB NOT NULL, \n'
     '\tsize INTEGER NOT NULL, \n'
     '\tPRIMARY KEY (digest)\n'
     ')'),
    ('CREATE TABLE "kernels" (\n'
     '\t"key" TEXT NOT NULL, \n'
     '\tarch TEXT NOT NULL, \n'
     '\tbackend TEXT NOT NULL, \n'
     "\tname TEXT DEFAULT ('') NOT NULL, \n"
     '\tcodec TEXT NOT NULL, \n'
     '\tdict_id INTEGER, \n'
     '\tblob BLOB NOT NULL, \n'
     '\traw_size INTEGER NOT NULL, \n'
     '\tstored_size INTEGER NOT NULL, \n'
     '\tchecksum TEXT NOT NULL, \n'
     "\tcompile_seconds FLOAT DEFAULT '0' NOT NULL, \n"
     '\tcreated FLOAT NOT NULL, \n'
     '\tlast_access FLOAT NOT NULL, \n'
     "\thits INTEGER DEFAULT '0' NOT NULL, \n"
     "\tdetails TEXT DEFAULT '{}' NOT NULL, \n"
     '\tcompiler_free_key TEXT, \n'
     '\tsigner TEXT, \n'
     '\tsignature BLOB, \n'
     '\tattrs BLOB NOT NULL, \n'
     '\tsource TEXT, \n'
     '\tattributes_sha256 TEXT NOT NULL, \n'
     '\tPRIMARY KEY ("key")\n'
     ')'),
    'CREATE INDEX ix_kernels_last_access ON kernels (last_access)',
    'CREATE INDEX ix_kernels_name ON kernels (name)',
    'CREATE INDEX ix_kernels_compiler_free_key ON kernels (compiler_free_key)',
    'CREATE INDEX ix_kernels_source ON kernels (source)',
)

#: The rows the migrations insert into a new file: (table, columns, values).
HEAD_ROWS: tuple[tuple[str, tuple[str, ...], tuple], ...] = (
    ('alembic_version', ('version_num',), ('0006',)),
    ('meta', ('name', 'value'), ('entries', '0')),
    ('meta', ('name', 'value'), ('raw_bytes', '0')),
    ('meta', ('name', 'value'), ('stored_bytes', '0')),
)


def create_at_head(conn: sqlite3.Connection) -> None:
    """Make the empty file ``conn`` is open on (autocommit: ``isolation_level=None``) a kdb
    file at :data:`HEAD_SCHEMA_REVISION`, in one immediate transaction: a writer killed
    halfway leaves an empty file, never half a schema. The caller holds the upgrade lock."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        for statement in HEAD_SCHEMA:
            conn.execute(statement)
        for table, columns, values in HEAD_ROWS:
            conn.execute(_insert(table, columns), values)
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _insert(table: str, columns: tuple[str, ...]) -> str:
    """The ``INSERT`` of one of :data:`HEAD_ROWS` (names from this module only; values bound)."""
    names = ", ".join(f'"{c}"' for c in columns)
    return f'INSERT INTO "{table}" ({names}) VALUES ({", ".join("?" * len(columns))})'


def snapshot(conn: sqlite3.Connection) -> tuple[tuple[str, ...], tuple]:
    """``(HEAD_SCHEMA, HEAD_ROWS)`` as they are in the file ``conn`` is open on: what they
    must be for a file the migrations brought to the head."""
    schema = tuple(r[0] for r in conn.execute(
        "SELECT sql FROM sqlite_master WHERE sql IS NOT NULL ORDER BY rowid"))
    tables = [r[0] for r in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
        "ORDER BY rowid")]
    rows = []
    for table in tables:
        columns = tuple(r[1] for r in conn.execute("SELECT * FROM pragma_table_info(?)",
                                                    (table,)))
        names = ", ".join(f'"{c}"' for c in columns)
        for values in conn.execute(f'SELECT {names} FROM "{table}" ORDER BY rowid'):  # noqa: S608
            rows.append((table, columns, tuple(values)))
    return schema, tuple(rows)


def render(revision: str, schema: tuple[str, ...], rows: tuple) -> str:
    """The head's constants for a snapshot, as Python source (``python -m`` prints them)."""
    lines = [f"HEAD_SCHEMA_REVISION = {revision!r}", "", "HEAD_SCHEMA: tuple[str, ...] = ("]
    for statement in schema:  # one line of SQL a line
        parts = [repr(p) for p in statement.splitlines(keepends=True)]
        lines.append(f"    {parts[0]}," if len(parts) == 1 else
                     "    (" + "\n     ".join(parts) + "),")
    lines += [")", "", "HEAD_ROWS: tuple[tuple[str, tuple[str, ...], tuple], ...] = ("]
    lines += [f"    {r!r}," for r in rows]
    return "\n".join([*lines, ")"])


def _main() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "head.kdb"
        upgrade_sqlite(path)
        conn = sqlite3.connect(path)
        try:
            print(render(HEAD, *snapshot(conn)))
        finally:
            conn.close()


if __name__ == "__main__":
    _main()
