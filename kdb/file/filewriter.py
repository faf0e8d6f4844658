"""The writer of a user file: create it, upgrade it, and store a batch in one transaction.

Runs off the hit path (the background writer, the store worker, ``put``, ``kdb evict``):
:class:`kdb.file.kernelfile.KernelFile` imports this module only when it writes. It is the one place
a user file is created (from the head revision's statements, without alembic) or upgraded
(alembic), under the file's upgrade lock; readers take every revision whose columns
they need as it is.
"""

from __future__ import annotations

import os
import sqlite3
import time
from typing import TYPE_CHECKING

from . import codec, compact, fs
from .. import faults, logs
from ..logs import warn_once  # by name: _store's 'logs' is the latency rows
from ..config import max_size, private_dir
from .eviction import drop_unused_sources, evict
from .fileformat import (
    DAMAGE,
    HEAD,
    REVISIONS,
    bump_meta,
    file_facts,
    has_no_tables,
    identity,
    meta_int,
    revision_of,
    set_meta,
    transaction,
)
from ..keys import compiler_free_key
from .rows import PROVISIONAL

if TYPE_CHECKING:
    from .kernelfile import CompileRecord, Entry, KernelFile


log = logs.get("kdb")


class _Gone(Exception):
    """The file was removed or replaced while this writer made it ready (``kdb clear``)."""


#: Times a write starts again on a file removed or replaced under it, before it gives up
#: (quietly, for this write only: the next write tries again).
_ATTEMPTS = 3

#: Bytes a ``-wal`` is cut back to once checkpointed: SQLite leaves it at its largest (4 MB
#: after 1,000 pages, more where a reader held a checkpoint off) beside a capped file.
_WAL_KEPT = 1 << 20


def ensure(f: KernelFile) -> sqlite3.Connection | None:
    """A writable connection to a file at the head revision, creating it if needed.

    The one place a user file is upgraded: under its upgrade lock, by the writer. A file
    removed or replaced meanwhile (``kdb clear`` beside a running program) is no fault: the
    writer makes the new one ready instead, and never gives the user tier up for it."""
    if f.readonly:
        return None
    for _ in range(_ATTEMPTS):
        try:
            return _ensure(f)
        except _Gone:
            f.close()
            f.checked = False
    return None


def _ensure(f: KernelFile) -> sqlite3.Connection | None:
    conn = f.connection()
    if conn is not None and f.replaced():
        f.close()  # reopen, or create, the file now at ``path``
        f.checked = False
        conn = None
    if conn is not None and f.checked and revision_of(conn) == HEAD:
        return conn
    if not f.usable:
        return None
    # A connection held open while the file is made ready keeps its inode from being reused,
    # so a new file at the path always has another identity. (Not a plain fd: closing one
    # would drop this process's SQLite locks on the file, sqlite.org/howtocorrupt.html.)
    keeper = None
    ident = began = None
    try:
        private_dir(f.path.parent)
        if not f.trusted():  # never create a file where others could change it
            return None
        if not f.path.exists():
            os.close(os.open(f.path, os.O_WRONLY | os.O_CREAT, 0o600))
        ident, began = identity(f.filename), True
        keeper = f.open_connection()
        _check_there(f, ident)
        from .migrate import file_lock

        with file_lock(f.path):
            if not _upgraded(f, ident):
                return None
    except DAMAGE as err:
        if began:
            _check_there(f, ident, err)
        f.damaged(err)
        return None
    except OSError as err:
        if began:
            _check_there(f, ident, err)
        f.usable = False
        faults.fault(f"cannot write {f.path} ({err}); kernels will not be stored",
                     once=str(f.path.parent))
        return None
    finally:
        if keeper is not None:
            keeper.close()
    f.close()
    f.checked = True
    f.compact = True  # at the head revision now
    return f.connection()


def _upgraded(f: KernelFile, ident: tuple[int, int]) -> bool:
    """Under the file's upgrade lock: a new file made a kdb file, an older one migrated to
    the head revision. False where it is not a kdb file, or is of a future revision."""
    _check_there(f, ident)
    probe = f.open_connection()
    try:
        rev = revision_of(probe)
        if rev is None and not has_no_tables(probe):
            probe.close()
            _check_there(f, ident)
            f.damaged(sqlite3.DatabaseError("not a kdb database"))
            return False
        if rev is None:
            probe.execute(f"PRAGMA journal_mode={_journal_mode(f)}")
    finally:
        probe.close()
    if rev == HEAD:
        return True
    if rev is not None and rev not in REVISIONS:
        f.checked = False
        f.connection()  # reports the future revision once
        return False
    made = _create if rev is None else _migrate  # a new file: no alembic
    if not made(f, lambda: _check_there(f, ident)):
        return False
    if rev is None:
        _describe(f)
    _check_there(f, ident)
    return True


