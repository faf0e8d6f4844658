"""Least-recently-used eviction and the running totals it keeps, inside a writer's transaction.

Recency is the ``last_access`` column (indexed), not file times; ``meta``'s running totals
make the size check a single row read, so the cost grows with what is evicted, not with the
size of the file.
"""

from __future__ import annotations

import sqlite3

from .fileformat import bump_meta, meta_int


def evict(conn: sqlite3.Connection, target: int, keep=frozenset()) -> tuple[int, int]:
    """Inside a write transaction: drop LRU entries (never those in ``keep``) until
    ``stored_bytes <= target``; returns (entries removed, bytes freed)."""
    excess = meta_int(conn, "stored_bytes") - max(target, 0)
    victims: list[tuple[str, int, int]] = []
    chosen = 0
    if excess > 0:
        cursor = conn.execute(
            "SELECT key, stored_size, raw_size FROM kernels ORDER BY last_access")
        for key, stored, raw in cursor:
            if key in keep:
                continue
            victims.append((key, stored, raw))
            chosen += stored
            if chosen >= excess:
                break
        cursor.close()
    removed, freed = remove(conn, victims)
    if removed:
        conn.execute(
            "INSERT INTO counters (name, value) VALUES ('evicted', ?) ON CONFLICT(name) "
            "DO UPDATE SET value = value + excluded.value", (removed,))
    return removed, freed


def remove(conn: sqlite3.Connection, rows: list[tuple[str, int, int]]) -> tuple[int, int]:
    """Delete ``(key, stored_size, raw_size)`` rows, and the sources they leave unused, and
    keep the running totals true."""
    sources = []
    for key, _, _ in rows:
        sources += [r[0] for r in conn.execute("DELETE FROM kernels WHERE key = ? RETURNING source",
                                               (key,))]
    drop_unused_sources(conn, sources)
    freed = sum(r[1] for r in rows)
    if rows:
        bump_meta(conn, "stored_bytes", -freed)
        bump_meta(conn, "raw_bytes", -sum(r[2] for r in rows))
        bump_meta(conn, "entries", -len(rows))
    return len(rows), freed


def drop_unused_sources(conn: sqlite3.Connection, digests) -> int:
    """Inside a write transaction: delete the ``sources`` rows of ``digests`` that no entry
    names any more (after entries were deleted or replaced); returns how many went."""
    gone = 0
    for digest in set(digests) - {None}:
        gone += conn.execute("DELETE FROM sources WHERE digest = ? AND NOT EXISTS "
                             "(SELECT 1 FROM kernels WHERE source = ?)",
                             (digest, digest)).rowcount
    return gone
