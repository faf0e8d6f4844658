"""The SQLite file format of a kdb tier file, known in this one module.

What a file's schema revision means for a reader and a writer (with the remedy a message
gives), whether a file is in WAL mode, the ``meta`` rows, the transaction every writer uses,
what a damaged file raises, and moving a bad file aside. Plain :mod:`sqlite3` only: the hit
path imports this module, so nothing heavy (and no :mod:`typing`) is imported here.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections import namedtuple

#: Every revision this kdb knows, oldest first; a test pins it to the alembic scripts.
REVISIONS: tuple[str, ...] = ("0001", "0002", "0003", "0004", "0005", "0006")
HEAD = REVISIONS[-1]
#: The oldest revision whose ``kernels`` columns a hit reads (:data:`kdb.file.kernelfile._FETCH`):
#: a reader serves every revision from here on as it is; only the writer upgrades.
READABLE_FROM = "0001"
#: The first revision that keeps running totals (entries, raw and stored bytes) in ``meta``.
TOTALS_FROM = "0003"
#: The first revision whose entries can carry a signature (``signer``, ``signature``).
SIGNED_FROM = "0005"
#: The first revision that stores attributes compressed, each source once in ``sources``
#: (:mod:`kdb.file.compact`), and checks ``attributes_sha256`` on a hit; before it, the whole
#: text is in ``attributes``, and a hit compares it.
COMPACT_FROM = "0006"

#: What a damaged file raises. Python's sqlite3 decodes SQLite's error message as UTF-8, and
#: the message of a damaged schema quotes bytes of the file: UnicodeDecodeError, not an Error.
DAMAGE = (sqlite3.DatabaseError, UnicodeDecodeError)

#: Tables each revision has (a file that lacks one is damaged, not merely old).
_TABLES = {"0001": ("kernels", "meta")}
_BEFORE_COMPACT = ("kernels", "meta", "compile_log", "counters")
_ALL_TABLES = (*_BEFORE_COMPACT, "sources")


def revision_of(conn: sqlite3.Connection) -> str | None:
    """The file's alembic revision, or ``None`` for a file with no kdb schema yet. A table
    of two revisions is damage (:class:`sqlite3.DatabaseError`): alembic refuses to upgrade
    or stamp it, so the file could never be written again, and the first row was taken for
    its revision (``kdb verify`` called it sound)."""
    try:
        rows = conn.execute("SELECT version_num FROM alembic_version LIMIT 2").fetchall()
    except sqlite3.OperationalError as err:
        if "no such table" in str(err):
            return None
        raise
    if len(rows) > 1:
        raise sqlite3.DatabaseError("alembic_version names more than one schema revision "
                                    f"({rows[0][0]!r}, {rows[1][0]!r}): damaged")
    return rows[0][0] if rows else None


def at_least(rev: str | None, oldest: str) -> bool:
    """Whether a known revision is ``oldest`` or later.

    >>> at_least("0003", TOTALS_FROM), at_least("0002", TOTALS_FROM), at_least("9999", "0001")
    (True, False, False)
    """
    return rev in REVISIONS and REVISIONS.index(rev) >= REVISIONS.index(oldest)


class Status(namedtuple("Status", "kind revision what remedy")):
    """What a file's revision means. ``kind`` is one of:

    ``current`` (the head), ``older`` (read as it is; the writer upgrades it), ``stale``
    (older than any reader can use: misses until the writer upgrades it), ``newer`` (from a
    newer kdb: left untouched), ``foreign`` (tables but no revision: not a kdb file),
    ``empty`` (created, its tables not yet: a first write is under way, or was killed).
    ``what`` says it in a phrase, ``remedy`` what to do ('' when nothing).
    """

    __slots__ = ()

    @property
    def readable(self) -> bool:
        return self.kind in ("current", "older")


def status_of(rev: str | None, empty: bool = False) -> Status:
    """Classify a revision (``empty``: the file has no tables at all).

    >>> status_of("9999").what
    'schema revision 9999 is newer than this kdb (0006)'
    >>> status_of(None, empty=True).kind, status_of(None).kind, status_of(HEAD).kind
    ('empty', 'foreign', 'current')
    """
    if rev is None and empty:
        return Status("empty", None, "empty (created, not yet written)",
                      "the next write creates its tables")
    if rev is None:
        return Status("foreign", None, "not a kdb database (no schema revision)",
                      "move it aside or delete it")
    if rev not in REVISIONS and not _after_head(rev):
        return Status("foreign", rev, f"schema revision {rev!r} is none kdb writes: not a kdb "
                      "database, or a damaged one", "move it aside or delete it")
    if rev not in REVISIONS:
        return Status("newer", rev, f"schema revision {rev} is newer than this kdb ({HEAD})",
                      "upgrade kdb")
    if rev == HEAD:
        return Status("current", rev, "", "")
    kind = "older" if at_least(rev, READABLE_FROM) else "stale"
    return Status(kind, rev, f"at revision {rev}", "upgraded on next write or by `kdb migrate`")


def _after_head(rev: object) -> bool:
    """Whether ``rev`` reads as a revision a later kdb writes (numbered as kdb numbers them,
    past the head); anything else is no kdb revision, and upgrading kdb would not help.

    >>> _after_head("0007"), _after_head("abc1"), _after_head("0005"), _after_head("07")
    (True, False, False, False)
    """
    return (isinstance(rev, str) and rev.isascii() and rev.isdigit() and len(rev) == len(HEAD)
            and rev > HEAD)


def classify(conn: sqlite3.Connection) -> Status:
    """The :class:`Status` of an open file; raises :data:`DAMAGE` for a file whose revision
    promises tables it lacks (damaged, not merely old)."""
    rev = revision_of(conn)
    missing = missing_tables(conn, rev)
    if missing:
        raise sqlite3.DatabaseError(f"schema revision {rev} but no table {', '.join(missing)}")
    return status_of(rev, rev is None and has_no_tables(conn))


def missing_tables(conn: sqlite3.Connection, rev: str | None) -> list[str]:
    """Tables a file at a known revision ``rev`` should have and lacks."""
    if rev not in REVISIONS:
        return []
    need = _TABLES.get(rev) or (_ALL_TABLES if at_least(rev, COMPACT_FROM) else _BEFORE_COMPACT)
    have = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    return [t for t in need if t not in have]


def has_no_tables(conn: sqlite3.Connection) -> bool:
    """A file created by a first write that has not created its tables yet (its writer holds
    the upgrade lock): not migrated yet, never damaged."""
    return conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0


# -- journal mode ---------------------------------------------------------------------------

def journal_of(path: str | os.PathLike[str]) -> str | None:
    """``"wal"`` or ``"rollback"`` from the file's header, else None (unreadable, short).

    Bytes 18-19 of the header are 1 for a rollback journal, 2 for WAL; an immutable
    connection's ``PRAGMA journal_mode`` does not look (sqlite.org/fileformat2.html).
    """
    try:
        with open(path, "rb") as f:
            header = f.read(20)
    except OSError:
        return None
    if header[18:20] == b"\x02\x02":
        return "wal"
    return "rollback" if header[18:20] == b"\x01\x01" else None


def wal_size(path: str | os.PathLike[str]) -> int:
    """Bytes in the ``-wal`` beside ``path`` (0 when there is none): commits the main file
    may lack, which a read-only (immutable) reader cannot see."""
    try:
        return os.stat(os.fspath(path) + "-wal").st_size
    except OSError:
        return 0


# -- meta rows ------------------------------------------------------------------------------

def meta_int(conn: sqlite3.Connection, name: str) -> int:
    """An integer ``meta`` row (a running total), 0 when absent."""
    row = conn.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
    return int(row[0]) if row else 0


def bump_meta(conn: sqlite3.Connection, name: str, delta: int) -> None:
    """Add ``delta`` to an integer ``meta`` row, creating it (inside the caller's write)."""
    conn.execute(
        "INSERT INTO meta (name, value) VALUES (?, ?) ON CONFLICT(name) "
        "DO UPDATE SET value = CAST(CAST(value AS INTEGER) + ? AS TEXT)",
        (name, str(delta), delta),
    )


def set_meta(conn: sqlite3.Connection, rows: list[tuple[str, str]]) -> None:
    """Write ``(name, value)`` rows of ``meta``, replacing what was there."""
    conn.executemany("INSERT OR REPLACE INTO meta (name, value) VALUES (?, ?)", rows)


def file_facts(created: float | None = None) -> list[tuple[str, str]]:
    """The ``meta`` rows every new database gets: its format major, the kdb that made it and
    when (``created``: default now). Callers add what they are (``arch``, or ``tier``)."""
    from ..config import FORMAT_MAJOR
    from .._version import __version__

    return [("format", str(FORMAT_MAJOR)), ("kdb_version", __version__),
            ("created", str(time.time() if created is None else created))]


# -- writing --------------------------------------------------------------------------------

class transaction:
    """``with transaction(conn):`` runs its body in ``BEGIN IMMEDIATE`` ... ``COMMIT``; any
    exception (a failed COMMIT included) rolls back and propagates. ``conn`` must be in
    autocommit mode (``isolation_level=None``)."""

    __slots__ = ("conn",)

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> sqlite3.Connection:
        self.conn.execute("BEGIN IMMEDIATE")
        return self.conn

    def __exit__(self, kind, err, tb) -> bool:
        if kind is None:
            try:
                self.conn.execute("COMMIT")
                return False
            except BaseException:
                self._rollback()
                raise
        self._rollback()
        return False

    def _rollback(self) -> None:
        if self.conn.in_transaction:
            try:
                self.conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass


def identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of ``path``, or None when nothing is there: tells a file removed and
    made again at its path (``kdb clear``) while a connection keeps the old inode in use."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def move_aside(path: str | os.PathLike[str]) -> bool:
    """Move a bad file (and its WAL) aside as ``*.corrupt-<time>``; False if the file itself
    could not be moved (a read-only cache): it is then left in place."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = os.fspath(path)
    moved = True
    for suffix in ("", "-wal", "-shm"):
        src = base + suffix
        if os.path.exists(src):
            try:
                os.rename(src, f"{base}.corrupt-{stamp}{suffix}")
            except OSError:
                moved = moved and suffix != ""
    return moved


#: Bytes a path keeps as is in a ``file:`` URI; SQLite decodes ``%XX`` in the rest.
_URI_SAFE = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789/-._~")


def sqlite_uri(path: str | os.PathLike[str], query: str = "") -> str:
    """An SQLite ``file:`` URI for a path, every byte but the unreserved ones %-quoted
    (``?``, ``#`` and ``%`` would otherwise end or change it); written here because
    ``urllib.parse`` is a costly import on the hit path.

    >>> sqlite_uri("/tmp/a b?.kdb", "mode=ro")
    'file:/tmp/a%20b%3F.kdb?mode=ro'
    """
    raw = os.fsencode(os.path.abspath(path))
    quoted = "".join(chr(b) if b in _URI_SAFE else f"%{b:02X}" for b in raw)
    return f"file:{quoted}?{query}" if query else f"file:{quoted}"