def _check_there(f: KernelFile, ident: tuple[int, int] | None,
                 err: Exception | None = None) -> None:
    """Raise :class:`_Gone` where the file that had ``ident`` when this writer began is no
    longer at ``f``'s path: removed, or replaced by another process's (``kdb clear``)."""
    if ident is None or identity(f.filename) != ident:
        raise _Gone from err


def _describe(f: KernelFile) -> None:
    """Facts about a new file in ``meta``: its arch, format and the kdb that made it."""
    conn = f.open_connection()  # mode=rw: a file removed meanwhile is not made again here
    try:
        set_meta(conn, [("arch", f.path.stem), *file_facts()])
    finally:
        conn.close()


def _journal_mode(f: KernelFile) -> str:
    """WAL on local disks; a rollback journal where WAL does not work (network FS)."""
    kind = fs.network_fs(f.path.parent)
    if kind is None:
        return "WAL"
    warn_once(
        "netfs:" + str(f.path.parent),
        "kdb: the kernel cache %s is on a network file system (%s), where SQLite's WAL "
        "does not work: kdb uses a rollback journal there, and concurrent jobs may wait "
        "on each other. Use a node-local KDB_CACHE_DIR (e.g. /tmp or $TMPDIR) instead.",
        f.path.parent, kind)
    return "DELETE"


def write(f: KernelFile, entries: list[Entry], logs: list[CompileRecord],
          hits: dict[str, tuple[int, float]], counters: dict[str, float],
          cap: int | None = None) -> bool:
    """Store entries, log rows, hit counts and counters in one short transaction.

    With a ``cap`` (bytes, default ``KDB_CACHE_MAX_SIZE``; 0 = none), an insert that
    would pass it evicts the least recently used entries until a third of it is free;
    a binary larger than the cap is not stored. True when everything given was written.
    """
    cap = max_size() if cap is None else cap  # a bad KDB_CACHE_MAX_SIZE: before any write
    for attempt in range(_ATTEMPTS):
        conn = ensure(f)
        if conn is None:
            return False
        try:
            _bound_wal(conn, cap)
            with transaction(conn):
                skipped = _store(f, conn, entries, logs=logs, hits=hits, counters=counters,
                                 cap=cap, now=time.time())
            return not skipped
        except (sqlite3.Error, UnicodeDecodeError) as err:
            if attempt + 1 < _ATTEMPTS and isinstance(err, sqlite3.Error) and f.replaced():
                f.close()  # removed or replaced since ensure() (kdb clear): write the new one
                f.checked = False
                continue
            _write_failed(f, err)
            return False
    return False


