"""The ``kdb`` commands that change the user tier: clear, migrate, evict, verify --repair.

Every other report only reads (:mod:`kdb.admin.report`, :mod:`kdb.admin.explain`, :mod:`kdb.admin.info`,
:mod:`kdb.admin.integrity`). System files are never changed here: they are read-only by design.
Upgrades go through :mod:`kdb.file.migrate` (alembic), imported only when one runs.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
from pathlib import Path
from typing import Any

from .. import config, lifecycle
from ..file import compact, discovery
from . import integrity
from ..errors import InvalidArgumentError
from ..storing import jobfiles, storetimes
from ..file.fileformat import (
    COMPACT_FROM,
    DAMAGE,
    HEAD,
    TOTALS_FROM,
    at_least,
    has_no_tables,
    move_aside,
    revision_of,
    set_meta,
    status_of,
    transaction,
)
from .integrity import verify_file
from .tierfiles import SIDE_FILES, can_write_beside, number, reading, user_files


class _NotFixed(Exception):
    """REINDEX did not make the file pass its integrity check: roll it back."""


def verify(user_dir: Path, arch: str | None = None, repair: bool = False) -> dict[str, Any]:
    """:func:`kdb.admin.integrity.verify`, and with ``repair`` each unsound user file fixed by
    :func:`repair_file` (never a system file)."""
    return integrity.verify(user_dir, arch, fix=repair_file if repair else None)


# -- clear ----------------------------------------------------------------------------------

def clearable(user_dir: Path, arch: str | None = None) -> list[Path]:
    """The user tier's files for ``arch`` (or all): the database, its WAL, lock and quarantined
    copies. A system file is never listed, even where a system directory is the user dir."""
    protected = {os.path.realpath(s.path) for s in discovery.all_sources() if not s.problem}
    out: list[Path] = []
    for db in user_files(user_dir, arch) or ([user_dir / f"{arch}.kdb"] if arch else []):
        names = [db] + [Path(str(db) + s) for s in SIDE_FILES]
        names += sorted(user_dir.glob(db.name + ".corrupt-*"))
        for p in names:
            if (p.is_file() or p.is_symlink()) and os.path.realpath(p) not in protected:
                out.append(p)
    if arch is None:  # leftovers whose database is already gone
        # .handoff-*.json: left by kdb before its store worker
        for pattern in ("*.kdb-wal", "*.kdb-shm", "*.kdb.lock", "*.kdb.corrupt-*",
                        ".handoff-*.json"):
            for p in sorted(user_dir.glob(pattern)):
                if p not in out and os.path.realpath(p) not in protected:
                    out.append(p)
        out += _spool_leftovers(user_dir) + _stale_claims(user_dir / "claims")
        out += [p for p in [user_dir / storetimes.FILE] if p.is_file()]
        out += _include_copies(user_dir)
    return out + _kept_names(user_dir, arch)


def _include_copies(user_dir: Path) -> list[Path]:
    """The copies of temporary include directories (:mod:`kdb.backends.opencl.tempincludes`),
    and their directory: each header edit made another, and nothing removed them."""
    root = user_dir / "includes"
    if not root.is_dir() or root.is_symlink():
        return []
    return sorted(p for p in root.iterdir()) + [root]


def _kept_names(user_dir: Path, arch: str | None) -> list[Path]:
    """The names kept to publish to a shared tier (:mod:`kdb.storing.backlog`) of the
    entries cleared, and their directories once empty: ``kdb info`` still counted them."""
    from ..storing import backlog

    root = user_dir / backlog.DIRNAME
    names = sorted(root.glob(f"*/{arch or '*'}/*"))
    dirs = sorted(root.glob(f"*/{arch or '*'}"), reverse=True)
    if arch is None:
        dirs += sorted(root.glob("*"), reverse=True) + [root]
    return names + [d for d in dirs if d.is_dir()]


def _spool_leftovers(user_dir: Path) -> list[Path]:
    """Every spool's queued and half-stored jobs (clear means clear: a store not done is
    dropped, and its program's next run compiles it again), temporary files of processes
    that have exited, and a spool directory itself where it holds no job, no store worker
    runs, and no process wrote to it for :data:`SPOOL_IDLE_S` (one may be starting its
    worker there)."""
    import time

    from ..storing import spool

    out: list[Path] = []
    for d in sorted(p for p in (user_dir / spool.SPOOL).glob("*") if p.is_dir()):
        quiet = time.time() - d.stat().st_mtime > SPOOL_IDLE_S  # before worker_running's open
        names = sorted(d.iterdir())
        jobs = [p for p in names if p.suffix in (spool.JOB, spool.SLOW, spool.TAKEN, spool.BAD)]
        idle = quiet and not jobs and not spool.worker_running(d)
        for p in names:
            if p in jobs or (p.name.endswith(".tmp") and not lifecycle.alive(p.name.split(".")[-2])) or (
                    idle and p.name in (spool.ENVIRONMENT, spool.LOCK, jobfiles.AHEAD_LOCK)):
                out.append(p)
        if idle:
            out.append(d)  # removed once empty; a job written meanwhile keeps it
    return out


#: Seconds a spool directory must have gone unwritten before ``kdb clear`` removes it.
SPOOL_IDLE_S = 60.0


def _stale_claims(claims_dir: Path) -> list[Path]:
    """Claim files whose holder is gone (no ``flock`` on them), and wishes for no claim."""
    import fcntl

    out = []
    for p in sorted(claims_dir.glob("*.lock")):
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            out.append(p)
        except OSError:
            pass  # a live holder
        finally:
            os.close(fd)
    out += [p for p in sorted(claims_dir.glob("*.want")) if not p.with_suffix(".lock").exists()]
    return out + sorted(claims_dir.glob("*" + jobfiles.QUEUED))  # their jobs go too


def clear(paths: list[Path]) -> tuple[list[str], list[tuple[str, str]]]:
    """Remove the files :func:`clearable` listed; returns the paths removed, and those that
    could not be (a read-only cache) with why. A claim file taken again since, or a spool
    directory that got a new job since, is left alone."""
    from ..claims import remove_if_stale
    from ..dirs import remove_unheld_lock

    removed: list[str] = []
    failed: list[tuple[str, str]] = []
    done: set[Path] = set()
    for p in paths:
        if p in done:
            continue
        try:
            db = _database_of(p)
            if db is not None:
                group = {db, *_side_files(db)} & set(paths)
                done |= group
                removed += _remove_database(db, group)
                continue
            if p.parent.name == "claims" and p.suffix == ".lock":
                if not remove_if_stale(p):
                    continue
            elif p.name.endswith(".kdb.lock"):  # an upgrader's: never from under its holder
                if not remove_unheld_lock(p):
                    continue
            elif p.parent.name == "includes" and p.is_dir() and not p.is_symlink():
                import shutil

                shutil.rmtree(p)  # a copy of an include directory: files and all
            elif p.is_dir() and not p.is_symlink():
                p.rmdir()
            else:
                p.unlink()
            removed.append(str(p))
        except (FileNotFoundError, FileExistsError):
            pass
        except OSError as err:
            if err.errno in (errno.ENOTEMPTY, errno.EEXIST) and p.is_dir():
                continue
            failed.append((str(p), err.strerror or str(err)))
    return removed, failed


def _database_of(p: Path) -> Path | None:
    """The user file ``p`` is, or whose ``-wal`` or ``-shm`` it is; None for anything else."""
    for suffix in (".kdb", ".kdb-wal", ".kdb-shm"):
        if p.name.endswith(suffix) and p.name != suffix:
            return p.with_name(p.name[: len(p.name) - len(suffix) + len(".kdb")])
    return None


def _side_files(db: Path) -> list[Path]:
    """``db``'s ``-wal``, ``-shm`` and lock file, in that order (:data:`SIDE_FILES`)."""
    return [Path(str(db) + s) for s in SIDE_FILES]


