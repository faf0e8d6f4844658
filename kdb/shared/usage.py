"""What the shared tier counts, when its entries were last used, and its cap.

Counters and the ``meta`` totals are bumped in the writer's transaction (:func:`bump_meta`,
:func:`bump_counters`). A hit served from the shared tier is not a write: its key joins this
process's pending touches (:class:`Touches`), written in one transaction per batch (64 keys,
or 5 s, or the process's exit), so ``last_access`` lags by at most that.

Past ``KDB_SHARED_MAX_SIZE`` stored bytes, the writer that published evicts the least
recently used entries until a third of the cap is free (:func:`keep_under`, :func:`evict`), in
a transaction of its own under an advisory lock: writers take turns, each checking the total
again once it has the lock. Entries used or created in the last :data:`KEEP_S` seconds are never
evicted: another node may be serving them or copying them home right now.
"""

from __future__ import annotations

import threading
import time

from sqlalchemy import BigInteger, Text, bindparam, cast, func, select
from sqlalchemy.engine import Connection

from ..file.schema import counters, kernels, meta, sources
from .server import lock_id

#: Held (for one transaction) by the writer that evicts (salted per namespace).
EVICT = "kdb.shared.tier.evict"
EVICT_LOCK = lock_id(EVICT)
#: Entries used or created this recently are never evicted.
KEEP_S = 60.0
#: Entries read at a time while choosing what to evict.
EVICT_BATCH = 1000
#: A writer over the cap tries this often (20 ms apart) to take its turn at evicting.
EVICT_TRIES = 100
#: Pending touches are written once this many keys wait, or this long after the first.
TOUCH_BATCH, TOUCH_S = 64, 5.0


def bump_meta(conn: Connection, deltas: dict[str, int]) -> None:
    from sqlalchemy.dialects.postgresql import insert

    for name, delta in deltas.items():
        stmt = insert(meta).values(name=name, value=str(delta))
        conn.execute(stmt.on_conflict_do_update(index_elements=["name"], set_={
            "value": cast(cast(meta.c.value, BigInteger) + delta, Text)}))


def bump_counters(conn: Connection, deltas: dict[str, float]) -> None:
    from sqlalchemy.dialects.postgresql import insert

    for name, delta in deltas.items():
        stmt = insert(counters).values(name=name, value=delta)
        conn.execute(stmt.on_conflict_do_update(index_elements=["name"], set_={
            "value": counters.c.value + stmt.excluded.value}))


def lock_sources(conn: Connection, digests) -> list[str]:
    """Lock the ``sources`` rows of ``digests`` (sorted: two writers never wait on each other
    in a cycle) until the transaction ends; returns the digests, sorted.

    A publisher locks the source of what it inserts before the entry (an upsert), a deleter
    those of what it deletes before the entries: so :func:`drop_unused_sources`, a later
    statement that sees every commit before it, never deletes a source whose entry another
    node is inserting."""
    held = sorted({d for d in digests if d is not None})
    if held:
        conn.execute(select(sources.c.digest).where(sources.c.digest.in_(held))
                     .order_by(sources.c.digest).with_for_update()).all()
    return held


def drop_unused_sources(conn: Connection, digests: list[str]) -> int:
    """Delete the sources of ``digests`` (locked by :func:`lock_sources`) that no entry names
    any more; returns how many went."""
    if not digests:
        return 0
    unused = ~select(kernels.c.key).where(kernels.c.source == sources.c.digest).exists()
    return conn.execute(sources.delete().where(sources.c.digest.in_(digests), unused)).rowcount


def stored_bytes(conn: Connection) -> int:
    """The stored bytes the ``meta`` total says (kept by every publish and drop)."""
    got = conn.execute(select(meta.c.value).where(meta.c.name == "stored_bytes")).scalar()
    return int(got or 0)


def keep_under(engine, cap: int, namespace: str | None = None) -> None:
    """After a publish: evict until the stored bytes are within ``cap``, taking turns with
    the other writers (one evicts at a time; a writer that finds the lock taken tries again
    once it is free, so a publish that lands during another's eviction is not left over the
    cap). Stops when nothing is old enough to go."""
    for _ in range(EVICT_TRIES):
        with engine.begin() as conn:
            if stored_bytes(conn) <= cap:
                return
            got = evict(conn, cap, namespace)
        if got == 0:
            return
        if got is None:
            time.sleep(0.02)


def evict(conn: Connection, cap: int, namespace: str | None = None) -> int | None:
    """If the entries' stored bytes exceed ``cap``, delete the least recently used until at
    most two thirds of it are left (entries of the last :data:`KEEP_S` seconds stay); the
    number deleted, or ``None`` when another writer of the namespace holds the eviction lock."""
    if not conn.execute(select(func.pg_try_advisory_xact_lock(lock_id(EVICT, namespace)))).scalar():
        return None
    total = stored_bytes(conn)
    if total <= cap:
        return 0
    target = cap * 2 // 3
    keep_after = time.time() - KEEP_S
    oldest = (select(kernels.c.key, kernels.c.raw_size, kernels.c.stored_size)
              .where(func.greatest(kernels.c.last_access, kernels.c.created) < keep_after)
              .order_by(kernels.c.last_access, kernels.c.created, kernels.c.key))
    picked, freed_raw, freed = [], 0, 0
    while total - freed > target:  # a batch at a time: never the whole table in memory
        batch = conn.execute(oldest.limit(EVICT_BATCH).offset(len(picked))).all()
        for key, raw_size, size in batch:
            if total - freed <= target:
                break
            picked.append(key)
            freed_raw += raw_size
            freed += size
        if len(batch) < EVICT_BATCH:
            break
    if picked:
        held = lock_sources(conn, conn.execute(select(kernels.c.source).where(
            kernels.c.key.in_(picked))).scalars())
        conn.execute(kernels.delete().where(kernels.c.key.in_(picked)))
        drop_unused_sources(conn, held)
        bump_meta(conn, {"entries": -len(picked), "raw_bytes": -freed_raw,
                         "stored_bytes": -freed})
        bump_counters(conn, {"evicted": len(picked)})  # named as in a file
    return len(picked)


class Touches:
    """This process's hits on the shared tier, written in batches."""

    def __init__(self) -> None:
        self._pending: dict[str, int] = {}
        self._first = 0.0
        self._lock = threading.Lock()

    def add(self, key: str) -> bool:
        """Count a hit on ``key``; True when the batch is due to be written."""
        with self._lock:
            if not self._pending:
                self._first = time.monotonic()
            self._pending[key] = self._pending.get(key, 0) + 1
            return (len(self._pending) >= TOUCH_BATCH
                    or time.monotonic() - self._first >= TOUCH_S)

    def take(self) -> dict[str, int]:
        with self._lock:
            pending, self._pending = self._pending, {}
        return pending

    def forget(self) -> None:
        self._lock = threading.Lock()
        self._pending = {}

    @staticmethod
    def write(conn: Connection, pending: dict[str, int]) -> None:
        """One transaction's worth: hits and last use for every pending key."""
        now = time.time()
        conn.execute(kernels.update().where(kernels.c.key == bindparam("k")).values(
            hits=kernels.c.hits + bindparam("n"),
            last_access=func.greatest(kernels.c.last_access, now)),
            [{"k": k, "n": n} for k, n in sorted(pending.items())])
        bump_counters(conn, {"hits": sum(pending.values())})