def _bound_wal(conn: sqlite3.Connection, cap: int) -> None:
    """Keep the ``-wal`` in proportion to the cap: with ``KDB_CACHE_MAX_SIZE=300K`` it
    stood at 4 MB beside the file, SQLite's defaults checkpointing every 1,000 pages and
    never cutting it back. Under a 16 MB cap it is checkpointed at a quarter of the cap
    (256 KB at least: each checkpoint is a sync, 20 ms here) and cut back to a quarter."""
    kept = min(_WAL_KEPT, cap // 4) if cap else _WAL_KEPT
    conn.execute(f"PRAGMA journal_size_limit={kept}")
    if cap and cap < 1000 * 4096 * 4:  # SQLite's 1,000-page default
        conn.execute(f"PRAGMA wal_autocheckpoint={max(64, kept // 4096)}")


#: Writes of this process that failed because another held the file's write lock past
#: SQLite's busy timeout (a ``sqlite3`` session, a backup, a long ``kdb`` command): the
#: store worker queues such a job again instead of dropping it (:mod:`kdb.worker.lane`).
locked_failures = 0


def _count_locked(err: BaseException) -> None:
    """Count ``err`` in :data:`locked_failures` when another connection held the lock (it
    is gone later: the write may be tried again)."""
    global locked_failures
    if isinstance(err, sqlite3.OperationalError) and (
            "locked" in str(err) or "busy" in str(err)):
        locked_failures += 1


def _write_failed(f: KernelFile, err: Exception) -> None:
    """A write that failed on the file itself: damage moves it aside, the rest is a fault."""
    _count_locked(err)
    if isinstance(err, UnicodeDecodeError) or (
            isinstance(err, sqlite3.DatabaseError) and "malformed" in str(err)):
        f.close()
        f.damaged(err)
    else:
        faults.fault(f"could not write to {f.path} ({err}); entries not stored",
                     once=faults.full_disk_key(f.path.parent) if faults.full_disk(err)
                     else "write:" + str(f.path))


#: A latency row, unless the same process's row for that key at that time is there: a store
#: job is stored again when its lane was stopped after its write but before it removed the
#: job (a store over its CPU bound is set aside and stored again; a hurry stores a job a
#: starved lane holds), and entries are idempotent by key. ``at`` is indexed.
#: Compile-log rows a user file keeps (the newest), at most; under a size cap, one per 1 KiB
#: of it, and never fewer than :data:`MIN_LOG_ROWS`.
LOG_ROWS = 20_000
MIN_LOG_ROWS = 1_000


def log_rows(cap: int) -> int:
    """How many compile-log rows a user file of size cap ``cap`` (0: none) keeps.

    >>> log_rows(0), log_rows(300 << 10), log_rows(8 << 20)
    (20000, 1000, 8192)
    """
    return LOG_ROWS if not cap else max(MIN_LOG_ROWS, min(LOG_ROWS, cap >> 10))


_LOG_ONCE = ("INSERT INTO compile_log (at, key, name, arch, backend, seconds, missed, reason, "
             "pid) SELECT ?, ?, ?, ?, ?, ?, ?, ?, ? WHERE NOT EXISTS (SELECT 1 FROM "
             "compile_log WHERE at = ? AND key = ? AND pid = ?)")


def _store(f: KernelFile, conn: sqlite3.Connection, entries: list[Entry], *,
           logs: list[CompileRecord], hits: dict[str, tuple[int, float]],
           counters: dict[str, float], cap: int, now: float) -> int:
    """The body of :meth:`write`, inside its transaction; returns how many entries were
    not stored: too large, or unsigned where a signed entry of the same key is (a process
    whose signing key was refused never takes a signed entry from the others)."""
    added = added_raw = added_entries = skipped = 0
    encoded = [codec.encode(e.raw) for e in entries]
    if cap and len(entries) > 1:  # a batch over the cap: only its newest are written
        entries, encoded = _newest_fitting(entries, encoded, cap - cap // 3)
    for e, enc in zip(entries, encoded):
        grew = _insert(f, conn, e, cap, now, enc)
        if grew is None:
            skipped += 1
            continue
        added += grew[0]
        added_raw += grew[1]
        added_entries += grew[2]
    # Running totals, kept in the same transaction, so size checks never scan.
    for name, delta in (("stored_bytes", added), ("raw_bytes", added_raw),
                        ("entries", added_entries)):
        if delta:
            bump_meta(conn, name, delta)
    # Hits first: an entry just used is recent when the eviction below picks (it was the
    # first to go, with its hits, when they were counted after).
    for key, (n, last) in hits.items():
        conn.execute(
            "UPDATE kernels SET hits = hits + ?, last_access = MAX(last_access, ?) "
            "WHERE key = ?", (n, last, key))
    # Any insert over the cap evicts, not only one that grows the file: the cap may
    # have been lowered since the file was filled. The entries written now go last, but
    # go: a batch bigger than the cap (a process's early entries at exit) left the file
    # several times its cap, every other entry evicted.
    if cap and len(entries) > skipped and meta_int(conn, "stored_bytes") > cap:
        evict(conn, cap - cap // 3, keep={e.key for e in entries})
        if meta_int(conn, "stored_bytes") > cap:
            evict(conn, cap - cap // 3)
    for r in logs:  # once each: a store job may be stored twice (see _LOG_ONCE)
        conn.execute(_LOG_ONCE, (r.at, r.key, r.name, r.arch, r.backend, r.seconds, r.missed,
                                 r.reason, r.pid, r.at, r.key, r.pid))
    if logs:  # the newest rows only: a cache restored run after run grew by every compile
        conn.execute("DELETE FROM compile_log WHERE id <= (SELECT max(id) FROM compile_log)"
                     " - ?", (log_rows(cap),))
    for name, delta in counters.items():
        conn.execute(
            "INSERT INTO counters (name, value) VALUES (?, ?) ON CONFLICT(name) "
            "DO UPDATE SET value = value + excluded.value", (name, delta))
    return skipped


def _newest_fitting(entries: list[Entry], encoded: list, room: int) -> tuple[list, list]:
    """The last of ``entries`` (the newest: a batch is in the order its programs were
    built) whose encoded binaries fit in ``room`` bytes, at least one. A process's early
    entries at exit, all written and then mostly evicted in one transaction, left the file
    four times its cap on disk (SQLite keeps the pages)."""
    total, first = 0, len(entries)
    while first > 0 and (total + len(encoded[first - 1][1]) <= room or first == len(entries)):
        first -= 1
        total += len(encoded[first][1])
    return entries[first:], encoded[first:]


def _insert(f: KernelFile, conn: sqlite3.Connection, e: Entry, cap: int,
            now: float, encoded: tuple | None = None) -> tuple[int, int, int] | None:
    """One entry written (its source once); what it added to the stored bytes, the raw
    bytes and the entry count, or None where it is not stored (over the cap, or unsigned
    in place of a signed one). ``encoded``: :func:`codec.encode` of its binary, if done."""
    kind, blob = encoded if encoded is not None else codec.encode(e.raw)
    if cap and len(blob) > cap:
        warn_once(f"toobig:{f.path}",
                  "kdb: a %d-byte binary (%s) exceeds the cache cap of %d "
                  "bytes (KDB_CACHE_MAX_SIZE) and is not stored",
                  len(blob), e.name or e.key[:16], cap)
        return None
    old = conn.execute("SELECT stored_size, raw_size, source, signer, signature, details "
                       "FROM kernels WHERE key = ?", (e.key,)).fetchone()
    if old is not None and e.details and e.details.get(PROVISIONAL) and not _provisional(old[5]):
        return None  # a stand-in never replaces what is stored, only an older stand-in
    if old is not None and old[3] and old[4] and not (e.signer and e.signature):
        log.debug("kdb: %s keeps its signed entry %s: not replaced by an unsigned one",
                  f.path, e.key[:16])
        return None
    packed = compact.pack(e.attributes)
    if packed.source is not None:
        conn.execute("INSERT OR IGNORE INTO sources (digest, body, size) VALUES (?, ?, ?)",
                     (packed.source, packed.body, packed.size))
    conn.execute(
        "INSERT OR REPLACE INTO kernels (key, arch, backend, name, attrs, source, "
        "attributes_sha256, details, codec, dict_id, blob, raw_size, stored_size, "
        "checksum, compile_seconds, created, last_access, hits, compiler_free_key, "
        "signer, signature) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, ?, ?, ?, ?, ?, ?, ?, 0, ?, ?, ?)",
        (e.key, e.arch, e.backend, e.name, packed.attrs, packed.source, packed.sha256,
         _json_text(e.details), kind, blob, len(e.raw),
         len(blob), codec.checksum(e.raw), e.compile_seconds, now, now,
         compiler_free_key(e.attributes), e.signer, e.signature),
    )
    if old and old[2] != packed.source:  # a damaged entry replaced: its source may go
        drop_unused_sources(conn, [old[2]])
    return (len(blob) - (old[0] if old else 0), len(e.raw) - (old[1] if old else 0),
            0 if old else 1)


def _provisional(details: str | None) -> bool:
    """Whether a stored entry's ``details`` text marks it provisional (:data:`PROVISIONAL`)."""
    import json

    try:
        return bool(details) and bool(json.loads(details).get(PROVISIONAL))
    except (ValueError, AttributeError):
        return False


def replace_binary(f: KernelFile, key: str, checksum_was: str, raw: bytes, details: dict,
                   cap: int | None = None) -> bool:
    """Put ``raw`` in place of the binary of ``key``'s entry, in one transaction, if that
    entry is still the unsigned one whose binary has the checksum ``checksum_was``
    (a refresh, :mod:`kdb.backends.opencl.refresh`: an entry stored or refreshed by
    another process meanwhile is left as it is). Its key, attributes, hits and times stay;
    ``details`` replaces its details. True when it was replaced."""
    cap = max_size() if cap is None else cap
    kind, blob = codec.encode(raw)
    if cap and len(blob) > cap:
        return False

    def swap(conn: sqlite3.Connection) -> bool:
        old = conn.execute("SELECT stored_size, raw_size FROM kernels WHERE key = ? AND "
                           "checksum = ? AND signature IS NULL", (key, checksum_was)).fetchone()
        if old is None:
            return False
        conn.execute("UPDATE kernels SET codec = ?, dict_id = NULL, blob = ?, raw_size = ?, "
                     "stored_size = ?, checksum = ?, details = ? WHERE key = ?",
                     (kind, blob, len(raw), len(blob), codec.checksum(raw),
                      _json_text(details), key))
        bump_meta(conn, "stored_bytes", len(blob) - old[0])
        bump_meta(conn, "raw_bytes", len(raw) - old[1])
        if cap and meta_int(conn, "stored_bytes") > cap:
            evict(conn, cap - cap // 3, keep={key})
        return True

    return change(f, "refresh an entry of", swap, False)


def change(f: KernelFile, what: str, change, default):
    """Run ``change(conn)`` in one immediate transaction; a failure is a fault, not fatal."""
    conn = ensure(f) if f.path.exists() else None
    if conn is None:
        return default
    try:
        with transaction(conn):
            return change(conn)
    except (sqlite3.Error, UnicodeDecodeError) as err:
        _count_locked(err)
        faults.fault(f"could not {what} {f.path} ({err})", once=f"{what}:{f.path}")
        return default


def _create(f: KernelFile, check_there) -> bool:
    """Make a new, empty file a kdb file at the head revision from the statements the
    migrations leave there (:func:`.migrate.create_at_head`: plain SQL, no alembic or
    SQLAlchemy to import); a failure is a fault, as a failed upgrade is."""
    from . import migrate

    if migrate.HEAD_SCHEMA_REVISION != HEAD:  # a revision without its snapshot: tests say
        return _migrate(f, check_there)
    conn = f.open_connection()  # autocommit: the transaction is create_at_head()'s own
    try:
        migrate.create_at_head(conn)
    except DAMAGE as err:
        check_there()
        f.usable = False
        faults.fault(f"{f.path} could not be created ({err}); kernels are compiled instead. "
                     "Delete it to start afresh.", once="upgrade:" + str(f.path))
        return False
    finally:
        conn.close()
    return True


def _migrate(f: KernelFile, check_there) -> bool:
    """Bring the file to the head revision with alembic; a failure is a fault, not fatal.
    ``check_there()`` raises :class:`_Gone` where the file was removed or replaced meanwhile:
    not the file's fault, and no reason to give the user tier up."""
    from . import migrate  # alembic and SQLAlchemy: only here, on a write

    try:
        migrate.upgrade_sqlite(f.path, create=False)
    except Exception as err:  # noqa: BLE001 - SQLAlchemy/alembic errors must not propagate
        check_there()
        f.usable = False
        faults.fault(_upgrade_failed(f.path, err), once="upgrade:" + str(f.path))
        return False
    return True


def _upgrade_failed(path, err: Exception) -> str:
    """What a user reads when an upgrade failed: for a full disk, the room it needs. An
    upgrade rewrites the file's entries in one transaction, so it needs about the file's
    size free beside it; until then nothing is stored in it."""
    from .fs import free_bytes

    try:
        size = os.path.getsize(path)
    except OSError:
        size = 0
    free = free_bytes(os.path.dirname(path) or ".")
    if _says_full(err) or (free is not None and free < size):
        have = f"{free / 2**20:.1f} MiB" if free is not None else "an unknown amount"
        return (f"{path} could not be upgraded to schema revision {HEAD}: its file system is "
                f"full (the upgrade needs about {size / 2**20:.1f} MiB free beside the file, "
                f"the file's size; {have} is free). Until then kernels are compiled and not "
                "stored. Free that much space (the next process to store upgrades it), or "
                "delete the file to start afresh.")
    return (f"{path} could not be upgraded to schema revision {HEAD} ({err}); it is left as "
            "is and kernels are compiled instead. Delete it to start afresh.")


def _says_full(err: BaseException | None) -> bool:
    """Whether ``err``, or an error it was raised while handling, is a full disk: alembic's
    cleanup after SQLite's 'database or disk is full' raised 'no such table:
    _alembic_tmp_kernels', and the user was told to delete the file."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if "disk is full" in str(err) or "No space left" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def _json_text(details: dict | None) -> str:
    """Entry details as stored (JSON); :mod:`json` loads here, on a store, not on a hit."""
    import json

    return json.dumps(details or {}, sort_keys=True)