def _remove_database(db: Path, listed: set[Path]) -> list[str]:
    """Remove ``db`` (where listed) with its ``-wal`` and ``-shm``, under the file's lock, and
    the lock file with them; returns the listed paths removed.

    SQLite finds a file's ``-wal`` and ``-shm`` by name. A process that made a new file at
    the path between the removal of the old one and of its side files would use the old
    ``-shm`` (another file's WAL index) and get "disk I/O error", or worse: a writer turns a
    new file to WAL mode only under this lock, so none can. Side files whose database is
    not listed are removed only while no database is there (leftovers); else they are a
    live file's.
    """
    from ..file.migrate import file_lock

    wal, shm, lock = _side_files(db)
    out = []
    with file_lock(db, remove=True):
        if db in listed:
            doomed = [db, wal, shm]
        else:  # leftovers, unless a file was made at the path since
            doomed = [] if db.exists() else [wal, shm]
        for p in doomed:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                if p in listed:
                    out.append(str(p))
    if lock in listed and not lock.exists():
        out.append(str(lock))
    return out


# -- migrate ----------------------------------------------------------------------------------

def migrate_files(user_dir: Path, check: bool = False) -> list[dict[str, Any]]:
    """Upgrade every user file to the head revision (``check``: only say which would be).

    Each result has ``path``, ``arch``, ``from``, ``to`` and ``action``: ``current``,
    ``upgraded``, ``needs upgrade``, ``empty``, or ``skipped`` with a ``problem``.
    """
    out = []
    for path in user_files(user_dir):
        rec: dict[str, Any] = {"path": str(path), "arch": path.name[: -len(".kdb")],
                               "from": None, "to": HEAD, "action": "", "problem": ""}
        try:
            with reading(path, "user") as conn:
                rev = revision_of(conn)
                status = status_of(rev, rev is None and has_no_tables(conn))
            if status.kind == "empty":
                rec.update(action="empty", to=None)
            elif status.kind == "foreign":
                rec.update(action="skipped", to=None, problem=status.what)
            elif status.kind == "newer":
                rec.update(**{"from": rev, "to": rev, "action": "skipped",
                              "problem": f"{status.what}; {status.remedy}"})
            elif status.kind == "current":
                rec.update(**{"from": rev, "action": "current"})
            elif check:
                rec.update(**{"from": rev, "action": "needs upgrade"})
            else:
                rec["from"] = rev
                from ..file.migrate import file_lock, upgrade_sqlite

                with file_lock(path):
                    if _revision(path) != HEAD:  # another process may have done it
                        upgrade_sqlite(path, create=False)
                rec["to"] = _revision(path)
                rec["action"] = "upgraded"
        except DAMAGE as err:
            compact.reraise_interrupt(err)
            rec.update(action="skipped", to=None, problem=f"unreadable: {err}")
        except OSError as err:  # a stuck upgrader (TimeoutError), a read-only cache
            rec.update(action="skipped", problem=f"cannot upgrade it now: {err}")
        except Exception as err:  # noqa: BLE001 - alembic's and SQLAlchemy's errors
            compact.reraise_interrupt(err)  # Ctrl-C, not a failed upgrade
            rec.update(action="skipped", problem=f"upgrade failed: {type(err).__name__}: {err}")
        out.append(rec)
    return out


