"""Alembic upgrades of a kdb file, and the lock that lets one process do one at a time.

Only writers import this module (a new or older user file, ``kdb pack``, ``kdb migrate``,
the shared tier); what a revision means is :mod:`kdb.file.fileformat`'s, re-exported here.
SQLAlchemy and alembic are imported inside the functions that run them. One process upgrades
a file at a time (an ``flock`` on ``<file>.lock``); the others wait, then find it current.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING

from .fileformat import COMPACT_FROM, HEAD, REVISIONS, at_least, revision_of

if TYPE_CHECKING:
    from typing import Iterator

__all__ = ["HEAD", "REVISIONS", "alembic_config", "file_lock", "migrations_dir",
           "revision_of", "script_heads", "script_revisions", "upgrade_sqlite"]


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


@contextlib.contextmanager
def file_lock(path: Path, timeout: float | None = None) -> Iterator[None]:
    """An exclusive advisory lock on ``<path>.lock``, for one upgrader at a time.

    Waits at most ``timeout`` seconds (default ``KDB_LOCK_TIMEOUT``) with back-off, then
    raises :class:`TimeoutError` (an ``OSError``): a holder stopped or stuck inside an
    upgrade must not stop every other process with it.
    """
    import fcntl
    import time

    from .. import config

    limit = config.lock_timeout() if timeout is None else timeout
    lock_path = path.with_name(path.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + limit
        delay = 0.005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"another process has held {lock_path} for more than {limit:g} s "
                        f"({config.ENV_LOCK_TIMEOUT})") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.1)
        try:
            yield
        finally:
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
