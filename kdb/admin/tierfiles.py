"""The tier files a report reads: finding them, and opening them read-only.

User files are opened ``mode=ro`` (a WAL file's recent commits are visible; nothing is
migrated or written), system files ``mode=ro&immutable=1`` as on the hot path. A row or a
table a file's revision lacks reads as nothing, so every report works on every revision.
Shared by :mod:`kdb.admin.report`, :mod:`kdb.admin.explain`, :mod:`kdb.admin.info`, :mod:`kdb.admin.integrity` and
:mod:`kdb.admin.maintenance`.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path
from typing import Any, Iterator

from .. import config
from ..file import compact, discovery
from ..errors import InvalidArgumentError
from ..file.fileformat import sqlite_uri, wal_size

#: Files beside a user file that belong to it.
SIDE_FILES = ("-wal", "-shm", ".lock")


# -- opening files --------------------------------------------------------------------------

@contextlib.contextmanager
def reading(path: Path, tier: str) -> Iterator[sqlite3.Connection]:
    """A read-only connection; system files are immutable, user files may be in use.

    A user file in WAL mode that cannot be opened ``mode=ro`` (a read-only cache directory
    or mount, a full disk: SQLite cannot create its ``-shm``) is read immutable, as the run
    time reads a read-only cache, when its ``-wal`` holds nothing (the main file is whole)
    or nobody can write there.
    """
    mode = "ro&immutable=1" if tier == "system" else "ro"
    conn = sqlite3.connect(sqlite_uri(path, "mode=" + mode), uri=True,
                           timeout=config.BUSY_TIMEOUT_S)
    if tier != "system":
        try:
            conn.execute("SELECT count(*) FROM sqlite_master").fetchall()
        except sqlite3.OperationalError:
            conn.close()
            if can_write_beside(path) and wal_size(path):
                raise  # commits in the -wal: reading around them could mislead
            conn = sqlite3.connect(sqlite_uri(path, "mode=ro&immutable=1"), uri=True)
        except BaseException:
            conn.close()
            raise
    # A damaged row's text may not be UTF-8: read it as it is, so that the row (not the file)
    # is reported, and a repair drops it.
    conn.text_factory = _lenient_text
    compact.register(conn)  # whole attributes of a file at revision 0006 or later, in SQL
    try:
        yield conn
    finally:
        conn.close()


def _lenient_text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def can_write_beside(path: Path) -> bool:
    """Whether this process may write ``path`` and create files beside it (``-wal``,
    ``-shm``, ``.corrupt-*``): false in a read-only directory or on a read-only mount."""
    return os.access(path, os.W_OK) and os.access(path.parent, os.W_OK | os.X_OK)


def scalar(conn: sqlite3.Connection, sql: str, default: Any = 0) -> Any:
    """The first column of the first row, or ``default`` (a table not created yet)."""
    found = read_rows(conn, sql)
    return found[0][0] if found and found[0][0] is not None else default


def number(value: Any, kind: type) -> Any:
    """A counter or total as ``kind``; 0 for a damaged value (a report never fails on one)."""
    try:
        return kind(value) if value is not None else kind(0)
    except (TypeError, ValueError, OverflowError):
        return kind(0)


def read_rows(conn: sqlite3.Connection, sql: str, params: tuple = ()) -> list[tuple]:
    """Rows of a read-only query; a table an older revision lacks yields none."""
    try:
        return conn.execute(sql, params).fetchall()
    except sqlite3.OperationalError as err:
        if "no such table" in str(err) or "no such column" in str(err):
            return []
        raise


def has_column(conn: sqlite3.Connection, table: str, column: str) -> bool:
    return any(r[1] == column for r in conn.execute(f"PRAGMA table_info({table})"))


def file_size(path: Path) -> int:
    total = 0
    for suffix in ("", "-wal"):
        try:
            total += os.stat(str(path) + suffix).st_size
        except OSError:
            pass
    return total


def user_files(user_dir: Path, arch: str | None = None) -> list[Path]:
    """The user tier's ``<arch>.kdb`` files, sorted (only ``arch``'s when given)."""
    if arch is not None:
        config.check_arch(arch)
        path = user_dir / f"{arch}.kdb"
        return [path] if path.is_file() else []
    try:
        names = sorted(os.listdir(user_dir))
    except OSError:
        return []
    out = []
    for n in names:
        if n.endswith(".kdb") and (user_dir / n).is_file():
            try:
                config.check_arch(n[: -len(".kdb")])
            except InvalidArgumentError:
                continue
            out.append(user_dir / n)
    return out


def odd_user_files(user_dir: Path, arch: str | None = None) -> list[tuple[Path, str]]:
    """``<arch>.kdb`` names in the user tier that are not regular files (a directory, a
    FIFO: opening one would block), with what each is; :func:`user_files` leaves them out."""
    import stat

    out = []
    try:
        names = sorted(os.listdir(user_dir))
    except OSError:
        return []
    for n in names:
        if not n.endswith(".kdb") or (arch is not None and n != f"{arch}.kdb"):
            continue
        try:
            config.check_arch(n[: -len(".kdb")])
            mode = os.stat(user_dir / n).st_mode
        except (InvalidArgumentError, OSError):
            continue
        if not stat.S_ISREG(mode):
            out.append((user_dir / n, "a directory" if stat.S_ISDIR(mode) else
                        "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"))
    return out


def tier_files(user_dir: Path, arch: str | None,
                tier: str | None) -> list[tuple[str, Path, str]]:
    """(tier, path, arch) of every usable file: system files first, as a lookup reads them."""
    if arch is not None:
        config.check_arch(arch)
    out: list[tuple[str, Path, str]] = []
    if tier in (None, "system"):
        for src in discovery.all_sources():
            if not src.problem and (arch is None or src.arch == arch):
                out.append(("system", src.path, src.arch))
    if tier in (None, "user"):
        out += [("user", p, p.name[: -len(".kdb")]) for p in user_files(user_dir, arch)]
    return out


def provider(origin: str) -> dict[str, str | None]:
    """The providing package and version of a system database, from its origin.

    >>> provider("package kdb_system_sm_90 1.0.0")
    {'package': 'kdb_system_sm_90', 'version': '1.0.0'}
    >>> provider("KDB_SYSTEM_DB_PATH")
    {'package': None, 'version': None}
    """
    kind, _, rest = origin.partition(" ")
    if kind != "package":
        return {"package": None, "version": None}
    name, _, version = rest.partition(" ")
    return {"package": name, "version": version or None}
