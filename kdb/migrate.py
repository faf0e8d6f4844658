"""Schema revisions: the cheap check on open, and alembic upgrades when a file needs one.

The hot path only reads ``alembic_version`` with :mod:`sqlite3` and compares it with
:data:`HEAD`; SQLAlchemy and alembic are imported only when a file must be created or
upgraded. One process upgrades a file at a time (an ``flock`` on ``<file>.lock``); the
others wait, then find the file current.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path
from typing import Iterator

#: Every revision this kdb knows, oldest first; a test pins it to the alembic scripts.
REVISIONS: tuple[str, ...] = ("0001", "0002", "0003", "0004")
HEAD = REVISIONS[-1]


def migrations_dir() -> Path:
    """Where the alembic environment is: inside the installed package, else the source tree."""
    here = Path(__file__).resolve().parent
    installed = here / "migrations"
    if (installed / "env.py").is_file():
        return installed
    return here.parent / "migrations"


def revision_of(conn: sqlite3.Connection) -> str | None:
    """The file's alembic revision, or ``None`` for a file with no kdb schema yet."""
    try:
        row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    except sqlite3.OperationalError as err:
        if "no such table" in str(err):
            return None
        raise
    return row[0] if row else None


def alembic_config(connection=None, url: str | None = None):
    """An alembic ``Config`` built in code, pointing at the installed migrations."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url)
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

    from . import config

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

    from .store import sqlite_uri

    uri = sqlite_uri(path, "mode=rwc" if create else "mode=rw")
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
