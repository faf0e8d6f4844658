"""One SQLite kernel file: the reads on the hot path and the writes off it.

Reads use plain :mod:`sqlite3` (no SQLAlchemy on a hit) and accept every schema revision
whose columns they need, as it is: a lookup never migrates. A system file is opened
``mode=ro&immutable=1`` and never written. A user file is created and upgraded by the writer
(:meth:`KernelFile.ensure`, called by every write, off the critical path), so a process whose
lookups all miss a file that does not exist yet pays nothing for creating it. What a revision
means, WAL detection and the ``meta`` rows live in :mod:`kdb.file.fileformat`.

Faults of the file itself (corrupt, foreign, from a newer kdb, locked, read-only, disk full)
are reported through :func:`kdb.faults.fault` and cost at most a recompile.
"""

from __future__ import annotations

import os
from pathlib import Path
import sqlite3
import stat
import threading
from typing import TYPE_CHECKING

from .. import faults
from . import compact, fs
from ..config import BUSY_TIMEOUT_S
from .rows import PROVISIONAL, CompileRecord, Entry, Row
from .fileformat import (COMPACT_FROM, DAMAGE, HEAD, at_least, classify, identity, journal_of,
                         move_aside, sqlite_uri, status_of, wal_size)

if TYPE_CHECKING:  # annotations are strings here
    from typing import Iterable

__all__ = ["CompileRecord", "Entry", "KernelFile", "Row", "sqlite_uri"]

#: What a hit reads (:class:`Row`): from revision 0006, the sha256 of the stored attributes;
#: before it (:data:`_FETCH_WHOLE`), the whole text.
_FETCH = (
    "SELECT codec, blob, raw_size, checksum, NULL, compile_seconds, attributes_sha256 "
    "FROM kernels WHERE key = ?"
)
_FETCH_WHOLE = "SELECT codec, blob, raw_size, checksum, attributes, compile_seconds " \
    "FROM kernels WHERE key = ?"

_SIGNATURE = "SELECT signer, signature FROM kernels WHERE key = ?"
#: sqlite3's error for a TEXT column whose bytes are not UTF-8: a damaged row.
_UNDECODABLE = "Could not decode to UTF-8"
_FETCH_ANY = ("SELECT key, codec, blob, raw_size, checksum, {attributes}, compile_seconds "
              "FROM kernels{join} WHERE compiler_free_key = ?")


def _damaged_row(conn: sqlite3.Connection, sql: str, key: str) -> Row | None:
    """The row of ``key`` whose text is not UTF-8, its text columns as bytes: the one check
    of a hit (:func:`kdb.tiers.verified`) refuses it, so the entry is dropped and compiled
    again like any corrupt entry, while the file's other entries go on serving. (Taken for
    an I/O error, it had the whole file set aside for the process, in every process.)"""
    old = conn.text_factory
    conn.text_factory = bytes  # this thread's own connection
    try:
        row = conn.execute(sql, (key,)).fetchone()
    except DAMAGE:
        return None
    finally:
        conn.text_factory = old
    if row is None:
        return None
    return Row(*row[:5], 0.0, *row[6:])