def _revision(path: Path) -> str | None:
    with reading(path, "user") as conn:
        return revision_of(conn)


# -- verify --repair ---------------------------------------------------------------------------

def repair_file(path: Path, result: dict[str, Any]) -> list[str]:
    """Fix one user file that :func:`kdb.admin.integrity.verify_file` found wrong (``result``);
    returns what was done. Bad entries are deleted and the running totals recomputed; a file
    that fails SQLite's integrity check (after a ``REINDEX``), or is not a kdb database, is
    moved aside (``*.corrupt-<time>``; kdb creates a new one). A file from a newer kdb, or
    one another user could change, is left alone."""
    from ..file.migrate import file_lock

    if result.get("unsafe") or result.get("future"):
        return []
    if not can_write_beside(path):
        result["problems"].append("cannot repair: the file or its directory is read-only")
        return []
    if result.get("integrity") and _reindexed(path):
        result = verify_file(path, "user", result["arch"])
        if result["ok"]:
            return ["indexes rebuilt (REINDEX)"]
    if result["fatal"]:
        # Under the upgrade lock: a first write that holds it is creating this file's tables.
        try:
            with file_lock(path):
                again = verify_file(path, "user", result["arch"])
                if again["ok"] or not again["fatal"]:
                    return []  # its writer finished meanwhile: nothing to move
                moved = move_aside(path)
        except OSError as err:
            result["problems"].append(f"cannot repair it now: {err}")
            return []
        if not moved:
            result["problems"].append("cannot repair: it could not be moved aside")
            return []
        return ["moved aside as *.corrupt-<time>; kdb creates a new file on its next write"]
    done = []
    bad = [b["key"] for b in result["bad_entries"]]
    conn = sqlite3.connect(path, timeout=config.BUSY_TIMEOUT_S, isolation_level=None)
    try:
        if not result["ok"]:
            _drop_bad_and_recount(conn, bad, result["revision"], done)
        if result.get("reclaimable"):  # sound, but much of it free pages
            conn.execute("VACUUM")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            done.append(f"gave back {result['reclaimable'] / 2**20:.1f} MiB of free pages "
                        "(VACUUM)")
    finally:
        conn.close()
    return done


