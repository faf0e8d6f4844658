"""One SQLite kernel file: the reads on the hot path and the writes off it.

Reads use plain :mod:`sqlite3` (no SQLAlchemy on a hit) and accept every schema revision
whose columns they need, as it is: a lookup never migrates. A system file is opened
``mode=ro&immutable=1`` and never written. A user file is created and upgraded by the writer
(:meth:`KernelFile.ensure`, called by every write, off the critical path), so a process whose
lookups all miss a file that does not exist yet pays nothing for creating it. What a revision
means, WAL detection and the ``meta`` rows live in :mod:`kdb.fileformat`.

Faults of the file itself (corrupt, foreign, from a newer kdb, locked, read-only, disk full)
are reported through :func:`kdb.faults.fault` and cost at most a recompile.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import threading
import time
from collections import namedtuple
from pathlib import Path

from . import codec, faults, fs
from .config import BUSY_TIMEOUT_S, max_size, private_dir
from .eviction import evict, remove
from .fileformat import (DAMAGE, HEAD, REVISIONS, bump_meta, classify, file_facts,
                         has_no_tables, journal_of, meta_int, move_aside, revision_of,
                         set_meta, sqlite_uri, transaction, wal_size)
from .keys import compiler_free_key

TYPE_CHECKING = False
if TYPE_CHECKING:  # annotations are strings here; typing stays off the hit path
    from typing import Iterable

__all__ = ["CompileRecord", "Entry", "KernelFile", "Row", "sqlite_uri"]

_DAMAGE = DAMAGE  # the name older callers import

_FETCH = (
    "SELECT codec, blob, raw_size, checksum, attributes, compile_seconds "
    "FROM kernels WHERE key = ?"
)

_FETCH_ANY = (
    "SELECT key, codec, blob, raw_size, checksum, attributes, compile_seconds "
    "FROM kernels WHERE compiler_free_key = ?"
)


class Row(namedtuple("Row", "codec blob raw_size checksum attributes compile_seconds")):
    """What a hit needs from a stored entry (the columns of ``_FETCH``)."""

    __slots__ = ()


class Entry(namedtuple("Entry", "key arch backend name attributes raw compile_seconds details",
                       defaults=(0.0, None))):
    """A binary ready to be written, with its bookkeeping (``details``: a dict or None)."""

    __slots__ = ()


class CompileRecord(namedtuple("CompileRecord",
                               "key name arch backend seconds missed reason at pid")):
    """One row of the start-up latency log."""

    __slots__ = ()


class KernelFile:
    """A tier's file for one arch. Thread-safe: one connection per thread."""

    def __init__(self, path: Path, *, tier: str, readonly: bool) -> None:
        self.path = Path(path)
        self.tier = tier
        self.readonly = readonly
        self.usable = True  # False once the file proved unusable in this process
        self._checked = False
        self._local = threading.local()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"KernelFile({str(self.path)!r}, tier={self.tier!r})"

    # -- connections ------------------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        if self.readonly:
            uri = sqlite_uri(self.path, "mode=ro&immutable=1")
            conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
        else:
            uri = sqlite_uri(self.path, "mode=rw")
            conn = sqlite3.connect(
                uri, uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                check_same_thread=False,
            )
            conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    def _conn(self) -> sqlite3.Connection | None:
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == os.getpid():
            return conn
        if not self.usable:
            return None
        try:
            mode = os.stat(self.path).st_mode
        except OSError:
            return None  # not there (yet), or not reachable: a miss
        if not stat.S_ISREG(mode):
            self._not_a_file(mode)
            return None
        if not self.readonly and not self._checked:
            if not self._trusted():
                return None
            if not _writable(self.path):
                self._read_only_cache()
        conn = None
        try:
            conn = self._open()
            if not self._checked and not self._check(conn):
                conn.close()
                return None
        except DAMAGE as err:
            if conn is not None:
                conn.close()
            self._damaged(err)
            return None
        self._local.conn, self._local.pid = conn, os.getpid()
        self._local.ident = _identity(self.path)
        return conn

    def _replaced(self) -> bool:
        """Whether the file this thread's connection writes to is no longer at ``path``
        (``kdb clear``, a repair, or a user deleted it): writes would go to an unlinked file."""
        return getattr(self._local, "ident", None) != _identity(self.path)

    def trusted(self) -> bool:
        """A user file is code this process will run: refuse one others can change (a
        fault, once); True when this file and its directory are private to this user."""
        why = fs.unsafe_reason(self.path) or fs.unsafe_reason(self.path.parent)
        if why is None:
            return True
        self.usable = False
        faults.fault(f"{self.path} is refused: {why}, and loading a binary from it would run "
                     "code someone else can change. Make it yours and private (chmod 700 on "
                     "the directory, 600 on the file) or set KDB_CACHE_DIR to a private "
                     "directory; kernels are compiled meanwhile.", once="unsafe:" + str(self.path))
        return False

    _trusted = trusted  # the name other modules used before

    def _not_a_file(self, mode: int) -> None:
        """A directory, FIFO or device where the file should be: opening a FIFO would block
        forever, and nothing can be stored there. Skipped, never moved or written."""
        self.usable = False
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "not a regular file")
        faults.fault(f"{self.path} is {kind}, not a kdb file; it is skipped and kernels are "
                     "compiled" + ("" if self.readonly else " but not stored there: remove it")
                     + ".", once=str(self.path))

    def _read_only_cache(self) -> None:
        """The user file exists but cannot be written (a read-only cache directory): use its
        entries, store nothing. Opened immutable: a WAL file needs a writable ``-shm`` beside
        it, and nobody can commit to a file in a directory no one may write."""
        self.readonly = True
        faults.fault(f"the kernel cache {self.path.parent} is read-only: kernels stored there "
                     "are used, new ones are compiled but not stored. Make it writable or set "
                     "KDB_CACHE_DIR to a writable directory.", once=str(self.path.parent))

    def _check(self, conn: sqlite3.Connection) -> bool:
        """Once per process: may lookups read this file as it is? Never upgrades it: every
        revision whose columns a hit needs is read as it is, and the writer upgrades.

        False (a miss) for a file skipped with a fault, and for one too old to read, which
        stays usable: :meth:`ensure` upgrades it on the next write.
        """
        with self._lock:
            if self._checked:
                return True
            if self.tier == "system" and not self._wal_ok():
                return False
            status = classify(conn)  # raises DAMAGE for a file missing its tables
            if status.readable or (status.kind == "empty" and self.tier == "user"):
                self._checked = True  # empty: reads miss until the writer creates its tables
                return True
            if status.kind == "stale":
                if self.readonly:
                    self.usable = False
                    faults.fault(f"{self.path} is {status.what}, older than this kdb reads; "
                                 "it is skipped and kernels are compiled instead",
                                 once=str(self.path))
                return False
            self.usable = False
            if status.kind in ("foreign", "empty"):
                faults.fault(
                    f"{self.path} is {status.what}; "
                    + ("it is skipped" if self.readonly else "it is moved aside"),
                    once=str(self.path),
                )
                if not self.readonly:
                    self._quarantine()
            else:
                faults.fault(
                    f"{self.path} has schema revision {status.revision!r}, newer than this kdb "
                    f"knows ({HEAD}); it is left untouched and kernels are compiled instead. "
                    "Upgrade kdb (pip install -U kdb) or point KDB_CACHE_DIR elsewhere.",
                    once=str(self.path),
                )
            return False

    def _wal_ok(self) -> bool:
        """A system file should be in rollback-journal mode (``kdb pack`` writes it so).

        One left in WAL mode is read as its main file (``immutable=1`` ignores the WAL) with
        a warning; if a non-empty ``-wal`` lies beside it, commits the main file lacks (or a
        half-done checkpoint) may sit there, so the file is skipped instead.
        """
        if journal_of(self.path) != "wal":
            return True  # rollback journal, or unreadable (opening reports it)
        wal = wal_size(self.path)
        if wal:
            self.usable = False
        faults.fault(
            f"system database {self.path} is in WAL mode"
            + (f" with a {wal}-byte -wal file beside it that a read-only reader cannot use; "
               "it is skipped" if wal else "; it is read, but should be rebuilt")
            + ". Rebuild it with `kdb pack` (which writes journal_mode=DELETE) or run "
            "`sqlite3 FILE 'PRAGMA journal_mode=DELETE'` on a writable copy.",
            once="walsys:" + str(self.path))
        return not wal

    def _migrate(self) -> bool:
        """Bring the file to the head revision with alembic; a failure is a fault, not fatal."""
        from . import migrate  # alembic and SQLAlchemy: only here, on a write

        try:
            migrate.upgrade_sqlite(self.path, create=False)
        except Exception as err:  # noqa: BLE001 - SQLAlchemy/alembic errors must not propagate
            self.usable = False
            faults.fault(
                f"{self.path} could not be upgraded to schema revision {HEAD} ({err}); "
                "it is left as is and kernels are compiled instead. Delete it to start afresh.",
                once="upgrade:" + str(self.path),
            )
            return False
        return True

    def _damaged(self, err: Exception) -> None:
        self.usable = False
        if isinstance(err, sqlite3.OperationalError):
            # I/O error, full disk, cannot open, read-only, locked: the file may be sound,
            # and moving it aside would lose every entry. Not used by this process.
            faults.fault(f"cannot use {self.path} now ({err}); kernels are compiled instead "
                         "and may not be stored", once=str(self.path.parent))
            return
        what = "skipped" if self.readonly else "moved aside and recreated"
        faults.fault(f"{self.path} is damaged ({err}); it is {what}", once=str(self.path))
        if not self.readonly:
            self._quarantine()

    def _quarantine(self) -> bool:
        """Move the file aside (:func:`kdb.fileformat.move_aside`); False if it could not be
        moved (a read-only cache): it is then left in place and not used."""
        moved = move_aside(self.path)
        self._local = threading.local()
        self.usable = moved  # the next write creates a fresh file
        self._checked = False
        return moved

    quarantine = _quarantine

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local = threading.local()

    # -- reads (hot path) -------------------------------------------------------------------

    def fetch(self, key: str) -> Row | None:
        conn = self._conn()
        if conn is None:
            return None
        try:
            row = conn.execute(_FETCH, (key,)).fetchone()
        except DAMAGE as err:
            if "no such table" in str(err):
                return None  # a file the writer has created but not migrated yet
            if "locked" in str(err) or "busy" in str(err):
                faults.fault(f"{self.path} is locked ({err}); treating as a miss", once="locked")
                return None
            self.close()
            self._damaged(err)
            return None
        if row is None:
            return None
        if row[5].__class__ is not float:  # a damaged row's column may hold any type
            row = (*row[:5], float(row[5]) if isinstance(row[5], int) else 0.0)
        return Row(*row)

    def fetch_any_compiler(self, free_key: str) -> list[tuple[str, Row]]:
        """``(key, row)`` of every entry whose compiler-free key is ``free_key``: the
        candidates :mod:`kdb.fallback` ranks when no compiler is installed. A file written
        before revision 0004 has no such column and yields none."""
        conn = self._conn()
        if conn is None:
            return []
        try:
            rows = conn.execute(_FETCH_ANY, (free_key,)).fetchall()
        except DAMAGE as err:
            if "no such" in str(err):  # an older revision, or a file not migrated yet
                return []
            if "locked" in str(err) or "busy" in str(err):
                faults.fault(f"{self.path} is locked ({err}); treating as a miss", once="locked")
                return []
            self.close()
            self._damaged(err)
            return []
        return [(r[0], Row(*r[1:6], float(r[6]) if isinstance(r[6], (int, float)) else 0.0))
                for r in rows]

    def query(self, sql: str, params: Iterable = ()) -> list[tuple]:
        """Read-only query for the CLI and ``explain``; an unusable file yields no rows."""
        conn = self._conn()
        if conn is None:
            return []
        try:
            return conn.execute(sql, tuple(params)).fetchall()
        except DAMAGE as err:
            if "no such table" in str(err):
                return []
            raise

    # -- writes (background) ----------------------------------------------------------------

    def ensure(self) -> sqlite3.Connection | None:
        """A writable connection to a file at the head revision, creating it if needed.

        The one place a user file is upgraded: under its upgrade lock, by the writer."""
        if self.readonly:
            return None
        conn = self._conn()
        if conn is not None and self._replaced():
            self.close()  # reopen, or create, the file now at ``path``
            self._checked = False
            conn = None
        if conn is not None and self._checked and revision_of(conn) == HEAD:
            return conn
        if not self.usable:
            return None
        try:
            private_dir(self.path.parent)
            if not self.trusted():  # never create a file where others could change it
                return None
            if not self.path.exists():
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
                os.close(fd)
            from .migrate import file_lock

            with file_lock(self.path):
                probe = self._open()
                try:
                    rev = revision_of(probe)
                    if rev is None and not has_no_tables(probe):
                        probe.close()
                        self._damaged(sqlite3.DatabaseError("not a kdb database"))
                        return None
                    if rev is None:
                        probe.execute(f"PRAGMA journal_mode={self._journal_mode()}")
                finally:
                    probe.close()
                if rev != HEAD:
                    if rev is not None and rev not in REVISIONS:
                        self._checked = False
                        self._conn()  # reports the future revision once
                        return None
                    if not self._migrate():
                        return None
                    if rev is None:
                        self._describe()
        except DAMAGE as err:
            self._damaged(err)
            return None
        except OSError as err:
            self.usable = False
            faults.fault(f"cannot write {self.path} ({err}); kernels will not be stored",
                         once=str(self.path.parent))
            return None
        self.close()
        self._checked = True
        return self._conn()

    def _describe(self) -> None:
        """Facts about a new file in ``meta``: its arch, format and the kdb that made it."""
        conn = sqlite3.connect(self.path, isolation_level=None)
        try:
            set_meta(conn, file_facts(self.path.stem))
        finally:
            conn.close()

    def _journal_mode(self) -> str:
        """WAL on local disks; a rollback journal where WAL does not work (network FS)."""
        kind = fs.network_fs(self.path.parent)
        if kind is None:
            return "WAL"
        faults.warn_once(
            "netfs:" + str(self.path.parent),
            "kdb: the kernel cache %s is on a network file system (%s), where SQLite's WAL "
            "does not work: kdb uses a rollback journal there, and concurrent jobs may wait "
            "on each other. Use a node-local KDB_CACHE_DIR (e.g. /tmp or $TMPDIR) instead.",
            self.path.parent, kind)
        return "DELETE"

    def write(self, entries: list[Entry], logs: list[CompileRecord],
              hits: dict[str, tuple[int, float]], counters: dict[str, float],
              cap: int | None = None) -> bool:
        """Store entries, log rows, hit counts and counters in one short transaction.

        With a ``cap`` (bytes, default ``KDB_CACHE_MAX_SIZE``; 0 = none), an insert that
        would pass it evicts the least recently used entries until a third of it is free;
        a binary larger than the cap is not stored. True when everything given was written.
        """
        cap = max_size() if cap is None else cap  # a bad KDB_CACHE_MAX_SIZE: before any write
        conn = self.ensure()
        if conn is None:
            return False
        now = time.time()
        try:
            with transaction(conn):
                skipped = self._store(conn, entries, logs, hits, counters, cap, now)
            return not skipped
        except (sqlite3.Error, UnicodeDecodeError) as err:
            if isinstance(err, UnicodeDecodeError) or (
                    isinstance(err, sqlite3.DatabaseError) and "malformed" in str(err)):
                self.close()
                self._damaged(err)
            else:
                faults.fault(f"could not write to {self.path} ({err}); entries not stored",
                             once="write:" + str(self.path))
            return False

    def _store(self, conn: sqlite3.Connection, entries: list[Entry],
               logs: list[CompileRecord], hits: dict[str, tuple[int, float]],
               counters: dict[str, float], cap: int, now: float) -> int:
        """The body of :meth:`write`, inside its transaction; returns how many entries were
        too large to store."""
        added = added_raw = added_entries = skipped = 0
        for e in entries:
            kind, blob = codec.encode(e.raw)
            if cap and len(blob) > cap:
                faults.warn_once(f"toobig:{self.path}",
                                 "kdb: a %d-byte binary (%s) exceeds the cache cap of %d "
                                 "bytes (KDB_CACHE_MAX_SIZE) and is not stored",
                                 len(blob), e.name or e.key[:16], cap)
                skipped += 1
                continue
            old = conn.execute("SELECT stored_size, raw_size FROM kernels WHERE key = ?",
                               (e.key,)).fetchone()
            added += len(blob) - (old[0] if old else 0)
            added_raw += len(e.raw) - (old[1] if old else 0)
            added_entries += 0 if old else 1
            conn.execute(
                "INSERT OR REPLACE INTO kernels (key, arch, backend, name, attributes, "
                "details, codec, dict_id, blob, raw_size, stored_size, checksum, "
                "compile_seconds, created, last_access, hits, compiler_free_key) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, NULL, ?, ?, ?, ?, ?, ?, ?, 0, ?)",
                (e.key, e.arch, e.backend, e.name, e.attributes,
                 _json_text(e.details), kind, blob, len(e.raw),
                 len(blob), codec.checksum(e.raw), e.compile_seconds, now, now,
                 compiler_free_key(e.attributes)),
            )
        # Running totals, kept in the same transaction, so size checks never scan.
        for name, delta in (("stored_bytes", added), ("raw_bytes", added_raw),
                            ("entries", added_entries)):
            if delta:
                bump_meta(conn, name, delta)
        # Any insert over the cap evicts, not only one that grows the file: the cap may
        # have been lowered since the file was filled.
        if cap and len(entries) > skipped and meta_int(conn, "stored_bytes") > cap:
            evict(conn, cap - cap // 3, keep={e.key for e in entries})
        for r in logs:
            conn.execute(
                "INSERT INTO compile_log (at, key, name, arch, backend, seconds, missed, "
                "reason, pid) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (r.at, r.key, r.name, r.arch, r.backend, r.seconds, r.missed, r.reason,
                 r.pid),
            )
        for key, (n, last) in hits.items():
            conn.execute(
                "UPDATE kernels SET hits = hits + ?, last_access = MAX(last_access, ?) "
                "WHERE key = ?", (n, last, key))
        for name, delta in counters.items():
            conn.execute(
                "INSERT INTO counters (name, value) VALUES (?, ?) ON CONFLICT(name) "
                "DO UPDATE SET value = value + excluded.value", (name, delta))
        return skipped

    def evict_to(self, target: int) -> tuple[int, int] | None:
        """Remove least recently used entries until at most ``target`` bytes are stored;
        returns (entries removed, bytes freed), or None when the file could not be changed."""
        if not self.path.exists():
            return 0, 0  # nothing stored, nothing to evict
        return self._change("evict from", lambda conn: evict(conn, target), None)

    def delete(self, keys: Iterable[str]) -> int:
        """Drop entries (corrupt, refused by the driver, or cleared); returns how many."""
        keys = list(keys)

        def drop(conn: sqlite3.Connection) -> int:
            rows = [(key, *row) for key in keys for row in conn.execute(
                "SELECT stored_size, raw_size FROM kernels WHERE key = ?", (key,))]
            return remove(conn, rows)[0]

        return self._change("delete from", drop, 0)

    def _change(self, what: str, change, default):
        """Run ``change(conn)`` in one immediate transaction; a failure is a fault, not fatal."""
        conn = self.ensure() if self.path.exists() else None
        if conn is None:
            return default
        try:
            with transaction(conn):
                return change(conn)
        except (sqlite3.Error, UnicodeDecodeError) as err:
            faults.fault(f"could not {what} {self.path} ({err})", once=f"{what}:{self.path}")
            return default


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of ``path``, or None when nothing is there."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _writable(path: Path) -> bool:
    """Whether this process can write ``path`` and create its journal beside it."""
    if not path.exists():
        return True  # created by the writer, which reports what fails
    return os.access(path, os.W_OK) and os.access(path.parent, os.W_OK | os.X_OK)


def _json_text(details: dict | None) -> str:
    """Entry details as stored (JSON); :mod:`json` loads here, on a store, not on a hit."""
    import json

    return json.dumps(details or {}, sort_keys=True)