class KernelFile:
    """A tier's file for one arch. Thread-safe: one connection per thread.

    ``filename`` is its path as a str (what the hit path uses); ``path``, the same as a Path.
    """

    def __init__(self, path: str | os.PathLike[str], *, tier: str, readonly: bool) -> None:
        self.filename = str(Path(path))
        self.tier = tier
        self.readonly = readonly
        self.usable = True  # False once the file proved unusable in this process
        self.checked = False  # its revision was checked in this process (the writer resets it)
        self.compact = True  # at revision 0006 or later (kdb.file.compact): set by the check
        self._local = threading.local()
        self._lock = threading.Lock()

    @property
    def path(self) -> Path:
        return Path(self.filename)

    @property
    def directory(self) -> str:
        """The directory the file is in, as a str (``path.parent``)."""
        return str(Path(self.filename).parent)

    def __repr__(self) -> str:
        return f"KernelFile({self.filename!r}, tier={self.tier!r})"

    # -- connections ------------------------------------------------------------------------

    def open_connection(self) -> sqlite3.Connection:
        """A new connection to the file (read-only and immutable for a system file); the
        writer (:mod:`kdb.file.filewriter`) opens its own with it."""
        if self.readonly:
            uri = sqlite_uri(self.filename, "mode=ro&immutable=1")
            conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
        else:
            uri = sqlite_uri(self.filename, "mode=rw")
            conn = sqlite3.connect(
                uri, uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                check_same_thread=False,
            )
            conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    def connection(self, again: bool = True) -> sqlite3.Connection | None:
        """This thread's connection for reads; None where the file is not there or not usable
        (a miss). Every open is checked (:meth:`trusted`), a new thread's and a forked
        child's too: what the path leads to may have been swapped since the last one."""
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == os.getpid():
            return conn
        if not self.usable:
            return None
        try:
            mode = os.stat(self.filename).st_mode
        except OSError:
            return None  # not there (yet), or not reachable: a miss
        if not stat.S_ISREG(mode):
            self._not_a_file(mode)
            return None
        if not self.trusted():
            return None
        if not self.readonly and not self.checked and not _writable(self.filename):
            self._read_only_cache()
        conn = None
        ident = identity(self.filename)  # before the open: a file replaced since counts as so
        try:
            conn = self.open_connection()
            if not self.checked and not self._check(conn):
                conn.close()
                return None
        except DAMAGE as err:
            if conn is not None:
                conn.close()
            self.damaged(err, moved=identity(self.filename) != ident)
            return None
        if identity(self.filename) != ident:
            # Removed or replaced while it was being opened (kdb clear): SQLite may have made
            # a -wal and -shm at the path for the old file. Let them go at once, so that a
            # new file there starts its own, and open the file that is there now.
            conn.close()
            self.checked = False
            return self.connection(again=False) if again else None
        self._local.conn, self._local.pid = conn, os.getpid()
        self._local.ident = ident
        return conn

    def replaced(self) -> bool:
        """Whether the file this thread's connection writes to is no longer at ``path``
        (``kdb clear``, a repair, or a user deleted it): writes would go to an unlinked file."""
        return getattr(self._local, "ident", None) != identity(self.filename)

    def trusted(self) -> bool:
        """A tier file is code this process will run: refuse one that others can change, or
        that lies below a directory others can change (a fault, once); True when nobody else
        can change the file or what its path leads to (:func:`kdb.file.fs.unsafe_chain`).

        By path, not a descriptor: closing any descriptor of a SQLite file drops this
        process's locks on it (sqlite.org/howtocorrupt.html, 2.2)."""
        system = self.tier == "system"
        bad = fs.unsafe_chain([self.filename, self.directory], system)
        if bad is None:
            return True
        self.usable = False
        if system:
            faults.fault(f"system database {self.filename} is not loaded: refused: {bad[0]}: "
                         f"{bad[1]}, so another user could swap in their own kernels; make it "
                         "owned by you or root and writable by its owner only (chmod go-w)",
                         once="unsafe-system:" + self.filename)
        else:
            fs.refuse(*bad, ("loading a binary from it would run code someone else can change",
                             "kernels are compiled meanwhile"), once=bad[0])
        return False

    def _not_a_file(self, mode: int) -> None:
        """A directory, FIFO or device where the file should be: opening a FIFO would block
        forever, and nothing can be stored there. Skipped, never moved or written."""
        self.usable = False
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "not a regular file")
        faults.fault(f"{self.filename} is {kind}, not a kdb file; it is skipped and kernels are "
                     "compiled" + ("" if self.readonly else " but not stored there: remove it")
                     + ".", once=self.filename)

    def _read_only_cache(self) -> None:
        """The user file exists but cannot be written (a read-only cache directory): use its
        entries, store nothing. Opened immutable: a WAL file needs a writable ``-shm`` beside
        it, and nobody can commit to a file in a directory no one may write."""
        self.readonly = True
        faults.fault(f"the kernel cache {self.directory} is read-only: kernels stored there "
                     "are used, new ones are compiled but not stored. Make it writable or set "
                     "KDB_CACHE_DIR to a writable directory.", once=self.directory)

    def _check(self, conn: sqlite3.Connection) -> bool:
        """Once per process: may lookups read this file as it is? Never upgrades it: every
        revision whose columns a hit needs is read as it is, and the writer upgrades.

        False (a miss) for a file skipped with a fault, and for one too old to read, which
        stays usable: :meth:`ensure` upgrades it on the next write.
        """
        with self._lock:
            if self.checked:
                return True
            if self.tier == "system" and not self._wal_ok():
                return False
            status = classify(conn)  # raises DAMAGE for a file missing its tables
            # An empty file gets its tables from this kdb's writer, at the head revision.
            self.compact = status.revision is None or at_least(status.revision, COMPACT_FROM)
            if status.readable or (status.kind == "empty" and self.tier == "user"):
                self.checked = True  # empty: reads miss until the writer creates its tables
                return True
            if status.kind == "stale":
                if self.readonly:
                    self.usable = False
                    faults.fault(f"{self.filename} is {status.what}, older than this kdb reads; "
                                 "it is skipped and kernels are compiled instead",
                                 once=self.filename)
                return False
            self.usable = False
            if status.kind in ("foreign", "empty"):  # no kdb revision: not a kdb file
                faults.fault(
                    f"{self.filename} is {status_of(status.revision).what}; "
                    + ("it is skipped" if self.readonly else "it is moved aside"),
                    once=self.filename,
                )
                if not self.readonly:
                    self._quarantine()
            else:
                faults.fault(
                    f"{self.filename} has schema revision {status.revision!r}, newer than this kdb "
                    f"knows ({HEAD}); it is left untouched and kernels are compiled instead. "
                    "Upgrade kdb (pip install -U kdb), or "
                    + ("install the system database package built for this kdb, or take its "
                       "directory out of KDB_SYSTEM_DB_PATH." if self.readonly else
                       "point KDB_CACHE_DIR elsewhere."),
                    once=self.filename,
                )
            return False

    def _wal_ok(self) -> bool:
        """A system file should be in rollback-journal mode (``kdb pack`` writes it so).

        One left in WAL mode is read as its main file (``immutable=1`` ignores the WAL) with
        a warning; if a non-empty ``-wal`` lies beside it, commits the main file lacks (or a
        half-done checkpoint) may sit there, so the file is skipped instead.
        """
        if journal_of(self.filename) != "wal":
            return True  # rollback journal, or unreadable (opening reports it)
        wal = wal_size(self.filename)
        if wal:
            self.usable = False
        faults.fault(
            f"system database {self.filename} is in WAL mode"
            + (f" with a {wal}-byte -wal file beside it that a read-only reader cannot use; "
               "it is skipped" if wal else "; it is read, but should be rebuilt")
            + ". Rebuild it with `kdb pack` (which writes journal_mode=DELETE) or run "
            "`sqlite3 FILE 'PRAGMA journal_mode=DELETE'` on a writable copy.",
            once="walsys:" + self.filename)
        return not wal

    def damaged(self, err: Exception, moved: bool = False) -> None:
        """The file failed with ``err``: not used again in this process (a corrupt one is
        moved aside), unless it was only removed meanwhile, or replaced (``moved``: the path
        no longer leads to the file this thread's connection read, whose ``-wal`` and
        ``-shm`` went with it: SQLite says "disk I/O error")."""
        self.usable = False
        if isinstance(err, sqlite3.OperationalError) and (
                moved or not Path(self.filename).exists()):
            self.usable = True  # removed meanwhile (kdb clear): the next use makes a new one
            self.close()
            self.checked = False
            return
        if isinstance(err, sqlite3.OperationalError):
            # I/O error, full disk, cannot open, read-only, locked: the file may be sound,
            # and moving it aside would lose every entry. Not used by this process.
            faults.fault(f"cannot use {self.filename} now ({err}); kernels are compiled instead "
                         "and may not be stored", once=self.directory)
            return
        what = "skipped" if self.readonly else "moved aside and recreated"
        faults.fault(f"{self.filename} is damaged ({err}); it is {what}", once=self.filename)
        if not self.readonly:
            self._quarantine()

    def _quarantine(self) -> bool:
        """Move the file aside (:func:`kdb.file.fileformat.move_aside`); False if it could not be
        moved (a read-only cache, an upgrader stuck on it): it is then left in place and not
        used. Under the file's lock, as ``kdb clear`` removes one: a writer that made a new
        file between the moves of the file and of its ``-shm`` would take that WAL index."""
        from .migrate import file_lock

        ident = identity(self.filename)
        try:
            with file_lock(self.path):
                # Moved aside or replaced by another process meanwhile: the next write
                # uses the file there now.
                moved = identity(self.filename) != ident or move_aside(self.filename)
        except OSError:
            moved = False
        self._local = threading.local()
        self.usable = moved  # the next write creates a fresh file
        self.checked = False
        return moved

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local = threading.local()

    # -- reads (hot path) -------------------------------------------------------------------

    def fetch(self, key: str, again: bool = True) -> Row | None:
        conn = self.connection()
        if conn is None:
            return None
        try:
            row = conn.execute(_FETCH if self.compact else _FETCH_WHOLE, (key,)).fetchone()
        except DAMAGE as err:
            if _UNDECODABLE in str(err):  # one row's text is damaged, not the file
                return _damaged_row(conn, _FETCH if self.compact else _FETCH_WHOLE, key)
            if "no such table" in str(err):
                return None  # a file the writer has created but not migrated yet
            if "no such column" in str(err) and again:  # another process upgraded it
                self.close()
                self.checked = False  # check its revision again
                return self.fetch(key, again=False)
            if "locked" in str(err) or "busy" in str(err):
                faults.fault(f"{self.filename} is locked ({err}); treating as a miss",
                             once="locked")
                return None
            moved = self.replaced()
            self.close()
            self.damaged(err, moved=moved)
            return None
        if row is None:
            return None
        if row[5].__class__ is not float:  # a damaged row's column may hold any type
            row = (*row[:5], float(row[5]) if isinstance(row[5], int) else 0.0)
        return Row(*row)

    def signature(self, key: str) -> tuple[str | None, bytes | None]:
        """``(signer, signature)`` of ``key``'s entry, asked only under a trust policy; a file
        from before revision 0005 (no such columns) or a damaged row counts as unsigned."""
        try:
            rows = self.query(_SIGNATURE, (key,))
        except DAMAGE:
            return None, None
        row = rows[0] if rows else (None, None)
        return row if isinstance(row[0], str) and isinstance(row[1], bytes) else (None, None)

    def fetch_any_compiler(self, free_key: str) -> list[tuple[str, Row]]:
        """``(key, row)`` of every entry whose compiler-free key is ``free_key``: the
        candidates :mod:`kdb.backends.fallback` ranks when no compiler is installed. A file written
        before revision 0004 has no such column and yields none."""
        conn = self.connection()
        if conn is None:
            return []
        attributes, join = compact.columns(self.compact)
        try:
            compact.register(conn)
            rows = conn.execute(_FETCH_ANY.format(attributes=attributes, join=join),
                                (free_key,)).fetchall()
        except DAMAGE as err:
            if "no such" in str(err):  # an older revision, or a file not migrated yet
                return []
            if "locked" in str(err) or "busy" in str(err):
                faults.fault(f"{self.filename} is locked ({err}); treating as a miss",
                             once="locked")
                return []
            moved = self.replaced()
            self.close()
            self.damaged(err, moved=moved)
            return []
        return [(r[0], Row(*r[1:6], float(r[6]) if isinstance(r[6], (int, float)) else 0.0))
                for r in rows]

    def details(self, keys: list[str]) -> dict[str, dict | None]:
        """``{key: details}`` for those of ``keys`` that have an entry here (``None`` where its
        details are empty or damaged)."""
        import json

        if not keys or not os.path.exists(self.filename):
            return {}
        marks = ",".join("?" * len(keys))
        out: dict[str, dict | None] = {}
        for key, text in self.query(
                f"SELECT key, details FROM kernels WHERE key IN ({marks})", keys):
            try:
                value = json.loads(text) if text else None
            except (ValueError, TypeError):
                value = None
            out[key] = value if isinstance(value, dict) else None
        return out

    def entries(self, keys: list[str]) -> list[Entry]:
        """The entries of ``keys`` stored here as binaries (not provisional stand-ins), whole,
        decoded and checked, signed as they were stored: what a publish to the shared tier
        sends of what this node compiled. A damaged or unreadable entry is left out."""
        import json

        from . import codec

        conn = self.connection() if keys else None
        if conn is None:
            return []
        attributes, join = compact.columns(self.compact)
        marks = ",".join("?" * len(keys))
        try:
            compact.register(conn)
            rows = conn.execute(
                f"SELECT key, arch, backend, name, {attributes}, codec, blob, raw_size, "
                f"checksum, compile_seconds, details, signer, signature FROM kernels{join} "
                f"WHERE key IN ({marks})", keys).fetchall()
        except sqlite3.Error:  # damaged, locked, or a revision before 0005: nothing to send
            return []
        out = []
        for key, arch, backend, name, text, kind, blob, size, digest, seconds, details, \
                signer, signature in rows:
            try:
                info = json.loads(details) if details else None
            except (ValueError, TypeError):
                info = None
            info = info if isinstance(info, dict) else None
            raw = codec.decode(kind, blob, size, digest)
            if raw is None or not isinstance(text, str) or (info or {}).get(PROVISIONAL):
                continue
            signed = isinstance(signer, str) and isinstance(signature, bytes)
            out.append(Entry(key=key, arch=arch, backend=backend, name=name, attributes=text,
                             raw=raw, compile_seconds=float(seconds or 0.0), details=info,
                             signer=signer if signed else None,
                             signature=signature if signed else None))
        return out

    def stored(self, keys: list[str]) -> set[str]:
        """Those of ``keys`` whose entry here is a binary, not a provisional stand-in for one
        (:data:`kdb.file.rows.PROVISIONAL`): what a store of them would no longer add."""
        return {k for k, d in self.details(keys).items() if not (d or {}).get(PROVISIONAL)}

    def query(self, sql: str, params: Iterable = ()) -> list[tuple]:
        """Read-only query for the CLI and ``explain``; an unusable file yields no rows."""
        conn = self.connection()
        if conn is None:
            return []
        try:
            return conn.execute(sql, tuple(params)).fetchall()
        except DAMAGE as err:
            if "no such table" in str(err):
                return []
            raise

    # -- writes (background, kdb.file.filewriter) ------------------------------------------------

    def ensure(self) -> sqlite3.Connection | None:
        """A writable connection to a file at the head revision, creating or upgrading it
        (the one place a user file is upgraded); None where nothing can be written."""
        from .filewriter import ensure

        return ensure(self)

    def write(self, entries: list[Entry], logs: list[CompileRecord],
              hits: dict[str, tuple[int, float]], counters: dict[str, float],
              cap: int | None = None) -> bool:
        """Store entries, log rows, hit counts and counters in one short transaction
        (:func:`kdb.file.filewriter.write`); True when everything given was written."""
        from .filewriter import write

        return write(self, entries, logs, hits, counters, cap)

    def evict_to(self, target: int) -> tuple[int, int] | None:
        """Remove least recently used entries until at most ``target`` bytes are stored;
        returns (entries removed, bytes freed), or None when the file could not be changed."""
        from .eviction import evict
        from .filewriter import change

        if not Path(self.filename).exists():
            return 0, 0  # nothing stored, nothing to evict
        return change(self, "evict from", lambda conn: evict(conn, target), None)

    def delete(self, keys: Iterable[str]) -> int:
        """Drop entries (corrupt, refused by the driver, or cleared); returns how many."""
        from .eviction import remove
        from .filewriter import change

        keys = list(keys)

        def drop(conn: sqlite3.Connection) -> int:
            rows = [(key, *row) for key in keys for row in conn.execute(
                "SELECT stored_size, raw_size FROM kernels WHERE key = ?", (key,))]
            return remove(conn, rows)[0]

        return change(self, "delete from", drop, 0)


def _writable(path: str) -> bool:
    """Whether this process can write ``path`` and create its journal beside it."""
    if not Path(path).exists():
        return True  # created by the writer, which reports what fails
    return os.access(path, os.W_OK) and os.access(str(Path(path).parent), os.W_OK | os.X_OK)
