"""What the shared tier's writes do inside their transaction: publish, drop.

A publish inserts each entry unless its key is there already; under a trust policy
(:mod:`kdb.signing`), a signed entry first removes an existing one no node would serve
(unsigned: no signer, or a NULL or empty signature). A row signed by another key is never
replaced (other nodes may trust it: two signers that do not trust each other would replace
each other's rows for ever); a signed entry whose key such a row holds goes to its signer's
own row, ``<key>@<signer id>`` (:func:`slot_key`), which a node under a trust policy reads
when the first row is not signed by a key it trusts. So a row signed by a key nobody trusts
(a rogue's) never keeps the tier useless for that kernel, and no signer's row is ever
another's to replace. The ``meta`` totals and counters move in the same transaction
(:mod:`kdb.shared.usage`). :class:`kdb.shared.tier.SharedTier` runs these under its bounds and
failover.
"""

from __future__ import annotations

import json
import time

from sqlalchemy import func, or_, select
from sqlalchemy.engine import Connection

from ..file import codec, compact
from ..file.kernelfile import CompileRecord, Entry
from ..file.schema import compile_log, kernels, sources
from ..keys import compiler_free_key
from . import usage


#: Joins a key and a signer id in a signer's own row (a key is hex: no entry's has one).
SLOT = "@"


def slot_key(key: str, signer: str) -> str:
    """The key column of ``signer``'s own row for the entry ``key``."""
    return f"{key}{SLOT}{signer}"


def rows(entries: list[Entry]) -> list[dict]:
    """The ``kernels`` rows for ``entries`` (compressed and checksummed outside any
    transaction); each holds its packed attributes under ``_packed`` too, for the source's
    row (:func:`publish` writes it, never as a column)."""
    now = time.time()
    out = []
    for e in entries:
        kind, blob = codec.encode(e.raw)
        packed = compact.pack(e.attributes)
        out.append(dict(key=e.key, arch=e.arch, backend=e.backend, name=e.name,
                        attrs=packed.attrs, source=packed.source,
                        attributes_sha256=packed.sha256, _packed=packed,
                        details=json.dumps(e.details or {}, sort_keys=True), codec=kind,
                        dict_id=None, blob=blob, raw_size=len(e.raw), stored_size=len(blob),
                        checksum=codec.checksum(e.raw), compile_seconds=e.compile_seconds,
                        created=now, last_access=now, hits=0,
                        compiler_free_key=compiler_free_key(e.attributes),
                        signer=e.signer, signature=e.signature))
    return out


def untrusted():
    """The unsigned rows a signed publish replaces, as a condition; ``None`` without a
    policy."""
    from ..signing import policy as signing

    policy = signing.current()
    if policy is None or not policy.verify:
        return None
    return or_(kernels.c.signature.is_(None), kernels.c.signer.is_(None),
               func.length(kernels.c.signature) == 0)


def publish(conn: Connection, new: list[dict], logs: list[CompileRecord] = ()) -> int:
    """Insert ``new`` rows (an existing key is kept, unless :func:`untrusted` and the new row
    is signed; a signed row whose key another signer holds goes to its own slot) and log
    rows; returns the entries added."""
    replace = untrusted()
    for row in new:
        if row["signature"] is not None and replace is not None:
            drop(conn, [row["key"]], replace)
    _upsert_sources(conn, [row["_packed"] for row in new])
    added = added_raw = added_stored = 0
    for row in new:
        n = _insert(conn, row)
        if not n and row["signer"] and row["signature"]:
            n = _into_slot(conn, row)
        if n:
            added += 1
            added_raw += row["raw_size"]
            added_stored += row["stored_size"]
    if added:
        usage.bump_meta(conn, {"entries": added, "raw_bytes": added_raw,
                               "stored_bytes": added_stored})
    if logs:
        conn.execute(compile_log.insert(), [dict(
            at=r.at, key=r.key, name=r.name, arch=r.arch, backend=r.backend, seconds=r.seconds,
            missed=r.missed + ",shared", reason=r.reason, pid=r.pid) for r in logs])
        usage.bump_counters(conn, {"compiles": len(logs),
                                   "compile_seconds": _own_seconds(new, logs)})
    return added


def _own_seconds(new: list[dict], logs: list[CompileRecord]) -> float:
    """The compile seconds ``logs`` add: a row's entry, published with it, holds its own
    part (a torch.compile graph's, less its C++ modules', which have rows of their own)."""
    own = {row["key"]: row["compile_seconds"] for row in new}
    return sum(own.get(r.key, r.seconds) for r in logs)


def _insert(conn: Connection, row: dict) -> int:
    """1 if ``row`` was inserted, 0 if its key was there (RETURNING: psycopg's rowcount of
    a single INSERT here is -1, which counted every conflict as an entry added)."""
    from sqlalchemy.dialects.postgresql import insert

    values = {k: v for k, v in row.items() if k != "_packed"}  # the source's, not a column
    return int(conn.execute(insert(kernels).values(**values).on_conflict_do_nothing(
        index_elements=["key"]).returning(kernels.c.key)).first() is not None)


def _into_slot(conn: Connection, row: dict) -> int:
    """``row``'s key is held: by its own signer (kept), else it goes to the signer's slot,
    replacing what is there (a slot is its signer's build, or nothing worth keeping)."""
    holder = conn.execute(select(kernels.c.signer).where(kernels.c.key == row["key"])).first()
    if holder is None or holder[0] == row["signer"]:
        return 0
    slot = dict(row, key=slot_key(row["key"], row["signer"]))
    drop(conn, [slot["key"]])
    return _insert(conn, slot)


def _upsert_sources(conn: Connection, packed: list) -> None:
    """Insert the sources the new entries name, or lock those there already (a no-op update,
    in digest order): a deleter waits for this transaction before it judges them unused
    (:func:`kdb.shared.usage.lock_sources`)."""
    from sqlalchemy.dialects.postgresql import insert

    rows = {p.source: p for p in packed if p.source is not None}
    for digest in sorted(rows):
        stmt = insert(sources).values(digest=digest, body=rows[digest].body,
                                      size=rows[digest].size)
        conn.execute(stmt.on_conflict_do_update(index_elements=["digest"],
                                                set_={"size": stmt.excluded.size}))


def drop(conn: Connection, keys: list[str], where=None) -> int:
    """Delete the entries of ``keys`` (only those matching ``where`` if given), and the
    sources they leave unused, keeping the ``meta`` totals; returns how many went."""
    cond = kernels.c.key.in_(keys)
    if where is not None:
        cond = cond & where
    held = usage.lock_sources(conn, conn.execute(select(kernels.c.source).where(cond)).scalars())
    gone = conn.execute(kernels.delete().where(cond).returning(
        kernels.c.raw_size, kernels.c.stored_size)).all()
    usage.drop_unused_sources(conn, held)
    if gone:
        usage.bump_meta(conn, {"entries": -len(gone), "raw_bytes": -sum(r[0] for r in gone),
                               "stored_bytes": -sum(r[1] for r in gone)})
    return len(gone)