def _drop_bad_and_recount(conn: sqlite3.Connection, bad: list[str], revision: str | None,
                          done: list[str]) -> None:
    """Delete the bad entries and unused sources, and recompute the running totals, in one
    transaction; what was done is added to ``done``."""
    with transaction(conn):
        for key in bad:
            conn.execute("DELETE FROM kernels WHERE key = ?", (key,))
        if bad:
            done.append(f"dropped {len(bad)} bad entr{'y' if len(bad) == 1 else 'ies'}")
        if at_least(revision, COMPACT_FROM):
            unused = conn.execute("DELETE " + integrity.UNUSED_SOURCES).rowcount
            if unused:
                done.append(f"dropped {unused} unused source{'s' * (unused != 1)}")
        if at_least(revision, TOTALS_FROM):
            count, raw, stored = conn.execute(
                "SELECT count(*), coalesce(sum(raw_size), 0), "
                "coalesce(sum(stored_size), 0) FROM kernels").fetchone()
            set_meta(conn, [("entries", str(count)), ("raw_bytes", str(raw)),
                            ("stored_bytes", str(stored))])
            done.append("running totals recomputed")


def _reindexed(path: Path) -> bool:
    """Try ``REINDEX`` on a file whose integrity check failed; True (and committed) if the
    file then passes, else rolled back: damaged indexes are rebuilt, damaged tables are not."""
    try:
        conn = sqlite3.connect(path, timeout=config.BUSY_TIMEOUT_S, isolation_level=None)
        try:
            with transaction(conn):
                conn.execute("REINDEX")
                if conn.execute("PRAGMA integrity_check").fetchall() != [("ok",)]:
                    raise _NotFixed
            return True
        except _NotFixed:
            return False
        finally:
            conn.close()
    except DAMAGE:
        return False



# -- evict ------------------------------------------------------------------------------------

def evict(user_dir: Path, target: int, arch: str | None = None) -> list[dict[str, Any]]:
    """Remove least recently used entries until each user file stores at most ``target``
    bytes (the cap applies per file); returns, per file, what was removed and what is left.
    """
    from ..file.kernelfile import KernelFile

    if isinstance(target, bool) or not isinstance(target, int) or target < 0:
        raise InvalidArgumentError(f"eviction target must be a size in bytes >= 0, not "
                                   f"{target!r}")
    out = []
    for path in user_files(user_dir, arch):
        f = KernelFile(path, tier="user", readonly=False)
        problem = ""
        try:
            done = f.evict_to(target)
            if done is None:
                problem = _unusable_why(path, f)
            removed, freed = done or (0, 0)
            try:
                left = dict(f.query("SELECT name, value FROM meta WHERE name IN "
                                    "('entries', 'stored_bytes')"))
            except DAMAGE:
                left = {}
        finally:
            f.close()
        out.append({"path": str(path), "arch": path.name[: -len(".kdb")], "removed": removed,
                    "freed": freed, "entries": number(left.get("entries"), int),
                    "stored_bytes": number(left.get("stored_bytes"), int),
                    "problem": problem})
    return out


def _unusable_why(path: Path, f: Any) -> str:
    """Why a user file could not be changed (for ``kdb evict``): the best guess from it."""
    from ..file import fs

    bad = fs.unsafe_chain([path, path.parent])
    if bad:
        return f"refused: {bad[0]}: {bad[1]}"
    if not can_write_beside(path):
        return "read-only: nothing evicted"
    if f.readonly or not f.usable:
        return "unusable (see the warning above): nothing evicted"
    return "could not be changed (see the warning above)"
