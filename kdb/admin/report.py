"""What ``kdb info``, ``ls``, ``stats`` and ``log`` report: files, entries, counters, compiles.

Every function here only reads: the tier files through :mod:`kdb.admin.tierfiles` (plain
:mod:`sqlite3`, read-only, any revision as it is) and returns plain data (lists and dicts of
JSON-ready values); :mod:`kdb.cli` only formats and prints them. ``explain`` lives in
:mod:`kdb.admin.explain`, the environment of ``kdb info`` in :mod:`kdb.admin.info`, the checks of
``kdb verify`` in :mod:`kdb.admin.integrity`. The commands that write (``clear``, ``migrate``,
``evict``, ``verify --repair``) are :mod:`kdb.admin.maintenance`'s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import config
from ..errors import InvalidArgumentError
from ..file.fileformat import DAMAGE, has_no_tables, revision_of, status_of
from .tierfiles import (
    file_size,
    number,
    odd_user_files,
    read_rows,
    reading,
    scalar,
    tier_files,
    user_files,
)

log = logging.getLogger("kdb")

__all__ = ["COUNTERS", "FileReport", "compile_log", "describe_file", "entries",
           "odd_user_files", "shared_summary", "stats", "user_files"]

#: Counters kept in each user file's ``counters`` table (written by :mod:`kdb.db`).
COUNTERS = ("hits.system", "hits.user", "hits.shared", "misses", "compiles", "compile_seconds",
            "saved_seconds", "evicted")


@dataclass(frozen=True)
class FileReport:
    """One tier file as ``kdb info`` shows it."""

    arch: str
    path: str
    tier: str  # "user" or "system"
    origin: str  # "user dir", "KDB_SYSTEM_DB_PATH" or "package <dist> <version>"
    size: int  # bytes on disk, the WAL included
    entries: int
    revision: str | None
    problem: str = ""


def describe_file(path: Path, tier: str, arch: str, origin: str) -> FileReport:
    """Size, entry count and revision of one file; ``problem`` says why it is unusable."""
    size = file_size(path)
    try:
        with reading(path, tier) as conn:
            rev = revision_of(conn)
            entries = read_rows(conn, "SELECT count(*) FROM kernels")
            status = status_of(rev, rev is None and has_no_tables(conn))
    except DAMAGE as err:
        return FileReport(arch, str(path), tier, origin, size, 0, None, f"unreadable: {err}")
    count = entries[0][0] if entries else 0
    problem = ""
    if status.kind in ("empty", "foreign"):
        problem = status.what
    elif status.kind == "newer" or (status.kind != "current" and tier == "user"):
        problem = f"{status.what}; {status.remedy}"
    return FileReport(arch, str(path), tier, origin, size, count, status.revision, problem)


def shared_summary() -> dict[str, Any] | None:
    """The shared tier (``KDB_SHARED_URL``) as ``kdb info`` and ``kdb stats`` show it: URL
    with its password masked, reachable, revision, entries, bytes, server-wide hits and
    compiles, entries per arch; ``None`` when no URL is set."""
    url = config.shared_url()
    if url is None:
        return None
    from ..shared import tier as shared

    return shared.tier(url).summary()


# -- ls -------------------------------------------------------------------------------------

def entries(user_dir: Path, arch: str | None = None, tier: str | None = None) -> list[dict]:
    """Every stored entry (system files first), most recently used first within a file."""
    out = []
    for t, path, _ in tier_files(user_dir, arch, tier):
        try:
            with reading(path, t) as conn:
                rows = read_rows(conn, "SELECT key, name, arch, backend, raw_size, stored_size, "
                             "hits, last_access, created, compile_seconds FROM kernels "
                             "ORDER BY last_access DESC")
        except DAMAGE as err:
            log.warning("kdb: %s skipped: %s", path, err)
            continue
        for r in rows:
            out.append({"key": r[0], "name": r[1], "arch": r[2], "backend": r[3],
                        "raw_size": r[4], "stored_size": r[5], "hits": r[6],
                        "last_access": r[7], "created": r[8], "compile_seconds": r[9],
                        "tier": t, "path": str(path)})
    return out


# -- stats ----------------------------------------------------------------------------------

def _empty_stats() -> dict[str, Any]:
    return {"hits": {"system": 0, "user": 0}, "misses": 0, "compiles": 0,
            "compile_seconds": 0.0, "saved_seconds": 0.0, "entries": 0, "stored_bytes": 0,
            "raw_bytes": 0, "system_entries": 0, "evicted": 0}


def _add(total: dict[str, Any], part: dict[str, Any]) -> None:
    for k, v in part.items():
        if isinstance(v, dict):
            for kk, vv in v.items():
                total[k][kk] += vv
        else:
            total[k] += v


def stats(user_dir: Path, arch: str | None = None) -> dict[str, Any]:
    """Counters and sizes per arch and in total; the totals are at the top level.

    Hits of both tiers, misses and compiles are counted in the user file (system files are
    never written), and in the spool for a process that exited before any user file existed
    (its bookkeeping waits there for the store worker: :class:`kdb.storing.spool.Queued`),
    so a compile counts once it happened, stored or not. ``pending`` is what the spool still
    holds to store: programs, their entries, and the oldest's age in seconds. Stored bytes
    come from the file's running total, not from a scan. ``cap`` is ``KDB_CACHE_MAX_SIZE``
    in bytes (per user file, 0 = none); ``evicted`` counts the entries the cap (or ``kdb
    evict``) removed.
    """
    from ..storing import spool

    per: dict[str, dict[str, Any]] = {}
    shared_hits = 0  # hits this node's user files counted from the shared tier
    for t, path, a in tier_files(user_dir, arch, None):
        got = _file_stats(t, path)
        if got is None:
            continue
        totals, counters = got
        s = per.setdefault(a, _empty_stats())
        if t == "system":
            s["system_entries"] += totals["entries"]
            continue
        s["entries"] += totals["entries"]
        s["stored_bytes"] += totals.get("stored_bytes", 0)
        s["raw_bytes"] += totals.get("raw_bytes", 0)
        shared_hits += _add_counters(s, counters)
    waiting = spool.queued(user_dir, arch)
    for a, counters in waiting.counters.items():
        shared_hits += _add_counters(per.setdefault(a, _empty_stats()), counters)
    total = _empty_stats()
    for s in per.values():
        _add(total, s)
    total["arches"] = dict(sorted(per.items()))
    total["pending"] = _pending_stores(waiting)
    total["cap"] = config.max_size()  # bytes per user file; 0 = no cap
    total["shared"] = shared_summary()  # None without KDB_SHARED_URL
    if total["shared"] is not None:
        total["shared"]["hits_here"] = shared_hits
    return total


def _file_stats(t: str, path: Path) -> tuple[dict[str, int], dict] | None:
    """One tier file's running totals and (a user file's) counters; None when unreadable."""
    try:
        with reading(path, t) as conn:
            totals = {k: number(v, int) for k, v in read_rows(
                conn, "SELECT name, value FROM meta WHERE name IN "
                      "('entries', 'raw_bytes', 'stored_bytes')")}
            if "entries" not in totals:  # a file older than revision 0003, or one
                # whose tables do not exist yet: count once (no table, no rows)
                totals["entries"] = scalar(conn, "SELECT count(*) FROM kernels")
                totals["raw_bytes"] = scalar(
                    conn, "SELECT coalesce(sum(raw_size), 0) FROM kernels")
            counters = {}
            if t == "user":
                counters = dict(read_rows(conn, "SELECT name, value FROM counters"))
    except DAMAGE as err:
        log.warning("kdb: %s skipped: %s", path, err)
        return None
    return totals, counters


def _add_counters(s: dict[str, Any], counters: dict) -> int:
    """Add a user file's (or a queued bookkeeping job's) counters to ``s``; returns its
    hits from the shared tier (kept apart: they are the shared tier's)."""
    s["hits"]["system"] += number(counters.get("hits.system"), int)
    s["hits"]["user"] += number(counters.get("hits.user"), int)
    s["misses"] += number(counters.get("misses"), int)
    s["compiles"] += number(counters.get("compiles"), int)
    s["evicted"] += number(counters.get("evicted"), int)
    s["compile_seconds"] += number(counters.get("compile_seconds"), float)
    s["saved_seconds"] += number(counters.get("saved_seconds"), float)
    return number(counters.get("hits.shared"), int)


def _pending_stores(waiting) -> dict[str, Any]:
    """``kdb stats``' ``pending``: programs and entries queued for the store worker, and
    how long the oldest has waited (None when nothing is queued)."""
    import time

    age = None if waiting.oldest is None else round(max(time.time() - waiting.oldest, 0.0), 1)
    return {"programs": waiting.programs, "entries": waiting.entries, "oldest_seconds": age}


# -- log ------------------------------------------------------------------------------------

def compile_log(user_dir: Path, limit: int | None = 50, arch: str | None = None) -> list[dict]:
    """The start-up latency log of every user file, newest first (``limit`` rows at most)."""
    if limit is not None and limit < 0:
        raise InvalidArgumentError(f"limit must be 0 or more, not {limit}")
    out = []
    for path in user_files(user_dir, arch):
        sql = ("SELECT at, key, name, arch, backend, seconds, missed, reason, pid "
               "FROM compile_log ORDER BY at DESC")
        params: tuple = ()
        if limit is not None:
            sql += " LIMIT ?"
            params = (limit,)
        try:
            with reading(path, "user") as conn:
                rows = read_rows(conn, sql, params)
        except DAMAGE as err:
            log.warning("kdb: %s skipped: %s", path, err)
            continue
        out += [log_record(r) for r in rows]
    out += _pending_log(user_dir, arch)
    out.sort(key=lambda r: r["at"], reverse=True)
    return out if limit is None else out[:limit]


def _pending_log(user_dir: Path, arch: str | None) -> list[dict]:
    """Compiles whose binaries the store worker has not stored yet (:mod:`kdb.storing.spool`): shown
    at once, marked ``pending``."""
    from ..storing import spool

    out = []
    for rec in spool.pending_log_rows(user_dir):
        if arch is None or rec.arch == arch:
            out.append({**log_record((rec.at, rec.key, rec.name, rec.arch, rec.backend,
                                       rec.seconds, rec.missed, rec.reason, rec.pid)),
                        "pending": True})
    return out


def log_record(r: tuple) -> dict[str, Any]:
    return {"at": r[0], "key": r[1], "name": r[2], "arch": r[3], "backend": r[4],
            "seconds": r[5], "missed": [m for m in r[6].split(",") if m], "reason": r[7],
            "pid": r[8], "pending": False}
