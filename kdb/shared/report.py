"""Reading a whole shared tier: the summary ``kdb info`` and ``kdb stats`` show, and the
export ``kdb pack --from-db`` builds a system file from. Neither runs on a lookup.

Both take a :class:`kdb.shared.tier.SharedTier` (its methods of the same names call them).
"""

from __future__ import annotations

import sqlite3
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select
from sqlalchemy.engine import Connection

from ..file import migrate
from . import server as pgserver
from . import writes
from ..file.schema import compile_log, counters, kernels, meta, sources

if TYPE_CHECKING:
    from pathlib import Path


def summary(tier) -> dict[str, Any]:
    """What ``kdb info`` and ``kdb stats`` show: reachability, revision, totals, counters.

    Reads only, on a connection of its own: a report never creates or upgrades the
    schema, and a server it cannot reach is a ``problem`` here, not a warning.
    """
    out: dict[str, Any] = {"url": tier.shown, "namespace": tier.namespace, "reachable": False,
                           "revision": None, "problem": None, "entries": 0, "raw_bytes": 0,
                           "stored_bytes": 0, "hits": 0, "compiles": 0,
                           "compile_seconds": 0.0, "evicted": 0, "arches": {}}
    try:
        engine = pgserver.create_engine(tier.url, tier.namespace)
    except Exception as err:  # noqa: BLE001 - a bad URL: say so
        out["problem"] = tier.reason(err)
        return out
    try:
        with pgserver.watchdog.guard(pgserver.bound_s(4)), engine.connect() as conn:
            rev = out["revision"] = pgserver.schema_revision(conn)
            out["reachable"] = True
            missing = tier.namespace and pgserver.namespace_problem(conn, tier.namespace)
            if missing:
                out["problem"] = missing
            elif rev is None:
                out["problem"] = (pgserver.no_namespace_problem(conn) if not tier.namespace
                                  else None) or _no_revision(conn)
            elif rev not in migrate.REVISIONS:
                out["problem"] = (f"schema revision {rev!r} is newer than this kdb knows "
                                  f"({migrate.HEAD}): the tier is off here")
            else:
                _read_totals(conn, out)
    except Exception as err:  # noqa: BLE001 - unreachable, refusing, or slow
        out["problem"] = (pgserver.damaged_problem(err, tier.namespace, tier.url)
                          if pgserver.damaged(err) else f"unreachable: {tier.reason(err)}")
    finally:
        engine.dispose()
    return out

def _no_revision(conn) -> str:
    """Why a database without kdb's revision has no tier yet: none of kdb's tables (it
    creates them on first use), or its tables without their revision (dropped by hand:
    creating them again fails)."""
    from sqlalchemy import inspect

    found = set(inspect(conn).get_table_names()) & {t.name for t in (kernels, compile_log)}
    if not found:
        return "no kdb schema yet (kdb creates it on first use)"
    return (f"kdb's tables ({', '.join(sorted(found))}) are there without their revision "
            "(alembic_version was dropped or changed by hand): kdb cannot create them again "
            "over them. An administrator restores alembic_version from a backup, or drops "
            "the tables for kdb to create them again, empty")


def export(tier, arch: str, dest: Path) -> int:
    """Copy the ``arch`` entries and log rows into a new SQLite user file at ``dest``
    (for ``kdb pack --from-db URL``); returns how many entries. Raises on a fault."""
    engine = tier.engine()
    if engine is None:
        from ..errors import KdbError

        raise KdbError(f"the shared tier is unavailable: {tier.problem or tier._last_error}")
    migrate.upgrade_sqlite(dest)
    cols = [c.name for c in kernels.columns]
    log_cols = [c.name for c in compile_log.columns if c.name != "id"]
    out = sqlite3.connect(dest, isolation_level=None)
    n = 0
    try:
        out.execute("BEGIN")
        with engine.connect() as conn:
            rows = conn.execution_options(yield_per=256).execute(
                select(*kernels.columns).where(kernels.c.arch == arch,  # not signers' own
                                               ~kernels.c.key.contains(writes.SLOT)))
            for part in rows.partitions():
                out.executemany(f"INSERT INTO kernels ({', '.join(cols)}) VALUES "
                                f"({', '.join('?' * len(cols))})",
                                [tuple(r) for r in part])
                n += len(part)
            named = select(kernels.c.source).where(kernels.c.arch == arch)
            for part in conn.execution_options(yield_per=64).execute(
                    select(sources.c.digest, sources.c.body, sources.c.size)
                    .where(sources.c.digest.in_(named))).partitions():
                out.executemany("INSERT INTO sources (digest, body, size) VALUES (?, ?, ?)",
                                [tuple(r) for r in part])
            logged = conn.execute(select(*(compile_log.c[c] for c in log_cols)).where(
                compile_log.c.arch == arch)).all()
        out.executemany(f"INSERT INTO compile_log ({', '.join(log_cols)}) VALUES "
                        f"({', '.join('?' * len(log_cols))})", [tuple(r) for r in logged])
        out.execute("COMMIT")
    finally:
        out.close()
    return n


def _read_totals(conn: Connection, out: dict[str, Any]) -> None:
    totals = dict(conn.execute(select(meta.c.name, meta.c.value).where(
        meta.c.name.in_(("entries", "raw_bytes", "stored_bytes")))).all())
    for k in ("entries", "raw_bytes", "stored_bytes"):
        out[k] = int(totals.get(k, 0))
    ctr = dict(conn.execute(select(counters.c.name, counters.c.value)).all())
    out["hits"] = int(ctr.get("hits", 0))
    out["compiles"] = int(ctr.get("compiles", 0))
    out["compile_seconds"] = float(ctr.get("compile_seconds", 0.0))
    # "evictions": what kdb before 2026-12 named the counter that files name "evicted".
    out["evicted"] = int(ctr.get("evicted", 0)) + int(ctr.get("evictions", 0))
    # Per arch: an aggregate (a scan), for the CLI only, never on a lookup.
    for arch, n, size in conn.execute(select(
            kernels.c.arch, func.count(), func.coalesce(func.sum(kernels.c.stored_size), 0))
            .group_by(kernels.c.arch).order_by(kernels.c.arch)):
        out["arches"][arch] = {"entries": int(n), "stored_bytes": int(size)}
